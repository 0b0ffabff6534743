"""Public ``bbox_loss``: CIoU + DFL + BCE losses, dispatched to the selected backend (see _backend.py).

``bbox_loss`` takes (B, A, .) tensors; ``bbox_loss_maps`` takes the Detect head's per-level maps as they
are: the C++ kernel reads them in place and returns gradients in their layout, the other backends get the
(B, A, .) tensors built here by one cat per map (``maps_to_rows``).
"""

from __future__ import annotations

import torch

from yolofast.ops._backend import backend_name, implementation


def bbox_loss(
    pred_dist: torch.Tensor,
    pred_scores: torch.Tensor,
    anchor_points: torch.Tensor,
    target_bboxes: torch.Tensor,
    target_scores: torch.Tensor,
    fg_mask: torch.Tensor,
) -> torch.Tensor:
    """(3,) float32 [L_box, L_cls, L_dfl] (DESIGN §2.2), differentiable w.r.t. pred_dist and pred_scores.

    Shapes and semantics in ``reference.bbox_loss_ref``; targets are in grid units (pixels / stride).
    """
    impl = implementation("bbox_loss", backend_name("bbox_loss", pred_dist.device.type))
    return impl(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask)


def maps_to_rows(feats, reg_max: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(pred_dist (B, A, 4*reg_max), pred_scores (B, A, nc)) from (B, 4*reg_max + nc, H_i, W_i) maps.

    The transposed views are cat straight into the two tensors: one copy each (a cat to (B, no, A) then two
    permute().contiguous() was ~40 ms at b8/640 on one thread, this ~15 ms).
    """
    nc = feats[0].shape[1] - 4 * reg_max
    dist_parts, score_parts = [], []
    for f in feats:
        d, s = f.flatten(2).split((4 * reg_max, nc), 1)
        dist_parts.append(d.transpose(1, 2))
        score_parts.append(s.transpose(1, 2))
    return torch.cat(dist_parts, 1), torch.cat(score_parts, 1)


def dense_target_scores(scores: torch.Tensor, labels: torch.Tensor, nc: int) -> torch.Tensor:
    """(B, A, nc) target scores from per-anchor ones: row (b, a) is zero but for scores[b, a] at class
    labels[b, a] clamped to [0, nc - 1] (the class the assigner scored)."""
    if labels is None:
        raise ValueError("bbox_loss_maps: (B, A) target_scores hold one class per anchor: pass target_labels "
                         "(tal_assign's first output)")
    cls = labels.long().clamp(0, nc - 1).unsqueeze(-1)
    return scores.new_zeros((*scores.shape, nc)).scatter_(-1, cls, scores.unsqueeze(-1))


def bbox_loss_maps(
    feats,
    anchor_points: torch.Tensor,
    target_bboxes: torch.Tensor,
    target_scores: torch.Tensor,
    fg_mask: torch.Tensor,
    reg_max: int = 16,
    target_labels: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``bbox_loss`` of the head's maps: feats a list of (B, 4*reg_max + nc, H_i, W_i) logits, anchors level
    by level (pixel h*W_i + w); the other arguments as in ``bbox_loss`` with A = sum H_i*W_i.
    target_scores may also be (B, A), one score per anchor of class ``target_labels.clamp(0, nc - 1)``
    (``tal_assign_maps(..., dense_scores=False)``). weights (3,), optional: the gradient the caller's backward
    will bring to the three losses (DetectionLoss: its gains x batch size); the C++ backend then computes the
    final map gradients in the forward pass, and its backward has nothing left to write. Values are the same.

    Returns (3,) [L_box, L_cls, L_dfl], differentiable w.r.t. every map. The C++ backend reads the maps in
    place (no cat, no transpose, the gradients written in the maps' layout); the others cat first.
    """
    name = backend_name("bbox_loss", feats[0].device.type)
    if name == "cpp":
        from yolofast.ops import _library

        return _library.bbox_loss_maps(feats, anchor_points, target_bboxes, target_scores, fg_mask, reg_max,
                                       target_labels, weights)
    if target_scores.dim() == 2:
        target_scores = dense_target_scores(target_scores, target_labels, feats[0].shape[1] - 4 * reg_max)
    pred_dist, pred_scores = maps_to_rows(feats, reg_max)
    impl = implementation("bbox_loss", name)
    return impl(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask)
