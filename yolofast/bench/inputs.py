"""Realistic random inputs for a benchmark preset, the same for a given seed on every machine and device.

Why not plain ``randn``: the fused assigner only visits the anchors inside each GT box and the loss only
works on the foreground, so their cost depends on the scene. Random boxes of one size with random
predictions would time an unrealistic case (almost no foreground, no conflicts). Here:
- GT boxes have log-uniform sides from 4 px (smaller than a stride-8 cell, so the 16 px widening of the
  candidate test is exercised) up to ``4 * imgsz / sqrt(n_gt)`` (a crowd of 1000 boxes at 640 px is at
  most ~80 px, a scene of 50 up to ~360 px), aspect ratios 1/3..3, centres anywhere (border boxes clipped).
- Predictions are near the GTs: every anchor inside a GT regresses that GT's box (the smallest one that
  contains it) with ~20 % log-normal jitter per side, and scores its class around sigmoid(-1); anchors
  outside every GT predict small random boxes and background scores around sigmoid(-6).
All random numbers come from one CPU ``torch.Generator`` seeded with ``seed`` and are moved to the target
device afterwards, so CPU and CUDA runs of a preset see the same values.
"""

from __future__ import annotations

import dataclasses
import math
from functools import cached_property

import torch

from yolofast.bench.presets import Preset, get_preset

__all__ = [
    "EmaInputs",
    "LossInputs",
    "StepInputs",
    "anchor_grid",
    "ema_inputs",
    "loss_inputs",
    "make_gt",
    "step_inputs",
]

STRIDES = (8, 16, 32)
REG_MAX = 16
MIN_SIDE = 4.0  # px
JITTER = 0.2  # log-normal sigma of a predicted side around its GT side
DFL_SHARPNESS = 2.0  # logit drop per bin away from the target distance


def _preset(p) -> Preset:
    return get_preset(p) if isinstance(p, str) else p


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def anchor_grid(imgsz: int, strides=STRIDES) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """(anchor_points (A, 2) in grid units, stride_tensor (A, 1), [(H_i, W_i)]) of a square image,
    levels in stride order, row-major within a level (the order of ``yolofast.boxes.make_anchors``)."""
    from yolofast.boxes import make_anchors

    shapes = [(imgsz // s, imgsz // s) for s in strides]
    feats = [torch.empty(1, 1, h, w) for h, w in shapes]
    anc, st = make_anchors(feats, strides, 0.5)
    return anc, st, shapes


def make_gt(batch: int, imgsz: int, nc: int, n_gt: int, gen: torch.Generator):
    """``n_gt`` real GTs per image padded to M = 16*ceil(n_gt/16) rows (the collate's bucket).

    Returns gt_labels (B, M, 1) float32, gt_bboxes (B, M, 4) float32 xyxy pixels, mask_gt (B, M, 1)
    float32 (1 for the first n_gt rows, 0 for padding, whose boxes are zero like the collate's).
    """
    m = 16 * max(-(-n_gt // 16), 1)
    labels = torch.zeros(batch, m, 1)
    boxes = torch.zeros(batch, m, 4)
    mask = torch.zeros(batch, m, 1)
    if n_gt:
        n = batch * n_gt
        smax = min(0.8 * imgsz, max(32.0, 4.0 * imgsz / math.sqrt(n_gt)))
        side = torch.exp(torch.empty(n).uniform_(math.log(MIN_SIDE), math.log(smax), generator=gen))
        ar = torch.exp(torch.empty(n).uniform_(math.log(1 / 3), math.log(3), generator=gen)).sqrt()
        w, h = side * ar, side / ar
        cx = torch.empty(n).uniform_(0, imgsz, generator=gen)
        cy = torch.empty(n).uniform_(0, imgsz, generator=gen)
        xyxy = torch.stack((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2), -1).clamp(0, imgsz)
        # A box whose centre sits on the border keeps >= 1 px after clipping (a degenerate box is an edge
        # case for the tests, not a realistic benchmark input).
        xyxy[:, 2:] = torch.maximum(xyxy[:, 2:], xyxy[:, :2] + 1)
        boxes[:, :n_gt] = xyxy.view(batch, n_gt, 4)
        labels[:, :n_gt, 0] = torch.randint(0, nc, (batch, n_gt), generator=gen).float()
        mask[:, :n_gt] = 1
    return labels, boxes, mask


def _owner(anc_px: torch.Tensor, boxes: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, A) index of the smallest real GT whose box contains each anchor centre, -1 for none.

    Chunked over GTs (<= 2**24 anchor-GT pairs at a time), so a 3000-GT 1024 px scene needs ~100 MB.
    """
    B, M, _ = boxes.shape
    A = anc_px.shape[0]
    best_area = torch.full((B, A), math.inf, device=boxes.device)
    owner = torch.full((B, A), -1, dtype=torch.long, device=boxes.device)
    ax, ay = anc_px[:, 0], anc_px[:, 1]
    step = max(1, (1 << 24) // max(A * B, 1))
    for g0 in range(0, M, step):
        bx = boxes[:, g0 : g0 + step]  # (B, m, 4)
        inside = (
            (ax > bx[..., 0:1]) & (ay > bx[..., 1:2]) & (ax < bx[..., 2:3]) & (ay < bx[..., 3:4])
            & (mask[:, g0 : g0 + step] > 0)
        )
        area = (bx[..., 2] - bx[..., 0]) * (bx[..., 3] - bx[..., 1])  # (B, m)
        area = torch.where(inside, area[..., None], math.inf)  # (B, m, A)
        a_min, i_min = area.min(1)  # first minimum on ties: the lower GT index
        better = a_min < best_area
        best_area = torch.where(better, a_min, best_area)
        owner = torch.where(better, i_min + g0, owner)
    return owner


@dataclasses.dataclass
class LossInputs:
    """Head outputs and padded targets of one preset (all float32, on ``device``)."""

    pred_dist: torch.Tensor  # (B, A, 4*reg_max) DFL logits
    pred_scores: torch.Tensor  # (B, A, C) class logits
    anchor_points: torch.Tensor  # (A, 2) grid units
    stride_tensor: torch.Tensor  # (A, 1)
    gt_labels: torch.Tensor  # (B, M, 1)
    gt_bboxes: torch.Tensor  # (B, M, 4) xyxy pixels
    mask_gt: torch.Tensor  # (B, M, 1)
    imgsz: int
    level_shapes: list

    def assign_args(self) -> tuple:
        """Positional inputs of ``tal_assign`` as DetectionLoss builds them (scores sigmoid, boxes in px)."""
        from yolofast.ops.reference import bbox_decode

        pd_bboxes = bbox_decode(self.pred_dist, self.anchor_points) * self.stride_tensor
        return (
            self.pred_scores.sigmoid(),
            pd_bboxes,
            self.anchor_points * self.stride_tensor,
            self.gt_labels,
            self.gt_bboxes,
            self.mask_gt,
        )

    @cached_property
    def assigned(self) -> tuple:
        """The reference assigner's outputs on these inputs (computed once, shared by every backend)."""
        from yolofast.ops.reference import tal_assign_ref

        return tal_assign_ref(*self.assign_args())

    def loss_args(self) -> tuple:
        """Positional inputs of ``bbox_loss``: targets in grid units from the reference assignment."""
        _, target_bboxes, target_scores, fg_mask, _ = self.assigned
        return (
            self.pred_dist,
            self.pred_scores,
            self.anchor_points,
            target_bboxes / self.stride_tensor,
            target_scores,
            fg_mask,
        )

    def feats(self) -> list[torch.Tensor]:
        """The three raw head maps (B, 4*reg_max + C, H_i, W_i) that hold these predictions."""
        pred = torch.cat((self.pred_dist, self.pred_scores), -1).transpose(1, 2)  # (B, no, A)
        out, a0 = [], 0
        for h, w in self.level_shapes:
            out.append(pred[..., a0 : a0 + h * w].reshape(pred.shape[0], pred.shape[1], h, w).contiguous())
            a0 += h * w
        return out

    def batch(self) -> dict:
        """The padded-target keys of a data batch (normalized xywh), as ``DetectionLoss`` reads them."""
        return targets_batch(self.gt_labels, self.gt_bboxes, self.mask_gt, self.imgsz)


def targets_batch(gt_labels, gt_bboxes, mask_gt, imgsz: int) -> dict:
    from yolofast.boxes import xyxy2xywh

    return {"gt_cls": gt_labels, "gt_bboxes": xyxy2xywh(gt_bboxes) / imgsz, "gt_mask": mask_gt}


def loss_inputs(preset, seed: int = 0, device="cpu") -> LossInputs:
    """Inputs of a ``loss``/``assign`` preset (name or Preset); deterministic in ``seed``."""
    p = _preset(preset)
    gen = _gen(seed)
    B, C = p.batch, p.nc
    anc, st, shapes = anchor_grid(p.imgsz)
    A = anc.shape[0]
    labels, boxes, mask = make_gt(B, p.imgsz, C, p.n_gt, gen)
    anc_px = anc * st
    owner = _owner(anc_px, boxes, mask)  # (B, A)
    has = owner >= 0
    own_box = boxes.gather(1, owner.clamp(min=0)[..., None].expand(B, A, 4))
    ltrb_gt = torch.cat((anc_px - own_box[..., :2], own_box[..., 2:] - anc_px), -1)  # px, > 0 inside
    jitter = torch.exp(torch.randn(B, A, 4, generator=gen) * JITTER)
    ltrb_bg = torch.empty(B, A, 4).uniform_(0.5, 3.0, generator=gen) * st
    ltrb = torch.where(has[..., None], ltrb_gt * jitter, ltrb_bg) / st  # grid units
    t = ltrb.clamp(0.01, REG_MAX - 1 - 0.01)
    bins = torch.arange(REG_MAX, dtype=torch.float32)
    pred_dist = -(bins - t[..., None]).abs() * DFL_SHARPNESS
    pred_dist = (pred_dist + 0.3 * torch.randn(B, A, 4, REG_MAX, generator=gen)).reshape(B, A, 4 * REG_MAX)

    pred_scores = torch.randn(B, A, C, generator=gen) - 6.0
    own_label = labels[..., 0].gather(1, owner.clamp(min=0)).long()  # (B, A)
    fg_logit = torch.randn(B, A, generator=gen) * 1.5 - 1.0
    cur = pred_scores.gather(2, own_label[..., None])[..., 0]
    pred_scores.scatter_(2, own_label[..., None], torch.where(has, fg_logit, cur)[..., None])

    dev = torch.device(device)
    return LossInputs(
        pred_dist.to(dev), pred_scores.to(dev), anc.to(dev), st.to(dev),
        labels.to(dev), boxes.to(dev), mask.to(dev), p.imgsz, shapes,
    )


@dataclasses.dataclass
class EmaInputs:
    """A model's floating state twice: as per-tensor lists (for ``torch._foreach_lerp_``) and flat."""

    ema_list: list  # separate tensors, one per parameter/buffer, like a real model's
    model_list: list
    ema_flat: torch.Tensor  # (N,) the same values, contiguous (what ModelEMA keeps)
    model_flat: torch.Tensor
    decay: float = 0.9998

    @property
    def numel(self) -> int:
        return self.ema_flat.numel()


def _state_shapes(model: str) -> list[tuple[int, ...]]:
    if model == "tiny":
        return [(16, 3, 3, 3), (16,), (16,)]
    from yolofast.nn import build_model

    m = build_model(model, nc=80)
    return [tuple(t.shape) for t in [*m.parameters(), *m.buffers()] if t.is_floating_point()]


def ema_inputs(preset, seed: int = 0, device="cpu") -> EmaInputs:
    """The floating state of the preset's model (yolov8s: 11.2 M values), random but deterministic."""
    p = _preset(preset)
    gen = _gen(seed)
    shapes = _state_shapes(p.model)
    n = sum(math.prod(s) for s in shapes)
    ema_flat = torch.randn(n, generator=gen)
    model_flat = ema_flat + 0.01 * torch.randn(n, generator=gen)
    dev = torch.device(device)
    ema_flat, model_flat = ema_flat.to(dev), model_flat.to(dev)
    ema_list, model_list, o = [], [], 0
    for s in shapes:
        k = math.prod(s)
        ema_list.append(ema_flat[o : o + k].view(s).clone())
        model_list.append(model_flat[o : o + k].view(s).clone())
        o += k
    return EmaInputs(ema_list, model_list, ema_flat, model_flat)


@dataclasses.dataclass
class StepInputs:
    """One training batch: images (B, 3, H, W) float in [0, 1] and the padded targets of the data contract."""

    img: torch.Tensor
    batch: dict


def step_inputs(preset, seed: int = 0, device="cpu") -> StepInputs:
    p = _preset(preset)
    gen = _gen(seed)
    img = torch.rand(p.batch, 3, p.imgsz, p.imgsz, generator=gen)
    labels, boxes, mask = make_gt(p.batch, p.imgsz, p.nc, p.n_gt, gen)
    dev = torch.device(device)
    batch = {k: v.to(dev) for k, v in targets_batch(labels, boxes, mask, p.imgsz).items()}
    return StepInputs(img.to(dev), batch)
