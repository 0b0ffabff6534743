"""YOLO26's additions to the reference ops (YOLO11_YOLO26.md §4.2-4.3): ``topk2`` in ``tal_assign_ref`` and
the reg_max 1 box loss (CIoU + normalised L1) in ``bbox_loss_ref``, against hand-worked cases (expected
values written here) and a literal loop-by-loop reading of step 4b on random scenes; and the op wrappers'
rule that routes these two arguments to the reference until a kernel implements them."""

import math
import sys

import pytest
import torch
from op_inputs import assign, ciou_py, close, small_scene, t64

from yolofast.ops import backend, bbox_loss, bbox_loss_maps, head_decode, tal_assign, tal_assign_maps
from yolofast.ops.reference import bbox_decode, bbox_loss_ref, tal_assign_ref

F64 = torch.float64
_TA = sys.modules["yolofast.ops.tal_assign"]  # the modules (the package attributes are the functions)
_BL = sys.modules["yolofast.ops.bbox_loss"]

# ------------------------------------------------------------------------------------ topk2: hand-made cases

# g0 and g1 contain X only; g2 contains X, Z and W. Every predicted box is g2's, so g2 overlaps each anchor
# best (overlap ~1). Scores on g2's class give align(g2) = X .5, Z .9, W .7.
G2 = [30, 30, 70, 70]
GTS = [[40, 40, 100, 60], [20, 45, 60, 90], G2]
ANC = [[50, 50], [65, 35], [35, 40]]  # X, Z, W
SCORES = [[0.64, 0.49, 0.25], [0.01, 0.01, 0.81], [0.01, 0.01, 0.49]]


def _scene(**kw):
    return assign(SCORES, [G2] * 3, ANC, [0, 1, 2], GTS, topk=2, **kw)


def test_topk2_off_keeps_the_won_anchor_beyond_topk():
    # topk 2: g0 and g1 select X (their only candidate), g2 selects Z and W. X is contested and goes to g2
    # (the best-overlap candidate GT) although g2 did not select it: g2 has 3 positives, more than topk.
    for kw in ({}, {"topk2": None}, {"topk2": 2}, {"topk2": 3}):  # topk2 == topk or >= the positives: off
        labels, _, ts, fg, idx = _scene(**kw)
        assert fg.tolist() == [[True, True, True]] and idx.tolist() == [[2, 2, 2]], kw
        close(ts[0, :, 2], [0.5 / 0.9, 1.0, 0.7 / 0.9], rel=1e-6)


def test_topk2_runs_after_conflicts_and_ranks_the_won_anchor_by_raw_align():
    # topk 2: g2's pool for the second top-k is {X (won by overlap) .5, Z .9, W .7}; topk2 1 keeps Z. The
    # dropped anchors lose g2 and become background: they do NOT go back to g0/g1 (4b runs after step 4).
    # The kept target score is normalised over the kept positives alone: .9 * ov(Z) / (.9 + 1e-9).
    labels, boxes, ts, fg, idx = _scene(topk2=1)
    assert fg.tolist() == [[False, True, False]] and idx.tolist() == [[0, 2, 0]]
    assert labels.tolist() == [[0, 2, 0]] and boxes[0, 1].tolist() == G2
    close(ts[0], [[0, 0, 0], [0, 0, 1.0], [0, 0, 0]], rel=1e-6)
    # W's align lowered to .4 and topk 1: g2 selects Z only, wins X by overlap, W is unselected. The pool
    # {X, Z} is larger than topk; topk2 2 keeps both, so an anchor won by overlap is kept as a positive.
    scores = [list(r) for r in SCORES]
    scores[2][2] = 0.16
    _, _, _, fg, idx = assign(scores, [G2] * 3, ANC, [0, 1, 2], GTS, topk=1)
    assert fg.tolist() == [[True, True, False]] and idx.tolist() == [[2, 2, 0]]
    _, _, ts, fg, idx = assign(scores, [G2] * 3, ANC, [0, 1, 2], GTS, topk=1, topk2=2)
    assert fg.tolist() == [[True, True, False]] and idx.tolist() == [[2, 2, 0]]
    close(ts[0, :, 2], [0.5 / 0.9, 1.0, 0.0], rel=1e-6)


def test_topk2_ties_go_to_the_lower_anchor_index():
    gt = [0, 0, 100, 100]
    anc = [[10 + 10 * i, 50] for i in range(5)]
    scores = [[0.09], [0.25], [0.81], [0.81], [0.25]]  # align .3 .5 .9 .9 .5 (equal pd boxes)
    _, _, ts, fg, _ = assign(scores, [gt] * 5, anc, [0], [gt], topk=3, topk2=1)
    assert fg.tolist() == [[False, False, True, False, False]]
    assert ts[0, :, 0].tolist() == pytest.approx([0, 0, 1.0, 0, 0], rel=1e-7)
    _, _, _, fg, _ = assign(scores, [gt] * 5, anc, [0], [gt], topk=3, topk2=2)
    assert fg.tolist() == [[False, False, True, True, False]]


def test_topk2_on_empty_images_and_padding():
    B, A, C = 2, 6, 3
    empty = tal_assign_ref(torch.rand(B, A, C), torch.rand(B, A, 4), torch.rand(A, 2), torch.zeros(B, 0, 1),
                           torch.zeros(B, 0, 4), torch.zeros(B, 0, 1), topk=7, topk2=1)
    assert empty[0].tolist() == [[C] * A] * B and not empty[3].any() and not empty[2].any()
    # image 0 has one GT, image 1 only a padding row: image 1 stays background
    gt = t64([[[0, 0, 40, 40]], [[0, 0, 40, 40]]])
    anc = t64([[10, 10], [20, 20], [30, 30], [50, 50], [60, 60], [70, 70]])
    pd = t64([[0, 0, 40, 40]]).expand(B, A, 4)
    out = tal_assign_ref(torch.full((B, A, C), 0.5, dtype=F64), pd, anc, torch.ones(B, 1, 1), gt,
                         t64([[[1]], [[0]]]), topk=7, topk2=1)
    assert out[3].tolist() == [[True] + [False] * 5, [False] * 6]


def test_topk2_must_keep_something():
    with pytest.raises(ValueError, match="topk2"):
        assign([[0.5]], [G2], [[50, 50]], [0], [G2], topk=7, topk2=0)


# ---------------------------------------------- topk2: a literal loop-by-loop reading of steps 1-5 with 4b


def _assign_loop_topk2(scores, pd, anc, labels, gts, mask, topk, topk2, alpha=0.5, beta=6.0, eps=1e-9):
    B, A, C = scores.shape
    M = gts.shape[1]
    out_fg = [[False] * A for _ in range(B)]
    out_idx = [[0] * A for _ in range(B)]
    out_sc = [[[0.0] * C for _ in range(A)] for _ in range(B)]
    for b in range(B):
        cand = [[False] * A for _ in range(M)]
        ov, al = [[0.0] * A for _ in range(M)], [[0.0] * A for _ in range(M)]
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
                    al[g][a] = scores[b, a, int(labels[b, g, 0])].item() ** alpha * ov[g][a] ** beta
        rank = [sorted(range(A), key=lambda a, g=g: (-al[g][a], a)) for g in range(M)]
        sel = [{a for a in rank[g][:topk] if al[g][a] > 0} for g in range(M)]
        owner = {}
        for a in range(A):
            by = [g for g in range(M) if a in sel[g]]
            if len(by) == 1:
                owner[a] = by[0]
            elif len(by) > 1:
                owner[a] = min((g for g in range(M) if cand[g][a]), key=lambda g, a=a: (-ov[g][a], g))
            if a in owner and al[owner[a]][a] <= 0:
                del owner[a]
        for g in range(M):  # 4b: each GT keeps its topk2 positives of largest align (ties: lower anchor)
            pos = sorted((a for a in owner if owner[a] == g), key=lambda a, g=g: (-al[g][a], a))
            for a in pos[topk2:]:
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


@pytest.mark.parametrize("seed, topk, topk2", [(0, 4, 1), (1, 7, 1), (2, 5, 2), (3, 3, 1)])
def test_topk2_matches_literal_loop_reading(seed, topk, topk2):
    torch.manual_seed(seed)
    args = small_scene(B=2, A=100, C=3, M=6)
    labels, boxes, ts, fg, idx = tal_assign_ref(*args, topk=topk, topk2=topk2)
    exp_fg, exp_idx, exp_sc = _assign_loop_topk2(*args, topk=topk, topk2=topk2)
    assert fg.tolist() == exp_fg and idx.tolist() == exp_idx
    torch.testing.assert_close(ts, t64(exp_sc), rtol=1e-9, atol=1e-12)
    assert torch.equal(labels, args[3][..., 0].long().gather(1, idx))
    assert torch.equal(boxes, args[4].gather(1, idx[..., None].expand(-1, -1, 4)))
    # at most topk2 positives per GT, and fewer positives than without the second top-k
    per_gt = torch.nn.functional.one_hot(torch.where(fg, idx, 6), 7)[..., :6].sum(1)
    assert per_gt.max() <= topk2 and fg.any()
    assert fg.sum() < tal_assign_ref(*args, topk=topk)[3].sum()


@pytest.mark.parametrize("seed", [0, 1])
def test_topk2_off_is_the_v8_reference_bit_for_bit(seed):
    torch.manual_seed(seed)
    args = [a.float() for a in small_scene(B=2, A=64, C=3, M=5)]
    base = tal_assign_ref(*args, topk=6)
    for topk2 in (None, 6):
        for got, exp in zip(tal_assign_ref(*args, topk=6, topk2=topk2), base):
            assert torch.equal(got, exp)


# --------------------------------------------------------------------------- reg_max 1: decode and L1 term


def test_decode_reg_max_1_is_the_raw_distance():
    # no softmax, no clamp: a negative distance moves the side past the anchor
    box = bbox_decode(t64([[[1.0, -0.5, 2.0, 3.0]]]), t64([[4.5, 2.5]]))
    close(box, [[[3.5, 3.0, 6.5, 5.5]]])


def _r1_loss(pd, tb, ts, fg, anc=((2.5, 2.5),), stride=8.0, img_hw=(64.0, 128.0)):
    A = len(anc)
    return bbox_loss_ref(t64(pd).view(1, A, 4), torch.zeros(1, A, 1, dtype=F64), t64(list(anc)),
                         t64(tb).view(1, A, 4), t64(ts).view(1, A, 1), torch.tensor([fg]),
                         stride_tensor=torch.full((A, 1), stride, dtype=F64), img_hw=img_hw)


def test_l1_term_hand_values_with_a_negative_target():
    # anchor (2.5, 2.5) grid units, stride 8, image H 64 x W 128. Prediction (l, t, r, b) = (1, 2, 3, 4);
    # target box (2, 3, 4, 5): the anchor lies above it, so t = (0.5, -0.5, 1.5, 2.5), NOT clamped.
    # x sides x 8 / 128, y sides x 8 / 64: p^ = (.0625, .25, .1875, .5), t^ = (.03125, -.0625, .09375, .3125)
    # |p^ - t^| = (.03125, .3125, .09375, .1875), mean .15625; w = 0.5, S = max(0.5, 1) = 1.
    loss = _r1_loss([1, 2, 3, 4], [2, 3, 4, 5], [0.5], [True])
    assert loss.shape == (3,) and loss.dtype == F64
    assert loss[2].item() == pytest.approx(0.15625 * 0.5, rel=1e-12)
    # box term: CIoU of the decoded (1.5, 0.5, 5.5, 6.5) and the target, the same weight
    ciou = ciou_py([1.5, 0.5, 5.5, 6.5], [2, 3, 4, 5])[0]
    assert loss[0].item() == pytest.approx((1 - ciou) * 0.5, rel=1e-9)
    assert loss[1].item() == pytest.approx(math.log(2) + 0.5 * 0, rel=1e-12)  # BCE(0, .5) = ln 2
    # the image size enters per axis: a square 128 x 128 image halves the y sides' share
    sq = _r1_loss([1, 2, 3, 4], [2, 3, 4, 5], [0.5], [True], img_hw=(128.0, 128.0))
    assert sq[2].item() == pytest.approx((0.03125 + 0.15625 + 0.09375 + 0.09375) / 4 * 0.5, rel=1e-12)


def test_l1_term_background_and_normaliser():
    # anchor 1 is background with a NaN target box: ignored. S = 2 + 0 > 1 divides every term.
    loss = _r1_loss([1, 2, 3, 4, 9, 9, 9, 9], [2, 3, 4, 5] + [float("nan")] * 4, [2.0, 0.0], [True, False],
                    anc=((2.5, 2.5), (7.5, 1.5)))
    assert torch.isfinite(loss).all()
    assert loss[2].item() == pytest.approx(0.15625 * 2 / 2, rel=1e-12)


def test_l1_term_needs_the_geometry():
    with pytest.raises(ValueError, match="img_hw"):
        bbox_loss_ref(torch.zeros(1, 1, 4), torch.zeros(1, 1, 1), torch.zeros(1, 2), torch.zeros(1, 1, 4),
                      torch.zeros(1, 1, 1), torch.ones(1, 1, dtype=torch.bool))


def test_reg_max_1_loss_gradcheck_fp64():
    torch.manual_seed(0)
    B, A, C = 2, 6, 3
    pred = torch.randn(B, A, 4, dtype=F64).abs().add(0.5).requires_grad_()
    scores = torch.randn(B, A, C, dtype=F64, requires_grad=True)
    anc = torch.rand(A, 2, dtype=F64) * 10 + 5
    stride = t64([[8.0], [8.0], [16.0], [16.0], [32.0], [32.0]])
    with torch.no_grad():  # targets with the prediction's aspect (CIoU's detached alpha drops out)
        box = bbox_decode(pred, anc)
        ctr, wh = (box[..., :2] + box[..., 2:]) / 2 + 0.3, (box[..., 2:] - box[..., :2]) * 0.8
        tb = torch.cat((ctr - wh / 2, ctr + wh / 2), -1)
    ts, fg = torch.rand(B, A, C, dtype=F64) * 0.6, torch.rand(B, A) < 0.6
    fg[0, 0] = True
    fn = lambda d, s: bbox_loss_ref(d, s, anc, tb, ts, fg, stride, (96.0, 160.0))  # noqa: E731
    assert torch.autograd.gradcheck(fn, (pred, scores))


def test_tiny_gt_enlarged_to_16px_gives_a_negative_l1_target():
    # a 4 x 4 px GT at (50, 50): enlarged to 16 px for the candidate test only, so anchor (44, 50) px
    # (stride 8: grid (5.5, 6.25)) is positive although it lies 4 px left of the real box: its left target
    # is -4 px, not clamped.
    tiny = [48, 48, 52, 52]
    _, boxes, ts, fg, _ = assign([[0.81]], [[42, 46, 54, 54]], [[44, 50]], [0], [tiny])
    assert fg.tolist() == [[True]] and boxes[0, 0].tolist() == tiny
    anc_g, tb_g = t64([[44 / 8, 50 / 8]]), boxes / 8
    pd = t64([[[0.0, 0.5, 1.0, 0.5]]])  # l t r b, grid units
    loss = bbox_loss_ref(pd, torch.zeros(1, 1, 1, dtype=F64), anc_g, tb_g, ts, fg, t64([[8.0]]), (64.0, 64.0))
    t_px = [44 - 48, 50 - 48, 52 - 44, 52 - 50]  # (-4, 2, 8, 2): unclamped
    p_px = [0.0, 4.0, 8.0, 4.0]
    l1 = sum(abs(p - t) / 64 for p, t in zip(p_px, t_px)) / 4
    w = ts.sum().item()
    assert loss[2].item() == pytest.approx(l1 * w / max(w, 1.0), rel=1e-12)


# --------------------------------------------------------------------- the ops' routing rule for the new args


def test_routing_rule_sends_the_new_arguments_to_the_reference(monkeypatch):
    assert _TA.topk2_backend("cpp", 10, None) == "cpp" and _TA.topk2_backend("cpp", 7, 7) == "cpp"
    # every assigner kernel implements topk2
    assert _TA.topk2_backend("cpp", 7, 1) == "cpp" and _TA.topk2_backend("triton", 7, 1) == "triton"
    assert _BL.reg_max_backend("cpp", 16) == "cpp" and _BL.reg_max_backend("cpp", 1) == "ref"
    # the CUDA and Triton (B, A, .) kernels implement reg_max 1; the C++ one does in the maps form only
    assert _BL.reg_max_backend("cuda", 1) == "cuda" and _BL.reg_max_backend("triton", 1) == "triton"
    # the plug-in point: a backend not listed as implementing the argument sends the call to the reference
    monkeypatch.setattr(_TA, "TOPK2_BACKENDS", frozenset({"ref"}))
    assert _TA.topk2_backend("cpp", 7, 1) == "ref"
    monkeypatch.setattr(_TA, "TOPK2_BACKENDS", frozenset({"ref", "cpp"}))
    monkeypatch.setattr(_BL, "REG_MAX1_BACKENDS", frozenset({"ref", "cpp"}))
    assert _TA.topk2_backend("cpp", 7, 1) == "cpp" and _BL.reg_max_backend("cpp", 1) == "cpp"


def _maps(B=2, nc=3, reg_max=1, hw=(64, 64), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, 4 * reg_max + nc, hw[0] // s, hw[1] // s, generator=g) for s in (8, 16, 32)]


@pytest.mark.parametrize("be", ["auto", "ref"])
def test_wrappers_with_topk2_and_reg_max_1_equal_the_reference(be):
    """On any selected backend (the C++ one under auto), the wrappers with topk2 / reg_max 1 return the
    reference's values: the maps forms (as the loss calls them) and the (B, A, .) forms."""
    from yolofast.boxes import make_anchors
    from yolofast.ops.bbox_loss import maps_to_rows

    torch.manual_seed(0)
    feats = _maps(hw=(64, 96))
    strides = (8.0, 16.0, 32.0)
    pd_dist, ps = maps_to_rows(feats, 1)
    anc, st = make_anchors(feats, strides)
    pd_px = bbox_decode(pd_dist, anc) * st
    gt = torch.tensor([[[10.0, 8, 40, 50], [30, 20, 90, 60]], [[4, 4, 8, 8], [0, 0, 0, 0]]])
    lab, mask = torch.tensor([[[0.0], [2.0]], [[1.0], [0.0]]]), torch.tensor([[[1.0], [1.0]], [[1.0], [0.0]]])
    ref = tal_assign_ref(ps.sigmoid(), pd_px, anc * st, lab, gt, mask, 7, topk2=1)
    with backend(be):
        assert torch.equal(head_decode(feats, strides, 1, scores=False)[1], pd_px)
        for got, exp in zip(tal_assign(ps.sigmoid(), pd_px, anc * st, lab, gt, mask, 7, topk2=1), ref):
            assert torch.equal(got, exp)
        maps_out = tal_assign_maps(feats, pd_px, anc * st, lab, gt, mask, 7, topk2=1, reg_max=1)
        for got, exp in zip(maps_out, ref):
            assert torch.equal(got, exp)
        # without topk2, reg_max 1 maps are assigned by the selected backend (C++: read in place): same values
        o2m = tal_assign_maps(feats, pd_px, anc * st, lab, gt, mask, 10, reg_max=1)
        o2m_ref = tal_assign_ref(ps.sigmoid(), pd_px, anc * st, lab, gt, mask, 10)
        assert torch.equal(o2m[3], o2m_ref[3]) and torch.equal(o2m[4], o2m_ref[4])
        torch.testing.assert_close(o2m[2], o2m_ref[2], rtol=1e-6, atol=1e-7)
        _, tb, ts, fg, _ = ref
        exp = bbox_loss_ref(pd_dist, ps, anc, tb / st, ts, fg, st, (64.0, 96.0))
        assert torch.equal(bbox_loss(pd_dist, ps, anc, tb / st, ts, fg, st, (64.0, 96.0)), exp)
        assert torch.equal(bbox_loss_maps(feats, anc, tb / st, ts, fg, 1, strides=strides), exp)
        with pytest.raises(ValueError, match="strides"):
            bbox_loss_maps(feats, anc, tb / st, ts, fg, 1)
