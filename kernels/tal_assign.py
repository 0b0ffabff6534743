"""Triton ``tal_assign``: the sparse task-aligned assigner (DESIGN §2.1), spec ``reference.tal_assign_ref``.

Nothing of size B*M*A exists: work O(sum of candidates + B*A), memory O(B*A + B*M).
  0. ``_grid_starts_kernel`` / ``_grid_levels_kernel``: the anchor grid, inferred on the device (no host
     sync, so the op stays CUDA-graph capturable and traceable): a level starts where y drops; each level is
     checked anchor by anchor against start + (ix*sx, iy*sy). Anchors that are not a few grids set a flag and
     every GT then scans all A anchors instead of its rectangles (same results, slower).
  1. ``_tal_scan_kernel``, one program per (GT, image): the candidate anchors of its widened box are one
     index rectangle per level (+1 cell margin; the exact ``cx - x1 > eps`` test decides). For candidates
     it computes overlap (CIoU, clamped at 0) and align, keeps its top-k on chip (iterative max extraction
     per tile, ties to the lower anchor index), and
     - atomically maxes a per-anchor key (overlap bits << 32 | ~GT) over *all* candidates: the conflict
       winner (largest overlap, ties -> lowest GT) without any per-anchor loop over GTs;
     - for each pick with align > 0: counts it per anchor (atomic add), notes the picker (atomic max) and
       its align/overlap (a plain store, only read where exactly one GT picked the anchor).
     Integer atomics only: their result does not depend on the order. float64 inputs cannot pack their
     overlap into 32 bits, so they take a second scan (PASS 2) that resolves ties with an atomic min.
  2. ``_tal_resolve_kernel`` per anchor: winner, align (recomputed bit-identically for conflicts), fg,
     target_gt_idx; per-GT max align / overlap over the final positives (atomic max on the float bits,
     exact for non-negative floats).
  3. ``_tal_write_kernel`` per anchor: norm, target labels/boxes/scores.
Float results follow the reference's order of operations with IEEE-rounded division/sqrt; see _common.py
for atan/pow. On a GPU, eager launches also turn off fma contraction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from yolofast.kernels import _common
from yolofast.ops.reference import SMALL_GT_SIDE

L_MAX = 8  # pyramid levels the grid table holds (YOLOv8 uses 3); more -> the all-anchor scan
BLOCK_SCAN = 2048 if _common.INTERPRET else 128  # anchors per tile of a GT's rectangle
BLOCK_A = 512 if _common.INTERPRET else 128  # anchors per program of the per-anchor passes
# classes per step of the target_scores write: 128 x 32 values per step keeps a GPU program at 32 per thread
WRITE_BLOCK_C = 128 if _common.INTERPRET else 32
BLOCK_GRID = 1024
_CIOU_EPS = tl.constexpr(1e-7)
_K = tl.constexpr(4.0 / 3.141592653589793**2)
_SIDE = tl.constexpr(SMALL_GT_SIDE)
_HALF_SIDE = tl.constexpr(SMALL_GT_SIDE / 2)
# Reductions in the hot loop call tl.reduce with Triton's own combine functions: the interpreter maps
# those to numpy directly, while tl.max/tl.sum are jit wrappers that cost it ~1 ms per call.
_MAX = tl.standard._elementwise_max
_MIN = tl.standard._elementwise_min
_SUM = tl.standard._sum_combine


# ------------------------------------------------------------------------------------------------- grid
@triton.jit
def _grid_starts_kernel(anc_ptr, lvi_ptr, nlv_ptr, A, L_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """One program: level k starts at the k-th anchor whose y is below its predecessor's (or anchor 0)."""
    carry = tl.program_id(0) * 0
    for i0 in range(0, A, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        m = i < A
        y = tl.load(anc_ptr + 2 * i + 1, mask=m, other=0.0)
        yp = tl.load(anc_ptr + 2 * i - 1, mask=m & (i > 0), other=0.0)
        flag = m & ((i == 0) | (y < yp))
        f = flag.to(tl.int32)
        lvl = carry + tl.cumsum(f, 0) - 1
        tl.store(lvi_ptr + lvl * 4, i, mask=flag & (lvl < L_MAX))
        carry += tl.sum(f, 0)
    tl.store(nlv_ptr, carry)


@triton.jit
def _grid_levels_kernel(
    anc_ptr, lvi_ptr, lvf_ptr, nlv_ptr, bad_ptr, A, L_MAX: tl.constexpr, BLOCK: tl.constexpr
):
    """Program l: width/height/origin/spacing of level l, and a check of each of its anchors."""
    l = tl.program_id(0)
    nlv = tl.load(nlv_ptr)
    if l < nlv:
        s = tl.load(lvi_ptr + l * 4)
        e = tl.load(lvi_ptr + (l + 1) * 4, mask=(l + 1 < nlv) & (l + 1 < L_MAX), other=A)
        n = e - s
        x0 = tl.load(anc_ptr + 2 * s)
        y0 = tl.load(anc_ptr + 2 * s + 1)
        w = tl.program_id(0) * 0
        for i0 in range(s, e, BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            m = i < e
            y = tl.load(anc_ptr + 2 * i + 1, mask=m, other=0.0)
            w += tl.sum((m & (y == y0)).to(tl.int32), 0)
        w = tl.maximum(w, 1)
        h = n // w
        sx = tl.load(anc_ptr + 2 * (s + 1), mask=w > 1, other=0.0) - x0
        sx = tl.where(w > 1, sx, 1.0)
        sy = tl.load(anc_ptr + 2 * (s + w) + 1, mask=h > 1, other=0.0) - y0
        sy = tl.where(h > 1, sy, 1.0)
        good = (w * h == n) & (sx > 0) & (sy > 0)
        nbad = tl.program_id(0) * 0
        for i0 in range(s, e, BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            m = i < e
            x = tl.load(anc_ptr + 2 * i, mask=m, other=0.0)
            y = tl.load(anc_ptr + 2 * i + 1, mask=m, other=0.0)
            j = i - s
            xe = x0 + (j % w).to(x0.dtype) * sx
            ye = y0 + (j // w).to(y0.dtype) * sy
            # a quarter cell of slack, well inside the +-1 cell margin of the scan's rectangles
            fit = (tl.abs(x - xe) <= 0.25 * sx) & (tl.abs(y - ye) <= 0.25 * sy)
            nbad += tl.sum((m & ~fit).to(tl.int32), 0)
        good = good & (nbad == 0)
        tl.store(lvi_ptr + l * 4 + 1, w)
        tl.store(lvi_ptr + l * 4 + 2, h)
        tl.store(lvi_ptr + l * 4 + 3, good.to(tl.int32))
        tl.store(lvf_ptr + l * 4 + 0, x0)
        tl.store(lvf_ptr + l * 4 + 1, y0)
        tl.store(lvf_ptr + l * 4 + 2, sx)
        tl.store(lvf_ptr + l * 4 + 3, sy)
        tl.atomic_add(bad_ptr, 1 - good.to(tl.int32))


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
    if F64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    g = tl.program_id(0)
    b = tl.program_id(1)
    bg = b.to(tl.int64) * M + g
    if tl.load(real_ptr + bg) != 0:
        lab = tl.load(labc_ptr + bg)
        gx1 = tl.load(gt_ptr + bg * 4 + 0)
        gy1 = tl.load(gt_ptr + bg * 4 + 1)
        gx2 = tl.load(gt_ptr + bg * 4 + 2)
        gy2 = tl.load(gt_ptr + bg * 4 + 3)
        # candidate box: sides under 16 px widened to 16 px about the centre (reference rule 1)
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
            for t0 in range(0, n, BLOCK):
                p = t0 + tl.arange(0, BLOCK)
                valid = p < n
                a = start + (iy0 + p // rw) * w + ix0 + p % rw  # increasing with p: ties keep scan order
                ax = tl.load(anc_ptr + a * 2, mask=valid, other=0.0)
                ay = tl.load(anc_ptr + a * 2 + 1, mask=valid, other=0.0)
                cand = (
                    valid & ((ax - ex1) > EPS) & ((ay - ey1) > EPS) & ((ex2 - ax) > EPS) & ((ey2 - ay) > EPS)
                )
                row = a_base + a
                px1 = tl.load(pd_ptr + row * 4 + 0, mask=cand, other=0.0).to(CT)
                py1 = tl.load(pd_ptr + row * 4 + 1, mask=cand, other=0.0).to(CT)
                px2 = tl.load(pd_ptr + row * 4 + 2, mask=cand, other=0.0).to(CT)
                py2 = tl.load(pd_ptr + row * 4 + 3, mask=cand, other=0.0).to(CT)
                ovl = _overlap(gx1, gy1, gx2, gy2, g_wh, g_atan, px1, py1, px2, py2, F64, USE_LIB)
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
                    s = tl.load(scores_ptr + row * C + lab, mask=cand, other=0.0).to(CT)
                    al = _align(s, ovl, ALPHA, AK, BETA, BK, USE_LIB, F64)
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
                else:
                    # float64: the winner among the anchor's candidate GTs with the maximal overlap bits
                    conflicted = cand & (tl.load(cnt_ptr + row, mask=cand, other=0) >= 2)
                    hit = conflicted & (tl.load(best_ptr + row, mask=conflicted, other=-1) == ovb)
                    tl.atomic_min(bestg_ptr + row, g, mask=hit)
        if PASS == 1:
            sel = (slot < K) & (bidx >= 0) & (bal > 0)
            row = a_base + bidx
            tl.atomic_add(cnt_ptr + row, 1, mask=sel)
            tl.atomic_max(owner_ptr + row, g, mask=sel)
            tl.store(sel_al_ptr + row, bal, mask=sel)
            tl.store(sel_ov_ptr + row, bov, mask=sel)


# --------------------------------------------------------------------------------------------- resolve
@triton.jit
def _tal_resolve_kernel(
    scores_ptr,
    labc_ptr,
    cnt_ptr,
    owner_ptr,
    best_ptr,
    bestg_ptr,
    sel_al_ptr,
    sel_ov_ptr,
    fg_ptr,
    tgi_ptr,
    pal_ptr,
    pov_ptr,
    A,
    C,
    M,
    ALPHA: tl.constexpr,
    AK: tl.constexpr,
    BETA: tl.constexpr,
    BK: tl.constexpr,
    F64: tl.constexpr,
    USE_LIB: tl.constexpr,
    BLOCK: tl.constexpr,
    DEFER: tl.constexpr = False,
):
    if F64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    b = tl.program_id(1)
    a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = a < A
    row = b.to(tl.int64) * A + a
    cnt = tl.load(cnt_ptr + row, mask=m, other=0)
    conf = m & (cnt >= 2)
    one = m & (cnt == 1)
    if F64:
        g2 = tl.load(bestg_ptr + row, mask=conf, other=0)
        ov2 = _bits_float(tl.load(best_ptr + row, mask=conf, other=0), F64)
    else:
        key = tl.load(best_ptr + row, mask=conf, other=0)
        g2 = (2147483647 - (key & 0xFFFFFFFF)).to(tl.int32)
        ov2 = _bits_float(key >> 32, F64)
    g2 = tl.where(conf, g2, 0)
    lab2 = tl.load(labc_ptr + b.to(tl.int64) * M + g2, mask=conf, other=0)
    s2 = tl.load(scores_ptr + row * C + lab2, mask=conf, other=0.0).to(CT)
    al2 = _align(s2, ov2, ALPHA, AK, BETA, BK, USE_LIB, F64)
    g1 = tl.load(owner_ptr + row, mask=one, other=0)
    al1 = tl.load(sel_al_ptr + row, mask=one, other=0.0)
    ov1 = tl.load(sel_ov_ptr + row, mask=one, other=0.0)
    gt = tl.where(conf, g2, g1)
    al = tl.where(conf, al2, al1)
    ov = tl.where(conf, ov2, ov1)
    fg = m & (cnt >= 1) & (al > 0)  # the winner of a conflict may have align 0: then not positive
    tl.store(fg_ptr + row, fg, mask=m)
    tl.store(tgi_ptr + row, tl.where(fg, gt, 0).to(tl.int64), mask=m)
    tl.store(sel_al_ptr + row, tl.where(fg, al, 0.0), mask=m)
    tl.store(sel_ov_ptr + row, tl.where(fg, ov, 0.0), mask=m)
    if not DEFER:  # DEFER: a second top-k follows and takes the maxima over the positives it keeps
        bgt = b.to(tl.int64) * M + gt
        tl.atomic_max(pal_ptr + bgt, _float_bits(al, F64), mask=fg)
        tl.atomic_max(pov_ptr + bgt, _float_bits(ov, F64), mask=fg)


# ---------------------------------------------------------------------------------------- second top-k
@triton.jit
def _kept_before(t2a_ptr, bg, BM, r, a, m):
    """Whether anchor a is among the picks of rounds [0, r) of GT slot bg."""
    kept = a < 0
    for j in range(0, r):
        kept = kept | (tl.load(t2a_ptr + bg + j * BM, mask=m, other=-1) == a)
    return kept


@triton.jit
def _tal_topk2_round_kernel(
    fg_ptr, tgi_ptr, sel_al_ptr, t2al_ptr, t2a_ptr, A, M, BM, r, STEP: tl.constexpr, F64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Round r of YOLO26's topk2 (spec §4.3 step 4b): each GT's r-th best positive by raw align among those
    not yet kept, its own picks and anchors won by overlap alike. STEP 0: the max align bits; STEP 1: the
    lowest anchor with them (ties to the lower anchor index). Integer atomics: order-independent."""
    b = tl.program_id(1)
    a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = a < A
    row = b.to(tl.int64) * A + a
    fg = tl.load(fg_ptr + row, mask=m, other=0) != 0
    bg = b.to(tl.int64) * M + tl.load(tgi_ptr + row, mask=fg, other=0)
    live = fg & ~_kept_before(t2a_ptr, bg, BM, r, a, fg)
    bits = _float_bits(tl.load(sel_al_ptr + row, mask=live, other=0.0), F64)
    slot = bg + r * BM
    if STEP == 0:
        tl.atomic_max(t2al_ptr + slot, bits, mask=live)
    else:
        hit = live & (tl.load(t2al_ptr + slot, mask=live, other=-1) == bits)
        tl.atomic_min(t2a_ptr + slot, a, mask=hit)


@triton.jit
def _tal_topk2_keep_kernel(
    fg_ptr, tgi_ptr, sel_al_ptr, sel_ov_ptr, t2a_ptr, pal_ptr, pov_ptr, A, M, BM, K2, F64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The positives no round kept become background; the kept ones give their GT's pos_align/overlap."""
    b = tl.program_id(1)
    a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = a < A
    row = b.to(tl.int64) * A + a
    fg = tl.load(fg_ptr + row, mask=m, other=0) != 0
    tgi = tl.load(tgi_ptr + row, mask=fg, other=0)
    bg = b.to(tl.int64) * M + tgi
    kept = fg & _kept_before(t2a_ptr, bg, BM, K2, a, fg)
    al = tl.load(sel_al_ptr + row, mask=fg, other=0.0)
    ov = tl.load(sel_ov_ptr + row, mask=fg, other=0.0)
    tl.store(fg_ptr + row, kept, mask=fg)
    tl.store(tgi_ptr + row, tl.where(kept, tgi, 0), mask=fg)
    tl.store(sel_al_ptr + row, tl.where(kept, al, 0.0), mask=fg)
    tl.atomic_max(pal_ptr + bg, _float_bits(al, F64), mask=kept)
    tl.atomic_max(pov_ptr + bg, _float_bits(ov, F64), mask=kept)


# ----------------------------------------------------------------------------------------------- write
@triton.jit
def _tal_write_kernel(
    fg_ptr,
    tgi_ptr,
    sel_al_ptr,
    sel_ov_ptr,
    pal_ptr,
    pov_ptr,
    labels_ptr,
    gt_raw_ptr,
    tlab_ptr,
    tbox_ptr,
    tsc_ptr,
    A,
    C,
    M,
    EPS: tl.constexpr,
    F64: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    b = tl.program_id(1)
    a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = a < A
    row = b.to(tl.int64) * A + a
    fg = tl.load(fg_ptr + row, mask=m, other=0) != 0
    tgi = tl.load(tgi_ptr + row, mask=m, other=0)
    bgt = b.to(tl.int64) * M + tgi
    al = tl.load(sel_al_ptr + row, mask=m, other=0.0)
    pa = _bits_float(tl.load(pal_ptr + bgt, mask=fg, other=0), F64)
    po = _bits_float(tl.load(pov_ptr + bgt, mask=fg, other=0), F64)
    norm = tl.where(fg, _common.div(al * po, pa + EPS, F64), 0.0)
    lab = tl.load(labels_ptr + bgt, mask=m, other=0)
    tl.store(tlab_ptr + row, tl.maximum(lab, 0), mask=m)
    labc = tl.minimum(tl.maximum(lab, 0), C - 1)
    for k in tl.static_range(4):
        tl.store(tbox_ptr + row * 4 + k, tl.load(gt_raw_ptr + bgt * 4 + k, mask=m), mask=m)
    out_ty = tsc_ptr.dtype.element_ty
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        val = tl.where(c[None, :] == labc[:, None], norm[:, None], 0.0)
        tl.store(
            tsc_ptr + row[:, None] * C + c[None, :],
            _common.cast_to(val, out_ty),
            mask=m[:, None] & (c < C)[None, :],
        )


# ---------------------------------------------------------------------------------------------- host
def _background(pd_scores: Tensor, gt_bboxes: Tensor):
    """Outputs when there is no GT slot at all (M == 0): labels C, no foreground (reference rule 6)."""
    B, A, C = pd_scores.shape
    dev = pd_scores.device
    return (
        torch.full((B, A), C, dtype=torch.long, device=dev),
        torch.zeros(B, A, 4, dtype=gt_bboxes.dtype, device=dev),
        torch.zeros(B, A, C, dtype=pd_scores.dtype, device=dev),
        torch.zeros(B, A, dtype=torch.bool, device=dev),
        torch.zeros(B, A, dtype=torch.long, device=dev),
    )


def _check(pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt) -> None:
    if pd_scores.dim() != 3:
        raise ValueError(f"tal_assign: pd_scores must be (B, A, C), got {tuple(pd_scores.shape)}")
    B, A, C = pd_scores.shape
    M = gt_bboxes.shape[1] if gt_bboxes.dim() == 3 else -1
    want = {
        "pd_bboxes": (pd_bboxes, (B, A, 4)),
        "anc_points": (anc_points, (A, 2)),
        "gt_bboxes": (gt_bboxes, (B, M, 4)),
        "gt_labels": (gt_labels, (B, M, 1)),
        "mask_gt": (mask_gt, (B, M, 1)),
    }
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"tal_assign: {name} must have shape {shape}, got {tuple(t.shape)}")
        if t.device != pd_scores.device:
            raise ValueError(f"tal_assign: {name} is on {t.device}, pd_scores on {pd_scores.device}")


@torch.library.triton_op("yolofast::tal_assign_triton", mutates_args=())
def _tal_assign_op(
    pd_scores: Tensor,
    pd_bboxes: Tensor,
    anc_points: Tensor,
    gt_labels: Tensor,
    gt_bboxes: Tensor,
    mask_gt: Tensor,
    topk: int,
    alpha: float,
    beta: float,
    eps: float,
    topk2: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check(pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt)
    if topk2 < 0:
        raise ValueError(f"tal_assign: topk2 must be >= 0 (0: no second top-k), got {topk2}")
    k2 = topk2 if topk2 != topk else 0  # applies only when it differs from topk (spec §4.3)
    B, A, C = pd_scores.shape
    M = gt_bboxes.shape[1]
    if M == 0 or B * A == 0 or C == 0:
        return _background(pd_scores, gt_bboxes)
    if B > 65535 and not _common.INTERPRET:  # the grids put the image on axis 1, at most 65535 on CUDA
        raise ValueError(f"tal_assign (Triton): the batch must be <= 65535 images, got {B}")
    ak, a_e = _common.pow_kind(alpha)
    bk, b_e = _common.pow_kind(beta)
    ct = _common.compute_dtype(pd_scores, pd_bboxes, gt_bboxes)
    f64 = ct == torch.float64
    dev = pd_scores.device
    i32, i64 = torch.int32, torch.int64

    scores, pd = pd_scores.contiguous(), pd_bboxes.contiguous()
    anc = anc_points.to(ct).contiguous()
    gt = gt_bboxes.to(ct).contiguous()
    labels = gt_labels.reshape(B, M).long().contiguous()
    labc = labels.clamp(0, C - 1).to(i32)
    real = (mask_gt.reshape(B, M) > 0).to(i32)

    lvi = torch.zeros((L_MAX, 4), dtype=i32, device=dev)
    lvf = torch.zeros((L_MAX, 4), dtype=ct, device=dev)
    nlv = torch.zeros((1,), dtype=i32, device=dev)
    bad = torch.zeros((1,), dtype=i32, device=dev)
    cnt = torch.zeros((B, A), dtype=i32, device=dev)
    owner = torch.zeros((B, A), dtype=i32, device=dev)
    best = torch.full((B, A), -1, dtype=i64, device=dev)
    bestg = torch.full((B, A) if f64 else (1,), M, dtype=i32, device=dev)
    sel_al = torch.empty((B, A), dtype=ct, device=dev)
    sel_ov = torch.empty((B, A), dtype=ct, device=dev)
    pal = torch.zeros((B, M), dtype=i64, device=dev)
    pov = torch.zeros((B, M), dtype=i64, device=dev)

    target_labels = _common.empty((B, A), i64, dev)
    target_bboxes = _common.empty((B, A, 4), gt_bboxes.dtype, dev)
    target_scores = _common.empty((B, A, C), pd_scores.dtype, dev)
    fg = _common.empty((B, A), torch.bool, dev)
    tgi = _common.empty((B, A), i64, dev)

    exact = _common.exact_opts()
    use_lib = _common.USE_LIBDEVICE
    _common.launch(_grid_starts_kernel)[(1,)](anc, lvi, nlv, A, L_MAX=L_MAX, BLOCK=BLOCK_GRID)
    _common.launch(_grid_levels_kernel)[(L_MAX,)](anc, lvi, lvf, nlv, bad, A, L_MAX=L_MAX, BLOCK=BLOCK_GRID)
    k = max(0, min(int(topk), A))
    metric = dict(ALPHA=a_e, AK=ak, BETA=b_e, BK=bk, F64=f64, USE_LIB=use_lib)
    scan_args = (scores, pd, anc, gt, labc, real, lvi, lvf, nlv, bad, cnt, owner, best, bestg, sel_al, sel_ov)
    # one warp per GT: its tiles are 128 anchors and the top-k rounds are reductions, which then stay
    # within warp shuffles instead of crossing warps through shared memory
    scan_kw = dict(
        EPS=float(eps), L_MAX=L_MAX, KP=_common.next_pow2(max(k, 1)), BLOCK=BLOCK_SCAN, num_warps=1
    )
    scan = _common.launch(_tal_scan_kernel)[(M, B)]
    scan(*scan_args, A, C, M, k, PASS=1, **metric, **scan_kw, **exact)
    if f64:
        scan(*scan_args, A, C, M, k, PASS=2, **metric, **scan_kw, **exact)
    grid_a = (triton.cdiv(A, BLOCK_A), B)
    res_args = (scores, labc, cnt, owner, best, bestg, sel_al, sel_ov, fg, tgi, pal, pov)
    _common.launch(_tal_resolve_kernel)[grid_a](
        *res_args, A, C, M, **metric, BLOCK=BLOCK_A, DEFER=k2 > 0, num_warps=4, **exact
    )
    if k2 > 0:
        _second_topk(grid_a, fg, tgi, sel_al, sel_ov, pal, pov, A, M, B, k2, f64, exact)
    wr_args = (fg, tgi, sel_al, sel_ov, pal, pov, labels, gt_bboxes.contiguous())
    outs = (target_labels, target_bboxes, target_scores)
    block_c = min(_common.next_pow2(C), WRITE_BLOCK_C)
    _common.launch(_tal_write_kernel)[grid_a](
        *wr_args,
        *outs,
        A,
        C,
        M,
        EPS=float(eps),
        F64=f64,
        BLOCK=BLOCK_A,
        BLOCK_C=block_c,
        num_warps=4,
        **exact,
    )
    return target_labels, target_bboxes, target_scores, fg, tgi


def _second_topk(grid_a, fg, tgi, sel_al, sel_ov, pal, pov, A, M, B, k2, f64, exact) -> None:
    """YOLO26's topk2 after the conflicts: k2 rounds over the anchors, slots O(B*M*k2), never (B, M, A)."""
    BM = B * M
    t2al = torch.zeros((k2, B, M), dtype=torch.int64, device=fg.device)
    t2a = torch.full((k2, B, M), 2147483647, dtype=torch.int32, device=fg.device)
    rnd = _common.launch(_tal_topk2_round_kernel)[grid_a]
    kw = dict(F64=f64, BLOCK=BLOCK_A, num_warps=4, **exact)
    for r in range(k2):
        for step in (0, 1):
            rnd(fg, tgi, sel_al, t2al, t2a, A, M, BM, r, STEP=step, **kw)
    _common.launch(_tal_topk2_keep_kernel)[grid_a](
        fg, tgi, sel_al, sel_ov, t2a, pal, pov, A, M, BM, k2, F64=f64, BLOCK=BLOCK_A, num_warps=4, **exact
    )


def tal_assign(
    pd_scores: Tensor,
    pd_bboxes: Tensor,
    anc_points: Tensor,
    gt_labels: Tensor,
    gt_bboxes: Tensor,
    mask_gt: Tensor,
    topk: int = 10,
    alpha: float = 0.5,
    beta: float = 6.0,
    eps: float = 1e-9,
    topk2: int | None = None,
):
    """Task-aligned assignment, same arguments and outputs as ``reference.tal_assign_ref``:
    (target_labels (B,A) int64, target_bboxes (B,A,4), target_scores (B,A,C), fg_mask (B,A) bool,
    target_gt_idx (B,A) int64). No gradient. alpha and beta must be finite and >= 0."""
    with torch.no_grad():
        return torch.ops.yolofast.tal_assign_triton(
            pd_scores,
            pd_bboxes,
            anc_points,
            gt_labels,
            gt_bboxes,
            mask_gt,
            int(topk),
            float(alpha),
            float(beta),
            float(eps),
            int(topk2 or 0),
        )


def aot_specs() -> list[tuple]:
    """(kernel, signature, constexprs, options) for the ahead-of-time compile test: every kernel in float32,
    and the metric kernels in float64 (both scan passes) with bf16 scores (a bf16 store when writing)."""
    specs = []
    for ct, sc in (("fp32", "fp32"), ("fp64", "bf16")):
        f64 = ct == "fp64"
        grid_sig = {
            "anc_ptr": f"*{ct}",
            "lvi_ptr": "*i32",
            "nlv_ptr": "*i32",
            "A": "i32",
            "L_MAX": "constexpr",
            "BLOCK": "constexpr",
        }
        if not f64:  # the grid kernels only load anchors: their float64 variant lowers alike
            specs.append((_grid_starts_kernel, grid_sig, {"L_MAX": L_MAX, "BLOCK": BLOCK_GRID}, {}))
        lv_sig = {
            "anc_ptr": f"*{ct}",
            "lvi_ptr": "*i32",
            "lvf_ptr": f"*{ct}",
            "nlv_ptr": "*i32",
            "bad_ptr": "*i32",
            "A": "i32",
            "L_MAX": "constexpr",
            "BLOCK": "constexpr",
        }
        if not f64:
            specs.append((_grid_levels_kernel, lv_sig, {"L_MAX": L_MAX, "BLOCK": BLOCK_GRID}, {}))
        metric = {"ALPHA": 0.5, "AK": 2, "BETA": 6, "BK": 5, "F64": f64, "USE_LIB": True}
        exact = dict(_common.EXACT)
        scan_sig = {
            "scores_ptr": f"*{sc}",
            "pd_ptr": f"*{sc}",
            "anc_ptr": f"*{ct}",
            "gt_ptr": f"*{ct}",
            "labc_ptr": "*i32",
            "real_ptr": "*i32",
            "lvi_ptr": "*i32",
            "lvf_ptr": f"*{ct}",
            "nlv_ptr": "*i32",
            "bad_ptr": "*i32",
            "cnt_ptr": "*i32",
            "owner_ptr": "*i32",
            "best_ptr": "*i64",
            "bestg_ptr": "*i32",
            "sel_al_ptr": f"*{ct}",
            "sel_ov_ptr": f"*{ct}",
            "A": "i32",
            "C": "i32",
            "M": "i32",
            "K": "i32",
        }
        scan_ce = dict(EPS=1e-9, PASS=1, L_MAX=L_MAX, KP=16, BLOCK=128, **metric)
        scan_sig.update({k: "constexpr" for k in scan_ce})
        for p in (1, 2) if f64 else (1,):
            specs.append((_tal_scan_kernel, scan_sig, {**scan_ce, "PASS": p}, exact))
        res_sig = {
            "scores_ptr": f"*{sc}",
            "labc_ptr": "*i32",
            "cnt_ptr": "*i32",
            "owner_ptr": "*i32",
            "best_ptr": "*i64",
            "bestg_ptr": "*i32",
            "sel_al_ptr": f"*{ct}",
            "sel_ov_ptr": f"*{ct}",
            "fg_ptr": "*i1",
            "tgi_ptr": "*i64",
            "pal_ptr": "*i64",
            "pov_ptr": "*i64",
            "A": "i32",
            "C": "i32",
            "M": "i32",
        }
        res_ce = dict(BLOCK=128, DEFER=False, **metric)
        res_sig.update({k: "constexpr" for k in res_ce})
        specs.append((_tal_resolve_kernel, res_sig, res_ce, exact))
        wr_sig = {
            "fg_ptr": "*i1",
            "tgi_ptr": "*i64",
            "sel_al_ptr": f"*{ct}",
            "sel_ov_ptr": f"*{ct}",
            "pal_ptr": "*i64",
            "pov_ptr": "*i64",
            "labels_ptr": "*i64",
            "gt_raw_ptr": f"*{ct}",
            "tlab_ptr": "*i64",
            "tbox_ptr": f"*{ct}",
            "tsc_ptr": f"*{sc}",
            "A": "i32",
            "C": "i32",
            "M": "i32",
        }
        wr_ce = {"EPS": 1e-9, "F64": f64, "BLOCK": 128, "BLOCK_C": 32}
        wr_sig.update({k: "constexpr" for k in wr_ce})
        specs.append((_tal_write_kernel, wr_sig, wr_ce, exact))
        specs.append((_tal_resolve_kernel, res_sig, {**res_ce, "DEFER": True}, exact))
        t2_sig = {
            "fg_ptr": "*i1",
            "tgi_ptr": "*i64",
            "sel_al_ptr": f"*{ct}",
            "t2al_ptr": "*i64",
            "t2a_ptr": "*i32",
            "A": "i32",
            "M": "i32",
            "BM": "i32",
            "r": "i32",
        }
        for step in (0, 1):
            ce = {"STEP": step, "F64": f64, "BLOCK": 128}
            specs.append((_tal_topk2_round_kernel, t2_sig | dict.fromkeys(ce, "constexpr"), ce, exact))
        keep_sig = {
            "fg_ptr": "*i1",
            "tgi_ptr": "*i64",
            "sel_al_ptr": f"*{ct}",
            "sel_ov_ptr": f"*{ct}",
            "t2a_ptr": "*i32",
            "pal_ptr": "*i64",
            "pov_ptr": "*i64",
            "A": "i32",
            "M": "i32",
            "BM": "i32",
            "K2": "i32",
        }
        keep_ce = {"F64": f64, "BLOCK": 128}
        specs.append((_tal_topk2_keep_kernel, keep_sig | dict.fromkeys(keep_ce, "constexpr"), keep_ce, exact))
    return specs
