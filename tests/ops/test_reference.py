"""The reference ops against hand-worked cases (expected values written here, not computed by the reference)
and against a literal, loop-by-loop reading of DESIGN §2.1 on random inputs."""

import math

import pytest
import torch
from op_inputs import F64, assign, ciou_py, close, small_scene, t64

from yolofast.ops import backend, bbox_loss, ema_update, tal_assign
from yolofast.ops.reference import bbox_ciou, bbox_decode, bbox_loss_ref, ema_update_ref, tal_assign_ref

# ---------------------------------------------------------------------------------------------- CIoU


@pytest.mark.parametrize(
    "box1, box2, expected",
    [
        # identical 4x2 boxes: iou = 8 / (8 + 9e-7) because h carries +eps and union +eps
        ([0, 0, 4, 2], [0, 0, 4, 2], 8 / (8 + 9e-7)),
        # disjoint unit squares 1 apart: iou 0, rho2 = 16/4 = 4, c2 = 3^2 + 1^2 = 10 -> -0.4
        ([0, 0, 1, 1], [2, 0, 3, 1], -0.3999999960000001),
        # 2x2 square centred in a 4x4 one: iou = 4/16, no centre offset, same aspect
        ([0, 0, 4, 4], [1, 1, 3, 3], 0.24999998906250046),
        # 2x1 vs 1x2 at the origin: iou 1/3, rho2/c2 = 0.5/8, v = 4/pi^2 (atan 2 - atan .5)^2, v*alpha
        ([0, 0, 2, 1], [0, 0, 1, 2], 0.23708163087569742),
    ],
)
def test_ciou_hand_values(box1, box2, expected):
    got = bbox_ciou(t64(box1), t64(box2))
    assert got.shape == ()
    assert got.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # bitwise symmetric by construction (the kernels may pass the boxes either way round)
    assert bbox_ciou(t64(box2), t64(box1)).item() == got.item()


def test_ciou_broadcasts():
    a = torch.tensor([[0.0, 0, 4, 4], [0, 0, 2, 1]])[:, None]  # (2, 1, 4)
    b = torch.tensor([[0.0, 0, 4, 4], [1, 1, 3, 3], [0, 0, 1, 2]])[None]  # (1, 3, 4)
    out = bbox_ciou(a, b)
    assert out.shape == (2, 3)
    assert out[0, 1].item() == pytest.approx(0.25, abs=1e-6)
    assert out[1, 2].item() == pytest.approx(0.23708163, abs=1e-6)


def test_ciou_gradient_holds_alpha_constant():
    box1, box2 = [0.3, 0.1, 2.2, 1.4], [0.0, 0.5, 1.1, 2.6]
    b1 = t64(box1).requires_grad_()
    bbox_ciou(b1, t64(box2)).backward()
    _, alpha0 = ciou_py(box1, box2)
    h = 1e-6
    for i in range(4):
        up, dn = list(box1), list(box1)
        up[i] += h
        dn[i] -= h
        frozen = (ciou_py(up, box2, alpha0)[0] - ciou_py(dn, box2, alpha0)[0]) / (2 * h)
        full = (ciou_py(up, box2)[0] - ciou_py(dn, box2)[0]) / (2 * h)
        assert b1.grad[i].item() == pytest.approx(frozen, abs=1e-7)
        if i in (0, 2):  # the width enters v, so letting alpha vary changes the x-gradients
            assert abs(b1.grad[i].item() - full) > 1e-5


# ---------------------------------------------------------------------------------------------- decode


def test_decode_expectation_and_layout():
    # side-major logits: one peaked bin per side; uniform side -> expectation 7.5
    logits = torch.full((1, 1, 4, 16), -1e4, dtype=F64)
    logits[0, 0, 0, 3] = 0  # l = 3
    logits[0, 0, 1, 10] = 0  # t = 10
    logits[0, 0, 2] = 0  # r = mean(0..15) = 7.5
    logits[0, 0, 3, 0] = 0  # b = 0
    box = bbox_decode(logits.view(1, 1, 64), t64([[20.5, 12.5]]))
    close(box, [[[17.5, 2.5, 28.0, 12.5]]])


# ---------------------------------------------------------------------------------------------- tal_assign

GT40x20 = [0, 0, 40, 20]


def test_assign_anchor_inside_one_gt():
    anc = [[10, 10], [30, 10], [10, 30], [50, 50]]  # first two inside the GT, the others outside
    pd = [GT40x20, [20, 0, 40, 20], GT40x20, GT40x20]
    scores = [[0.0, 0.81], [0.0, 0.64], [0.0, 0.99], [0.0, 0.99]]
    labels, boxes, tscores, fg, idx = assign(scores, pd, anc, [1], [GT40x20])
    assert fg.tolist() == [[True, True, False, False]]
    assert idx.tolist() == [[0, 0, 0, 0]]
    assert labels.tolist() == [[1, 1, 1, 1]]  # background anchors get GT 0's label
    assert boxes.tolist() == [[GT40x20] * 4]
    # overlap(a1) = CIoU = 0.44675186749421775, align(a1) = sqrt(.64) * ov^6 = 0.006360455911772697,
    # align(a0) = 0.9 * (1 - 1e-8)^6, so norm(a1) = align(a1) * ov(a0) / (align(a0) + 1e-9)
    assert tscores[0, :, 0].tolist() == [0, 0, 0, 0]
    assert tscores[0, :, 1].tolist() == pytest.approx([1.0, 0.007067173585226232, 0, 0], rel=1e-7)
    assert tscores.dtype == F64


def test_assign_two_gts_larger_overlap_wins():
    anc = [[50, 50]]
    gts = [[40, 40, 100, 60], [30, 30, 70, 70]]
    labels, _, tscores, fg, idx = assign([[0.25, 0.64]], [[32, 30, 70, 70]], anc, [0, 1], gts)
    assert fg.tolist() == [[True]] and idx.tolist() == [[1]] and labels.tolist() == [[1]]
    assert tscores[0, 0, 0].item() == 0 and tscores[0, 0, 1].item() > 0.9
    # equal overlaps (identical boxes): the lowest GT index wins
    labels, _, _, fg, idx = assign([[0.25, 0.64]], [[32, 30, 70, 70]], anc, [0, 1], [gts[1], gts[1]])
    assert fg.tolist() == [[True]] and idx.tolist() == [[0]] and labels.tolist() == [[0]]


def test_assign_conflict_goes_to_best_candidate_even_if_it_did_not_select():
    # X = (50, 50) lies in g0, g1 and g2; Z = (65, 35) only in g2. With topk=1, g0 and g1 select X (their
    # only candidate) and g2 selects Z (align .9 vs .5). X is contested -> it goes to g2, the candidate GT
    # with the largest overlap (pd box of X == g2's box), although g2 did not select X.
    g2 = [30, 30, 70, 70]
    gts = [[40, 40, 100, 60], [20, 45, 60, 90], g2]
    scores = [[0.64, 0.49, 0.25], [0.01, 0.01, 0.81]]
    labels, boxes, tscores, fg, idx = assign(scores, [g2, g2], [[50, 50], [65, 35]], [0, 1, 2], gts, topk=1)
    assert fg.tolist() == [[True, True]]
    assert idx.tolist() == [[2, 2]] and labels.tolist() == [[2, 2]]
    assert boxes.tolist() == [[g2, g2]]
    # g2's positives: align X = .5, Z = .9 (overlaps 1) -> norm X = .5/.9, Z = 1
    close(tscores[0], [[0, 0, 0.5 / 0.9], [0, 0, 1.0]])

    # same scene but g2 scores 0 on X: the winner's align is 0, and an align-0 anchor is never positive
    scores0 = [[0.64, 0.49, 0.0], [0.01, 0.01, 0.81]]
    _, _, tscores, fg, idx = assign(scores0, [g2, g2], [[50, 50], [65, 35]], [0, 1, 2], gts, topk=1)
    assert fg.tolist() == [[False, True]] and idx.tolist() == [[0, 2]]
    close(tscores[0], [[0, 0, 0], [0, 0, 1.0]])


def test_assign_zero_align_pick_of_topk_does_not_count_as_a_selection():
    # g0 has X as its only candidate but scores 0 on g0's class: its top-k picks X with align 0, which is
    # no selection. So X is selected by g1 alone and stays with g1, although g0 overlaps X better.
    g0, g1 = [30, 30, 70, 70], [40, 40, 100, 60]
    labels, _, tscores, fg, idx = assign([[0.0, 0.64]], [g0], [[50, 50]], [0, 1], [g0, g1], topk=10)
    assert fg.tolist() == [[True]] and idx.tolist() == [[1]] and labels.tolist() == [[1]]
    close(tscores[0], [[0, 0.2018646355894898]])  # CIoU(g1, X) = 0.20186836431720404


def test_assign_single_selector_keeps_anchor_despite_better_candidate():
    # X in g0 and g1; g1 overlaps X better but selects Y (topk=1); X is selected by g0 alone and stays.
    g0, g1 = [40, 40, 100, 60], [30, 30, 70, 70]
    scores = [[0.64, 0.01], [0.01, 0.81]]
    _, _, _, fg, idx = assign(scores, [g1, g1], [[50, 50], [35, 35]], [0, 1], [g0, g1], topk=1)
    assert fg.tolist() == [[True, True]] and idx.tolist() == [[0, 1]]


def test_assign_gt_without_anchor_centre():
    # anchor (20, 30) sits on the left edge: cx - x1 = 0 is not > eps, so it is not inside
    anc = [[10, 10], [50, 50], [20, 30]]
    gt = [20, 20, 40, 40]
    labels, boxes, tscores, fg, idx = assign([[0.9, 0.9]] * 3, [gt] * 3, anc, [1], [gt])
    assert not fg.any() and idx.tolist() == [[0, 0, 0]]
    assert labels.tolist() == [[1, 1, 1]] and boxes.tolist() == [[gt] * 3]
    assert not tscores.any()


def test_assign_tiny_gt_is_widened_to_16px_for_candidates_only():
    tiny = [48, 48, 52, 52]  # 4x4 around (50, 50) -> candidates inside [42, 42, 58, 58]
    flat = [10, 10, 60, 12]  # h = 2 around y = 11 -> y range (3, 19)
    thin = [70, 10, 72, 60]  # w = 2 around x = 71 -> x range (63, 79)
    pad = [100, 100, 102, 102]  # padding row: never a candidate
    anc = [[44, 50], [57.9, 50], [41, 50], [59, 50], [30, 17], [30, 2], [64, 30], [101, 101]]
    pd = [tiny, tiny, tiny, tiny, flat, flat, thin, pad]
    labels, boxes, _, fg, idx = assign(
        [[0.5]] * 8, pd, anc, [0, 0, 0, 0], [tiny, flat, thin, pad], mask=[1, 1, 1, 0]
    )
    assert fg.tolist() == [[True, True, False, False, True, False, True, False]]
    assert idx.tolist() == [[0, 0, 0, 0, 1, 0, 2, 0]]
    assert boxes[0, [0, 4, 6]].tolist() == [tiny, flat, thin]  # the original, un-widened boxes


def test_assign_no_gt():
    B, A, C = 2, 5, 3
    labels, boxes, scores, fg, idx = tal_assign_ref(
        torch.rand(B, A, C, dtype=torch.bfloat16),
        torch.rand(B, A, 4),
        torch.rand(A, 2),
        torch.zeros(B, 0, 1),
        torch.zeros(B, 0, 4),
        torch.zeros(B, 0, 1),
    )
    assert labels.tolist() == [[C] * A] * B and labels.dtype == torch.int64
    assert boxes.shape == (B, A, 4) and not boxes.any()
    assert scores.shape == (B, A, C) and scores.dtype == torch.bfloat16 and not scores.any()
    assert fg.dtype == torch.bool and not fg.any()
    assert idx.dtype == torch.int64 and not idx.any()


def test_assign_only_padding_gts_gives_background():
    labels, boxes, scores, fg, idx = assign(
        [[0.9]] * 2, [[0, 0, 40, 40]] * 2, [[10, 10], [20, 20]], [0, 0], [[0, 0, 40, 40]] * 2, mask=[0, 0]
    )
    assert not fg.any() and not scores.any() and idx.tolist() == [[0, 0]]


def test_assign_topk_ties_go_to_lower_anchor_index():
    gt = [0, 0, 100, 100]
    anc = [[10 + 10 * i, 50] for i in range(5)]
    # equal pd boxes -> equal overlaps; align proportional to sqrt(score) = [.3, .5, .9, .5, .5]
    scores = [[0.09], [0.25], [0.81], [0.25], [0.25]]
    _, _, tscores, fg, _ = assign(scores, [gt] * 5, anc, [0], [gt], topk=3)
    assert fg.tolist() == [[False, True, True, True, False]]
    assert tscores[0, :, 0].tolist() == pytest.approx([0, 0.5 / 0.9, 1.0, 0.5 / 0.9, 0], rel=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_candidate_metric_equals_the_dense_form(dtype, monkeypatch):
    """The eager-CPU assigner scores only the candidate pairs; the dense form (what torch.compile, a CUDA
    graph and CUDA run) gives the same overlaps and aligns: zero off the candidates, and on them equal up
    to the last bit of the vector vs scalar atan/pow (float64: no vector tail difference at all)."""
    from yolofast.ops import reference as R

    torch.manual_seed(5)
    scores, pd, anc, labels, gts, mask = (x.to(dtype) for x in small_scene(3, 400, 7, 9))
    real = mask.reshape(3, 9) > 0
    labels_c = labels.reshape(3, 9).long()
    cand = R._candidates(gts, real, anc, 1e-9)
    assert 0 < cand.sum() < cand.numel()
    got = R._metric(scores, pd, gts, labels_c, cand, 0.5, 6.0)
    monkeypatch.setattr(R, "_eager_cpu", lambda t: False)
    want = R._metric(scores, pd, gts, labels_c, cand, 0.5, 6.0)
    for g, w in zip(got, want):
        assert torch.equal(g != 0, w != 0)
        torch.testing.assert_close(g, w, rtol=4 * torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("k", [0, 1, 3, 10, 40, 64])
def test_stable_topk_mask_is_the_stable_sort_prefix(k):
    """The assigner's top-k without a sort equals the first k of torch's stable descending sort on rows
    full of ties (values on a 1/8 grid), all-equal rows, NaN entries (ranked above every number) and
    k >= the row length."""
    from yolofast.ops.reference import _stable_topk_mask

    g = torch.Generator().manual_seed(k)
    m = (torch.randint(0, 9, (3, 5, 40), generator=g) / 8).to(torch.float32)
    m[0, 1] = 0.5  # one row all ties
    m[1, 2, [3, 17, 30]] = float("nan")
    want = torch.zeros_like(m, dtype=torch.bool)
    if k:
        want.scatter_(-1, torch.sort(m, dim=-1, descending=True, stable=True).indices[..., :k], True)
    assert torch.equal(_stable_topk_mask(m, k), want)


def test_assign_align_zero_is_never_positive():
    gt = [0, 0, 100, 100]
    anc = [[20, 20], [50, 50], [80, 80]]
    pd = [gt, [200, 200, 220, 220], gt]  # anchor 1's box is disjoint: CIoU < 0 -> overlap 0
    scores = [[0.0], [0.9], [0.49]]  # anchor 0 scores 0 on the GT's class
    _, _, tscores, fg, _ = assign(scores, pd, anc, [0], [gt], topk=10)
    assert fg.tolist() == [[False, False, True]]
    assert tscores[0, :, 0].tolist() == pytest.approx([0, 0, 1.0], rel=1e-7)


def test_assign_score_normalisation():
    g0, g1 = [0, 0, 40, 40], [100, 100, 140, 140]
    anc = [[15, 20], [25, 20], [120, 120]]
    pd = [[5, 5, 35, 35], [10, 10, 30, 30], g1]
    scores = [[1e-6, 0.3], [1.0, 0.2], [0.3, 0.04]]
    _, _, tscores, fg, idx = assign(scores, pd, anc, [0, 1], [g0, g1])
    assert fg.tolist() == [[True, True, True]] and idx.tolist() == [[0, 0, 1]]
    # g0: overlaps A = 0.5624999975039062, B = 0.249999999046875 (concentric squares: CIoU = IoU);
    # aligns A = sqrt(1e-6) * ovA^6 = 3.16763511806955e-05 < B = ovB^6 = 0.00024414061941528328.
    # pos_align is B's align, pos_overlap is A's overlap: norm = align * ovA / (alignB + 1e-9).
    # g1 is normalised on its own: align / (align + 1e-9) * overlap(~1).
    close(tscores[0], [[0.07298201553159138, 0], [0.5624976935133009, 0], [0, 1.0]])


def test_assign_low_precision_inputs_compute_in_fp32():
    torch.manual_seed(1)
    B, A, C, M = 2, 64, 4, 3
    args = small_scene(B, A, C, M)
    out32 = tal_assign_ref(*[a.float() if a.is_floating_point() else a for a in args])
    sc16 = args[0].to(torch.bfloat16)
    out16 = tal_assign_ref(sc16, *[a.float() for a in args[1:]])
    assert out16[2].dtype == torch.bfloat16 and out16[1].dtype == torch.float32
    # same fg/idx up to bf16 score rounding; scores within bf16 resolution
    assert (out16[3] == out32[3]).float().mean() > 0.95
    ref = tal_assign_ref(sc16.float(), *[a.float() for a in args[1:]])
    assert torch.equal(out16[3], ref[3]) and torch.equal(out16[4], ref[4])
    torch.testing.assert_close(out16[2].float(), ref[2], rtol=1e-2, atol=1e-2)


# ---- a literal loop-by-loop reading of DESIGN §2.1, compared with the vectorised reference on random data


def _assign_loop(scores, pd, anc, labels, gts, mask, topk, alpha=0.5, beta=6.0, eps=1e-9):
    B, A, C = scores.shape
    M = gts.shape[1]
    out_fg = [[False] * A for _ in range(B)]
    out_idx = [[0] * A for _ in range(B)]
    out_sc = [[[0.0] * C for _ in range(A)] for _ in range(B)]
    for b in range(B):
        cand = [[False] * A for _ in range(M)]
        ov = [[0.0] * A for _ in range(M)]
        al = [[0.0] * A for _ in range(M)]
        for g in range(M):
            if mask[b, g, 0] <= 0:
                continue
            x1, y1, x2, y2 = gts[b, g].tolist()
            if x2 - x1 < 16:
                x1, x2 = (x1 + x2) / 2 - 8, (x1 + x2) / 2 + 8
            if y2 - y1 < 16:
                y1, y2 = (y1 + y2) / 2 - 8, (y1 + y2) / 2 + 8
            for a in range(A):
                cx, cy = anc[a].tolist()
                if cx - x1 > eps and cy - y1 > eps and x2 - cx > eps and y2 - cy > eps:
                    cand[g][a] = True
                    ov[g][a] = max(ciou_py(gts[b, g].tolist(), pd[b, a].tolist())[0], 0.0)
                    s = scores[b, a, int(labels[b, g, 0])].item()
                    al[g][a] = s**alpha * ov[g][a] ** beta
        sel = [
            {a for a in sorted(range(A), key=lambda a, g=g: (-al[g][a], a))[:topk] if al[g][a] > 0}
            for g in range(M)
        ]
        owner = {}
        for a in range(A):
            by = [g for g in range(M) if a in sel[g]]
            if len(by) == 1:
                owner[a] = by[0]
            elif len(by) > 1:
                owner[a] = min((g for g in range(M) if cand[g][a]), key=lambda g, a=a: (-ov[g][a], g))
            if a in owner and al[owner[a]][a] <= 0:
                del owner[a]
        for g in range(M):
            pos = [a for a in owner if owner[a] == g]
            if not pos:
                continue
            pa, po = max(al[g][a] for a in pos), max(ov[g][a] for a in pos)
            for a in pos:
                out_fg[b][a], out_idx[b][a] = True, g
                out_sc[b][a][int(labels[b, g, 0])] = al[g][a] * po / (pa + eps)
    return out_fg, out_idx, out_sc


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_assign_matches_literal_loop_reading(seed):
    torch.manual_seed(seed)
    args = small_scene(B=2, A=100, C=3, M=6)
    topk = 4  # small, so GTs overlap and compete for anchors
    labels, boxes, tscores, fg, idx = tal_assign_ref(*args, topk=topk)
    exp_fg, exp_idx, exp_sc = _assign_loop(*args, topk=topk)
    assert fg.tolist() == exp_fg
    assert idx.tolist() == exp_idx
    torch.testing.assert_close(tscores, t64(exp_sc), rtol=1e-9, atol=1e-12)
    gl = args[3][..., 0].long()
    assert torch.equal(labels, gl.gather(1, idx))
    assert torch.equal(boxes, args[4].gather(1, idx[..., None].expand(-1, -1, 4)))
    assert fg.any()


# ---------------------------------------------------------------------------------------------- bbox_loss


def _one_anchor_loss(logits, anchor, target, ts):
    return bbox_loss_ref(
        logits.view(1, 1, -1),
        torch.zeros(1, 1, 1, dtype=F64),
        t64([anchor]),
        t64([[target]]),
        t64([[ts]]),
        torch.tensor([[True]]),
    )


def test_bbox_loss_box_cls_dfl_hand_values():
    # anchor 0 (10.5, 10.5): uniform logits -> distances 7.5 -> pred (3, 3, 18, 18); the concentric target
    # half its size gives CIoU = 0.2499999973888889. DFL with uniform logits is ln 16 whatever the target.
    # Anchor 1 is background (its garbage target box must not matter).
    pred_dist = torch.zeros(1, 2, 64, dtype=F64)
    pred_scores = t64([[[0.0, 0.0], [2.0, -1.0]]])
    anc = t64([[10.5, 10.5], [2.5, 2.5]])
    tb = t64([[[6.75, 6.75, 14.25, 14.25], [float("nan")] * 4]])
    fg = torch.tensor([[True, False]])
    ln2 = math.log(2)
    bce_bg = math.log1p(math.exp(2)) + math.log1p(math.exp(-1))  # BCE(2, 0) + BCE(-1, 0)
    # S = max(0.5, 1) = 1; w = 0.5
    loss = bbox_loss_ref(pred_dist, pred_scores, anc, tb, t64([[[0.5, 0], [0, 0]]]), fg)
    assert loss.dtype == F64 and loss.shape == (3,)
    assert loss.tolist() == pytest.approx(
        [(1 - 0.2499999973888889) * 0.5, 2 * ln2 + bce_bg, math.log(16) * 0.5], rel=1e-9
    )
    # non-contiguous logits (e.g. a permuted head output) are fine
    nc_dist = torch.zeros(1, 64, 2, dtype=F64).transpose(1, 2)
    assert torch.equal(bbox_loss_ref(nc_dist, pred_scores, anc, tb, t64([[[0.5, 0], [0, 0]]]), fg), loss)
    # S = 3 > 1 normalises all three terms (BCE at logit 0 is ln 2 for any target)
    loss = bbox_loss_ref(pred_dist, pred_scores, anc, tb, t64([[[2.0, 1.0], [0, 0]]]), fg)
    assert loss.tolist() == pytest.approx(
        [1 - 0.2499999973888889, (2 * ln2 + bce_bg) / 3, math.log(16)], rel=1e-9
    )


def test_dfl_targets_on_bin_edges_and_at_the_clamp():
    # one peaked bin (logit 5, others 0) per side: logsm = 5 - LSE at the peak, -LSE elsewhere,
    # LSE = ln(15 + e^5) = 5.096281712246793
    logits = torch.zeros(4, 16, dtype=F64)
    for side, peak in enumerate((3, 15, 0, 7)):
        logits[side, peak] = 5
    ax, ay = 20.5, 20.5
    # distances l = 3 (bin edge: all weight on bin 3), t = 20 -> clamped 14.99 (0.01 on bin 14, 0.99 on 15),
    # r = 0 (edge at bin 0), b = 7.25 (0.75 on bin 7) -> dfl per side LSE - 5, -4.95, -5, -3.75
    target = [ax - 3, ay - 20, ax + 0, ay + 7.25]
    loss = _one_anchor_loss(logits, [ax, ay], target, [1.0])
    assert loss[2].item() == pytest.approx(5.096281712246793 - 4.675, rel=1e-9)


@pytest.mark.parametrize("R, fast", [(4, False), (16, True)])  # full Jacobian on few bins (CPU cost)
def test_bbox_loss_gradcheck_fp64(R, fast):
    torch.manual_seed(0)
    B, A, C = 2, 6, 3
    pred_dist = torch.randn(B, A, 4 * R, dtype=F64, requires_grad=True)
    pred_scores = torch.randn(B, A, C, dtype=F64, requires_grad=True)
    anc = torch.rand(A, 2, dtype=F64) * 10 + 5
    # Targets with the decoded prediction's aspect ratio (scaled 0.7x about a shifted centre): there the
    # CIoU aspect term v and its gradient vanish, so finite differences (which would also move the
    # detached alpha) agree with the analytic gradient. Box, DFL and cls terms are all non-trivial.
    with torch.no_grad():
        box = bbox_decode(pred_dist, anc)
        ctr, wh = (box[..., :2] + box[..., 2:]) / 2 + 0.8, (box[..., 2:] - box[..., :2]) * 0.7
        tb = torch.cat((ctr - wh / 2, ctr + wh / 2), -1)
    ts = torch.rand(B, A, C, dtype=F64) * 0.6
    fg = torch.rand(B, A) < 0.6
    fg[0, 0], fg[1, 0] = True, False
    fn = lambda d, s: bbox_loss_ref(d, s, anc, tb, ts, fg)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (pred_dist, pred_scores), fast_mode=fast)


def test_bbox_loss_bf16_inputs_compute_in_fp32():
    torch.manual_seed(0)
    B, A, C = 2, 10, 3
    pd16 = torch.randn(B, A, 64).to(torch.bfloat16).requires_grad_()
    ps16 = torch.randn(B, A, C).to(torch.bfloat16).requires_grad_()
    anc = torch.rand(A, 2) * 10 + 5
    tb = torch.cat((anc - 2, anc + 3), -1).expand(B, A, 4)
    ts = torch.rand(B, A, C).to(torch.bfloat16)
    fg = torch.rand(B, A) < 0.5
    loss = bbox_loss_ref(pd16, ps16, anc, tb, ts, fg)
    assert loss.dtype == torch.float32
    # upcast first, so it equals the fp32 computation on the bf16-rounded values
    assert torch.equal(loss, bbox_loss_ref(pd16.float(), ps16.float(), anc, tb, ts.float(), fg))
    loss.sum().backward()
    assert pd16.grad.dtype == torch.bfloat16 and torch.isfinite(pd16.grad.float()).all()
    assert ps16.grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(bbox_loss_ref(pd16, ps16, anc, tb, ts, fg), loss)


# ---------------------------------------------------------------------------------------------- ema_update


def test_ema_update_ref_in_place():
    ema, model = torch.tensor([1.0, 2.0, -4.0]), torch.tensor([3.0, 2.0, 0.0])
    ptr = ema.data_ptr()
    assert ema_update_ref(ema, model, 0.75) is None
    assert ema.tolist() == [1.5, 2.0, -3.0] and ema.data_ptr() == ptr
    ema_update_ref(ema, model, torch.tensor(0.5, dtype=torch.float64))
    assert ema.tolist() == [2.25, 2.0, -1.5]
    half = torch.tensor([1.0, 2.0], dtype=torch.float16)
    ema_update_ref(half, torch.tensor([3.0, 2.0], dtype=torch.float16), torch.tensor(0.75))
    assert half.dtype == torch.float16 and half.tolist() == [1.5, 2.0]
    with pytest.raises(ValueError, match="shape"):
        ema_update_ref(torch.zeros(3), torch.zeros(4), 0.5)


# ---------------------------------------------------------------------------------------------- wrappers


def test_public_wrappers_dispatch_to_reference():
    torch.manual_seed(0)
    args = [a.float() for a in small_scene(B=1, A=64, C=3, M=4)]
    with backend("ref"):
        for got, exp in zip(tal_assign(*args, topk=5), tal_assign_ref(*args, topk=5)):
            assert torch.equal(got, exp)
        pd, ps = torch.randn(1, 64, 64), torch.randn(1, 64, 3)
        tb = torch.cat((args[2] / 8 - 1, args[2] / 8 + 2), -1)[None]
        ts, fg = torch.rand(1, 64, 3), torch.rand(1, 64) < 0.3
        assert torch.equal(
            bbox_loss(pd, ps, args[2] / 8, tb, ts, fg), bbox_loss_ref(pd, ps, args[2] / 8, tb, ts, fg)
        )
        e1, m = torch.randn(50), torch.randn(50)
        e2 = e1.clone()
        ema_update(e1, m, 0.9)
        ema_update_ref(e2, m, 0.9)
        assert torch.equal(e1, e2)
