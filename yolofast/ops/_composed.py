"""Op forms a backend has no kernel of its own for, composed of torch ops and the backend's base op.

``_backend.implementation`` hands these out, the base op's callable bound as the first argument, for
every backend without a native form: the maps variants cat the head's maps into (B, A, .) tensors and call
the base op, ``ema_update.multi`` calls it pair by pair, and ``head_decode`` (a kernel on the CPU only)
is sigmoid plus ``reference.bbox_decode``-style boxes. Values are the native forms' (tests/ops).
"""

from __future__ import annotations

import torch

from yolofast.boxes import make_anchors
from yolofast.ops.reference import bbox_decode


def maps_to_rows(feats, reg_max: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(pred_dist (B, A, 4*reg_max), pred_scores (B, A, nc)) from (B, 4*reg_max + nc, H_i, W_i) maps.

    Each level's channels are moved last with permute + reshape and the levels cat: one copy each (a cat
    to (B, no, A) then two permute().contiguous() was ~40 ms at b8/640 on one thread; a cat of transposed
    (B, HW, c) views 4.4 ms and this 3.1 ms for the (16, 2100, 80) scores at b16/320).
    """
    nc = feats[0].shape[1] - 4 * reg_max
    return _rows(feats, 0, 4 * reg_max), _rows(feats, 4 * reg_max, nc)


def _rows(feats, start: int, n: int) -> torch.Tensor:
    """(B, A, n): channels start..start+n of every level's map, anchors level by level."""
    return torch.cat([f[:, start:start + n].permute(0, 2, 3, 1).reshape(f.shape[0], -1, n) for f in feats], 1)


def dense_target_scores(scores: torch.Tensor, labels: torch.Tensor, nc: int) -> torch.Tensor:
    """(B, A, nc) target scores from per-anchor ones: row (b, a) is zero but for scores[b, a] at class
    labels[b, a] clamped to [0, nc - 1] (the class the assigner scored)."""
    if labels is None:
        raise ValueError("bbox_loss_maps: (B, A) target_scores hold one class per anchor: pass target_labels "
                         "(tal_assign's first output)")
    cls = labels.long().clamp(0, nc - 1).unsqueeze(-1)
    return scores.new_zeros((*scores.shape, nc)).scatter_(-1, cls, scores.unsqueeze(-1))


def tal_assign_maps(tal_assign, feats, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, topk=10,
                    alpha=0.5, beta=6.0, eps=1e-9, reg_max=16, dense_scores=True, **extra):
    """``tal_assign.maps`` as ``tal_assign`` of the sigmoid of the cat-ed class logits (``extra``, e.g.
    topk2, passed on)."""
    with torch.no_grad():  # the class channels alone, (B, A, nc)
        pd_scores = _rows([f.detach() for f in feats], 4 * reg_max, feats[0].shape[1] - 4 * reg_max).sigmoid()
    out = tal_assign(pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, topk, alpha, beta, eps,
                     **extra)
    if dense_scores:
        return out
    labels, boxes, scores, fg, gt_idx = out
    # One non-zero per row: the row's sum is that score exactly.
    return labels, boxes, scores.sum(-1), fg, gt_idx


def bbox_loss_maps(bbox_loss, feats, anchor_points, target_bboxes, target_scores, fg_mask, reg_max=16,
                   target_labels=None, weights=None, l1_scale=None, **extra):
    """``bbox_loss.maps`` as ``bbox_loss`` of the cat-ed maps (weights only steer the C++ kernel's layout,
    l1_scale is the maps kernels' form of the reg_max 1 geometry; ``extra``, its (B, A, .) form, passed
    on)."""
    if target_scores.dim() == 2:
        target_scores = dense_target_scores(target_scores, target_labels, feats[0].shape[1] - 4 * reg_max)
    pred_dist, pred_scores = maps_to_rows(feats, reg_max)
    return bbox_loss(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask, **extra)


def ema_update_multi(ema_update, name, ema, model, decay) -> None:
    """``ema_update.multi`` pair by pair: integer tensors copied, floating ones updated by ``ema_update`` of
    backend ``name`` (the reference takes any layout, the CUDA/Triton kernels flat buffers: ModelEMA keeps
    flat buffers on those devices and never passes lists there)."""
    for e, m in zip(ema, model):
        if not e.is_floating_point():
            e.copy_(m)
        elif name == "ref":
            ema_update(e, m, decay)
        else:
            if not e.is_contiguous():
                raise ValueError(f"ema_update: the {name} backend takes contiguous tensors; got strides "
                                 f"{e.stride()} (pass flat buffers, as ModelEMA does on {e.device.type})")
            ema_update(e.view(-1), m.reshape(-1), decay)


def _decode(feats, strides, reg_max: int, scores: bool):
    dt = torch.float64 if any(f.dtype == torch.float64 for f in feats) else torch.float32
    feats = [f.detach().to(dt) for f in feats]
    if scores:
        pred_dist, pred_scores = maps_to_rows(feats, reg_max)
    else:  # the box channels alone: the class channels' copy was ~15 ms of a b16/320 nc 80 step
        pred_dist = torch.cat([f.flatten(2)[:, :4 * reg_max].transpose(1, 2) for f in feats], 1)
    anchor_points, stride_tensor = make_anchors(feats, strides, 0.5)
    if reg_max == 1:  # YOLO11_YOLO26.md §3.4: the box in grid units, then x stride (the loss's own order)
        boxes = bbox_decode(pred_dist, anchor_points) * stride_tensor
        return (pred_scores.sigmoid() if scores else None), boxes
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


def head_decode(feats, strides, reg_max=16):
    """(pd_scores (B, A, nc) sigmoid, pd_bboxes (B, A, 4) xyxy pixels) of the cat-ed maps."""
    return _decode(feats, strides, reg_max, True)


def head_decode_boxes(feats, strides, reg_max=16):
    """pd_bboxes (B, A, 4) xyxy pixels of the cat-ed maps, without the scores."""
    return _decode(feats, strides, reg_max, False)[1]
