"""Predict-time letterbox (Ultralytics' rule) and the inverse mapping of boxes to the original image."""

from __future__ import annotations

import numpy as np
import torch

from yolofast.data.augment import letterbox as _letterbox


def letterbox_shape(shape: tuple[int, int], imgsz: int, stride: int = 32,
                    auto: bool = True) -> tuple[int, int]:
    """(h, w) of the padded image: scale the long side to ``imgsz``; ``auto`` pads only up to the next
    stride multiple (the minimal rectangle: 480x640 stays 480x640 at imgsz 640), else to imgsz x imgsz."""
    h0, w0 = shape
    r = min(imgsz / h0, imgsz / w0)
    h, w = round(h0 * r), round(w0 * r)
    if not auto:
        return imgsz, imgsz
    return h + (imgsz - h) % stride, w + (imgsz - w) % stride


def letterbox(img: np.ndarray, new_shape: tuple[int, int]):
    """BGR HWC image -> (padded image, r, (padw, padh)): resized by r to fit, centred, grey 114 borders."""
    return _letterbox(img, new_shape)


def scale_boxes(boxes: torch.Tensor, r: float, pad: tuple[int, int], orig_shape: tuple[int, int]):
    """xyxy boxes of the letterboxed image -> original pixels (in place on a copy), clipped to the image."""
    boxes = boxes.clone()
    boxes[:, [0, 2]] = ((boxes[:, [0, 2]] - pad[0]) / r).clamp(0, orig_shape[1])
    boxes[:, [1, 3]] = ((boxes[:, [1, 3]] - pad[1]) / r).clamp(0, orig_shape[0])
    return boxes
