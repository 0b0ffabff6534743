"""Detection losses: task-aligned assignment + CIoU box loss + DFL (or L1) + BCE class loss.

``DetectionLoss`` is the YOLOv8 and YOLO11 criterion (DESIGN §2; YOLO11_YOLO26.md §4.1) and one branch of
YOLO26's; ``E2EDetectionLoss`` is YOLO26's end-to-end criterion (YOLO11_YOLO26.md §4.4): the one-to-many
and one-to-one branches, each a ``DetectionLoss``, weighted by the epoch (``e2e_weights``). Both have
``set_epoch(epoch, epochs)``, which the trainer calls after each epoch's last batch and on resume.
"""

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


def head_maps(preds) -> list:
    """The per-level maps (B, 4*reg_max + nc, H_i, W_i) the losses take, from a head's training output:
    the list of maps itself, or an Ultralytics-style dict ``{"boxes": (B, 4*reg_max, A), "scores": (B, nc,
    A), "feats": [maps whose sizes give the levels]}`` (split along A level by level, one copy)."""
    if not isinstance(preds, dict):
        return list(preds)
    if "maps" in preds:  # yolofast's head keeps its per-level maps beside the flat views: no copy needed
        return list(preds["maps"])
    missing = {"boxes", "scores", "feats"} - set(preds)
    if missing:
        raise KeyError(f"head_maps: a head output dict needs boxes, scores and feats; "
                       f"missing {sorted(missing)}")
    boxes, scores = preds["boxes"], preds["scores"]
    sizes = [tuple(f.shape[2:]) for f in preds["feats"]]
    if sum(h * w for h, w in sizes) != boxes.shape[-1]:
        raise ValueError(f"head_maps: the feats' sizes {sizes} do not add up to the {boxes.shape[-1]} "
                         "anchors of boxes/scores")
    rows = torch.cat((boxes, scores), 1)
    return [r.unflatten(2, hw) for r, hw in zip(rows.split([h * w for h, w in sizes], 2), sizes)]


def fp32_preds(preds):
    """The head's training output with its maps in float32 for the loss (under autocast they come out in
    bf16/fp16): a list of maps, or an end-to-end head's dict of branches as it is (each branch's
    ``DetectionLoss`` takes its maps in float32 itself)."""
    return preds if isinstance(preds, dict) else [f.float() for f in preds]


def loss_names(reg_max: int) -> tuple[str, str, str]:
    """The logged item names: ``box_loss, cls_loss`` and ``dfl_loss`` (reg_max > 1) or ``l1_loss``."""
    return ("box_loss", "cls_loss", "l1_loss" if int(reg_max) == 1 else "dfl_loss")


class DetectionLoss:
    """``loss(feats, batch) -> (total, items)`` for the raw maps of a YOLOv8 / YOLO11 Detect head.

    feats: list of (B, 4*reg_max + nc, H_i, W_i) maps, one per stride, box channels first (or a head output
    dict, see ``head_maps``).
    batch: dict with ``gt_cls`` (B, M, 1), ``gt_bboxes`` (B, M, 4) normalized xywh and ``gt_mask`` (B, M, 1),
    or, when those are missing, ``batch_idx``/``cls``/``bboxes`` that are padded here.
    Returns total (0-d float32, ``(box*L_box + cls*L_cls + dfl*L_dfl) * B``, the quantity to backprop)
    and items (3,) detached float32 ``[box*L_box, cls*L_cls, dfl*L_dfl]`` (no batch factor, for logging).
    Everything runs in float32, also under autocast.
    class_weights: optional (nc,) per-class weights on the BCE class loss (``cls_pw``, see
    ``yolofast.engine.class_weights``); then the class term comes from PyTorch's BCE over the same logits
    (the fused kernels have no per-class weight) and the box/DFL terms stay fused.
    topk2: YOLO26's one-to-one second top-k (None: off). reg_max 1: raw distances, and the third term is
    the normalised L1 distance (``l1_loss``, gain ``dfl``) instead of DFL (YOLO11_YOLO26.md §4.2).
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
        topk2: int | None = None,
    ):
        self.nc, self.reg_max = int(nc), int(reg_max)
        self.topk2 = None if topk2 is None else int(topk2)
        self.names = loss_names(self.reg_max)
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

    def set_epoch(self, epoch: int, epochs: int | None = None) -> None:
        """Nothing to do: the v8/YOLO11 loss has no epoch schedule (the trainer may call it on any loss)."""

    def __call__(self, feats, batch: dict):
        st = self.stages(feats, batch)
        return st.items.sum() * st.fg_mask.shape[0], st.items.detach()

    def vector(self, feats, batch: dict):
        """(loss vector (3,) = items x B, differentiable; items (3,) detached): Ultralytics' convention."""
        st = self.stages(feats, batch)
        return st.items * st.fg_mask.shape[0], st.items.detach()

    def stages(self, feats, batch: dict, weight: float = 1.0) -> LossStages:
        """The loss of ``__call__`` with what led to it: targets, decoded boxes, the assigner's outputs.

        weight: the factor the caller applies to this loss before backward (YOLO26's branch weight); it only
        tells the fused kernel which gradient to prepare in its forward pass, values are the same.
        """
        feats = head_maps(feats)
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
        # assigner ~7 ms of the b16/320 step on AVX2). The CUDA and Triton losses read reg_max 1 maps in place
        # too; other forms cat inside the wrappers.
        anchor_points, stride_tensor, anc_px, scale, gains = self._anchors(feats)
        gt_cls, gt_bboxes, gt_mask = self._targets(batch, bsz, feats[0].device)
        gt_xyxy = xywh2xyxy(gt_bboxes * scale)

        with torch.no_grad():
            _, pd_bboxes = head_decode(feats, self.strides, self.reg_max, scores=False)
            # Per-anchor scores (B, A): the (B, A, nc) one-hot of them is ~99 % zeros that the assigner
            # would write and the loss read again (10.7 MB at b16/320).
            labels, target_bboxes, score, fg_mask, gt_idx = tal_assign_maps(
                feats, pd_bboxes, anc_px, gt_cls, gt_xyxy, gt_mask, self.topk, self.alpha, self.beta,
                reg_max=self.reg_max, dense_scores=False, topk2=self.topk2,
            )
        # The gradient __call__'s total brings to the three losses is gains x batch: the loss can then
        # write the final map gradients in its forward pass (when the weights are all non-zero: the
        # backward rescales from them for any other gradient).
        fused = self.class_weights is None and all(self.gains) and weight != 0
        weights = gains * (bsz * float(weight)) if fused else None
        losses = bbox_loss_maps(
            feats, anchor_points, target_bboxes / stride_tensor, score, fg_mask, self.reg_max, labels,
            weights, strides=self.strides,
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


# YOLO26's one-to-many weight falls linearly from 0.8 in epoch 0 to 0.1 in the last epoch (YOLO11_YOLO26.md
# §4.4); the one-to-one branch gets the rest.
_O2M_FIRST, _O2M_LAST = 0.8, 0.1


def e2e_weights(epoch: int, epochs: int) -> tuple[float, float]:
    """(w_o2m, w_o2o) in effect during 0-based ``epoch`` of ``epochs``, as Python floats (float64).

    w_o2m = 0.1 + 0.7 * max(0, 1 - epoch / max(epochs - 1, 1)), w_o2o = max(0, 1 - w_o2m). Evaluated as
    ``max(1 - e/max(E-1, 1), 0) * (0.8 - 0.1) + 0.1``: that order gives exactly 0.8 at epoch 0 (so w_o2o is
    0.19999999999999996) and Ultralytics' float64 values (0.4111111111111111 at epoch 5 of 10); the
    spelled-out sum would give 0.7999999999999999 at epoch 0.
    """
    frac = max(1 - int(epoch) / max(int(epochs) - 1, 1), 0)
    o2m = frac * (_O2M_FIRST - _O2M_LAST) + _O2M_LAST
    return o2m, max(0.0, 1 - o2m)


class E2EDetectionLoss:
    """YOLO26's end-to-end criterion (YOLO11_YOLO26.md §4.4): ``loss(preds, batch) -> (total, items)``.

    preds: ``{"one2many": maps, "one2one": maps}``, each branch's head output as ``DetectionLoss`` takes it
    (a list of per-level maps, or a head output dict, see ``head_maps``); the one-to-one maps come from
    detached features in the model, so that branch's loss trains its own head only.
    Each branch is a ``DetectionLoss`` assigning from its own (detached) predictions: one-to-many top-k 10,
    one-to-one top-k 7 then topk2 1; both alpha 0.5, beta 6 and the same gains. With V = that branch's items
    ``[box*L_box, cls*L_cls, dfl*L_l1]``:
        total = sum of the vector B * (w_o2m * V_o2m + w_o2o * V_o2o), the quantity to backprop;
        items = V_o2o detached (no weight, no batch factor), named ``names`` (box_loss, cls_loss, l1_loss).
    The weights follow ``e2e_weights(epoch, epochs)``. The epoch counter starts at 0; the trainer calls
    ``set_epoch(e + 1, epochs)`` right after epoch e's last batch (before the epoch-end callbacks, the EMA
    sync and validation), and ``set_epoch(start_epoch, epochs)`` when it resumes, so that resumed and
    uninterrupted runs agree. ``epochs`` is read at each ``set_epoch`` (time= runs re-estimate it).
    """

    def __init__(self, nc: int, reg_max: int = 1, strides=(8, 16, 32), box: float = 7.5, cls: float = 0.5,
                 dfl: float = 1.5, epochs: int = 100, class_weights: torch.Tensor | None = None,
                 topk: int = 10, topk_o2o: int = 7, topk2_o2o: int = 1, alpha: float = 0.5,
                 beta: float = 6.0):
        common = dict(reg_max=reg_max, strides=strides, box=box, cls=cls, dfl=dfl, alpha=alpha, beta=beta,
                      class_weights=class_weights)
        self.one2many = DetectionLoss(nc, topk=topk, **common)
        self.one2one = DetectionLoss(nc, topk=topk_o2o, topk2=topk2_o2o, **common)
        self.nc, self.reg_max, self.names = self.one2many.nc, self.one2many.reg_max, self.one2many.names
        self.epoch, self.epochs = 0, int(epochs)

    def set_epoch(self, epoch: int, epochs: int | None = None) -> None:
        """Make ``epoch`` (0-based) the one whose weights apply; ``epochs`` updates E when given."""
        if int(epoch) < 0:
            raise ValueError(f"E2EDetectionLoss.set_epoch: epoch {epoch} is negative; epochs count from 0")
        self.epoch = int(epoch)
        if epochs is not None:
            self.epochs = int(epochs)

    @property
    def weights(self) -> tuple[float, float]:
        """(w_o2m, w_o2o) in effect now."""
        return e2e_weights(self.epoch, self.epochs)

    def _branches(self, preds):
        if not isinstance(preds, dict) or not {"one2many", "one2one"} <= set(preds):
            got = sorted(preds) if isinstance(preds, dict) else type(preds).__name__
            raise KeyError("E2EDetectionLoss: preds must be the end-to-end head's training output "
                           f"{{'one2many': ..., 'one2one': ...}}; got {got}")
        return preds["one2many"], preds["one2one"]

    def vector(self, preds, batch: dict):
        """(loss vector (3,) B * (w_o2m * V_o2m + w_o2o * V_o2o), differentiable; items V_o2o (3,) detached):
        Ultralytics' return convention."""
        o2m, o2o = self._branches(preds)
        w_o2m, w_o2o = self.weights
        v_o2m = self.one2many.stages(o2m, batch, w_o2m).items
        v_o2o = self.one2one.stages(o2o, batch, w_o2o).items
        bsz = head_maps(o2m)[0].shape[0]
        return (v_o2m * bsz) * w_o2m + (v_o2o * bsz) * w_o2o, v_o2o.detach()

    def __call__(self, preds, batch: dict):
        vec, items = self.vector(preds, batch)
        return vec.sum(), items


def criterion_for(model, box: float | None = None, cls: float | None = None, dfl: float | None = None,
                  epochs: int | None = None, class_weights: torch.Tensor | None = None):
    """The training criterion of a detection model's family: ``E2EDetectionLoss`` for an end-to-end head
    (YOLO26, ``model.end2end``), ``DetectionLoss`` otherwise (YOLOv8, YOLO11); nc, reg_max and strides from
    the model. Gains and epochs not given are read from ``model.args`` (a dict or namespace, as Ultralytics
    keeps the recipe there) when it has them, else the defaults (7.5, 0.5, 1.5, 100 epochs)."""
    args = getattr(model, "args", None)

    def arg(name, given, default):
        if given is not None:
            return given
        found = args.get(name) if isinstance(args, dict) else getattr(args, name, None)
        return default if found is None else found

    common = dict(reg_max=getattr(model, "reg_max", 16), strides=tuple(float(s) for s in model.stride),
                  box=arg("box", box, 7.5), cls=arg("cls", cls, 0.5), dfl=arg("dfl", dfl, 1.5),
                  class_weights=class_weights)
    if getattr(model, "end2end", False):
        return E2EDetectionLoss(model.nc, epochs=arg("epochs", epochs, 100), **common)
    return DetectionLoss(model.nc, **common)
