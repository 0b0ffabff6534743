"""Public ``bbox_loss``: CIoU + DFL + BCE losses, dispatched to the selected backend (see _backend.py)."""

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
