"""Triton ``bbox_loss`` of a reg_max 1 head's maps read in place (YOLO26: CIoU + L1 + BCE, YOLO11_YOLO26.md
§4.2): ``bbox_loss.maps`` on the Triton backend.

Spec: ``reference.bbox_loss_ref`` of the maps cat into (B, A, .) rows; this reads each (B, 4 + C, H, W)
map where it is (anchor a of level l is pixel h*W + w, levels in order) and writes the gradients in the
maps' layout, so neither the forward nor the backward makes a (B, A, .) copy of the logits.
  1. ``_maps_l1_kernel``, one launch per level, one program per BLOCK_A pixels of one image row of blocks:
     the math of ``bbox_loss._bbox_loss_l1_kernel`` (BCE, CIoU, L1 and their gradients), the logits loaded
     with the map's channel stride. It writes one (B, 8 + C, H, W) gradient map per level -- channels 0-3
     the gradient of S*L_box w.r.t. the 4 raw distances, 4-7 that of S*L_l1, 8.. that of S*L_cls -- and 4
     partial sums (box, cls, l1, sum t) per program.
  2. ``bbox_loss._bbox_loss_reduce_kernel`` adds every level's partial sums in a fixed order (float64).
Backward writes each map's gradient once: box channels ``g_box*c0 + g_l1*c2``, class channels ``g_cls*c1``
(c = incoming grad / S), into a fresh map of the feature's shape (no cat, nothing recomputed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _common
from .bbox_loss import BLOCK_A, BLOCK_R, _bbox_loss_reduce_kernel, _ciou_grads


@triton.jit
def _bce_maps(x_row, sc, g_row, hw, ts_ptr, lab_ptr, rows, ok, C, PER_ANCHOR: tl.constexpr,
              BLOCK_A: tl.constexpr, BLOCK_C: tl.constexpr, CT: tl.constexpr):
    """``bbox_loss._bce_rows`` of map pixels: class c's logit at x_row + c*sc, its gradient stored at
    g_row + c*hw; the targets (B*A, C) rows, or per anchor (PER_ANCHOR: one score ts[row] of class
    lab[row] clamped to [0, C - 1], zeros elsewhere). Returns (cls (BA,), w (BA,))."""
    cls_acc = tl.zeros((BLOCK_A,), dtype=CT)
    w = tl.zeros((BLOCK_A,), dtype=CT)
    if PER_ANCHOR:
        lab = tl.minimum(tl.maximum(tl.load(lab_ptr + rows, mask=ok, other=0), 0), C - 1)
        score = tl.load(ts_ptr + rows, mask=ok, other=0.0).to(CT)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        m2 = ok[:, None] & (c < C)[None, :]
        x = tl.load(x_row[:, None] + c[None, :] * sc, mask=m2, other=0.0).to(CT)
        if PER_ANCHOR:
            t = tl.where(c[None, :] == lab[:, None], score[:, None], 0.0)
        else:
            t = tl.load(ts_ptr + rows[:, None] * C + c[None, :], mask=m2, other=0.0).to(CT)
        e = tl.exp(-tl.abs(x))
        u = 1.0 + e
        log1p_e = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))  # Kahan's log1p
        bce = (1.0 - t) * x - tl.minimum(x, 0.0) + log1p_e  # (1 - t) x - log(sigmoid(x))
        sig = tl.where(x >= 0, 1.0 / u, e / u)
        tl.store(g_row[:, None] + c[None, :] * hw, sig - t, mask=m2)
        cls_acc += tl.sum(tl.where(m2, bce, 0.0), axis=1)
        w += tl.sum(tl.where(m2, t, 0.0), axis=1)
    return cls_acc, w


@triton.jit
def _l1_side_map(g_row, hw, fg, ok, side: tl.constexpr, e, g_e, t_dist, s, dim, wf):
    """One side of reg_max 1 at map pixels (``bbox_loss._l1_side`` with the gradients stored at channel
    ``side`` and ``4 + side`` of the gradient map, channel stride hw); returns |d|."""
    d = (e * s) / dim - (t_dist * s) / dim
    sign = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    tl.store(g_row + side * hw, tl.where(fg, g_e, 0.0), mask=ok)
    tl.store(g_row + (4 + side) * hw, tl.where(fg, ((wf * 0.25) * sign) * s / dim, 0.0), mask=ok)
    return tl.abs(d)


@triton.jit
def _maps_l1_kernel(
    map_ptr, sb, sc, anc_ptr, tb_ptr, ts_ptr, lab_ptr, fg_ptr, g_ptr, part_ptr,
    n_pix, hw, a0, A, C, stride, img_h, img_w,
    PER_ANCHOR: tl.constexpr, F64: tl.constexpr, USE_LIB: tl.constexpr, BLOCK_A: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One level: map (B, 4 + C, H, W) with image stride sb, channel stride sc and pixel stride 1; pixel
    r = b*hw + p of the level is global row b*A + a0 + p of the targets. Gradient map g (B, 8 + C, H, W)
    contiguous; partial sums at part_ptr (this launch's slice)."""
    if F64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    pid = tl.program_id(0)
    r = pid.to(tl.int64) * BLOCK_A + tl.arange(0, BLOCK_A)
    ok = r < n_pix
    b = r // hw
    p = r - b * hw
    a = a0 + p
    rows = b * A + a  # the (B, A, .) row of the targets
    fg = (tl.load(fg_ptr + rows, mask=ok, other=0) != 0) & ok
    m_row = map_ptr + b * sb + p  # channel k at m_row + k*sc
    g_row = g_ptr + b * ((8 + C) * hw) + p  # channel k at g_row + k*hw
    cls_acc, w = _bce_maps(m_row + 4 * sc, sc, g_row + 8 * hw, hw, ts_ptr, lab_ptr, rows, ok, C, PER_ANCHOR,
                           BLOCK_A, BLOCK_C, CT)

    ld = ok & fg
    tx1 = tl.load(tb_ptr + rows * 4 + 0, mask=ld, other=0.0).to(CT)
    ty1 = tl.load(tb_ptr + rows * 4 + 1, mask=ld, other=0.0).to(CT)
    tx2 = tl.load(tb_ptr + rows * 4 + 2, mask=ld, other=0.0).to(CT)
    ty2 = tl.load(tb_ptr + rows * 4 + 3, mask=ld, other=0.0).to(CT)
    ax = tl.load(anc_ptr + a * 2, mask=ok, other=0.0).to(CT)
    ay = tl.load(anc_ptr + a * 2 + 1, mask=ok, other=0.0).to(CT)
    e_l = tl.load(m_row + 0 * sc, mask=ld, other=0.0).to(CT)
    e_t = tl.load(m_row + 1 * sc, mask=ld, other=0.0).to(CT)
    e_r = tl.load(m_row + 2 * sc, mask=ld, other=0.0).to(CT)
    e_b = tl.load(m_row + 3 * sc, mask=ld, other=0.0).to(CT)
    x1, y1, x2, y2 = ax - e_l, ay - e_t, ax + e_r, ay + e_b
    ciou, d_x1, d_y1, d_x2, d_y2 = _ciou_grads(x1, y1, x2, y2, tx1, ty1, tx2, ty2, USE_LIB)
    wf = tl.where(fg, w, 0.0)
    box_acc = tl.where(fg, (1.0 - ciou) * w, 0.0)
    s = stride  # the level's stride, the same for its every anchor (a scalar; promoted with the distances)
    l1 = _l1_side_map(g_row, hw, fg, ok, 0, e_l, wf * d_x1, ax - tx1, s, img_w, wf)
    l1 += _l1_side_map(g_row, hw, fg, ok, 1, e_t, wf * d_y1, ay - ty1, s, img_h, wf)
    l1 += _l1_side_map(g_row, hw, fg, ok, 2, e_r, -wf * d_x2, tx2 - ax, s, img_w, wf)
    l1 += _l1_side_map(g_row, hw, fg, ok, 3, e_b, -wf * d_y2, ty2 - ay, s, img_h, wf)
    l1_acc = tl.where(fg, (l1 * 0.25) * w, 0.0)

    part = part_ptr + pid.to(tl.int64) * 4
    tl.store(part + 0, tl.sum(box_acc, axis=0).to(tl.float64))
    tl.store(part + 1, tl.sum(cls_acc, axis=0).to(tl.float64))
    tl.store(part + 2, tl.sum(l1_acc, axis=0).to(tl.float64))
    tl.store(part + 3, tl.sum(tl.where(ok, w, 0.0), axis=0).to(tl.float64))


def _pixel_axis(f: Tensor) -> Tensor:
    """f, or its contiguous copy when its pixels are not one axis of stride 1 (channels_last, a crop)."""
    return f if f.stride(3) == 1 and f.stride(2) == f.shape[3] else f.contiguous()


def _check_maps(feats, anchor_points, target_bboxes, target_scores, fg_mask, target_labels, l1_scale):
    if not feats or any(f.dim() != 4 or f.shape[:2] != feats[0].shape[:2] for f in feats):
        raise ValueError("bbox_loss_maps: feats must be (B, 4 + nc, H, W) maps of one B and nc, got "
                         f"{[tuple(f.shape) for f in feats]}")
    B, no = feats[0].shape[:2]
    A = sum(f.shape[2] * f.shape[3] for f in feats)
    if no < 5:
        raise ValueError(f"bbox_loss_maps: reg_max 1 maps need 4 + nc >= 5 channels, got {no}")
    want = {"anchor_points": (anchor_points, (A, 2)), "target_bboxes": (target_bboxes, (B, A, 4)),
            "fg_mask": (fg_mask, (B, A))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"bbox_loss_maps: {name} must have shape {shape}, got {tuple(t.shape)}")
    if tuple(target_scores.shape) not in ((B, A), (B, A, no - 4)):
        raise ValueError(f"bbox_loss_maps: target_scores must be (B, A, nc) = {(B, A, no - 4)} or (B, A) "
                         f"with target_labels, got {tuple(target_scores.shape)}")
    if target_scores.dim() == 2 and (target_labels is None or tuple(target_labels.shape) != (B, A)):
        raise ValueError("bbox_loss_maps: (B, A) target_scores hold one class per anchor: pass target_labels "
                         f"(B, A) = {(B, A)} (tal_assign's first output)")
    if len(l1_scale) != len(feats) + 2:
        raise ValueError("bbox_loss_maps: l1_scale must hold each map's stride and the batch image's (H, W): "
                         f"{len(feats) + 2} values, got {len(l1_scale)}")


@torch.library.triton_op("yolofast::bbox_loss_maps_triton", mutates_args=())
def _maps_op(
    feats: list[Tensor],
    anchor_points: Tensor,
    target_bboxes: Tensor,
    target_scores: Tensor,
    fg_mask: Tensor,
    target_labels: Tensor | None,
    l1_scale: list[float],
) -> tuple[Tensor, list[Tensor], Tensor]:
    """reg_max 1 maps (B, 4 + C, H_i, W_i), l1_scale = each map's stride then the batch image's (H, W)
    -> (losses (3,) [L_box, L_cls, L_l1], per map the (B, 8 + C, H_i, W_i) gradients of S*L_box, S*L_l1
    (channels 0-3, 4-7) and S*L_cls (8..), 1/S), in the compute dtype."""
    _check_maps(feats, anchor_points, target_bboxes, target_scores, fg_mask, target_labels, l1_scale)
    B, no = feats[0].shape[:2]
    C = no - 4
    A = sum(f.shape[2] * f.shape[3] for f in feats)
    ct = _common.compute_dtype(*feats)
    dev = feats[0].device
    fg = fg_mask.contiguous() if fg_mask.dtype == torch.bool else (fg_mask != 0).contiguous()
    per_anchor = target_scores.dim() == 2
    ts = target_scores.contiguous()
    lab = target_labels.contiguous() if per_anchor else fg  # a placeholder pointer, never read
    anc, tb = anchor_points.to(ct).contiguous(), target_bboxes.contiguous()
    grads = [_common.empty((B, 8 + C, f.shape[2], f.shape[3]), ct, dev) for f in feats]
    n_parts = [triton.cdiv(B * f.shape[2] * f.shape[3], BLOCK_A) for f in feats]
    part = torch.empty((max(sum(n_parts), 1), 4), dtype=torch.float64, device=dev)
    a0 = p0 = 0
    for f, g, n_part, s in zip(feats, grads, n_parts, l1_scale):
        hw = f.shape[2] * f.shape[3]
        if n_part:
            m = _pixel_axis(f)
            _common.launch(_maps_l1_kernel)[(n_part,)](
                m, m.stride(0), m.stride(1), anc, tb, ts, lab, fg, g, part[p0:], B * hw, hw, a0, A, C,
                float(s), float(l1_scale[-2]), float(l1_scale[-1]),
                PER_ANCHOR=per_anchor, F64=ct == torch.float64, USE_LIB=_common.USE_LIBDEVICE,
                BLOCK_A=BLOCK_A, BLOCK_C=min(_common.next_pow2(max(C, 1)), 128), num_warps=4,
            )
        a0, p0 = a0 + hw, p0 + n_part
    losses, inv_s = _common.empty((3,), ct, dev), _common.empty((), ct, dev)
    _common.launch(_bbox_loss_reduce_kernel)[(1,)](part, losses, inv_s, p0, BLOCK=BLOCK_R, num_warps=4)
    return losses, grads, inv_s


def _setup_context(ctx, inputs, output) -> None:
    _, grads, inv_s = output
    ctx.save_for_backward(inv_s, *grads)
    ctx.dtypes = [f.dtype for f in inputs[0]]
    ctx.mark_non_differentiable(*grads, inv_s)
    ctx.set_materialize_grads(False)


def _backward(ctx, g_losses, *_unused):
    inv_s, *grads = ctx.saved_tensors
    rest = (None,) * 6
    if g_losses is None:  # a Tensor[] input takes a list of (undefined) grads, not one None
        return [None] * len(grads), *rest
    c = g_losses.to(inv_s.dtype) * inv_s  # (3,): the incoming grads over S
    out = []
    for g, dt in zip(grads, ctx.dtypes):
        B, n8, H, W = g.shape
        o = torch.empty((B, n8 - 4, H, W), dtype=g.dtype, device=g.device)
        box = torch.mul(g[:, :4], c[0], out=o[:, :4])  # written in place: no (B, 4 + C) temporary
        box.addcmul_(g[:, 4:8], c[2])
        torch.mul(g[:, 8:], c[1], out=o[:, 4:])
        out.append(o if o.dtype == dt else o.to(dt))
    return out, *rest


_maps_op.register_autograd(_backward, setup_context=_setup_context)
# The loss computes in fp32 whatever autocast would pick (the reference upcasts too).
torch.library.register_autocast("yolofast::bbox_loss_maps_triton", "cuda", torch.float32)


def bbox_loss_maps(
    feats,
    anchor_points: Tensor,
    target_bboxes: Tensor,
    target_scores: Tensor,
    fg_mask: Tensor,
    reg_max: int = 1,
    target_labels: Tensor | None = None,
    weights: Tensor | None = None,
    l1_scale=None,
    stride_tensor: Tensor | None = None,
    img_hw=None,
) -> Tensor:
    """``bbox_loss.maps`` (yolofast/ops/bbox_loss.py) for reg_max 1 on Triton: (3,) [L_box, L_cls, L_l1] of
    the maps read in place, differentiable w.r.t. every map. l1_scale: each map's stride, then the batch
    image's (H, W) (as the C++ form takes it); weights only steer the C++ kernel's layout and are ignored;
    stride_tensor and img_hw (the composed forms' geometry) are accepted and unused when l1_scale is given."""
    if int(reg_max) != 1:
        raise ValueError(f"bbox_loss_maps (Triton): this kernel reads reg_max 1 maps; got reg_max {reg_max} "
                         "(DFL maps go through the (B, A, .) kernel)")
    if l1_scale is None:
        raise ValueError("bbox_loss_maps (Triton): reg_max 1 needs l1_scale = each map's stride and the "
                         "batch image's (H, W), to normalise the L1 distances")
    scale = [float(v) for v in l1_scale]
    return torch.ops.yolofast.bbox_loss_maps_triton(
        list(feats), anchor_points, target_bboxes, target_scores, fg_mask, target_labels, scale)[0]
