"""Public ``head_decode``: the assigner's inputs (sigmoid scores, decoded pixel boxes) from the head's maps.

The C++ backend (the CPU default) does it in one pass over the maps; every other backend computes
``sigmoid`` and ``reference.bbox_decode(...) * stride`` of the cat-ed (B, A, .) tensors, the same values.
"""

from __future__ import annotations

import torch

from yolofast.ops._backend import backend_name


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
    # reg_max 1 (raw distances) runs where bbox_loss's rule sends it: the C++ decode is DFL-only today.
    from yolofast.ops.bbox_loss import reg_max_backend

    if reg_max_backend(backend_name("bbox_loss", feats[0].device.type), reg_max) == "cpp":
        from yolofast.ops import _library

        if not scores:
            return None, _library.head_decode_boxes(feats, strides, reg_max)
        return _library.head_decode(feats, strides, reg_max)
    from yolofast.boxes import make_anchors
    from yolofast.ops.bbox_loss import maps_to_rows

    dt = torch.float64 if any(f.dtype == torch.float64 for f in feats) else torch.float32
    feats = [f.detach().to(dt) for f in feats]
    anchor_points, stride_tensor = make_anchors(feats, strides, 0.5)
    if reg_max == 1:  # YOLO11_YOLO26.md §3.4: the box in grid units, then x stride (the loss's own order)
        from yolofast.ops.reference import bbox_decode

        # Only the 4 distance channels are gathered: the loss's call (scores=False) skipped a cat of all
        # B*A*(4 + nc) logits (b16/320: 2.8M values per branch) that it never read.
        pred_dist = torch.cat([f[:, :4].flatten(2) for f in feats], 2).transpose(1, 2)
        boxes = bbox_decode(pred_dist, anchor_points) * stride_tensor
        return (maps_to_rows(feats, reg_max)[1].sigmoid() if scores else None), boxes
    pred_dist, pred_scores = maps_to_rows(feats, reg_max)
    prob = pred_dist.unflatten(-1, (4, reg_max)).softmax(-1)
    bins = torch.arange(reg_max, dtype=prob.dtype, device=prob.device)
    # A matmul with the bin values, not (prob * bins).sum(-1): that materialises a (B, A, 4, R) product
    # (~17 MB at b8/640) and was ~3x slower; autocast off so it stays in the compute dtype.
    with torch.autocast(prob.device.type, enabled=False):
        ltrb = torch.matmul(prob, bins)
    anc = anchor_points * stride_tensor
    s = stride_tensor
    boxes = torch.cat((anc - ltrb[..., :2] * s, anc + ltrb[..., 2:] * s), -1)
    return (pred_scores.sigmoid() if scores else None), boxes
