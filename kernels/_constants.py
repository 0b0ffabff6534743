"""Numbers the references and every kernel must share, defined once (this module imports nothing).

``yolofast.ops.reference`` (the spec) and the Triton kernels read them from here; a kernel that used its
own copy could drift from the spec by one edit. The C++/CUDA sources read the same values from
``csrc/common/constants.h`` (``kCiouEps``, ``kFourOverPi2``, ``kSmallGtSide``); tests/ops/test_constants.py
asserts the two files agree and that no other file in csrc/ or kernels/ spells these literals again.
"""

import math

# CIoU's eps: added to each box's height, to the union and to the enclosing box's squared diagonal, and to 1
# in alpha's denominator (reference.bbox_ciou).
CIOU_EPS = 1e-7
# CIoU's aspect-ratio term v = 4/pi^2 * (atan(w2/h2) - atan(w1/h1))^2.
FOUR_OVER_PI2 = 4.0 / math.pi**2
# Sides of a real GT shorter than this (px, the middle stride 16) are widened to it for the assigner's
# candidate test only (DESIGN §2.1 step 1): a 4 px box otherwise may contain no anchor centre of any level.
SMALL_GT_SIDE = 16.0
# Muon's Newton-Schulz normalisation X / (||X||_F + eps) (YOLO11_YOLO26.md §5.3); the same value as CIoU's
# eps by coincidence, named apart so that neither can change the other.
NS_EPS = 1e-7
