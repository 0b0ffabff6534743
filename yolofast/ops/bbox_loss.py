"""Public ``bbox_loss``: CIoU + DFL + BCE losses, dispatched to the selected backend (see _backend.py).

``bbox_loss`` takes (B, A, .) tensors; ``bbox_loss_maps`` takes the Detect head's per-level maps as they
are: the C++ kernel reads them in place and returns gradients in their layout, the other backends get the
(B, A, .) tensors built by one cat per map (``maps_to_rows``, in _composed.py).
"""

from __future__ import annotations

import torch

from yolofast.ops._backend import backend_name, implementation
from yolofast.ops._composed import dense_target_scores, maps_to_rows

__all__ = ["bbox_loss", "bbox_loss_maps", "dense_target_scores", "maps_to_rows"]


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
    impl = implementation("bbox_loss.maps", backend_name("bbox_loss", feats[0].device.type))
    return impl(feats, anchor_points, target_bboxes, target_scores, fg_mask, reg_max, target_labels, weights)
