"""Triton ``bbox_loss``: fused CIoU + DFL box loss and BCE class loss with their gradients (DESIGN §2.2).

Spec: ``reference.bbox_loss_ref``. Two launches, no float atomics (run-to-run identical):
  1. ``_bbox_loss_kernel``, one program per block of BLOCK_A anchors (rows of the flattened B*A): BCE over
     the classes and its gradient sigmoid(x) - t, the anchor weight w = sum_c t; for foreground anchors the
     softmax over reg_max bins per side, the decoded box, CIoU(pred, target) and its analytic gradient
     through the expectation (alpha held constant), DFL and its gradient. It writes the gradients of
     S*L_box, S*L_dfl, S*L_cls w.r.t. the logits and its 4 partial sums (box, cls, dfl, sum t).
  2. ``_bbox_loss_reduce_kernel`` (one program) adds the partial sums in a fixed order in float64,
     S = max(sum t, 1), writes [L_box, L_cls, L_dfl] / S and 1/S.
Backward only scales the stored gradients by the incoming gradient / S (nothing is recomputed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _bbox_loss_grad, _common
from ._constants import CIOU_EPS, FOUR_OVER_PI2

BLOCK_A = 256 if _common.INTERPRET else 32  # the interpreter runs programs one by one: fewer, larger ones
BLOCK_R = 1024  # partial sums added per step of the reduction
_K = tl.constexpr(FOUR_OVER_PI2)
_EPS = tl.constexpr(CIOU_EPS)


@triton.jit
def _dmin(x, y):
    """d min(x, y) / dx as torch's autograd defines it (half of the gradient on a tie)."""
    return tl.where(x < y, 1.0, tl.where(x == y, 0.5, 0.0))


@triton.jit
def _side_softmax(row_ptr, rows_ok, side: tl.constexpr, R: tl.constexpr, CT: tl.constexpr):
    """Softmax over the R bins of one side: (p (BA, R), log p (BA, R), expectation (BA,))."""
    j = tl.arange(0, R)
    x = tl.load(row_ptr[:, None] + side * R + j[None, :], mask=rows_ok[:, None], other=0.0).to(CT)
    mx = tl.max(x, axis=1)
    ex = tl.exp(x - mx[:, None])
    se = tl.sum(ex, axis=1)
    p = ex / se[:, None]
    logp = (x - mx[:, None]) - tl.log(se)[:, None]
    e = tl.sum(p * j.to(CT)[None, :], axis=1)
    return p, logp, e


@triton.jit
def _side_grads(
    gd_box_row,
    gd_dfl_row,
    pd_row,
    rows_ok,
    fg,
    side: tl.constexpr,
    g_e,
    t_dist,
    w,
    R: tl.constexpr,
    CT: tl.constexpr,
):
    """Stores one side's logit gradients of the box and DFL terms; returns its DFL value (BA,)."""
    j = tl.arange(0, R)
    p, logp, e = _side_softmax(pd_row, rows_ok & fg, side, R, CT)
    # DFL target: clamp to [0, R - 1 - 0.01] so that bin tl + 1 exists (reference.bbox_loss_ref)
    t = tl.minimum(tl.maximum(t_dist, 0.0), R - 1 - 0.01)
    t_lo = tl.floor(t)
    wl = (t_lo + 1.0) - t
    wr = 1.0 - wl
    at_lo = j.to(CT)[None, :] == t_lo[:, None]
    at_hi = j.to(CT)[None, :] == (t_lo + 1.0)[:, None]
    lp_lo = tl.sum(tl.where(at_lo, logp, 0.0), axis=1)
    lp_hi = tl.sum(tl.where(at_hi, logp, 0.0), axis=1)
    dfl = -(wl * lp_lo + wr * lp_hi)
    g_box = g_e[:, None] * p * (j.to(CT)[None, :] - e[:, None])
    tgt = tl.where(at_lo, wl[:, None], 0.0) + tl.where(at_hi, wr[:, None], 0.0)
    g_dfl = (w * 0.25)[:, None] * ((wl + wr)[:, None] * p - tgt)
    on = fg[:, None]
    offs = side * R + j[None, :]
    tl.store(gd_box_row[:, None] + offs, tl.where(on, g_box, 0.0), mask=rows_ok[:, None])
    tl.store(gd_dfl_row[:, None] + offs, tl.where(on, g_dfl, 0.0), mask=rows_ok[:, None])
    return dfl


@triton.jit
def _target_and_anchor(tb_ptr, anc_ptr, rows, a, ok, ld, CT: tl.constexpr):
    """The target box (x1, y1, x2, y2) of each foreground row (0 elsewhere) and its anchor point (ax, ay)."""
    tx1 = tl.load(tb_ptr + rows * 4 + 0, mask=ld, other=0.0).to(CT)
    ty1 = tl.load(tb_ptr + rows * 4 + 1, mask=ld, other=0.0).to(CT)
    tx2 = tl.load(tb_ptr + rows * 4 + 2, mask=ld, other=0.0).to(CT)
    ty2 = tl.load(tb_ptr + rows * 4 + 3, mask=ld, other=0.0).to(CT)
    ax = tl.load(anc_ptr + a * 2, mask=ok, other=0.0).to(CT)
    ay = tl.load(anc_ptr + a * 2 + 1, mask=ok, other=0.0).to(CT)
    return tx1, ty1, tx2, ty2, ax, ay


@triton.jit
def _bce_rows(ps_ptr, ts_ptr, gs_ptr, rows, ok, C, BLOCK_A: tl.constexpr, BLOCK_C: tl.constexpr,
              CT: tl.constexpr):
    """BCE over the classes of rows (summed per row), its gradient sigmoid(x) - t stored, and the anchor
    weights w = sum_c t: (cls (BA,), w (BA,))."""
    cls_acc = tl.zeros((BLOCK_A,), dtype=CT)
    w = tl.zeros((BLOCK_A,), dtype=CT)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        m2 = ok[:, None] & (c < C)[None, :]
        offs = rows[:, None] * C + c[None, :]
        x = tl.load(ps_ptr + offs, mask=m2, other=0.0).to(CT)
        t = tl.load(ts_ptr + offs, mask=m2, other=0.0).to(CT)
        e = tl.exp(-tl.abs(x))
        u = 1.0 + e
        log1p_e = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))  # Kahan's log1p
        bce = (1.0 - t) * x - tl.minimum(x, 0.0) + log1p_e  # (1 - t) x - log(sigmoid(x))
        sig = tl.where(x >= 0, 1.0 / u, e / u)
        tl.store(gs_ptr + offs, sig - t, mask=m2)
        cls_acc += tl.sum(tl.where(m2, bce, 0.0), axis=1)
        w += tl.sum(t, axis=1)
    return cls_acc, w


@triton.jit
def _ciou_grads(x1, y1, x2, y2, tx1, ty1, tx2, ty2, USE_LIB: tl.constexpr):
    """CIoU(pred (x1, y1, x2, y2), target) and the d_* terms of its gradient (alpha held constant): the
    gradient of (1 - ciou) w.r.t. the distances (l, t, r, b) is (d_x1, d_y1, -d_x2, -d_y2)."""
    w1 = x2 - x1
    h1 = (y2 - y1) + _EPS
    w2 = tx2 - tx1
    h2 = (ty2 - ty1) + _EPS
    iw_raw = tl.minimum(x2, tx2) - tl.maximum(x1, tx1)
    ih_raw = tl.minimum(y2, ty2) - tl.maximum(y1, ty1)
    iw = tl.maximum(iw_raw, 0.0)
    ih = tl.maximum(ih_raw, 0.0)
    inter = iw * ih
    union = ((w1 * h1 + w2 * h2) - inter) + _EPS
    iou = inter / union
    cw = tl.maximum(x2, tx2) - tl.minimum(x1, tx1)
    ch = tl.maximum(y2, ty2) - tl.minimum(y1, ty1)
    c2 = (cw * cw + ch * ch) + _EPS
    dxc = (tx1 + tx2) - (x1 + x2)
    dyc = (ty1 + ty2) - (y1 + y2)
    rho2 = (dxc * dxc + dyc * dyc) * 0.25
    u1 = w1 / h1
    da = _common.atan(w2 / h2, USE_LIB) - _common.atan(u1, USE_LIB)
    v = _K * (da * da)
    alpha = v / ((v - iou) + (1.0 + _EPS))
    ciou = iou - (rho2 / c2 + v * alpha)

    # d ciou / d (x1, y1, x2, y2) of the prediction, alpha constant; torch's clamp passes at 0 (>=)
    g_inter = (1.0 + iou) / union
    g_iw = tl.where(iw_raw >= 0, g_inter * ih, 0.0)
    g_ih = tl.where(ih_raw >= 0, g_inter * iw, 0.0)
    g_u1 = (alpha * (2.0 * _K) * da) / (1.0 + u1 * u1)  # -alpha * dv/du1
    g_w1 = -(iou / union) * h1 + g_u1 / h1
    g_h1 = -(iou / union) * w1 - g_u1 * w1 / (h1 * h1)
    q_r = 1.0 / c2
    q_c = -rho2 / (c2 * c2)
    dp_x = q_r * (-0.5 * dxc)
    dp_y = q_r * (-0.5 * dyc)
    d_x1 = -g_w1 - g_iw * _dmin(tx1, x1) - (dp_x - q_c * 2.0 * cw * _dmin(x1, tx1))
    d_x2 = g_w1 + g_iw * _dmin(x2, tx2) - (dp_x + q_c * 2.0 * cw * _dmin(tx2, x2))
    d_y1 = -g_h1 - g_ih * _dmin(ty1, y1) - (dp_y - q_c * 2.0 * ch * _dmin(y1, ty1))
    d_y2 = g_h1 + g_ih * _dmin(y2, ty2) - (dp_y + q_c * 2.0 * ch * _dmin(ty2, y2))
    return ciou, d_x1, d_y1, d_x2, d_y2


@triton.jit
def _bbox_loss_kernel(
    pd_ptr,
    ps_ptr,
    anc_ptr,
    tb_ptr,
    ts_ptr,
    fg_ptr,
    gd_box_ptr,
    gd_dfl_ptr,
    gs_ptr,
    part_ptr,
    n_rows,
    A,
    C,
    R: tl.constexpr,
    F64: tl.constexpr,
    USE_LIB: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    if F64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_A + tl.arange(0, BLOCK_A)
    ok = rows < n_rows
    fg = (tl.load(fg_ptr + rows, mask=ok, other=0) != 0) & ok
    a = rows % A

    # ---- BCE over every anchor and class; w = sum_c t
    cls_acc, w = _bce_rows(ps_ptr, ts_ptr, gs_ptr, rows, ok, C, BLOCK_A, BLOCK_C, CT)

    # ---- box: decoded prediction vs target, CIoU and its gradient w.r.t. the 4 expectations
    pd_row = pd_ptr + rows * (4 * R)
    ld = ok & fg
    tx1, ty1, tx2, ty2, ax, ay = _target_and_anchor(tb_ptr, anc_ptr, rows, a, ok, ld, CT)
    _p, _lp, e_l = _side_softmax(pd_row, ld, 0, R, CT)
    _p, _lp, e_t = _side_softmax(pd_row, ld, 1, R, CT)
    _p, _lp, e_r = _side_softmax(pd_row, ld, 2, R, CT)
    _p, _lp, e_b = _side_softmax(pd_row, ld, 3, R, CT)
    x1 = ax - e_l
    y1 = ay - e_t
    x2 = ax + e_r
    y2 = ay + e_b

    ciou, d_x1, d_y1, d_x2, d_y2 = _ciou_grads(x1, y1, x2, y2, tx1, ty1, tx2, ty2, USE_LIB)
    # L = (1 - ciou) w; x1 = ax - l, y1 = ay - t, x2 = ax + r, y2 = ay + b
    wf = tl.where(fg, w, 0.0)
    box_acc = tl.where(fg, (1.0 - ciou) * w, 0.0)

    # ---- per side: DFL value and the logit gradients of both terms
    gd_box_row = gd_box_ptr + rows * (4 * R)
    gd_dfl_row = gd_dfl_ptr + rows * (4 * R)
    dfl = _side_grads(gd_box_row, gd_dfl_row, pd_row, ok, fg, 0, wf * d_x1, ax - tx1, wf, R, CT)
    dfl += _side_grads(gd_box_row, gd_dfl_row, pd_row, ok, fg, 1, wf * d_y1, ay - ty1, wf, R, CT)
    dfl += _side_grads(gd_box_row, gd_dfl_row, pd_row, ok, fg, 2, -wf * d_x2, tx2 - ax, wf, R, CT)
    dfl += _side_grads(gd_box_row, gd_dfl_row, pd_row, ok, fg, 3, -wf * d_y2, ty2 - ay, wf, R, CT)
    dfl_acc = tl.where(fg, (dfl * 0.25) * w, 0.0)

    part = part_ptr + pid.to(tl.int64) * 4
    tl.store(part + 0, tl.sum(box_acc, axis=0).to(tl.float64))
    tl.store(part + 1, tl.sum(cls_acc, axis=0).to(tl.float64))
    tl.store(part + 2, tl.sum(dfl_acc, axis=0).to(tl.float64))
    tl.store(part + 3, tl.sum(tl.where(ok, w, 0.0), axis=0).to(tl.float64))


@triton.jit
def _l1_side(gd_box_ptr, gd_l1_ptr, rows, ok, fg, side: tl.constexpr, e, g_e, t_dist, s, dim, wf):
    """reg_max 1, one side: stores the raw distance's gradients of the box term (g_e) and of the L1 term;
    returns |d|, d = e*s/dim - t*s/dim (YOLO11_YOLO26.md §4.2; t unclamped, dim the image's W or H). The L1
    gradient of |d| * w/4 is w/4 * sign(d) * s/dim (abs' subgradient 0 at 0, as autograd's)."""
    d = (e * s) / dim - (t_dist * s) / dim
    sign = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    tl.store(gd_box_ptr + rows * 4 + side, tl.where(fg, g_e, 0.0), mask=ok)
    tl.store(gd_l1_ptr + rows * 4 + side, tl.where(fg, ((wf * 0.25) * sign) * s / dim, 0.0), mask=ok)
    return tl.abs(d)


@triton.jit
def _bbox_loss_l1_kernel(
    pd_ptr,
    ps_ptr,
    anc_ptr,
    tb_ptr,
    ts_ptr,
    fg_ptr,
    st_ptr,
    gd_box_ptr,
    gd_l1_ptr,
    gs_ptr,
    part_ptr,
    n_rows,
    A,
    C,
    img_h,
    img_w,
    F64: tl.constexpr,
    USE_LIB: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """reg_max 1 (YOLO26): pd (B*A, 4) raw distances; BCE and CIoU as ``_bbox_loss_kernel``, the L1 term of
    the distances x stride / (W, H) instead of DFL; partial sums (box, cls, l1, sum t)."""
    if F64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_A + tl.arange(0, BLOCK_A)
    ok = rows < n_rows
    fg = (tl.load(fg_ptr + rows, mask=ok, other=0) != 0) & ok
    a = rows % A
    cls_acc, w = _bce_rows(ps_ptr, ts_ptr, gs_ptr, rows, ok, C, BLOCK_A, BLOCK_C, CT)

    ld = ok & fg
    tx1, ty1, tx2, ty2, ax, ay = _target_and_anchor(tb_ptr, anc_ptr, rows, a, ok, ld, CT)
    s = tl.load(st_ptr + a, mask=ok, other=1.0).to(CT)
    e_l = tl.load(pd_ptr + rows * 4 + 0, mask=ld, other=0.0).to(CT)
    e_t = tl.load(pd_ptr + rows * 4 + 1, mask=ld, other=0.0).to(CT)
    e_r = tl.load(pd_ptr + rows * 4 + 2, mask=ld, other=0.0).to(CT)
    e_b = tl.load(pd_ptr + rows * 4 + 3, mask=ld, other=0.0).to(CT)
    x1, y1, x2, y2 = ax - e_l, ay - e_t, ax + e_r, ay + e_b
    ciou, d_x1, d_y1, d_x2, d_y2 = _ciou_grads(x1, y1, x2, y2, tx1, ty1, tx2, ty2, USE_LIB)
    wf = tl.where(fg, w, 0.0)
    box_acc = tl.where(fg, (1.0 - ciou) * w, 0.0)

    # img_h, img_w: fp32 scalars, exact for image sizes (integers < 2^24); promoted with the distances.
    l1 = _l1_side(gd_box_ptr, gd_l1_ptr, rows, ok, fg, 0, e_l, wf * d_x1, ax - tx1, s, img_w, wf)
    l1 += _l1_side(gd_box_ptr, gd_l1_ptr, rows, ok, fg, 1, e_t, wf * d_y1, ay - ty1, s, img_h, wf)
    l1 += _l1_side(gd_box_ptr, gd_l1_ptr, rows, ok, fg, 2, e_r, -wf * d_x2, tx2 - ax, s, img_w, wf)
    l1 += _l1_side(gd_box_ptr, gd_l1_ptr, rows, ok, fg, 3, e_b, -wf * d_y2, ty2 - ay, s, img_h, wf)
    l1_acc = tl.where(fg, (l1 * 0.25) * w, 0.0)

    part = part_ptr + pid.to(tl.int64) * 4
    tl.store(part + 0, tl.sum(box_acc, axis=0).to(tl.float64))
    tl.store(part + 1, tl.sum(cls_acc, axis=0).to(tl.float64))
    tl.store(part + 2, tl.sum(l1_acc, axis=0).to(tl.float64))
    tl.store(part + 3, tl.sum(tl.where(ok, w, 0.0), axis=0).to(tl.float64))


@triton.jit
def _bbox_loss_reduce_kernel(part_ptr, out_ptr, inv_s_ptr, n_part, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK, 4), dtype=tl.float64)
    k = tl.arange(0, 4)
    for i0 in range(0, n_part, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        acc += tl.load(part_ptr + i[:, None] * 4 + k[None, :], mask=(i < n_part)[:, None], other=0.0)
    sums = tl.sum(acc, axis=0)
    s = tl.maximum(tl.sum(tl.where(k == 3, sums, 0.0), axis=0), 1.0)
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + k, (sums / s).to(ty), mask=k < 3)
    tl.store(inv_s_ptr, (1.0 / s).to(ty))


def _check(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask, l1=False) -> None:
    if pred_dist.dim() != 3 or pred_dist.shape[-1] % 4:
        raise ValueError(f"bbox_loss: pred_dist must be (B, A, 4*reg_max), got {tuple(pred_dist.shape)}")
    B, A, R4 = pred_dist.shape
    R = R4 // 4
    if l1 and R != 1:
        raise ValueError(f"bbox_loss (Triton, L1): pred_dist must be (B, A, 4) raw distances, got {R4}")
    if not l1 and (R < 2 or R & (R - 1)):
        raise ValueError(f"bbox_loss (Triton): reg_max must be a power of two >= 2 (or 1), got {R}")
    C = pred_scores.shape[-1]
    want = {
        "pred_scores": (pred_scores, (B, A, C)),
        "anchor_points": (anchor_points, (A, 2)),
        "target_bboxes": (target_bboxes, (B, A, 4)),
        "target_scores": (target_scores, (B, A, C)),
        "fg_mask": (fg_mask, (B, A)),
    }
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"bbox_loss: {name} must have shape {shape}, got {tuple(t.shape)}")
        if t.device != pred_dist.device:
            raise ValueError(f"bbox_loss: {name} is on {t.device}, pred_dist on {pred_dist.device}")


@torch.library.triton_op("yolofast::bbox_loss_triton", mutates_args=())
def _bbox_loss_op(
    pred_dist: Tensor,
    pred_scores: Tensor,
    anchor_points: Tensor,
    target_bboxes: Tensor,
    target_scores: Tensor,
    fg_mask: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (losses (3,), grad of S*L_box w.r.t. pred_dist, grad of S*L_dfl w.r.t. pred_dist,
    grad of S*L_cls w.r.t. pred_scores, 1/S), all in the compute dtype (as yolofast::bbox_loss)."""
    _check(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask)
    B, A, R4 = pred_dist.shape
    C = pred_scores.shape[-1]
    ct = _common.compute_dtype(pred_dist, pred_scores)
    dev = pred_dist.device
    pd, ps = pred_dist.contiguous(), pred_scores.contiguous()
    tb, ts = target_bboxes.contiguous(), target_scores.contiguous()
    anc = anchor_points.to(ct).contiguous()
    fg = fg_mask.contiguous()
    if fg.dtype != torch.bool:
        fg = fg != 0
    losses = _common.empty((3,), ct, dev)
    gd_box = _common.empty((B, A, R4), ct, dev)
    gd_dfl = _common.empty((B, A, R4), ct, dev)
    gs = _common.empty((B, A, C), ct, dev)
    inv_s = _common.empty((), ct, dev)
    n_rows = B * A
    n_part = triton.cdiv(n_rows, BLOCK_A)
    part = torch.empty((max(n_part, 1), 4), dtype=torch.float64, device=dev)
    if n_part:
        _common.launch(_bbox_loss_kernel)[(n_part,)](
            pd,
            ps,
            anc,
            tb,
            ts,
            fg,
            gd_box,
            gd_dfl,
            gs,
            part,
            n_rows,
            A,
            C,
            R=R4 // 4,
            F64=ct == torch.float64,
            USE_LIB=_common.USE_LIBDEVICE,
            BLOCK_A=BLOCK_A,
            BLOCK_C=min(_common.next_pow2(max(C, 1)), 128),
            num_warps=4,
        )
    _common.launch(_bbox_loss_reduce_kernel)[(1,)](part, losses, inv_s, n_part, BLOCK=BLOCK_R, num_warps=4)
    return losses, gd_box, gd_dfl, gs, inv_s


# The same backward as yolofast::bbox_loss (the C++/CUDA op): scale the stored gradients.
_bbox_loss_op.register_autograd(_bbox_loss_grad.backward, setup_context=_bbox_loss_grad.setup_context)
# The loss computes in fp32 whatever autocast would pick (the reference upcasts too).
torch.library.register_autocast("yolofast::bbox_loss_triton", "cuda", torch.float32)


@torch.library.triton_op("yolofast::bbox_loss_l1_triton", mutates_args=())
def _bbox_loss_l1_op(
    pred_dist: Tensor,
    pred_scores: Tensor,
    anchor_points: Tensor,
    target_bboxes: Tensor,
    target_scores: Tensor,
    fg_mask: Tensor,
    stride_tensor: Tensor,
    img_h: float,
    img_w: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """reg_max 1 (YOLO26): pred_dist (B, A, 4) raw distances, stride_tensor each anchor's stride (A values),
    img_h x img_w the batch image -> the outputs of ``bbox_loss_triton`` with [L_box, L_cls, L_l1] and the L1
    gradient in the DFL gradient's place (as yolofast::bbox_loss.l1)."""
    _check(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask, l1=True)
    B, A, _ = pred_dist.shape
    if stride_tensor.numel() != A or stride_tensor.device != pred_dist.device:
        raise ValueError(f"bbox_loss: stride_tensor must hold one stride per anchor (A = {A}) on "
                         f"{pred_dist.device}, got {tuple(stride_tensor.shape)} on {stride_tensor.device}")
    C = pred_scores.shape[-1]
    ct = _common.compute_dtype(pred_dist, pred_scores)
    dev = pred_dist.device
    fg = fg_mask.contiguous()
    if fg.dtype != torch.bool:
        fg = fg != 0
    losses, inv_s = _common.empty((3,), ct, dev), _common.empty((), ct, dev)
    gd_box, gd_l1 = _common.empty((B, A, 4), ct, dev), _common.empty((B, A, 4), ct, dev)
    gs = _common.empty((B, A, C), ct, dev)
    n_rows = B * A
    n_part = triton.cdiv(n_rows, BLOCK_A)
    part = torch.empty((max(n_part, 1), 4), dtype=torch.float64, device=dev)
    if n_part:
        _common.launch(_bbox_loss_l1_kernel)[(n_part,)](
            pred_dist.contiguous(), pred_scores.contiguous(), anchor_points.to(ct).contiguous(),
            target_bboxes.contiguous(), target_scores.contiguous(), fg, stride_tensor.to(ct).contiguous(),
            gd_box, gd_l1, gs, part, n_rows, A, C, float(img_h), float(img_w),
            F64=ct == torch.float64,
            USE_LIB=_common.USE_LIBDEVICE,
            BLOCK_A=BLOCK_A,
            BLOCK_C=min(_common.next_pow2(max(C, 1)), 128),
            num_warps=4,
        )
    _common.launch(_bbox_loss_reduce_kernel)[(1,)](part, losses, inv_s, n_part, BLOCK=BLOCK_R, num_warps=4)
    return losses, gd_box, gd_l1, gs, inv_s


_bbox_loss_l1_op.register_autograd(_bbox_loss_grad.l1_backward, setup_context=_bbox_loss_grad.setup_context)
torch.library.register_autocast("yolofast::bbox_loss_l1_triton", "cuda", torch.float32)


def bbox_loss(
    pred_dist: Tensor,
    pred_scores: Tensor,
    anchor_points: Tensor,
    target_bboxes: Tensor,
    target_scores: Tensor,
    fg_mask: Tensor,
    stride_tensor: Tensor | None = None,
    img_hw: tuple[float, float] | None = None,
) -> Tensor:
    """(3,) [L_box, L_cls, L_dfl] as ``reference.bbox_loss_ref`` (same arguments), differentiable w.r.t.
    pred_dist and pred_scores; the logits' gradients are computed in the forward pass. reg_max 1
    (pred_dist (B, A, 4) raw distances): [L_box, L_cls, L_l1], stride_tensor and img_hw required."""
    if pred_dist.dim() == 3 and pred_dist.shape[-1] == 4:
        if stride_tensor is None or img_hw is None:
            raise ValueError("bbox_loss: reg_max 1 (raw distances, L1 term) needs stride_tensor (A, 1) and "
                             "img_hw (H, W) of the batch image to normalise the distances")
        return torch.ops.yolofast.bbox_loss_l1_triton(
            pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask, stride_tensor,
            float(img_hw[0]), float(img_hw[1]),
        )[0]
    return torch.ops.yolofast.bbox_loss_triton(
        pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask
    )[0]
