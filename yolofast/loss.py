"""YOLOv8 detection loss: task-aligned assignment + CIoU/DFL box loss + BCE class loss (DESIGN §2)."""

from __future__ import annotations

import torch

from yolofast.boxes import make_anchors, xywh2xyxy
from yolofast.ops import bbox_loss, tal_assign


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
        """(anchor_points (A,2) grid units, stride_tensor (A,1), pixel-space decode offsets (A,4) and signs
        (A,4), image-size scale (4,), gains (3,)), cached per feature sizes/device/dtype: rebuilding them
        costs ~20 small ops per step."""
        key = (tuple(f.shape[2:] for f in feats), feats[0].device, feats[0].dtype)
        hit = None if torch.compiler.is_compiling() else self._anchor_cache.get(key)
        if hit is not None:
            return hit
        anchor_points, stride_tensor = make_anchors(feats, self.strides, 0.5)
        anc_px = anchor_points * stride_tensor
        # (anc - lt, anc + rb) * s == anc*s + ltrb * (-s, -s, s, s): bit-identical for power-of-two strides
        # (8/16/32), fp32 rounding otherwise; one addcmul on (B, A, 4) instead of cat + mul.
        sign = anchor_points.new_tensor([-1.0, -1.0, 1.0, 1.0])
        # Image size (normalized GT -> pixels) and the loss gains as device tensors made here, once: a
        # new_tensor per step is a host->device copy, which CUDA-graph capture refuses (and which waits
        # for the queued GPU work in eager mode).
        img_h, img_w = feats[0].shape[2] * self.strides[0], feats[0].shape[3] * self.strides[0]
        scale = anchor_points.new_tensor([img_w, img_h, img_w, img_h])
        gains = anchor_points.new_tensor(self.gains)
        out = (anchor_points, stride_tensor, anc_px, anc_px.repeat(1, 2), sign * stride_tensor, scale, gains)
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
        # Split each map into box/class channels and cat the transposed views straight into (B, A, 4R) and
        # (B, A, nc): one copy each (a cat to (B, no, A) then two permute().contiguous() was ~40 ms at
        # b8/640 on one thread, this ~15 ms). The backward is then one cat per level into (B, no, H*W),
        # contiguous, which AccumulateGrad takes without the extra copy it needed before (~17 ms).
        dist_parts, score_parts = [], []
        for f in feats:
            d, s = f.flatten(2).split((4 * self.reg_max, self.nc), 1)
            dist_parts.append(d.transpose(1, 2))
            score_parts.append(s.transpose(1, 2))
        pred_dist = torch.cat(dist_parts, 1)  # (B, A, 4*reg_max)
        pred_scores = torch.cat(score_parts, 1)  # (B, A, nc)

        anchor_points, stride_tensor, anc_px, anc_px4, sign_stride, scale, gains = self._anchors(feats)
        gt_cls, gt_bboxes, gt_mask = self._targets(batch, bsz, pred_dist.device)
        gt_xyxy = xywh2xyxy(gt_bboxes * scale)

        with torch.no_grad():
            pd_bboxes = self._decode_px(pred_dist.detach(), anc_px4, sign_stride)
            _, target_bboxes, target_scores, fg_mask, _ = tal_assign(
                pred_scores.detach().sigmoid(),
                pd_bboxes,
                anc_px,
                gt_cls,
                gt_xyxy,
                gt_mask,
                self.topk,
                self.alpha,
                self.beta,
            )
        losses = bbox_loss(
            pred_dist, pred_scores, anchor_points, target_bboxes / stride_tensor, target_scores, fg_mask
        )
        items = losses * gains
        return items.sum() * bsz, items.detach()

    def _decode_px(self, pred_dist, anc_px4, sign_stride):
        """``reference.bbox_decode(pred_dist, anchors) * stride`` (pixels, xyxy) for the assigner, fp32.

        The DFL expectation is a matmul with the bin values instead of ``(prob * bins).sum(-1)``: that
        materialises a (B, A, 4, R) product (~17 MB at b8/640) and was ~3x slower; the two agree to fp32
        rounding. Autocast is off so the matmul stays fp32 (no gradient flows here).
        """
        prob = pred_dist.unflatten(-1, (4, self.reg_max)).softmax(-1)
        bins = torch.arange(self.reg_max, dtype=prob.dtype, device=prob.device)
        with torch.autocast(prob.device.type, enabled=False):
            ltrb = torch.matmul(prob, bins)  # (B, A, 4)
        return torch.addcmul(anc_px4, ltrb, sign_stride)
