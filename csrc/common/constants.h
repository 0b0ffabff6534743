// Numbers every kernel shares with the reference (yolofast/ops/reference.py), defined once for csrc/cpu and
// csrc/cuda. They are the same values as kernels/_constants.py (what the reference and the Triton kernels
// read); tests/ops/test_constants.py parses this file, asserts the two agree, and fails on a copy of these
// literals anywhere else in csrc/ or kernels/. Includes nothing: usable from host, device and emulated code.
// Each is a double: a kernel converts it to its compute type with static_cast<T>, as the reference's
// Python floats enter float32 arithmetic rounded to float32.
#pragma once

namespace yolofast {

// CIoU's eps: added to each box's height, to the union and to the enclosing box's squared diagonal, and to 1
// in alpha's denominator (reference.bbox_ciou).
constexpr double kCiouEps = 1e-7;
// CIoU's aspect-ratio term v = 4/pi^2 * (atan(w2/h2) - atan(w1/h1))^2: the double nearest 4/pi^2, the same
// double as Python's 4.0 / math.pi**2 and C's 4.0 / (M_PI * M_PI) (M_PI is not standard C++).
constexpr double kFourOverPi2 = 0.40528473456935108578;
// Sides of a real GT shorter than this (px, the middle stride 16) are widened to it about the centre for the
// assigner's candidate test only (DESIGN §2.1 step 1).
constexpr double kSmallGtSide = 16.0;

}  // namespace yolofast
