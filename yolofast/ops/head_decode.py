"""Public ``head_decode``: the assigner's inputs (sigmoid scores, decoded pixel boxes) from the head's maps.

The C++ backend (the CPU default) does it in one pass over the maps; every other backend computes
``sigmoid`` and ``reference.bbox_decode(...) * stride`` of the cat-ed (B, A, .) tensors, the same values
(``_composed.head_decode``). Its backend is its own (``YOLOFAST_BACKEND_HEAD_DECODE``).
"""

from __future__ import annotations

import torch

from yolofast.ops._backend import backend_name, implementation


@torch.no_grad()
def head_decode(feats, strides, reg_max: int = 16, scores: bool = True):
    """feats: list of (B, 4*reg_max + nc, H_i, W_i) logits; strides: one (pixels) per map.

    Returns (pd_scores (B, A, nc) sigmoid of the class logits, pd_bboxes (B, A, 4) xyxy pixels), A = sum
    H_i*W_i level by level, float32 (float64 when a map is float64); no gradient. ``scores=False`` skips
    the scores (returned as None): the loss's assigner reads the logits itself (``tal_assign_maps``).
    """
    if len(strides) != len(feats):
        raise ValueError(
            f"head_decode: {len(feats)} maps but {len(strides)} strides; pass one stride per map"
        )
    # reg_max 1 (raw distances, YOLO26): the C++ decode reads them in place too, in the torch form's order.
    name = backend_name("head_decode", feats[0].device.type)
    if not scores:
        return None, implementation("head_decode.boxes", name, reg_max)(feats, strides, reg_max)
    return implementation("head_decode", name, reg_max)(feats, strides, reg_max)
