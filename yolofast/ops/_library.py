"""The compiled ops as Python callables, for the "cpp" and "cuda" backends (``_backend.implementation``).

Each loads the compiled extension on first use (``_build.py``; the schemas come from ``_schemas.py``) and
calls its ``torch.ops.yolofast`` op; the op list, shapes and semantics are in ``_schemas.py``. Variants of
one op are separate callables here (``bbox_loss_rows`` on the CPU, ``bbox_loss`` on CUDA, ``*_maps``,
``ema_update_multi``, ``head_decode_boxes``); which one runs is ``_backend.py``'s choice, not a test here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from yolofast.kernels._bbox_loss_grad import eager as _eager
from yolofast.ops import _build, _schemas  # noqa: F401 - _schemas: the ops must be defined before loading


# ------------------------------------------------------------------------------------------ python callables
def _ensure_loaded() -> None:
    # A plain global test, so torch.compile folds it (guarded) instead of tracing the loader.
    if not _build.LOADED:
        report = _build.load_extension()
        if not report.ok:
            raise RuntimeError(f"yolofast compiled ops are unavailable: {report.reason}")


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
    """Compiled ``tal_assign``; same signature and outputs as ``reference.tal_assign_ref``."""
    _ensure_loaded()
    return torch.ops.yolofast.tal_assign(
        pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, int(topk), float(alpha),
        float(beta), float(eps), int(topk2 or 0),
    )


def tal_assign_maps(
    feats: list[Tensor],
    pd_bboxes: Tensor,
    anc_points: Tensor,
    gt_labels: Tensor,
    gt_bboxes: Tensor,
    mask_gt: Tensor,
    topk: int = 10,
    alpha: float = 0.5,
    beta: float = 6.0,
    eps: float = 1e-9,
    reg_max: int = 16,
    dense_scores: bool = True,
    topk2: int | None = None,
):
    """Compiled ``tal_assign`` with the scores read from the head's class logits (sigmoid) in place;
    ``dense_scores=False``: target_scores (B, A), each anchor's one non-zero score (see the op above)."""
    _ensure_loaded()
    return torch.ops.yolofast.tal_assign.maps(
        [f.detach() for f in feats], int(reg_max), pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt,
        int(topk), float(alpha), float(beta), float(eps), bool(dense_scores), int(topk2 or 0),
    )


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
    """Compiled ``bbox_loss``: (3,) [L_box, L_cls, L_dfl] as ``reference.bbox_loss_ref``, differentiable
    w.r.t. pred_dist and pred_scores (the gradients are computed in the forward pass); the CUDA backend's.
    reg_max 1 (pred_dist (B, A, 4) raw distances): [L_box, L_cls, L_l1] by ``bbox_loss.l1``, with
    stride_tensor (A, 1) and img_hw (H, W) required."""
    _ensure_loaded()
    if pred_dist.dim() == 3 and pred_dist.shape[-1] == 4:
        if stride_tensor is None or img_hw is None:
            raise ValueError("bbox_loss: reg_max 1 (raw distances, L1 term) needs stride_tensor (A, 1) and "
                             "img_hw (H, W) of the batch image to normalise the distances")
        return torch.ops.yolofast.bbox_loss.l1(
            pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask, stride_tensor,
            float(img_hw[0]), float(img_hw[1]),
        )[0]
    return torch.ops.yolofast.bbox_loss(
        pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask
    )[0]


def bbox_loss_rows(
    pred_dist: Tensor,
    pred_scores: Tensor,
    anchor_points: Tensor,
    target_bboxes: Tensor,
    target_scores: Tensor,
    fg_mask: Tensor,
) -> Tensor:
    """``bbox_loss`` of the C++ backend: the same values, with the box and DFL gradients kept for the
    foreground anchors only (``bbox_loss.rows``; every anchor's row under tracing)."""
    _ensure_loaded()
    return torch.ops.yolofast.bbox_loss.rows(
        pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask, _eager()
    )[0]


def bbox_loss_maps(
    feats: list[Tensor],
    anchor_points: Tensor,
    target_bboxes: Tensor,
    target_scores: Tensor,
    fg_mask: Tensor,
    reg_max: int = 16,
    target_labels: Tensor | None = None,
    weights: Tensor | None = None,
    l1_scale=None,
    stride_tensor: Tensor | None = None,
    img_hw: tuple[float, float] | None = None,
) -> Tensor:
    """Compiled ``bbox_loss`` read from the head's maps in place: (3,) [L_box, L_cls, L_dfl], differentiable
    w.r.t. every map (the gradients, in the maps' layout, are computed in the forward pass). target_scores
    (B, A) per anchor with their classes in target_labels, or (B, A, C). weights (3,): the gradient the
    caller's backward will bring to the three losses; the forward then writes the final map gradients
    (used in eager mode with per-anchor targets; traced code keeps the general layout). reg_max 1 (raw
    distances, YOLO26): [L_box, L_cls, L_l1] with l1_scale (len(feats) + 2 floats, or such a float64 CPU
    tensor) = each map's stride and the batch image's (H, W), or built here from the torch forms' geometry
    (stride_tensor (A, 1), img_hw). On CUDA (reg_max 1 only) the forward keeps the general layout: weights
    are ignored (the final gradients would need S before the pass) and the rows are always the static ones."""
    _ensure_loaded()
    if l1_scale is None and stride_tensor is not None and img_hw is not None:
        l1_scale = _l1_scale(feats, stride_tensor, img_hw)
    elif l1_scale is not None and not isinstance(l1_scale, Tensor):
        l1_scale = _l1_scale_tensor(tuple(float(v) for v in l1_scale))
    eager = _eager()
    if not eager or target_scores.dim() != 2 or feats[0].device.type != "cpu":
        weights = None
    return torch.ops.yolofast.bbox_loss_maps(
        list(feats), anchor_points, target_bboxes, target_scores, fg_mask, int(reg_max), eager,
        target_labels, weights, l1_scale,
    )[0]


_L1_SCALES: dict[tuple, Tensor] = {}


def _l1_scale_tensor(values: tuple[float, ...]) -> Tensor:
    """The float64 CPU tensor of l1_scale's numbers, made once per geometry and kept: a step then makes no
    new tensor (a CUDA-graph capture allows none); the kernels only read it. Under torch.compile it is a
    constant of the graph instead."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.float64)
    if values not in _L1_SCALES:
        if len(_L1_SCALES) >= 256:  # image sizes of one run are a handful (rect batches: tens)
            _L1_SCALES.clear()
        _L1_SCALES[values] = torch.tensor(values, dtype=torch.float64)
    return _L1_SCALES[values]


def _l1_scale(feats: list[Tensor], stride_tensor: Tensor, img_hw) -> Tensor:
    """(len(feats) + 2,) float64: each map's stride (its first anchor's in stride_tensor), then (H, W)."""
    starts, a = [], 0
    for f in feats:
        starts.append(a)
        a += f.shape[2] * f.shape[3]
    strides = stride_tensor.reshape(-1)[starts].to(device="cpu", dtype=torch.float64)
    return torch.cat((strides, torch.tensor([float(img_hw[0]), float(img_hw[1])], dtype=torch.float64)))


def head_decode(feats: list[Tensor], strides, reg_max: int = 16) -> tuple[Tensor, Tensor]:
    """Compiled (pd_scores (B,A,C) sigmoid, pd_bboxes (B,A,4) xyxy pixels) from the head's maps; no grad."""
    _ensure_loaded()
    maps = [f.detach() for f in feats]
    return torch.ops.yolofast.head_decode(maps, [float(s) for s in strides], int(reg_max))


def head_decode_boxes(feats: list[Tensor], strides, reg_max: int = 16) -> Tensor:
    """Compiled pd_bboxes (B,A,4) xyxy pixels from the head's maps, without the scores; no grad."""
    _ensure_loaded()
    maps = [f.detach() for f in feats]
    return torch.ops.yolofast.head_decode.boxes(maps, [float(s) for s in strides], int(reg_max))


def bbox_vec_bits() -> int:
    """SIMD width in bits of the CPU loss kernels as built (512 AVX-512, 256 AVX2, 128 NEON, 0: none)."""
    _ensure_loaded()
    return torch.ops.yolofast._bbox_vec_bits(torch.empty(0))


def ema_update(ema: Tensor, model: Tensor, decay) -> None:
    """Compiled in-place ``ema = lerp(ema, model, 1 - decay)`` as ``reference.ema_update_ref``; decay a
    float or a 0-d tensor (read on the device, so no host sync is needed on CUDA)."""
    _ensure_loaded()
    if not isinstance(decay, Tensor):
        decay = torch.tensor(float(decay), dtype=torch.float64)
    torch.ops.yolofast.ema_update(ema, model, decay)


def ema_update_multi(ema: list[Tensor], model: list[Tensor], decay) -> None:
    """Compiled in-place EMA over lists of tensors (CPU): each floating pair as ``ema_update``, each
    integer pair copied, all in one parallel sweep that reads the model's tensors where they are."""
    _ensure_loaded()
    if not isinstance(decay, Tensor):
        decay = torch.tensor(float(decay), dtype=torch.float64)
    torch.ops.yolofast.ema_update.multi(list(ema), list(model), decay)


def ema_plan(ema: list[Tensor], model: list[Tensor], decay: float, tau: float):
    """Compiled ``ModelEMA`` step over fixed lists of CPU tensors (``torch.classes.yolofast.EmaPlan``):
    ``plan.step(updates)`` adds 1 to the int64 counter, forms d = decay*(1 - exp(-updates/tau)) and
    updates every pair as ``ema_update_multi``, in one call of one argument."""
    _ensure_loaded()
    return torch.classes.yolofast.EmaPlan(list(ema), list(model), float(decay), float(tau))


def simd_lanes() -> int:
    """Debug: floats per SIMD vector in the loaded CPU build (16 AVX-512, 8 AVX2, 4 NEON)."""
    _ensure_loaded()
    return torch.ops.yolofast._simd_lanes(torch.empty(0))


def threads_seen() -> int:
    """Debug: distinct threads that ran a chunk of any CPU kernel since the last call (resets the record)."""
    _ensure_loaded()
    return torch.ops.yolofast._threads_seen(torch.empty(0))


def ns_orthogonalize(mats: list[Tensor], steps: int = 5, eps: float = 1e-7,
                     fp32: bool = False) -> list[Tensor]:
    """Compiled Muon orthogonalisation of a list of matrices/conv weights (``_schemas.py``); each output as
    ``reference.ns_orthogonalize_ref(m.reshape(m.shape[0], -1))`` in m's shape."""
    _ensure_loaded()
    return torch.ops.yolofast.ns_orthogonalize(list(mats), int(steps), float(eps), bool(fp32))


def ns_orthogonalize_musgd(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor],
                           bufs_sgd: list[Tensor], counts: list[int], lr: list[float], momentum: list[float],
                           weight_decay: list[float], nesterov: list[bool], use_muon: list[bool], muon: float,
                           sgd: float, steps: int = 5, eps: float = 1e-7, fp32: bool = False) -> bool:
    """Compiled MuSGD step in place (CPU, ``_schemas.py``: ``ns_orthogonalize.musgd``): the tensors group
    after group, per-group hyperparameters; False (nothing touched) where a tensor does not fit it."""
    _ensure_loaded()
    return torch.ops.yolofast.ns_orthogonalize.musgd(
        params, grads, bufs, bufs_sgd, counts, lr, momentum, weight_decay, [int(bool(n)) for n in nesterov],
        [int(bool(u)) for u in use_muon], float(muon), float(sgd), int(steps), float(eps), bool(fp32))


def hsv_augment(img: Tensor, lut: Tensor, rgb: bool, step: int = 64) -> Tensor:
    """Compiled fused HSV augmentation (``_schemas.py``): BGR uint8 (..., 3) -> a new RGB (``rgb``) or BGR
    image, the same bytes as ``yolofast.data.augment.augment_hsv``'s OpenCV path with the tables ``lut``
    (``step``: OpenCV's pixels per vector step on this CPU)."""
    _ensure_loaded()
    return torch.ops.yolofast.hsv_augment(img, lut, bool(rgb), int(step))


def hsv_augment_(img: Tensor, lut: Tensor, rgb: bool, step: int = 64) -> Tensor:
    """``hsv_augment`` written over ``img`` (contiguous), which it returns."""
    _ensure_loaded()
    return torch.ops.yolofast.hsv_augment_(img, lut, bool(rgb), int(step))
