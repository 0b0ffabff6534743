"""Public ``tal_assign``: the task-aligned assigner, dispatched to the selected backend (see _backend.py).

``tal_assign_maps`` is the same assignment with the scores given as the Detect head's class logits (the
per-level maps): the C++ backend reads them in place and takes the sigmoid of a candidate's logit only,
instead of a sigmoid of all B*A*C logits and their (B, A, C) copy first.
"""

from __future__ import annotations

import torch

from yolofast.ops._backend import backend_name, implementation

# Backends whose tal_assign kernels implement ``topk2`` (YOLO26's second top-k, YOLO11_YOLO26.md §4.3):
# all of them. A backend outside this set would run a call with topk2 (other than None or topk) on the
# reference (``topk2_backend``), a rule of this op, tested, not a fallback.
TOPK2_BACKENDS = frozenset({"ref", "cpp", "cuda", "triton"})


def _second_topk_on(topk: int, topk2: int | None) -> bool:
    return topk2 is not None and int(topk2) != int(topk)


def topk2_backend(name: str, topk: int, topk2: int | None) -> str:
    """The backend that runs a tal_assign call: ``name`` (the selected one) unless the call asks for a
    second top-k that ``name``'s kernel does not implement; then "ref". A backend in TOPK2_BACKENDS gets
    topk2 as a keyword argument."""
    return "ref" if _second_topk_on(topk, topk2) and name not in TOPK2_BACKENDS else name


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
    topk2: int | None = None,
):
    """Assign GTs to anchors (DESIGN §2.1); shapes and semantics in ``reference.tal_assign_ref``.

    topk2: YOLO26's second top-k per GT after conflict resolution (None: off); see ``topk2_backend`` for
    which backend runs it.
    Returns (target_labels (B,A) int64, target_bboxes (B,A,4), target_scores (B,A,C), fg_mask (B,A) bool,
    target_gt_idx (B,A) int64).
    """
    name = topk2_backend(backend_name("tal_assign", pd_scores.device.type), topk, topk2)
    extra = {"topk2": int(topk2)} if _second_topk_on(topk, topk2) else {}
    return implementation("tal_assign", name)(pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt,
                                              topk, alpha, beta, eps, **extra)


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
    topk2: int | None = None,
):
    """``tal_assign`` with ``pd_scores = sigmoid(class logits)`` of the head's maps: feats a list of
    (B, 4*reg_max + nc, H_i, W_i) maps (anchors level by level, pixel h*W_i + w), the other arguments and
    the outputs as ``tal_assign``'s; target_scores has the maps' (promoted) dtype. No gradient.
    topk2 as in ``tal_assign`` (a call with it runs where ``topk2_backend`` says).

    dense_scores=False: target_scores is (B, A), each anchor's one non-zero target score (0 off the
    foreground), of class ``target_labels.clamp(max=nc - 1)``: the (B, A, nc) tensor is that one-hot, and
    ``bbox_loss_maps(..., target_labels=...)`` takes it as it is (the C++ backend never writes the zeros).
    """
    name = topk2_backend(backend_name("tal_assign", feats[0].device.type), topk, topk2)
    extra = {"topk2": int(topk2)} if _second_topk_on(topk, topk2) else {}
    # The C++ maps kernel reads the class logits in place for any reg_max (1: YOLO26's raw distances); the
    # other backends get the (B, A, C) form after one cat of the class logits.
    impl = implementation("tal_assign.maps", name, reg_max)
    return impl(feats, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, topk, alpha, beta, eps, reg_max,
                dense_scores, **extra)
