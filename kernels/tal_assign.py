"""Triton ``tal_assign``: the sparse task-aligned assigner (DESIGN §2.1), spec ``reference.tal_assign_ref``.

Nothing of size B*M*A exists: work O(sum of candidates + B*A), memory O(B*A + B*M).
  0. ``_grid_starts_kernel`` / ``_grid_levels_kernel``: the anchor grid, inferred on the device (no host
     sync, so the op stays CUDA-graph capturable and traceable): a level starts where y drops; each level is
     checked anchor by anchor against start + (ix*sx, iy*sy). Anchors that are not a few grids set a flag and
     every GT then scans all A anchors instead of its rectangles (same results, slower).
  1. ``_tal_scan_kernel`` (kernels/_tal_scan.py, one jit helper per phase of DESIGN §2.1), one program per
     (GT, image): the candidate anchors of its widened box are one index rectangle per level (+1 cell
     margin; the exact ``cx - x1 > eps`` test decides). For candidates
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

from . import _common
from ._tal_scan import _align, _bits_float, _float_bits, _tal_scan_kernel

L_MAX = 8  # pyramid levels the grid table holds (YOLOv8 uses 3); more -> the all-anchor scan
BLOCK_SCAN = 2048 if _common.INTERPRET else 128  # anchors per tile of a GT's rectangle
BLOCK_A = 512 if _common.INTERPRET else 128  # anchors per program of the per-anchor passes
# classes per step of the target_scores write: 128 x 32 values per step keeps a GPU program at 32 per thread
WRITE_BLOCK_C = 128 if _common.INTERPRET else 32
BLOCK_GRID = 1024


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
