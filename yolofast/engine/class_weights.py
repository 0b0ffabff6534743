"""``cls_pw``: class-frequency weights on the class (BCE) loss, Ultralytics 8.4's meaning.

Per class c with n_c boxes in the train labels: ``w_c = (1 / n_c) ** cls_pw``; classes without boxes get the
mean weight of the others; the weights are scaled to mean 1. ``cls_pw=1`` is full inverse frequency, 0.5 its
square root, 0 off. The weight multiplies every anchor's BCE term of class c (positives and negatives).
The fused ``bbox_loss`` kernels compute the unweighted class loss; with weights on, ``DetectionLoss`` takes
the class term from a PyTorch BCE over the same logits instead (logged once; the box and DFL terms stay
fused).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["class_weights"]


def class_weights(labels, nc: int, power: float) -> torch.Tensor | None:
    """(nc,) float32 weights from a dataset's ``labels`` (dicts with ``cls``), or None when off/unlabelled."""
    if not power:
        return None
    cls = np.concatenate([np.asarray(lb["cls"]).reshape(-1) for lb in labels] or [np.zeros(0)])
    counts = np.bincount(cls.astype(np.int64), minlength=nc)[:nc].astype(np.float64)
    present = counts > 0
    if not present.any():
        return None
    w = (1.0 / np.where(present, counts, 1.0)) ** power
    w = np.where(present, w, w[present].mean())
    return torch.from_numpy(w / w.mean()).float()
