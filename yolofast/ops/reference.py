"""Pure-PyTorch reference of every hot op: the executable spec (DESIGN §2), the fallback and the baseline.

Every C++/CUDA/Triton kernel is tested against these functions, so they are written for clarity and
exactness, not speed: the assigner builds dense (B, M, A) tensors, which the kernels must not.

Conventions shared by all kernels (read these before writing one):
- ``bbox_ciou`` evaluates its terms in the order written below; with that order CIoU(a, b) is bitwise
  equal to CIoU(b, a) (the centre offset is ``(x1' + x2') - (x1 + x2)``, a difference of two sums, and
  ``atan`` terms are squared), so a kernel may pass the boxes either way round.
- Nothing here calls ``.item()``, ``nonzero()`` or indexes with a boolean mask: background anchors are
  removed with ``torch.where`` (not a multiply, so a non-finite value on a background anchor never leaks
  into a sum), which keeps the loss traceable by ``torch.compile(fullgraph=True)`` and capturable in a
  CUDA graph. One exception, in eager CPU code only (``_eager_cpu``): the assigner's step 2 evaluates the
  candidate pairs alone (``_metric_candidates``), per pair the same formula as the dense form.
- Low-precision inputs are upcast: the assigner and the loss compute in float32 (float64 when the
  inputs are float64, which is what gradcheck uses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from yolofast.kernels._constants import CIOU_EPS, FOUR_OVER_PI2, SMALL_GT_SIDE

__all__ = [
    "SMALL_GT_SIDE",
    "bbox_ciou",
    "bbox_decode",
    "tal_assign_ref",
    "bbox_loss_ref",
    "ema_update_ref",
    "ns_orthogonalize_ref",
]

# SMALL_GT_SIDE (16 px: shorter sides of a real GT are widened to it for the candidate test only), CIoU's
# eps and 4/pi^2 are defined once, in yolofast/kernels/_constants.py, for this spec and every kernel.


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64 (gradcheck), float32 otherwise (also for bf16/fp16 inputs)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def bbox_ciou(box1: torch.Tensor, box2: torch.Tensor, eps: float = CIOU_EPS) -> torch.Tensor:
    """Complete IoU of xyxy boxes (DESIGN §2.2), broadcast over the leading dimensions.

    box1 (..., 4), box2 (..., 4) -> (...) in their (promoted) dtype. The aspect-ratio weight ``alpha`` is
    computed from detached values, so it is a constant in the gradient (as the CIoU paper prescribes).
    Order of operations, which a kernel that must agree closely should follow:
        w1 = x2 - x1;  h1 = (y2 - y1) + eps       (same for box 2)
        inter = clamp(min(x2, x2') - max(x1, x1'), 0) * clamp(min(y2, y2') - max(y1, y1'), 0)
        union = (w1*h1 + w2*h2 - inter) + eps;    iou = inter / union
        cw = max(x2, x2') - min(x1, x1');  ch = max(y2, y2') - min(y1, y1');  c2 = (cw^2 + ch^2) + eps
        rho2 = (((x1' + x2') - (x1 + x2))^2 + ((y1' + y2') - (y1 + y2))^2) / 4
        v = 4/pi^2 * (atan(w2/h2) - atan(w1/h1))^2;  alpha = v / ((v - iou) + (1 + eps))   [detached]
        ciou = iou - (rho2/c2 + v*alpha)
    """
    b1x1, b1y1, b1x2, b1y2 = box1.unbind(-1)
    b2x1, b2y1, b2x2, b2y2 = box2.unbind(-1)
    w1, h1 = b1x2 - b1x1, b1y2 - b1y1 + eps
    w2, h2 = b2x2 - b2x1, b2y2 - b2y1 + eps

    inter = (torch.minimum(b1x2, b2x2) - torch.maximum(b1x1, b2x1)).clamp(min=0) * (
        torch.minimum(b1y2, b2y2) - torch.maximum(b1y1, b2y1)
    ).clamp(min=0)
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union

    cw = torch.maximum(b1x2, b2x2) - torch.minimum(b1x1, b2x1)
    ch = torch.maximum(b1y2, b2y2) - torch.minimum(b1y1, b2y1)
    c2 = cw.pow(2) + ch.pow(2) + eps
    rho2 = ((b2x1 + b2x2) - (b1x1 + b1x2)).pow(2) + ((b2y1 + b2y2) - (b1y1 + b1y2)).pow(2)
    rho2 = rho2 / 4
    v = FOUR_OVER_PI2 * (torch.atan(w2 / h2) - torch.atan(w1 / h1)).pow(2)
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou - (rho2 / c2 + v * alpha)


def bbox_decode(pred_dist: torch.Tensor, anchor_points: torch.Tensor) -> torch.Tensor:
    """DFL decode: per side, softmax over the reg_max bins and the expectation with bin values 0..reg_max-1.

    pred_dist (..., A, 4*reg_max) logits, side-major (l, t, r, b each a block of reg_max bins);
    anchor_points (A, 2) anchor centres (x, y) in grid units.
    Returns (..., A, 4) xyxy boxes ``(ax - l, ay - t, ax + r, ay + b)`` in grid units, in pred_dist's dtype.
    reg_max 1 (YOLO26, YOLO11_YOLO26.md §3.4): the four channels are the distances themselves (no softmax,
    no clamp; they may be negative).
    """
    if pred_dist.shape[-1] % 4:
        raise ValueError(f"bbox_decode: pred_dist last dim {pred_dist.shape[-1]} is not 4*reg_max")
    reg_max = pred_dist.shape[-1] // 4
    if reg_max == 1:
        anc = anchor_points.to(pred_dist.dtype)
        return torch.cat((anc - pred_dist[..., :2], anc + pred_dist[..., 2:]), -1)
    prob = pred_dist.unflatten(-1, (4, reg_max)).softmax(-1)
    bins = torch.arange(reg_max, dtype=prob.dtype, device=prob.device)
    # A sum, not a matmul: autocast would run a matmul in bf16/fp16.
    ltrb = (prob * bins).sum(-1)
    anc = anchor_points.to(ltrb.dtype)
    return torch.cat((anc - ltrb[..., :2], anc + ltrb[..., 2:]), -1)


@torch.no_grad()
def tal_assign_ref(
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
    """Task-aligned assigner (TOOD's TAL as used by YOLOv8), exactly DESIGN §2.1. No gradient.

    Inputs:
        pd_scores (B, A, C) sigmoid class scores; pd_bboxes (B, A, 4) predicted xyxy boxes in pixels;
        anc_points (A, 2) anchor centres in pixels; gt_labels (B, M, 1) class ids (any numeric dtype);
        gt_bboxes (B, M, 4) xyxy pixels; mask_gt (B, M, 1) 1 = real GT, 0 = padding (any dtype, > 0 is real).
    Returns:
        target_labels (B, A) int64: label of target_gt_idx, clamped >= 0 (C everywhere when M == 0);
        target_bboxes (B, A, 4) in gt_bboxes' dtype: the (un-enlarged) box of target_gt_idx;
        target_scores (B, A, C) in pd_scores' dtype: one_hot(label) * norm on positives, 0 elsewhere;
        fg_mask (B, A) bool; target_gt_idx (B, A) int64 (0 for background).
    Rules a kernel must reproduce exactly (g = GT, a = anchor):
        1. candidate(g, a): g is real and the anchor centre is strictly inside g's box after widening any
           side shorter than SMALL_GT_SIDE (16 px) to 16 px about the centre: cx - x1 > eps, cy - y1 > eps,
           x2 - cx > eps, y2 - cy > eps (centre = (x1 + x2) / 2, widened side = centre -/+ 8).
        2. overlap = clamp(CIoU(gt box, pd box), min=0), align = score[a, label(g)]^alpha * overlap^beta on
           candidates; both 0 elsewhere.
        3. selected(g, a): a is among the topk largest align of g (stable descending sort over the A
           anchors: ties go to the lower anchor index) and align(g, a) > 0.
        4. an anchor selected by one GT gets it; selected by >= 2 GTs, it gets the GT with the largest
           overlap among ALL its candidate GTs (ties -> lowest GT index), even one that did not select it.
           It is positive (fg) only if align(assigned GT, a) > 0: an anchor with align 0 is never positive.
        4b. only when topk2 is given and differs from topk (YOLO26's one-to-one branch, YOLO11_YOLO26.md
           §4.3): per GT, of its positives after step 4 (its own selections that it kept, plus anchors it
           won by overlap in a conflict) only the topk2 with the largest raw align stay (stable descending
           sort: ties go to the lower anchor index); the others lose the GT and become background.
        5. per GT over its positives: pos_align = max align, pos_overlap = max overlap;
           norm(a) = (align(g, a) * pos_overlap(g)) / (pos_align(g) + eps).
        Computed in float32 (float64 if any of pd_scores, pd_bboxes, gt_bboxes is float64).
    """
    B, A, C = pd_scores.shape
    M = gt_bboxes.shape[1]
    dev = pd_scores.device
    if topk2 is not None and int(topk2) < 1:
        raise ValueError(f"tal_assign: topk2={topk2} keeps no positive; pass topk2 >= 1, or None for no "
                         "second top-k")
    if M == 0:
        return (
            torch.full((B, A), C, dtype=torch.long, device=dev),
            torch.zeros(B, A, 4, dtype=gt_bboxes.dtype, device=dev),
            torch.zeros(B, A, C, dtype=pd_scores.dtype, device=dev),
            torch.zeros(B, A, dtype=torch.bool, device=dev),
            torch.zeros(B, A, dtype=torch.long, device=dev),
        )
    ct = _compute_dtype(pd_scores, pd_bboxes, gt_bboxes)
    scores, pd, anc, gt = pd_scores.to(ct), pd_bboxes.to(ct), anc_points.to(ct), gt_bboxes.to(ct)
    real = mask_gt.reshape(B, M) > 0
    labels = gt_labels.reshape(B, M).long()
    labels_c = labels.clamp(0, C - 1)  # only so that padding rows index safely

    cand = _candidates(gt, real, anc, eps)  # 1.
    overlap, align = _metric(scores, pd, gt, labels_c, cand, alpha, beta)  # 2.
    selected = _topk(align, cand, topk)  # 3.
    gt_idx, align_a, fg = _conflicts(selected, cand, overlap, align)  # 4.
    if topk2 is not None and int(topk2) != int(topk):
        fg = _second_topk(align, fg, gt_idx, topk2)  # 4b.
    return _targets(fg, gt_idx, align_a, align, overlap, labels, labels_c, gt_bboxes, pd_scores.dtype,
                    C, eps)  # 5.


def _candidates(gt: torch.Tensor, real: torch.Tensor, anc: torch.Tensor, eps: float) -> torch.Tensor:
    """Step 1 of ``tal_assign_ref``: candidates (B, M, A), the anchor centre strictly inside the real GT's
    box with any side shorter than SMALL_GT_SIDE widened to it about the box centre."""
    x1, y1, x2, y2 = gt.unbind(-1)
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    half = SMALL_GT_SIDE / 2
    widen_x = ((x2 - x1) < SMALL_GT_SIDE) & real
    widen_y = ((y2 - y1) < SMALL_GT_SIDE) & real
    x1, x2 = torch.where(widen_x, cx - half, x1), torch.where(widen_x, cx + half, x2)
    y1, y2 = torch.where(widen_y, cy - half, y1), torch.where(widen_y, cy + half, y2)
    ax, ay = anc[:, 0], anc[:, 1]
    inside = (
        ((ax - x1[..., None]) > eps)
        & ((ay - y1[..., None]) > eps)
        & ((x2[..., None] - ax) > eps)
        & ((y2[..., None] - ay) > eps)
    )
    return inside & real[..., None]


def _metric(scores: torch.Tensor, pd: torch.Tensor, gt: torch.Tensor, labels_c: torch.Tensor,
            cand: torch.Tensor, alpha: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2: (overlap, align), each (B, M, A) and zero off the candidates."""
    if _eager_cpu(pd):
        return _metric_candidates(scores, pd, gt, labels_c, cand, alpha, beta)
    B, A, M = scores.shape[0], scores.shape[1], gt.shape[1]
    overlap = bbox_ciou(gt[:, :, None, :], pd[:, None, :, :]).clamp(min=0)
    overlap = torch.where(cand, overlap, 0)
    # s[b, g, a] = scores[b, a, label(b, g)]
    s = scores.gather(2, labels_c[:, None, :].expand(B, A, M)).transpose(1, 2)
    align = torch.where(cand, s.pow(alpha) * overlap.pow(beta), 0)
    return overlap, align


def _eager_cpu(t: torch.Tensor) -> bool:
    """True where a data-dependent shape is allowed: CPU tensors outside torch.compile and outside any
    dispatch-mode tracing (a CUDA-graph capture, its CPU emulation in the tests, FakeTensor)."""
    return (t.device.type == "cpu" and not torch.compiler.is_compiling()
            and not is_in_torch_dispatch_mode())


def _metric_candidates(scores, pd, gt, labels_c, cand, alpha: float, beta: float):
    """``_metric`` evaluated on the candidate pairs only and scattered into zeros: the same formula per
    pair (values equal to the dense form's up to the last bit of atan/pow, whose vector and scalar CPU
    paths may round differently), a fraction of the work: ~6 % of the (B, M, A) pairs are candidates at
    b16/320 px/20 GT, where the dense form took 69 ms of the reference YOLO26 loss step's 230 ms (both
    branches) and this one 16 ms (one thread, AMD EPYC, loaded machine)."""
    b, g, a = cand.nonzero(as_tuple=True)
    ov = bbox_ciou(gt[b, g], pd[b, a]).clamp(min=0)
    al = scores[b, a, labels_c[b, g]].pow(alpha) * ov.pow(beta)
    overlap = gt.new_zeros(cand.shape).index_put_((b, g, a), ov)
    align = gt.new_zeros(cand.shape).index_put_((b, g, a), al)
    return overlap, align


def _topk(align: torch.Tensor, cand: torch.Tensor, topk: int) -> torch.Tensor:
    """Step 3: selected (B, M, A), each GT's topk largest align that are candidates with align > 0; a
    stable sort makes ties go to the lower anchor index."""
    return _stable_topk_mask(align, topk) & cand & (align > 0)


def _stable_topk_mask(metric: torch.Tensor, k: int) -> torch.Tensor:
    """(..., A) bool: the first k entries of each row's stable descending sort (ties go to the lower
    index, NaN ranks above every number, as in ``torch.sort``), without sorting: every entry above the
    row's k-th largest value, then its ties in index order until k are taken. The same mask as
    ``sort(stable=True).indices[..., :k]`` scattered, ~4x cheaper (a (16, 16, 2100) row set: 4.5 ms vs
    20 ms at one thread, AMD EPYC): YOLO26's reference step runs three top-k per step."""
    k = min(int(k), metric.shape[-1])
    if k <= 0:  # topk=0: no anchor is selected
        return torch.zeros_like(metric, dtype=torch.bool)
    key = metric.nan_to_num(nan=float("inf"))  # the metric is never +inf (scores, overlaps <= 1)
    kth = key.topk(k, dim=-1).values[..., -1:]
    above = key > kth
    tie = key == kth
    room = k - above.sum(-1, keepdim=True)
    return above | (tie & (tie.cumsum(-1) <= room))


def _conflicts(selected: torch.Tensor, cand: torch.Tensor, overlap: torch.Tensor, align: torch.Tensor):
    """Step 4: (gt_idx (B, A), its align (B, A), fg (B, A)). An anchor selected by >= 2 GTs goes to its
    best-overlap candidate GT (argmax returns the first maximum, i.e. the lowest GT index on ties;
    non-candidates rank below every candidate); one selected by a single GT keeps it; it is positive only
    with align > 0 for the GT it got."""
    n_sel = selected.sum(1)
    # max(1).indices is argmax(1) (the first maximum, NaN counting as the maximum) at ~1/7 the cost:
    # argmax over a non-last dim is not vectorised on the CPU (8.4 vs 1.3 ms at (16, 16, 2100)).
    best_overlap_gt = torch.where(cand, overlap, -1).max(1).indices
    only_gt = selected.to(torch.uint8).max(1).indices
    gt_idx = torch.where(n_sel > 1, best_overlap_gt, only_gt)
    align_a = align.gather(1, gt_idx[:, None]).squeeze(1)  # (B, A) align with the assigned GT
    fg = (n_sel > 0) & (align_a > 0)
    return gt_idx, align_a, fg


def _targets(fg, gt_idx, align_a, align, overlap, labels, labels_c, gt_bboxes, score_dtype, C: int,
             eps: float):
    """Step 5: the targets of each anchor's GT (GT 0 for background) and the per-GT score normalisation
    norm(a) = align(g, a) * pos_overlap(g) / (pos_align(g) + eps) over g's positives."""
    B, M, A = align.shape
    dev = align.device
    target_gt_idx = torch.where(fg, gt_idx, 0)
    pos = fg[:, None, :] & (target_gt_idx[:, None, :] == torch.arange(M, device=dev)[None, :, None])
    pos_align = torch.where(pos, align, 0).amax(-1)  # (B, M)
    pos_overlap = torch.where(pos, overlap, 0).amax(-1)
    norm = align_a * pos_overlap.gather(1, target_gt_idx) / (pos_align.gather(1, target_gt_idx) + eps)
    norm = torch.where(fg, norm, 0)

    target_labels = labels.gather(1, target_gt_idx).clamp(min=0)
    target_bboxes = gt_bboxes.gather(1, target_gt_idx[..., None].expand(B, A, 4))
    lab = labels_c.gather(1, target_gt_idx)
    # norm at the label's class, 0 elsewhere: a scatter into zeros (an eq + where over (B, A, C) cost
    # ~4x more: 12 vs 3 ms at b16, 2,100 anchors, 80 classes, one thread).
    target_scores = norm.new_zeros((B, A, C)).scatter_(-1, lab[..., None], norm[..., None]).to(score_dtype)
    return target_labels, target_bboxes, target_scores, fg, target_gt_idx


def _second_topk(align: torch.Tensor, fg: torch.Tensor, gt_idx: torch.Tensor, topk2: int) -> torch.Tensor:
    """Step 4b of ``tal_assign_ref``: fg (B, A) reduced to each GT's topk2 positives by raw align (B, M, A).

    A positive has align > 0 and every other entry of the masked metric is 0, so the first topk2 of the
    stable descending sort hold all of a GT's positives when it has at most topk2 (then nothing changes).
    topk2 = 1 (YOLO26) takes argmax, which returns the first maximum: the same anchor as the stable sort,
    without sorting B*M rows of A (a (16, 20, 2100) sort ~190 ms vs ~3 ms at one thread, AMD EPYC).
    """
    B, M, A = align.shape
    pos = fg[:, None, :] & (gt_idx[:, None, :] == torch.arange(M, device=align.device)[None, :, None])
    metric = torch.where(pos, align, 0)
    if min(int(topk2), A) == 1:
        kept = torch.zeros_like(pos).scatter_(-1, metric.argmax(-1, keepdim=True), True)
    else:
        kept = _stable_topk_mask(metric, topk2)
    return (kept & pos).any(1)


def bbox_loss_ref(
    pred_dist: torch.Tensor,
    pred_scores: torch.Tensor,
    anchor_points: torch.Tensor,
    target_bboxes: torch.Tensor,
    target_scores: torch.Tensor,
    fg_mask: torch.Tensor,
    stride_tensor: torch.Tensor | None = None,
    img_hw: tuple[float, float] | None = None,
) -> torch.Tensor:
    """CIoU box loss + DFL + BCE class loss (DESIGN §2.2), each divided by S, no gains, no batch factor.

    Inputs:
        pred_dist (B, A, 4*reg_max) DFL logits (side-major: l, t, r, b); pred_scores (B, A, C) class logits;
        anchor_points (A, 2) grid units; target_bboxes (B, A, 4) xyxy in GRID units (pixels / stride);
        target_scores (B, A, C) soft targets from the assigner; fg_mask (B, A) bool.
    Returns a (3,) tensor [L_box, L_cls, L_dfl], float32 (float64 when pred_dist or pred_scores is float64),
    differentiable w.r.t. pred_dist and pred_scores (targets are treated as constants). With
    w(a) = sum_c target_scores[a, c] and S = max(sum target_scores, 1):
        L_box = sum_fg (1 - CIoU(decoded pred, target)) * w / S        (CIoU alpha held constant)
        L_dfl = sum_fg mean_4sides(dfl) * w / S, with t = clamp(target distance, 0, reg_max - 1 - 0.01),
                tl = floor(t), wl = (tl + 1) - t, wr = 1 - wl, dfl = -(wl*logsm[tl] + wr*logsm[tl + 1])
        L_cls = sum over all anchors and classes of BCEWithLogits(pred_scores, target_scores) / S
    The target boxes of background anchors are never read (they may hold anything, even NaN); their target
    scores count in S and L_cls (the assigner leaves them 0).

    reg_max 1 (YOLO26, YOLO11_YOLO26.md §4.2): pred_dist (B, A, 4) are the raw distances (``bbox_decode``)
    and the third loss is L_l1 instead of L_dfl; stride_tensor (A, 1) (pixels per grid unit of each
    anchor) and img_hw (H, W) (pixels of the batch image tensor, not imgsz) are then required:
        t = (ax - x1, ay - y1, x2 - ax, y2 - ay) of the target box, grid units, NOT clamped (may be < 0)
        p^ = p * s / (W, H, W, H),  t^ = t * s / (W, H, W, H)     (per side, s = the anchor's stride)
        L_l1 = sum_fg mean_4sides |p^ - t^| * w / S
    """
    reg_max = pred_dist.shape[-1] // 4
    if reg_max == 1 and (stride_tensor is None or img_hw is None):
        raise ValueError("bbox_loss: reg_max 1 (raw distances, L1 term) needs stride_tensor (A, 1) and "
                         "img_hw (H, W) of the batch image to normalise the distances")
    ct = _compute_dtype(pred_dist, pred_scores)
    pd, ps = pred_dist.to(ct), pred_scores.to(ct)
    anc = anchor_points.to(ct)
    fg = fg_mask.bool()
    # Background target boxes are ignored entirely (a kernel never reads them): zeroing them first keeps
    # a garbage/NaN box there out of the forward value, the DFL bin index and the backward pass.
    tb = torch.where(fg[..., None], target_bboxes.detach().to(ct), 0)
    ts = target_scores.detach().to(ct)

    weight = ts.sum(-1)  # (B, A)
    norm = ts.sum().clamp(min=1)

    ciou = bbox_ciou(bbox_decode(pd, anc), tb)
    l_box = torch.where(fg, (1 - ciou) * weight, 0).sum() / norm
    l_cls = F.binary_cross_entropy_with_logits(ps, ts, reduction="sum") / norm
    if reg_max == 1:
        l1 = _l1_distance(pd, anc, tb, stride_tensor.to(ct), img_hw)
        l_l1 = torch.where(fg, l1 * weight, 0).sum() / norm
        return torch.stack((l_box, l_cls, l_l1))

    # DFL: the clamp keeps tl + 1 <= reg_max - 1 (a distance of 15 grid units would index bin 16).
    t = torch.cat((anc - tb[..., :2], tb[..., 2:] - anc), -1).clamp(0, reg_max - 1 - 0.01)  # (B, A, 4)
    tl = t.floor()
    wl = tl + 1 - t
    wr = 1 - wl
    logp = pd.unflatten(-1, (4, reg_max)).log_softmax(-1)
    il = tl.long()[..., None]
    lp_left = logp.gather(-1, il).squeeze(-1)
    lp_right = logp.gather(-1, il + 1).squeeze(-1)
    dfl = -(wl * lp_left + wr * lp_right).mean(-1)  # (B, A)
    l_dfl = torch.where(fg, dfl * weight, 0).sum() / norm
    return torch.stack((l_box, l_cls, l_dfl))


def _l1_distance(pd: torch.Tensor, anc: torch.Tensor, tb: torch.Tensor, stride: torch.Tensor, img_hw):
    """(B, A) mean over the 4 sides of |p^ - t^| (``bbox_loss_ref``, reg_max 1): the raw predicted and the
    unclamped target distances, both x stride and / (W, H, W, H)."""
    h, w = float(img_hw[0]), float(img_hw[1])
    t = torch.cat((anc - tb[..., :2], tb[..., 2:] - anc), -1)
    p_px, t_px = pd * stride, t * stride
    # x sides (l, r) by W, y sides (t, b) by H, with Python scalars (no host->device copy: CUDA graphs).
    dx = p_px[..., 0::2] / w - t_px[..., 0::2] / w
    dy = p_px[..., 1::2] / h - t_px[..., 1::2] / h
    return torch.stack((dx, dy), -1).flatten(-2).abs().mean(-1)  # back to (l, t, r, b) order


def ema_update_ref(ema: torch.Tensor, model: torch.Tensor, decay) -> None:
    """In place ``ema = d*ema + (1 - d)*model`` as ``ema.lerp_(model, 1 - d)`` (DESIGN §2.3).

    ema, model (N,) flat tensors of one floating dtype on one device; decay a float or a 0-d tensor
    (kept on the device so the update needs no host sync and fits in a CUDA graph). The weight 1 - d is
    formed in decay's precision and rounded once to the compute dtype (ema's dtype, float32 for
    bf16/fp16 ema, which is then computed in float32 and rounded back). torch.lerp evaluates
    ``ema + w*(model - ema)`` for w < 0.5 and ``model - (model - ema)*(1 - w)`` otherwise.
    """
    if ema.shape != model.shape:
        raise ValueError(f"ema_update: ema {tuple(ema.shape)} and model {tuple(model.shape)} differ in shape")
    low = ema.dtype in (torch.float16, torch.bfloat16)
    cdt = torch.float32 if low else ema.dtype
    w = 1 - decay
    if isinstance(w, torch.Tensor):
        w = w.to(device=ema.device, dtype=cdt)
    if low:
        ema.copy_(ema.float().lerp_(model.float(), w))
    else:
        ema.lerp_(model.to(cdt), w)


# Newton-Schulz quintic coefficients of Muon (YOLO11_YOLO26.md §5.3): fast growth of small singular values,
# the fixed point wobbling within ~0.7-1.2 instead of converging to 1.
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def ns_orthogonalize_ref(mat: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Muon's orthogonalisation ``NS5(mat)`` of one matrix or a batch ``(..., m, n)``, returned in mat's
    dtype and shape (YOLO11_YOLO26.md §5.3; the caller applies σ and the flattening of a conv weight).

    In ``dtype`` (bfloat16: the spec; float32: the mode for CPUs without native bf16):
    ``X = x / (‖x‖_F + eps)`` with the norm taken of the low-precision tensor in its own dtype; if
    m > n the iteration runs on ``Xᵀ`` (so ``X Xᵀ`` is the smaller Gram matrix); ``steps`` times with
    (a, b, c) = NS_COEFFS: ``A = X Xᵀ``, ``B = b·A + c·(A A)``, ``X = a·X + B X``, each affine step one
    ``baddbmm`` (inputs in dtype, accumulation in fp32, one rounding), then transposed back.
    The orientation is each matrix's own (Ultralytics takes it on the zero-padded row count of its
    batches, which changes the rounding, not the value, of matrices it pads past square).
    """
    if mat.dim() < 2:
        raise ValueError(f"ns_orthogonalize: expected a matrix or a batch (..., m, n), got shape "
                         f"{tuple(mat.shape)}")
    m, n = mat.shape[-2:]
    x = mat.reshape(-1, m, n).to(dtype)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    if m > n:
        x = x.transpose(-2, -1)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        gram = torch.bmm(x, x.transpose(-2, -1))
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    if m > n:
        x = x.transpose(-2, -1)
    return x.to(mat.dtype).reshape(mat.shape)
