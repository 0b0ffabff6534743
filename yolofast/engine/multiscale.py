"""``multi_scale``: each training batch at a random size around ``imgsz`` (Ultralytics 8.4's meaning).

With ``multi_scale=0.5`` and ``imgsz=640`` a batch's longer side is drawn from [320, 960 + stride) and rounded
down to a multiple of the stride (32): 320, 352, ..., 960. The batch is resized bilinearly on the device; the
shorter side keeps the aspect ratio, rounded up to the stride. Box labels are normalized, so they stay valid.

Cost: every new size is a new input shape. Under ``compile=True`` (dynamic=False) each size compiles once
more ((2·multi_scale·imgsz)/stride + 1 sizes: 21 at 0.5/640; past torch's recompile limit, 8 per function by
default, the remaining sizes run uncompiled), and a CUDA graph replays one shape only, so the trainer turns
``cuda_graph=True`` off (the eager step, with the reason logged).
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

__all__ = ["random_size", "resize_batch"]


def random_size(imgsz: int, multi_scale: float, stride: int, rng: random.Random) -> int:
    """A side in [max(stride, imgsz·(1 − m)), imgsz·(1 + m) + stride), rounded down to the stride."""
    lo = max(stride, int(imgsz * (1.0 - multi_scale)))
    hi = int(imgsz * (1.0 + multi_scale) + stride)
    return rng.randrange(lo, hi) // stride * stride


def resize_batch(img: torch.Tensor, size: int, stride: int) -> torch.Tensor:
    """(B, 3, H, W) float images with the longer side ``size`` (the other side rounded up to the stride)."""
    sf = size / max(img.shape[2:])
    if sf == 1:
        return img
    shape = [math.ceil(x * sf / stride) * stride for x in img.shape[2:]]
    return F.interpolate(img, size=shape, mode="bilinear", align_corners=False)
