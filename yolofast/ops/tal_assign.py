"""Public ``tal_assign``: the task-aligned assigner, dispatched to the selected backend (see _backend.py)."""

from __future__ import annotations

import torch

from yolofast.ops import reference
from yolofast.ops._backend import select_backend


@torch.compiler.assume_constant_result
def _backend_name(device_type: str) -> str:
    # Under torch.compile this runs once at trace time and the choice is baked into the graph (the
    # availability check takes a lock that dynamo cannot trace); in eager mode it runs on every call.
    return select_backend("tal_assign", device_type)


def tal_assign(
    pd_scores: torch.Tensor,
    pd_bboxes: torch.Tensor,
    anc_points: torch.Tensor,
    gt_labels: torch.Tensor,
    gt_bboxes: torch.Tensor,
    mask_gt: torch.Tensor,
    topk: int = 10,
    alpha: float = 0.5,
    beta: float = 6.0,
    eps: float = 1e-9,
):
    """Assign GTs to anchors (DESIGN §2.1); shapes and semantics in ``reference.tal_assign_ref``.

    Returns (target_labels (B,A) int64, target_bboxes (B,A,4), target_scores (B,A,C), fg_mask (B,A) bool,
    target_gt_idx (B,A) int64).
    """
    args = (pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, topk, alpha, beta, eps)
    name = _backend_name(pd_scores.device.type)
    if name == "ref":
        return reference.tal_assign_ref(*args)
    if name in ("cpp", "cuda"):
        from yolofast.ops import _library

        return _library.tal_assign(*args)
    from yolofast.kernels.tal_assign import tal_assign as triton_tal_assign

    return triton_tal_assign(*args)
