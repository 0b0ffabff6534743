"""The compiled ops' schemas and their Python-side registrations (namespace ``yolofast``), in one file.

C++/CUDA sources only register kernels (``TORCH_LIBRARY_IMPL(yolofast, CPU|CUDA, m)``); here live the
schemas, the fake (meta) implementations that let ``torch.compile(fullgraph=True)`` trace through the ops,
the autograd registration of ``bbox_loss`` (its formula, shared with the Triton op, is in
``yolofast/kernels/_bbox_loss_grad.py``) and its autocast rule (fp32). Importing this module defines them and
loads nothing: ``_build.py`` builds and loads the kernels, ``_library.py`` holds the Python callables.

Ops (tensor shapes as in ``reference.py``):
  tal_assign(pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, topk, alpha, beta, eps)
      -> (target_labels int64 (B,A), target_bboxes (B,A,4) gt_bboxes' dtype, target_scores (B,A,C)
          pd_scores' dtype, fg_mask bool (B,A), target_gt_idx int64 (B,A)); no gradient.
  bbox_loss(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask)
      -> (losses (3,) [L_box, L_cls, L_dfl], grad_dist_box (B,A,4R), grad_dist_dfl (B,A,4R),
          grad_scores (B,A,C), inv_s ())
      all in the compute dtype (float64 if pred_dist or pred_scores is float64, else float32). The grads
      are those of S*L_box, S*L_dfl, S*L_cls w.r.t. the logits and inv_s = 1/S, so backward is
      ``grad_pred_dist = gd_box*(g[0]*inv_s) + gd_dfl*(g[2]*inv_s)``, ``grad_pred_scores = gs*(g[1]*inv_s)``.
  bbox_loss.l1(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask, stride_tensor,
               img_h, img_w) -> the same outputs for reg_max 1 (CUDA): pred_dist (B, A, 4) raw distances,
      losses [L_box, L_cls, L_l1] and the L1 gradient in grad_dist_dfl's place; stride_tensor (A,) or (A, 1)
      each anchor's stride, img_h x img_w the batch image (reference.bbox_loss_ref's stride_tensor, img_hw).
  bbox_loss.rows(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask, compact=True)
      -> (losses (3,), grad_scores (B,A,C), fg_rows (N, 2, 4R), fg_index (N,) int64, inv_s ())
      bbox_loss on the CPU with the box and DFL gradients of the foreground anchors only, as bbox_loss_maps
      keeps them (below); its backward is _bbox_loss_rows_scale.
  _bbox_loss_rows_scale(grad_scores, fg_rows, fg_index, c) -> (grad_dist (B,A,4R), grad_scores)
      bbox_loss.rows' backward (CPU) in one pass: fg_rows[:, 0]*c[0] + fg_rows[:, 1]*c[2] at the foreground
      anchors, 0 elsewhere, and grad_scores*c[1].
  bbox_loss_maps(feats, anchor_points, target_bboxes, target_scores, fg_mask, reg_max, compact=True,
                 target_labels=None, weights=None, l1_scale=None)
      -> (losses (3,), grad_cls [(B, C, H_i, W_i)], fg_rows (N, 2, 4R), fg_index (N,) int64, inv_s ())
      the same loss read from the Detect head's per-level maps (B, 4R+C, H_i, W_i) in place (anchors level
      by level, pixel h*W_i + w): grad_cls is the gradient of S*L_cls in the maps' layout, fg_rows those of
      [S*L_box, S*L_dfl] w.r.t. the 4R box logits of the N foreground anchors (the others' are zero),
      fg_index their global anchor b*A + a, ascending. N is data-dependent (the foreground count);
      compact=False makes it static: N = B*A, row b*A + a, zero rows off the foreground (for tracing).
      target_scores may be (B, A) per anchor, as tal_assign.maps(dense_scores=False) gives them, with
      target_labels (B, A): the (B, A, C) targets are then one-hot of class min(max(label, 0), C - 1).
      weights (3,) (per-anchor targets only; finite, non-zero): the gradient the caller will bring to the
      losses; grad_cls
      is then each map's whole final gradient (B, 4R+C, H_i, W_i) of weights . losses, which backward
      hands on as it is when that gradient arrives (once), and rescales otherwise.
      reg_max 1 (raw distances, YOLO26): losses are [L_box, L_cls, L_l1] with l1_scale (len(feats) + 2,)
      float64 = each map's stride and the batch image's (H, W).
      CUDA: reg_max 1 only, weights None, and always the static layout whatever compact says (a compact
      one would need a host sync for its size).
  _bbox_loss_maps_scale(grad_cls, fg_rows, fg_index, c, reg_max) -> [(B, 4R+C, H_i, W_i)]
      bbox_loss_maps' backward (CPU, CUDA): each map's gradient written once, class channels grad_cls*c[1],
      box channels fg_rows[:, 0]*c[0] + fg_rows[:, 1]*c[2] at the foreground anchors and 0 elsewhere.
  tal_assign.maps(feats, reg_max, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, topk, alpha, beta,
                  eps, dense_scores=True)
      -> tal_assign's outputs for pd_scores = sigmoid of the maps' class logits (as (B, A, C)), read in
          place and only where the assigner needs a score; target_scores in the maps' promoted dtype.
          dense_scores=False: target_scores is (B, A), each anchor's one non-zero score (0 off the
          foreground) of class min(target_labels, C - 1), without the (B, A, C) zeros.
  head_decode(feats, strides, reg_max) -> (pd_scores (B, A, C) sigmoid, pd_bboxes (B, A, 4) xyxy pixels)
      the assigner's inputs decoded from the maps in one pass (reference.bbox_decode * stride); no gradient.
  head_decode.boxes(feats, strides, reg_max) -> pd_bboxes   the boxes alone (for tal_assign.maps).
  ema_update(ema!, model, decay) -> ()   in place ema = lerp(ema, model, 1 - decay).
  ema_update.multi(ema![], model[], decay) -> ()   the same over lists of tensors (the model's own, in
      place; integer tensors copied): one parallel sweep, no flat copy (CPU).
  ns_orthogonalize(mats[], steps, eps, fp32) -> Tensor[]   Muon's Newton-Schulz NS5 of every mats[i]
      flattened to (size(0), numel/size(0)), each back in its own shape and dtype (contiguous): the list
      grouped by shape, each group one batched bmm/baddbmm per product; bf16 (fp32=True: float32).
  ns_orthogonalize.musgd(params![], grads[], bufs![], bufs_sgd![], counts, lr, momentum, weight_decay,
                         nesterov, use_muon, muon, sgd, steps, eps, fp32) -> bool
      a whole MuSGD step in place (CPU; yolofast/optim/musgd.py's semantics, bit for bit): params, grads
      and bufs (momentum_buffer) group after group, counts[k] tensors in group k, bufs_sgd the Muon groups'
      momentum_buffer_SGD in the same order; per group lr, momentum, weight_decay, nesterov (0/1),
      use_muon (0/1). False, nothing touched, where a tensor is not float32 and dense with the same
      strides as its grad and buffers: the caller then runs the multi-tensor step.
  hsv_augment(img, lut, rgb, step=64) -> Tensor   the training HSV augmentation of a BGR uint8 image (..., 3)
      in one pass (CPU): OpenCV's 8-bit BGR->HSV, lut (256, 3) uint8 hue/sat/val tables, HSV->RGB (rgb) or
      BGR; the same bytes as yolofast.data.augment.augment_hsv's OpenCV path (a new tensor of img's shape)
      when step is OpenCV's pixels per vector step on this CPU (64 AVX-512, 32 AVX2, 16 SSE).
  hsv_augment_(img!, lut, rgb, step=64) -> Tensor   the same written over img (contiguous), returned.
  _simd_lanes(x) -> int   debug: floats per SIMD vector the CPU build uses (16 AVX-512, 8 AVX2, 4 NEON).
  _threads_seen(x) -> int   debug: distinct threads that ran a kernel chunk since the last call (CPU).
  _bbox_vec_bits(x) -> int  debug: SIMD width in bits the CPU loss kernels were built for (0: scalar).
"""

from __future__ import annotations

import torch
from torch import Tensor

from yolofast.kernels import _bbox_loss_grad

NAMESPACE = "yolofast"
_lib = torch.library.Library(NAMESPACE, "DEF")

_lib.define(
    "tal_assign(Tensor pd_scores, Tensor pd_bboxes, Tensor anc_points, Tensor gt_labels, Tensor gt_bboxes, "
    "Tensor mask_gt, int topk, float alpha, float beta, float eps, int topk2=0) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_lib.define(
    "bbox_loss(Tensor pred_dist, Tensor pred_scores, Tensor anchor_points, Tensor target_bboxes, "
    "Tensor target_scores, Tensor fg_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_lib.define(
    "bbox_loss.l1(Tensor pred_dist, Tensor pred_scores, Tensor anchor_points, Tensor target_bboxes, "
    "Tensor target_scores, Tensor fg_mask, Tensor stride_tensor, float img_h, float img_w) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_lib.define(
    "bbox_loss.rows(Tensor pred_dist, Tensor pred_scores, Tensor anchor_points, Tensor target_bboxes, "
    "Tensor target_scores, Tensor fg_mask, bool compact=True) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_lib.define(
    "_bbox_loss_rows_scale(Tensor grad_scores, Tensor fg_rows, Tensor fg_index, Tensor c) -> (Tensor, Tensor)"
)
_lib.define(
    "bbox_loss_maps(Tensor[] feats, Tensor anchor_points, Tensor target_bboxes, Tensor target_scores, "
    "Tensor fg_mask, int reg_max, bool compact=True, Tensor? target_labels=None, Tensor? weights=None, "
    "Tensor? l1_scale=None) -> (Tensor, Tensor[], Tensor, Tensor, Tensor)"
)
_lib.define(
    "_bbox_loss_maps_scale(Tensor[] grad_cls, Tensor fg_rows, Tensor fg_index, Tensor c, int reg_max) "
    "-> Tensor[]"
)
_lib.define(
    "tal_assign.maps(Tensor[] feats, int reg_max, Tensor pd_bboxes, Tensor anc_points, Tensor gt_labels, "
    "Tensor gt_bboxes, Tensor mask_gt, int topk, float alpha, float beta, float eps, bool dense_scores=True, "
    "int topk2=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_lib.define("head_decode(Tensor[] feats, float[] strides, int reg_max) -> (Tensor, Tensor)")
_lib.define("head_decode.boxes(Tensor[] feats, float[] strides, int reg_max) -> Tensor")
_lib.define("_bbox_vec_bits(Tensor x) -> int")
_lib.define("ema_update(Tensor(a!) ema, Tensor model, Tensor decay) -> ()")
_lib.define("ema_update.multi(Tensor(a!)[] ema, Tensor[] model, Tensor decay) -> ()")
_lib.define("_threads_seen(Tensor x) -> int")
_lib.define("_simd_lanes(Tensor x) -> int")
_lib.define("ns_orthogonalize(Tensor[] mats, int steps, float eps, bool fp32) -> Tensor[]")
_lib.define(
    "ns_orthogonalize.musgd(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] bufs, Tensor(c!)[] bufs_sgd, "
    "int[] counts, float[] lr, float[] momentum, float[] weight_decay, int[] nesterov, int[] use_muon, "
    "float muon, float sgd, int steps, float eps, bool fp32) -> bool"
)
_lib.define("hsv_augment(Tensor img, Tensor lut, bool rgb, int step=64) -> Tensor")
_lib.define("hsv_augment_(Tensor(a!) img, Tensor lut, bool rgb, int step=64) -> Tensor(a!)")


# ---------------------------------------------------------------------------------------------- fake impls
@torch.library.register_fake("yolofast::tal_assign", lib=_lib)
def _tal_assign_fake(pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, topk, alpha, beta, eps,
                     topk2=0):
    B, A, C = pd_scores.shape
    return (
        pd_scores.new_empty((B, A), dtype=torch.int64),
        gt_bboxes.new_empty((B, A, 4)),
        pd_scores.new_empty((B, A, C)),
        pd_scores.new_empty((B, A), dtype=torch.bool),
        pd_scores.new_empty((B, A), dtype=torch.int64),
    )


@torch.library.register_fake("yolofast::tal_assign.maps", lib=_lib)
def _tal_assign_maps_fake(feats, reg_max, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, topk, alpha,
                          beta, eps, dense_scores=True, topk2=0):
    B, no = feats[0].shape[:2]
    A = sum(f.shape[2] * f.shape[3] for f in feats)
    dt = feats[0].dtype
    for f in feats[1:]:
        dt = torch.promote_types(dt, f.dtype)
    return (
        pd_bboxes.new_empty((B, A), dtype=torch.int64),
        gt_bboxes.new_empty((B, A, 4)),
        pd_bboxes.new_empty((B, A, no - 4 * reg_max) if dense_scores else (B, A), dtype=dt),
        pd_bboxes.new_empty((B, A), dtype=torch.bool),
        pd_bboxes.new_empty((B, A), dtype=torch.int64),
    )


def _loss_dtype(pred_dist: Tensor, pred_scores: Tensor) -> torch.dtype:
    return torch.float64 if torch.float64 in (pred_dist.dtype, pred_scores.dtype) else torch.float32


@torch.library.register_fake("yolofast::bbox_loss", lib=_lib)
def _bbox_loss_fake(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask):
    B, A, R4 = pred_dist.shape
    C = pred_scores.shape[-1]
    dt = _loss_dtype(pred_dist, pred_scores)
    return (
        pred_dist.new_empty((3,), dtype=dt),
        pred_dist.new_empty((B, A, R4), dtype=dt),
        pred_dist.new_empty((B, A, R4), dtype=dt),
        pred_dist.new_empty((B, A, C), dtype=dt),
        pred_dist.new_empty((), dtype=dt),
    )


@torch.library.register_fake("yolofast::bbox_loss.l1", lib=_lib)
def _bbox_loss_l1_fake(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask,
                       stride_tensor, img_h, img_w):
    return _bbox_loss_fake(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask)


@torch.library.register_fake("yolofast::bbox_loss.rows", lib=_lib)
def _bbox_loss_rows_fake(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask,
                         compact=True):
    B, A, R4 = pred_dist.shape
    dt = _loss_dtype(pred_dist, pred_scores)
    # The foreground count, or every anchor in the static layout.
    n = torch.library.get_ctx().new_dynamic_size() if compact else B * A
    return (pred_dist.new_empty((3,), dtype=dt), pred_dist.new_empty((B, A, pred_scores.shape[-1]), dtype=dt),
            pred_dist.new_empty((n, 2, R4), dtype=dt), pred_dist.new_empty((n,), dtype=torch.int64),
            pred_dist.new_empty((), dtype=dt))


@torch.library.register_fake("yolofast::_bbox_loss_rows_scale", lib=_lib)
def _bbox_loss_rows_scale_fake(grad_scores, fg_rows, fg_index, c):
    B, A, _ = grad_scores.shape
    return grad_scores.new_empty((B, A, fg_rows.shape[-1])), torch.empty_like(grad_scores)


def _maps_dtype(feats) -> torch.dtype:
    return torch.float64 if any(f.dtype == torch.float64 for f in feats) else torch.float32


@torch.library.register_fake("yolofast::bbox_loss_maps", lib=_lib)
def _bbox_loss_maps_fake(feats, anchor_points, target_bboxes, target_scores, fg_mask, reg_max, compact=True,
                         target_labels=None, weights=None, l1_scale=None):
    dt = _maps_dtype(feats)
    B, no = feats[0].shape[:2]
    ch = no if weights is not None else no - 4 * reg_max  # the whole gradient, or the class channels'
    grad_cls = [f.new_empty((B, ch, *f.shape[2:]), dtype=dt) for f in feats]
    # The foreground count, or every anchor in the static layout.
    n = torch.library.get_ctx().new_dynamic_size() if compact else fg_mask.numel()
    return (feats[0].new_empty((3,), dtype=dt), grad_cls, feats[0].new_empty((n, 2, 4 * reg_max), dtype=dt),
            feats[0].new_empty((n,), dtype=torch.int64), feats[0].new_empty((), dtype=dt))


@torch.library.register_fake("yolofast::_bbox_loss_maps_scale", lib=_lib)
def _bbox_loss_maps_scale_fake(grad_cls, fg_rows, fg_index, c, reg_max):
    return [g.new_empty((g.shape[0], 4 * reg_max + g.shape[1], *g.shape[2:])) for g in grad_cls]


@torch.library.register_fake("yolofast::head_decode", lib=_lib)
def _head_decode_fake(feats, strides, reg_max):
    dt = _maps_dtype(feats)
    B, no = feats[0].shape[:2]
    A = sum(f.shape[2] * f.shape[3] for f in feats)
    return feats[0].new_empty((B, A, no - 4 * reg_max), dtype=dt), feats[0].new_empty((B, A, 4), dtype=dt)


@torch.library.register_fake("yolofast::head_decode.boxes", lib=_lib)
def _head_decode_boxes_fake(feats, strides, reg_max):
    B = feats[0].shape[0]
    A = sum(f.shape[2] * f.shape[3] for f in feats)
    return feats[0].new_empty((B, A, 4), dtype=_maps_dtype(feats))


@torch.library.register_fake("yolofast::hsv_augment", lib=_lib)
def _hsv_augment_fake(img, lut, rgb, step=64):
    return torch.empty_like(img, memory_format=torch.contiguous_format)


@torch.library.register_fake("yolofast::hsv_augment_", lib=_lib)
def _hsv_augment_inplace_fake(img, lut, rgb, step=64):
    return img


@torch.library.register_fake("yolofast::ema_update", lib=_lib)
def _ema_update_fake(ema, model, decay):
    return None


@torch.library.register_fake("yolofast::ema_update.multi", lib=_lib)
def _ema_update_multi_fake(ema, model, decay):
    return None


@torch.library.register_fake("yolofast::ns_orthogonalize", lib=_lib)
def _ns_orthogonalize_fake(mats, steps, eps, fp32):
    return [torch.empty_like(m, memory_format=torch.contiguous_format) for m in mats]


# ------------------------------------------------------------------------------------------------ autograd
# The formula is shared with the Triton op (yolofast/kernels/bbox_loss.py): kernels/_bbox_loss_grad.py.
torch.library.register_autograd(
    "yolofast::bbox_loss", _bbox_loss_grad.backward, setup_context=_bbox_loss_grad.setup_context, lib=_lib
)

torch.library.register_autograd(
    "yolofast::bbox_loss.l1", _bbox_loss_grad.l1_backward, setup_context=_bbox_loss_grad.setup_context,
    lib=_lib
)

torch.library.register_autograd(
    "yolofast::bbox_loss.rows",
    _bbox_loss_grad.rows_backward,
    setup_context=_bbox_loss_grad.setup_context,
    lib=_lib,
)

torch.library.register_autograd(
    "yolofast::bbox_loss_maps",
    _bbox_loss_grad.maps_backward,
    setup_context=_bbox_loss_grad.maps_setup_context,
    lib=_lib,
)


# The assigner has no gradient (DESIGN §2.1): its outputs are constants even when pd_scores requires grad.
def _tal_assign_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(*output)


def _tal_assign_backward(ctx, *grads):
    return (None,) * 11


torch.library.register_autograd(
    "yolofast::tal_assign", _tal_assign_backward, setup_context=_tal_assign_setup, lib=_lib
)
torch.library.register_autograd(
    "yolofast::tal_assign.maps", lambda ctx, *grads: (None,) * 13, setup_context=_tal_assign_setup, lib=_lib
)

# ------------------------------------------------------------------------------------------------- autocast
# The loss computes in fp32 whatever autocast would pick: under autocast, floating inputs arrive as fp32
# (the bf16 -> fp32 casts are differentiable, so the gradients flow back in the model's dtype).
for _device in ("cpu", "cuda"):
    torch.library.register_autocast("yolofast::bbox_loss", _device, torch.float32, lib=_lib)
    torch.library.register_autocast("yolofast::bbox_loss.rows", _device, torch.float32, lib=_lib)
    torch.library.register_autocast("yolofast::bbox_loss.l1", _device, torch.float32, lib=_lib)
    torch.library.register_autocast("yolofast::bbox_loss_maps", _device, torch.float32, lib=_lib)
