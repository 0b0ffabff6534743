"""YOLOv8 detection loss: task-aligned assignment + CIoU/DFL box loss + BCE class loss (DESIGN §2)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from yolofast.boxes import make_anchors, xywh2xyxy
from yolofast.ops import bbox_loss_maps, head_decode, tal_assign_maps
from yolofast.ops.bbox_loss import dense_target_scores


def _pad_targets(batch_idx, cls, bboxes, batch_size: int):
    from yolofast.data.collate import pad_targets

    return pad_targets(batch_idx, cls, bboxes, batch_size)


class LossStages(NamedTuple):
    """One ``DetectionLoss`` evaluation, stage by stage (``DetectionLoss.stages``; the doctor reads them).

    items (3,) ``[box*L_box, cls*L_cls, dfl*L_dfl]``, differentiable, no batch factor; the assigner's
    fg_mask (B, A) bool, target_gt_idx (B, A), target_labels (B, A) and target_score (B, A), each anchor's
    one non-zero target score (``target_scores`` builds the (B, A, nc) one-hot of them); its inputs: the
    padded targets gt_cls (B, M, 1), gt_xyxy (B, M, 4) pixels, gt_mask (B, M, 1), the decoded pd_bboxes
    (B, A, 4) pixels and the anchor centres anc_px (A, 2) pixels; img_wh the image size in pixels; nc the
    classes.
    """

    items: torch.Tensor
    fg_mask: torch.Tensor
    target_gt_idx: torch.Tensor
    target_labels: torch.Tensor
    target_score: torch.Tensor
    gt_cls: torch.Tensor
    gt_xyxy: torch.Tensor
    gt_mask: torch.Tensor
    pd_bboxes: torch.Tensor
    anc_px: torch.Tensor
    img_wh: tuple[float, float]
    nc: int

    @property
    def target_scores(self) -> torch.Tensor:
        """(B, A, nc) target scores, as the reference assigner returns them (built here: the loss never
        needs the zeros)."""
        return dense_target_scores(self.target_score, self.target_labels, self.nc)


class DetectionLoss:
    """``loss(feats, batch) -> (total, items)`` for the raw maps of a YOLOv8 Detect head.

    feats: list of (B, 4*reg_max + nc, H_i, W_i) maps, one per stride, box channels first.
    batch: dict with ``gt_cls`` (B, M, 1), ``gt_bboxes`` (B, M, 4) normalized xywh and ``gt_mask`` (B, M, 1),
    or, when those are missing, ``batch_idx``/``cls``/``bboxes`` that are padded here.
    Returns total (0-d float32, ``(box*L_box + cls*L_cls + dfl*L_dfl) * B``, the quantity to backprop)
    and items (3,) detached float32 ``[box*L_box, cls*L_cls, dfl*L_dfl]`` (no batch factor, for logging).
    Everything runs in float32, also under autocast.
    class_weights: optional (nc,) per-class weights on the BCE class loss (``cls_pw``, see
    ``yolofast.engine.class_weights``); then the class term comes from PyTorch's BCE over the same logits
    (the fused kernels have no per-class weight) and the box/DFL terms stay fused.
    """

    def __init__(
        self,
        nc: int,
        reg_max: int = 16,
        strides=(8, 16, 32),
        box: float = 7.5,
        cls: float = 0.5,
        dfl: float = 1.5,
        topk: int = 10,
        alpha: float = 0.5,
        beta: float = 6.0,
        class_weights: torch.Tensor | None = None,
    ):
        self.nc, self.reg_max = int(nc), int(reg_max)
        self.no = 4 * self.reg_max + self.nc
        self.strides = tuple(float(s) for s in strides)
        self.gains = (float(box), float(cls), float(dfl))
        self.topk, self.alpha, self.beta = int(topk), float(alpha), float(beta)
        self._anchor_cache: dict = {}
        self.class_weights = (None if class_weights is None
                              else torch.as_tensor(class_weights, dtype=torch.float32))
        if self.class_weights is not None and self.class_weights.shape != (self.nc,):
            raise ValueError(f"DetectionLoss: class_weights has shape {tuple(self.class_weights.shape)}, "
                             f"expected ({self.nc},)")

    def _targets(self, batch: dict, bsz: int, device: torch.device):
        if all(k in batch for k in ("gt_cls", "gt_bboxes", "gt_mask")):
            gt_cls, gt_bboxes, gt_mask = batch["gt_cls"], batch["gt_bboxes"], batch["gt_mask"]
        elif all(k in batch for k in ("batch_idx", "cls", "bboxes")):
            gt_cls, gt_bboxes, gt_mask = _pad_targets(batch["batch_idx"], batch["cls"], batch["bboxes"], bsz)
        else:
            raise KeyError(
                "DetectionLoss: the batch needs gt_cls/gt_bboxes/gt_mask (padded targets) or "
                f"batch_idx/cls/bboxes; it has keys {sorted(batch)}"
            )
        as_f32 = {"device": device, "dtype": torch.float32, "non_blocking": True}
        return gt_cls.to(**as_f32), gt_bboxes.to(**as_f32), gt_mask.to(**as_f32)

    def _anchors(self, feats):
        """(anchor_points (A,2) grid units, stride_tensor (A,1), anchor centres in pixels (A,2), image-size
        scale (4,), gains (3,)), cached per feature sizes/device/dtype: rebuilding them costs ~20 small ops
        per step."""
        compiling = torch.compiler.is_compiling()
        key = None
        if not compiling:  # (dynamo cannot trace is_inference_mode_enabled; a compiled loss is not cached)
            # Inference mode is in the key: tensors made under validation's inference_mode cannot be saved
            # for backward, and a train step at a size validation saw first (multi_scale, rect) reused them.
            key = (tuple(f.shape[2:] for f in feats), feats[0].device, feats[0].dtype,
                   torch.is_inference_mode_enabled())
            hit = self._anchor_cache.get(key)
            if hit is not None:
                return hit
        anchor_points, stride_tensor = make_anchors(feats, self.strides, 0.5)
        # Image size (normalized GT -> pixels) and the loss gains as device tensors made here, once: a
        # new_tensor per step is a host->device copy, which CUDA-graph capture refuses (and which waits
        # for the queued GPU work in eager mode).
        img_h, img_w = feats[0].shape[2] * self.strides[0], feats[0].shape[3] * self.strides[0]
        scale = anchor_points.new_tensor([img_w, img_h, img_w, img_h])
        gains = anchor_points.new_tensor(self.gains)
        out = (anchor_points, stride_tensor, anchor_points * stride_tensor, scale, gains)
        if not compiling:
            self._anchor_cache[key] = out
        return out

    def __call__(self, feats, batch: dict):
        st = self.stages(feats, batch)
        return st.items.sum() * feats[0].shape[0], st.items.detach()

    def stages(self, feats, batch: dict) -> LossStages:
        """The loss of ``__call__`` with what led to it: targets, decoded boxes, the assigner's outputs."""
        if len(feats) != len(self.strides):
            raise ValueError(f"DetectionLoss: got {len(feats)} feature maps for strides {self.strides}")
        feats = [f.float() for f in feats]
        bsz, ch = feats[0].shape[:2]
        if ch != self.no:
            raise ValueError(
                f"DetectionLoss: feature maps have {ch} channels, expected 4*reg_max + nc = {self.no} "
                f"(reg_max={self.reg_max}, nc={self.nc}); build the loss with the model's nc"
            )
        # The maps go to the ops as they are: on the CPU default (C++) the box decode, the assigner (which
        # takes the sigmoid of a candidate's class logit only) and the fused loss read them in place, and
        # the loss's gradients come back in the maps' layout (in the b8/640/50-GT step the cat into
        # (B, A, .) and back in backward was 27 ms of 110; the sigmoid of all B*A*C scores for the
        # assigner ~7 ms of the b16/320 step on AVX2). Other backends cat inside the wrappers.
        anchor_points, stride_tensor, anc_px, scale, gains = self._anchors(feats)
        gt_cls, gt_bboxes, gt_mask = self._targets(batch, bsz, feats[0].device)
        gt_xyxy = xywh2xyxy(gt_bboxes * scale)

        with torch.no_grad():
            _, pd_bboxes = head_decode(feats, self.strides, self.reg_max, scores=False)
            # Per-anchor scores (B, A): the (B, A, nc) one-hot of them is ~99 % zeros that the assigner
            # would write and the loss read again (10.7 MB at b16/320).
            labels, target_bboxes, score, fg_mask, gt_idx = tal_assign_maps(
                feats, pd_bboxes, anc_px, gt_cls, gt_xyxy, gt_mask, self.topk, self.alpha, self.beta,
                reg_max=self.reg_max, dense_scores=False,
            )
        # The gradient __call__'s total brings to the three losses is gains x batch: the loss can then
        # write the final map gradients in its forward pass (when the weights are all non-zero: the
        # backward rescales from them for any other gradient).
        weights = gains * bsz if self.class_weights is None and all(self.gains) else None
        losses = bbox_loss_maps(
            feats, anchor_points, target_bboxes / stride_tensor, score, fg_mask, self.reg_max, labels, weights
        )
        if self.class_weights is not None:
            lcls = self._weighted_cls(feats, dense_target_scores(score, labels, self.nc))
            losses = torch.stack((losses[0], lcls, losses[2]))  # the fused class term gets no gradient
        return LossStages(losses * gains, fg_mask, gt_idx, labels, score, gt_cls, gt_xyxy, gt_mask, pd_bboxes,
                          anc_px, (feats[0].shape[3] * self.strides[0], feats[0].shape[2] * self.strides[0]),
                          self.nc)

    def _weighted_cls(self, feats, target_scores):
        """sum_c w_c * BCE(logits, target_scores) / max(sum target_scores, 1): the fused L_cls, weighted."""
        nc = self.nc
        logits = torch.cat([f[:, -nc:].flatten(2) for f in feats], 2).transpose(1, 2)  # (B, A, nc)
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, target_scores, reduction="none")
        w = self.class_weights.to(logits.device)
        return (bce * w).sum() / target_scores.sum().clamp(min=1)
