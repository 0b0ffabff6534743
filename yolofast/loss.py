"""YOLOv8 detection loss: task-aligned assignment + CIoU/DFL box loss + BCE class loss (DESIGN §2)."""

from __future__ import annotations

import torch

from yolofast.boxes import make_anchors, xywh2xyxy
from yolofast.ops import bbox_loss_maps, head_decode, tal_assign


def _pad_targets(batch_idx, cls, bboxes, batch_size: int):
    from yolofast.data.collate import pad_targets

    return pad_targets(batch_idx, cls, bboxes, batch_size)


class DetectionLoss:
    """``loss(feats, batch) -> (total, items)`` for the raw maps of a YOLOv8 Detect head.

    feats: list of (B, 4*reg_max + nc, H_i, W_i) maps, one per stride, box channels first.
    batch: dict with ``gt_cls`` (B, M, 1), ``gt_bboxes`` (B, M, 4) normalized xywh and ``gt_mask`` (B, M, 1),
    or, when those are missing, ``batch_idx``/``cls``/``bboxes`` that are padded here.
    Returns total (0-d float32, ``(box*L_box + cls*L_cls + dfl*L_dfl) * B``, the quantity to backprop)
    and items (3,) detached float32 ``[box*L_box, cls*L_cls, dfl*L_dfl]`` (no batch factor, for logging).
    Everything runs in float32, also under autocast.
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
    ):
        self.nc, self.reg_max = int(nc), int(reg_max)
        self.no = 4 * self.reg_max + self.nc
        self.strides = tuple(float(s) for s in strides)
        self.gains = (float(box), float(cls), float(dfl))
        self.topk, self.alpha, self.beta = int(topk), float(alpha), float(beta)
        self._anchor_cache: dict = {}

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
        key = (tuple(f.shape[2:] for f in feats), feats[0].device, feats[0].dtype)
        hit = None if torch.compiler.is_compiling() else self._anchor_cache.get(key)
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
        if not torch.compiler.is_compiling():
            self._anchor_cache[key] = out
        return out

    def __call__(self, feats, batch: dict):
        if len(feats) != len(self.strides):
            raise ValueError(f"DetectionLoss: got {len(feats)} feature maps for strides {self.strides}")
        feats = [f.float() for f in feats]
        bsz, ch = feats[0].shape[:2]
        if ch != self.no:
            raise ValueError(
                f"DetectionLoss: feature maps have {ch} channels, expected 4*reg_max + nc = {self.no} "
                f"(reg_max={self.reg_max}, nc={self.nc}); build the loss with the model's nc"
            )
        # The maps go to the ops as they are: on the CPU default (C++) the decode + sigmoid for the
        # assigner and the fused loss read them in place, and the loss's gradients come back in the maps'
        # layout (in the b8/640/50-GT step the cat into (B, A, .) and back in backward was 27 ms of 110).
        # Other backends get one cat per map inside the wrappers (bbox_loss.maps_to_rows).
        anchor_points, stride_tensor, anc_px, scale, gains = self._anchors(feats)
        gt_cls, gt_bboxes, gt_mask = self._targets(batch, bsz, feats[0].device)
        gt_xyxy = xywh2xyxy(gt_bboxes * scale)

        with torch.no_grad():
            pd_scores, pd_bboxes = head_decode(feats, self.strides, self.reg_max)
            _, target_bboxes, target_scores, fg_mask, _ = tal_assign(
                pd_scores,
                pd_bboxes,
                anc_px,
                gt_cls,
                gt_xyxy,
                gt_mask,
                self.topk,
                self.alpha,
                self.beta,
            )
        losses = bbox_loss_maps(
            feats, anchor_points, target_bboxes / stride_tensor, target_scores, fg_mask, self.reg_max
        )
        items = losses * gains
        return items.sum() * bsz, items.detach()
