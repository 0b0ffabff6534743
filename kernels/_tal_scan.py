"""The scan of the Triton ``tal_assign`` (kernels/tal_assign.py has the other kernels and the launch): one
program per (GT, image) over the GT's candidate anchors, in DESIGN §2.1's phases (candidates, metric,
top-k, the GT's part of the conflicts), each a jit helper; and the metric (CIoU overlap, align) that the
resolve kernel shares. Float results follow the reference's order of operations (see _common.py for
atan/pow).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _common
from ._constants import CIOU_EPS, FOUR_OVER_PI2, SMALL_GT_SIDE

_CIOU_EPS = tl.constexpr(CIOU_EPS)
_K = tl.constexpr(FOUR_OVER_PI2)
_SIDE = tl.constexpr(SMALL_GT_SIDE)
_HALF_SIDE = tl.constexpr(SMALL_GT_SIDE / 2)
# Reductions in the hot loop call tl.reduce with Triton's own combine functions: the interpreter maps
# those to numpy directly, while tl.max/tl.sum are jit wrappers that cost it ~1 ms per call.
_MAX = tl.standard._elementwise_max
_MIN = tl.standard._elementwise_min
_SUM = tl.standard._sum_combine


@triton.jit
def _cell_range(lo_edge, hi_edge, o, step, n):
    """Cells [i0, i1) of a row of n anchors at o + i*step that may lie inside (lo, hi), +-1 cell margin."""
    q0 = (lo_edge - o) / step
    q1 = (hi_edge - o) / step
    lim = (n + 2).to(q0.dtype)
    q0 = tl.where(q0 == q0, tl.minimum(tl.maximum(q0, -2.0), lim), lim)  # NaN box -> empty range
    q1 = tl.where(q1 == q1, tl.minimum(tl.maximum(q1, -2.0), lim), -2.0)
    i0 = tl.maximum(tl.floor(q0).to(tl.int32), 0)
    i1 = tl.minimum(tl.floor(q1).to(tl.int32) + 2, n)
    return i0, i1


# ---------------------------------------------------------------------------------------------- metric
@triton.jit
def _overlap(gx1, gy1, gx2, gy2, g_wh, g_atan, px1, py1, px2, py2, F64: tl.constexpr, USE_LIB: tl.constexpr):
    """clamp(CIoU(gt, pred), min=0) in reference.bbox_ciou's order of operations (gt is box 1)."""
    w2 = px2 - px1
    h2 = (py2 - py1) + _CIOU_EPS
    inter = tl.maximum(tl.minimum(gx2, px2) - tl.maximum(gx1, px1), 0.0) * tl.maximum(
        tl.minimum(gy2, py2) - tl.maximum(gy1, py1), 0.0
    )
    union = ((g_wh + w2 * h2) - inter) + _CIOU_EPS
    # float32 division as div_rn (IEEE), inline: a jit-helper call costs the interpreter ~1 ms per tile
    iou = inter / union if F64 else tl.math.div_rn(inter, union)
    cw = tl.maximum(gx2, px2) - tl.minimum(gx1, px1)
    ch = tl.maximum(gy2, py2) - tl.minimum(gy1, py1)
    c2 = (cw * cw + ch * ch) + _CIOU_EPS
    dx = (px1 + px2) - (gx1 + gx2)
    dy = (py1 + py2) - (gy1 + gy2)
    rho2 = (dx * dx + dy * dy) * 0.25
    da = _common.atan(w2 / h2 if F64 else tl.math.div_rn(w2, h2), USE_LIB) - g_atan
    v = _K * (da * da)
    den = (v - iou) + (1.0 + _CIOU_EPS)
    alpha = v / den if F64 else tl.math.div_rn(v, den)
    ciou = iou - ((rho2 / c2 if F64 else tl.math.div_rn(rho2, c2)) + v * alpha)
    return tl.where(ciou < 0, 0.0, ciou)  # keeps NaN, like torch.clamp


@triton.jit
def _align(
    s,
    ovl,
    ALPHA: tl.constexpr,
    AK: tl.constexpr,
    BETA: tl.constexpr,
    BK: tl.constexpr,
    USE_LIB: tl.constexpr,
    F64: tl.constexpr,
):
    return _common.pow_c(s, ALPHA, AK, USE_LIB, F64) * _common.pow_c(ovl, BETA, BK, USE_LIB, F64)


@triton.jit
def _float_bits(x, F64: tl.constexpr):
    """The bits of x >= 0 (or NaN) as an int64 that orders like x (sign bit cleared: -0.0 == 0.0)."""
    if F64:
        r = x.to(tl.int64, bitcast=True) & 0x7FFFFFFFFFFFFFFF
    else:
        r = (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.int64)
    return r


@triton.jit
def _bits_float(b, F64: tl.constexpr):
    if F64:
        r = b.to(tl.float64, bitcast=True)
    else:
        r = b.to(tl.int32).to(tl.float32, bitcast=True)
    return r


# ------------------------------------------------------------------------------------------------ scan
# _tal_scan_kernel runs DESIGN §2.1's first phases for one GT, each a jit helper below: candidates
# (_gt_box, _level_rect, _tile_candidates), metric (_overlap, _align), top-k (_topk_merge) and the GT's part
# of the conflicts (_note_conflict over all candidates, _commit_picks for its top-k). The helpers are
# called once per GT, level or tile, never per top-k round: each call costs the interpreter ~1 ms.
@triton.jit
def _gt_box(gt_ptr, bg, F64: tl.constexpr, USE_LIB: tl.constexpr):
    """Candidates, 1: the GT, its candidate box (sides under 16 px widened to 16 px about the centre,
    reference rule 1) and CIoU's GT terms w * (h + eps), atan(w / (h + eps))."""
    gx1 = tl.load(gt_ptr + bg * 4 + 0)
    gy1 = tl.load(gt_ptr + bg * 4 + 1)
    gx2 = tl.load(gt_ptr + bg * 4 + 2)
    gy2 = tl.load(gt_ptr + bg * 4 + 3)
    cx = (gx1 + gx2) * 0.5
    cy = (gy1 + gy2) * 0.5
    widen_x = (gx2 - gx1) < _SIDE
    widen_y = (gy2 - gy1) < _SIDE
    ex1 = tl.where(widen_x, cx - _HALF_SIDE, gx1)
    ex2 = tl.where(widen_x, cx + _HALF_SIDE, gx2)
    ey1 = tl.where(widen_y, cy - _HALF_SIDE, gy1)
    ey2 = tl.where(widen_y, cy + _HALF_SIDE, gy2)
    g_w = gx2 - gx1
    g_h = (gy2 - gy1) + _CIOU_EPS
    g_wh = g_w * g_h
    g_atan = _common.atan(_common.div(g_w, g_h, F64), USE_LIB)
    return gx1, gy1, gx2, gy2, ex1, ey1, ex2, ey2, g_wh, g_atan


@triton.jit
def _level_rect(lvi_ptr, lvf_ptr, lv, grid_ok, ex1, ey1, ex2, ey2, A):
    """Candidates, 2: the index rectangle of level lv that may hold anchors inside the candidate box
    (start, row width, first column and row, width, anchors in it); every anchor as one row when the grid
    table is bad."""
    if grid_ok:
        start = tl.load(lvi_ptr + lv * 4)
        w = tl.load(lvi_ptr + lv * 4 + 1)
        h = tl.load(lvi_ptr + lv * 4 + 2)
        x0 = tl.load(lvf_ptr + lv * 4 + 0)
        y0 = tl.load(lvf_ptr + lv * 4 + 1)
        sx = tl.load(lvf_ptr + lv * 4 + 2)
        sy = tl.load(lvf_ptr + lv * 4 + 3)
        ix0, ix1 = _cell_range(ex1, ex2, x0, sx, w)
        iy0, iy1 = _cell_range(ey1, ey2, y0, sy, h)
    else:
        start = lv * 0
        w = A + lv * 0
        ix0 = lv * 0
        ix1 = A + lv * 0
        iy0 = lv * 0
        iy1 = lv * 0 + 1
    rw = tl.maximum(ix1 - ix0, 0)
    n = rw * tl.maximum(iy1 - iy0, 0)
    return start, w, ix0, iy0, rw, n


@triton.jit
def _tile_candidates(
    anc_ptr, start, w, ix0, iy0, rw, n, t0, ex1, ey1, ex2, ey2, EPS: tl.constexpr, BLOCK: tl.constexpr
):
    """Candidates, 3: the anchors of tile t0 of a rectangle and the exact test (centre inside the candidate
    box by more than eps)."""
    p = t0 + tl.arange(0, BLOCK)
    valid = p < n
    a = start + (iy0 + p // rw) * w + ix0 + p % rw  # increasing with p: ties keep scan order
    ax = tl.load(anc_ptr + a * 2, mask=valid, other=0.0)
    ay = tl.load(anc_ptr + a * 2 + 1, mask=valid, other=0.0)
    cand = valid & ((ax - ex1) > EPS) & ((ay - ey1) > EPS) & ((ex2 - ax) > EPS) & ((ey2 - ay) > EPS)
    return a, cand


@triton.jit
def _note_conflict(best_ptr, bestg_ptr, cnt_ptr, row, cand, ovl, g, PASS: tl.constexpr, F64: tl.constexpr):
    """Conflicts, over ALL candidates of every GT. PASS 1 maxes the anchor's key; float32: (overlap bits,
    lowest GT) in one key, float64: the overlap bits, whose ties PASS 2 resolves with an atomic min of the GT
    index (only on anchors that two or more GTs picked: the others never read it)."""
    # = _float_bits(ovl, F64), inlined: a jit-helper call costs the interpreter ~1 ms per tile
    if F64:
        ovb = ovl.to(tl.int64, bitcast=True) & 0x7FFFFFFFFFFFFFFF
    else:
        ovb = (ovl.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.int64)
    if PASS == 1:
        if F64:
            tl.atomic_max(best_ptr + row, ovb, mask=cand)
        else:
            tl.atomic_max(best_ptr + row, (ovb << 32) | (2147483647 - g.to(tl.int64)), mask=cand)
    else:
        conflicted = cand & (tl.load(cnt_ptr + row, mask=cand, other=0) >= 2)
        hit = conflicted & (tl.load(best_ptr + row, mask=conflicted, other=-1) == ovb)
        tl.atomic_min(bestg_ptr + row, g, mask=hit)


@triton.jit
def _topk_merge(bkey, bidx, bal, bov, cand, a, al, ovl, slot, K, KP: tl.constexpr):
    """Top-k: merges one tile into the GT's buffer (bkey/bidx/bal/bov, KP slots, the K first live) by
    iterative max extraction, ties to the lower anchor index; returns the new buffer."""
    # rank key: NaN first (as torch.sort), zero-align anchors never count
    key = tl.where(cand & ((al > 0) | (al != al)), tl.where(al != al, _common.INF, al), -1.0)
    kth = tl.reduce(bkey, 0, _MIN)
    n_rounds = tl.minimum(tl.reduce((key > kth).to(tl.int32), 0, _SUM), K)
    for _r in range(0, n_rounds):
        # the best tile entry left (lowest anchor index among equals) ...
        mt = tl.reduce(key, 0, _MAX)
        it = tl.reduce(tl.where(key == mt, a, 2147483647), 0, _MIN)
        lane = (key == mt) & (a == it)
        wk = tl.reduce(bkey, 0, _MIN)
        # ... replaces the worst slot: smallest key, and of those the highest anchor index
        worst = bkey == wk
        wi = tl.reduce(tl.where(worst, bidx, -2), 0, _MAX)
        pos = tl.reduce(tl.where(worst & (bidx == wi), slot, KP), 0, _MIN)
        pos = tl.where(mt > wk, pos, KP)  # a tie with the buffer keeps the earlier anchor
        put = slot == pos
        bkey = tl.where(put, mt, bkey)
        bidx = tl.where(put, it, bidx)
        bal = tl.where(put, tl.reduce(tl.where(lane, al, 0.0), 0, _SUM), bal)
        bov = tl.where(put, tl.reduce(tl.where(lane, ovl, 0.0), 0, _SUM), bov)
        key = tl.where(lane, -2.0, key)
    return bkey, bidx, bal, bov


@triton.jit
def _commit_picks(cnt_ptr, owner_ptr, sel_al_ptr, sel_ov_ptr, a_base, g, bidx, bal, bov, slot, K):
    """Conflicts, the GT's picks: a count per anchor, the picker (atomic max) and its align/overlap (read
    only where exactly one GT picked the anchor). NaN aligns held top-k slots but are never picks."""
    sel = (slot < K) & (bidx >= 0) & (bal > 0)
    row = a_base + bidx
    tl.atomic_add(cnt_ptr + row, 1, mask=sel)
    tl.atomic_max(owner_ptr + row, g, mask=sel)
    tl.store(sel_al_ptr + row, bal, mask=sel)
    tl.store(sel_ov_ptr + row, bov, mask=sel)


@triton.jit
def _tal_scan_kernel(
    scores_ptr,
    pd_ptr,
    anc_ptr,
    gt_ptr,
    labc_ptr,
    real_ptr,
    lvi_ptr,
    lvf_ptr,
    nlv_ptr,
    bad_ptr,
    cnt_ptr,
    owner_ptr,
    best_ptr,
    bestg_ptr,
    sel_al_ptr,
    sel_ov_ptr,
    A,
    C,
    M,
    K,
    EPS: tl.constexpr,
    ALPHA: tl.constexpr,
    AK: tl.constexpr,
    BETA: tl.constexpr,
    BK: tl.constexpr,
    PASS: tl.constexpr,
    F64: tl.constexpr,
    USE_LIB: tl.constexpr,
    L_MAX: tl.constexpr,
    KP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per (GT, image): the phases above over the GT's candidate rectangles, tile by tile."""
    if F64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    g = tl.program_id(0)
    b = tl.program_id(1)
    bg = b.to(tl.int64) * M + g
    if tl.load(real_ptr + bg) != 0:
        lab = tl.load(labc_ptr + bg)
        gx1, gy1, gx2, gy2, ex1, ey1, ex2, ey2, g_wh, g_atan = _gt_box(gt_ptr, bg, F64, USE_LIB)
        slot = tl.arange(0, KP)
        bkey = tl.where(slot < K, -1.0, _common.INF).to(CT)
        bidx = slot * 0 - 1
        bal = tl.zeros((KP,), dtype=CT)
        bov = tl.zeros((KP,), dtype=CT)

        nlv = tl.load(nlv_ptr)
        grid_ok = (nlv <= L_MAX) & (tl.load(bad_ptr) == 0)
        n_lv = tl.where(grid_ok, nlv, 1)
        a_base = b.to(tl.int64) * A
        for lv in range(0, n_lv):
            start, w, ix0, iy0, rw, n = _level_rect(lvi_ptr, lvf_ptr, lv, grid_ok, ex1, ey1, ex2, ey2, A)
            for t0 in range(0, n, BLOCK):
                a, cand = _tile_candidates(
                    anc_ptr, start, w, ix0, iy0, rw, n, t0, ex1, ey1, ex2, ey2, EPS, BLOCK
                )
                row = a_base + a
                px1 = tl.load(pd_ptr + row * 4 + 0, mask=cand, other=0.0).to(CT)
                py1 = tl.load(pd_ptr + row * 4 + 1, mask=cand, other=0.0).to(CT)
                px2 = tl.load(pd_ptr + row * 4 + 2, mask=cand, other=0.0).to(CT)
                py2 = tl.load(pd_ptr + row * 4 + 3, mask=cand, other=0.0).to(CT)
                ovl = _overlap(gx1, gy1, gx2, gy2, g_wh, g_atan, px1, py1, px2, py2, F64, USE_LIB)
                _note_conflict(best_ptr, bestg_ptr, cnt_ptr, row, cand, ovl, g, PASS, F64)
                if PASS == 1:
                    s = tl.load(scores_ptr + row * C + lab, mask=cand, other=0.0).to(CT)
                    al = _align(s, ovl, ALPHA, AK, BETA, BK, USE_LIB, F64)
                    bkey, bidx, bal, bov = _topk_merge(bkey, bidx, bal, bov, cand, a, al, ovl, slot, K, KP)
        if PASS == 1:
            _commit_picks(cnt_ptr, owner_ptr, sel_al_ptr, sel_ov_ptr, a_base, g, bidx, bal, bov, slot, K)
