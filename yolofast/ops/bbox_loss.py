"""Public ``bbox_loss``: CIoU + DFL + BCE losses, dispatched to the selected backend (see _backend.py)."""

from __future__ import annotations

import torch

from yolofast.ops import reference
from yolofast.ops._backend import select_backend


@torch.compiler.assume_constant_result
def _backend_name(device_type: str) -> str:
    # Under torch.compile this runs once at trace time and the choice is baked into the graph (the
    # availability check takes a lock that dynamo cannot trace); in eager mode it runs on every call.
    return select_backend("bbox_loss", device_type)


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
    args = (pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask)
    name = _backend_name(pred_dist.device.type)
    if name == "ref":
        return reference.bbox_loss_ref(*args)
    if name in ("cpp", "cuda"):
        from yolofast.ops import _library

        return _library.bbox_loss(*args)
    from yolofast.kernels.bbox_loss import bbox_loss as triton_bbox_loss

    return triton_bbox_loss(*args)
