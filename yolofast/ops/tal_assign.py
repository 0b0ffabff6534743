"""Public ``tal_assign``: the task-aligned assigner, dispatched to the selected backend (see _backend.py).

``tal_assign_maps`` is the same assignment with the scores given as the Detect head's class logits (the
per-level maps): the C++ backend reads them in place and takes the sigmoid of a candidate's logit only,
instead of a sigmoid of all B*A*C logits and their (B, A, C) copy first.
"""

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


def tal_assign_maps(
    feats,
    pd_bboxes: torch.Tensor,
    anc_points: torch.Tensor,
    gt_labels: torch.Tensor,
    gt_bboxes: torch.Tensor,
    mask_gt: torch.Tensor,
    topk: int = 10,
    alpha: float = 0.5,
    beta: float = 6.0,
    eps: float = 1e-9,
    reg_max: int = 16,
    dense_scores: bool = True,
):
    """``tal_assign`` with ``pd_scores = sigmoid(class logits)`` of the head's maps: feats a list of
    (B, 4*reg_max + nc, H_i, W_i) maps (anchors level by level, pixel h*W_i + w), the other arguments and
    the outputs as ``tal_assign``'s; target_scores has the maps' (promoted) dtype. No gradient.

    dense_scores=False: target_scores is (B, A), each anchor's one non-zero target score (0 off the
    foreground), of class ``target_labels.clamp(max=nc - 1)``: the (B, A, nc) tensor is that one-hot, and
    ``bbox_loss_maps(..., target_labels=...)`` takes it as it is (the C++ backend never writes the zeros).
    """
    impl = implementation("tal_assign.maps", backend_name("tal_assign", feats[0].device.type))
    return impl(feats, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, topk, alpha, beta, eps, reg_max,
                dense_scores)
