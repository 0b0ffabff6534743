"""Public ``tal_assign``: the task-aligned assigner, dispatched to the selected backend (see _backend.py)."""

from __future__ import annotations

import torch

from yolofast.ops._backend import backend_name, implementation


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
    impl = implementation("tal_assign", backend_name("tal_assign", pd_scores.device.type))
    return impl(pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, topk, alpha, beta, eps)
