"""Public ``bbox_loss``: CIoU + DFL (or, for reg_max 1, L1) + BCE losses, dispatched to the selected backend
(see _backend.py).

``bbox_loss`` takes (B, A, .) tensors; ``bbox_loss_maps`` takes the Detect head's per-level maps as they
are: the C++ kernel reads them in place and returns gradients in their layout, and so do the CUDA and
Triton kernels for reg_max 1 (YOLO26); the other cases get the (B, A, .) tensors built by one cat per map
(``maps_to_rows``, in _composed.py).
"""

from __future__ import annotations

import torch

from yolofast.ops._backend import backend_name, implementation
from yolofast.ops._composed import dense_target_scores, maps_to_rows

__all__ = ["bbox_loss", "bbox_loss_maps", "dense_target_scores", "maps_to_rows"]

# Backends whose (B, A, .) bbox_loss kernels implement reg_max 1 (YOLO26: raw distances, the L1 term instead
# of DFL, YOLO11_YOLO26.md §4.2): CUDA (yolofast::bbox_loss.l1) and Triton (bbox_loss_l1_triton), the CIoU,
# L1 and BCE gradients computed in the forward pass. The C++ backend implements it in the maps form only
# (below), so a (B, A, .) reg_max 1 call there runs the reference: a rule of this op, tested, not a
# fallback (``reg_max_backend``). A kernel that implements it adds its backend's name here.
REG_MAX1_BACKENDS = frozenset({"ref", "cuda", "triton"})
# The same for the maps form (bbox_loss_maps, what the loss calls): every backend, each reading reg_max 1 maps
# in place (no cat; the gradients written in the maps' layout): C++ and CUDA yolofast::bbox_loss_maps, Triton
# bbox_loss_maps_triton (kernels/_bbox_loss_maps.py). DFL maps: C++ in place, CUDA/Triton one cat per map.
REG_MAX1_MAPS_BACKENDS = frozenset({"ref", "cpp", "cuda", "triton"})


def reg_max_backend(name: str, reg_max: int) -> str:
    """The backend that runs a bbox_loss call: ``name`` (the selected one) unless reg_max is 1 and
    ``name``'s kernel does not implement it; then "ref"."""
    return "ref" if int(reg_max) == 1 and name not in REG_MAX1_BACKENDS else name


def bbox_loss(
    pred_dist: torch.Tensor,
    pred_scores: torch.Tensor,
    anchor_points: torch.Tensor,
    target_bboxes: torch.Tensor,
    target_scores: torch.Tensor,
    fg_mask: torch.Tensor,
    stride_tensor: torch.Tensor | None = None,
    img_hw: tuple[float, float] | None = None,
) -> torch.Tensor:
    """(3,) float32 [L_box, L_cls, L_dfl] (DESIGN §2.2), differentiable w.r.t. pred_dist and pred_scores.

    Shapes and semantics in ``reference.bbox_loss_ref``; targets are in grid units (pixels / stride).
    reg_max 1 (pred_dist (B, A, 4)): [L_box, L_cls, L_l1], with stride_tensor (A, 1) and img_hw (H, W)
    required; it runs where ``reg_max_backend`` says.
    """
    reg_max = pred_dist.shape[-1] // 4
    name = reg_max_backend(backend_name("bbox_loss", pred_dist.device.type), reg_max)
    extra = {"stride_tensor": stride_tensor, "img_hw": img_hw} if reg_max == 1 else {}
    impl = implementation("bbox_loss", name)
    return impl(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask, **extra)


def bbox_loss_maps(
    feats,
    anchor_points: torch.Tensor,
    target_bboxes: torch.Tensor,
    target_scores: torch.Tensor,
    fg_mask: torch.Tensor,
    reg_max: int = 16,
    target_labels: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    strides=None,
) -> torch.Tensor:
    """``bbox_loss`` of the head's maps: feats a list of (B, 4*reg_max + nc, H_i, W_i) logits, anchors level
    by level (pixel h*W_i + w); the other arguments as in ``bbox_loss`` with A = sum H_i*W_i.
    target_scores may also be (B, A), one score per anchor of class ``target_labels.clamp(0, nc - 1)``
    (``tal_assign_maps(..., dense_scores=False)``). weights (3,), optional: the gradient the caller's backward
    will bring to the three losses (DetectionLoss: its gains x batch size); the C++ backend then computes the
    final map gradients in the forward pass, and its backward has nothing left to write. Values are the same.

    Returns (3,) [L_box, L_cls, L_dfl], differentiable w.r.t. every map. The C++ backend reads the maps in
    place (no cat, no transpose, the gradients written in the maps' layout), CUDA and Triton too for reg_max
    1; otherwise they cat first.
    reg_max 1: [L_box, L_cls, L_l1] (``reference.bbox_loss_ref``); strides (one per map, pixels) are then
    required, the image size is that of the first map times its stride; it runs on the selected backend
    if that is in ``REG_MAX1_MAPS_BACKENDS``, else on the reference.
    """
    name = backend_name("bbox_loss", feats[0].device.type)
    if int(reg_max) == 1 and name not in REG_MAX1_MAPS_BACKENDS:
        name = "ref"
    extra = _l1_geometry(feats, strides) if int(reg_max) == 1 else {}
    impl = implementation("bbox_loss.maps", name, reg_max)
    return impl(feats, anchor_points, target_bboxes, target_scores, fg_mask, reg_max, target_labels, weights,
                **extra)


def _l1_geometry(feats, strides) -> dict:
    """The reg_max 1 L1 term's geometry from the maps: stride_tensor (A, 1) and img_hw (H, W) of the batch
    image for the (B, A, .) forms, and l1_scale (each map's stride, H, W; Python floats, so a CUDA kernel
    reads them without a device-to-host copy) for the kernels that read the maps in place."""
    if strides is None or len(strides) != len(feats):
        raise ValueError(f"bbox_loss_maps: reg_max 1 needs strides, one per map ({len(feats)} maps), "
                         f"to normalise the L1 distances; got {strides!r}")
    from yolofast.boxes import make_anchors

    stride_tensor = make_anchors(feats, strides, 0.5)[1]
    s0 = float(strides[0])
    img_hw = (feats[0].shape[2] * s0, feats[0].shape[3] * s0)
    return {"stride_tensor": stride_tensor, "img_hw": img_hw, "l1_scale": (*map(float, strides), *img_hw)}
