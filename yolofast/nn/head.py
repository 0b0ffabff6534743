"""Decoupled, anchor-free detection head of YOLOv8, YOLO11 and YOLO26 (DFL or direct box decode, and
YOLO26's one-to-one branches)."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from yolofast.boxes import dist2bbox, make_anchors
from yolofast.nn.conv import Conv, DWConv


class DFL(nn.Module):
    """Distribution focal loss decode: softmax over reg_max bins, expectation with bin values 0..reg_max-1.

    The bin values live in a frozen 1x1 conv weight (requires_grad False): it is never trained, but it is
    counted in ``parameters()`` (the published YOLOv8 counts include these 16 numbers) and its state-dict
    key (``dfl.conv.weight``) matches the usual YOLOv8 layout.
    """

    def __init__(self, reg_max: int = 16):
        super().__init__()
        self.reg_max = reg_max
        self.conv = nn.Conv2d(reg_max, 1, 1, bias=False).requires_grad_(False)
        with torch.no_grad():
            self.conv.weight.copy_(torch.arange(reg_max, dtype=torch.float32).view(1, reg_max, 1, 1))

    def forward(self, x):
        """x (B, 4*reg_max, A) logits -> (B, 4, A) expected distances in grid units."""
        b, _, a = x.shape
        prob = x.view(b, 4, self.reg_max, a).softmax(2)
        return (prob * self.conv.weight.view(1, 1, self.reg_max, 1).to(prob.dtype)).sum(2)


class Detect(nn.Module):
    """Per level: a box branch (Conv3x3, Conv3x3, Conv2d 1x1 -> 4*reg_max) and a class branch -> nc.

    ``legacy`` (YOLOv8) class branch: Conv3x3, Conv3x3, Conv2d 1x1. Non-legacy (YOLO11/YOLO26, any config
    with a C3k2 row): [DWConv3x3, Conv1x1], [DWConv3x3, Conv1x1], Conv2d 1x1 -- cheaper at the same width.
    ``end2end`` (YOLO26) adds ``one2one_cv2``/``one2one_cv3``: copies of both branches taken at build time,
    trained with a one-to-one assignment so their top-k needs no NMS. ``reg_max`` 1 (YOLO26) regresses the
    four side distances directly (no DFL).

    Train mode: a list of nl raw maps (B, 4*reg_max + nc, H_i, W_i), box channels first; with the one-to-one
    branches, ``{"one2many": out, "one2one": out}`` where each ``out`` holds ``boxes`` (B, 4*reg_max, A),
    ``scores`` (B, nc, A) raw logits, ``feats`` (the head inputs; detached for one2one, so the one-to-one
    loss trains only its own branches) and ``maps`` (the per-level raw maps, what the loss ops consume).
    Eval mode: ``decode`` of the one-to-many maps, (B, 4+nc, A) xywh pixels + sigmoid scores; with
    ``nms_free`` switched on (``nms=False``), the one-to-one branch's top-k rows (B, k, 6):
    x1, y1, x2, y2, score, class.
    """

    def __init__(self, nc: int = 80, ch: tuple[int, ...] = (), strides: tuple[float, ...] = (8, 16, 32),
                 reg_max: int = 16, end2end: bool = False, legacy: bool = True, c3: int | None = None):
        super().__init__()
        if len(ch) != len(strides):
            raise ValueError(f"Detect: got {len(ch)} input levels but {len(strides)} strides")
        self.nc, self.nl, self.reg_max, self.legacy = nc, len(ch), reg_max, legacy
        self.no = nc + 4 * reg_max
        self.strides = tuple(float(s) for s in strides)
        # Width rules: box branch >= 16 and >= 4*reg_max channels; class branch at least min(nc, 100) so
        # that many-class heads are not starved by a narrow P3.
        c2 = max(16, ch[0] // 4, reg_max * 4)
        # c3 given: a head fine-tuned from a checkpoint keeps that checkpoint's class-branch width
        c3 = c3 or max(ch[0], min(nc, 100))
        self.cv2 = nn.ModuleList(
            nn.Sequential(Conv(x, c2, 3), Conv(c2, c2, 3), nn.Conv2d(c2, 4 * reg_max, 1)) for x in ch)
        self.cv3 = nn.ModuleList(class_branch(x, c3, nc, legacy) for x in ch)
        self.dfl = DFL(reg_max) if reg_max > 1 else nn.Identity()
        if end2end:
            self.one2one_cv2 = copy.deepcopy(self.cv2)
            self.one2one_cv3 = copy.deepcopy(self.cv3)
        self.nms_free = False  # eval output: one-to-one top-k (nms=False) instead of one-to-many maps
        self.max_det, self.agnostic = 300, False  # the one-to-one top-k's k and class handling
        self._anchor_cache: dict = {}
        self.bias_init()

    @property
    def end2end(self) -> bool:
        """True when the head has the one-to-one (NMS-free) branches (YOLO26)."""
        return hasattr(self, "one2one_cv2")

    @torch.no_grad()
    def bias_init(self):
        """Box logits start at 2.0; class logits at log(5 / nc / (640/s)^2), a prior of ~5 objects per
        class spread over a 640-px image's (640/s)^2 cells of level s (e.g. -11.5 for s=8, nc=80).
        Both branch sets when the head has the one-to-one copies."""
        sets = [(self.cv2, self.cv3)] + ([(self.one2one_cv2, self.one2one_cv3)] if self.end2end else [])
        for cv2, cv3 in sets:
            for box, cls, s in zip(cv2, cv3, self.strides):
                box[-1].bias.fill_(2.0)
                cls[-1].bias.fill_(math.log(5 / self.nc / (640 / s) ** 2))

    def rebuild_class_branches(self, c3: int) -> None:
        """New class branches of width ``c3`` (both sets when end2end), freshly initialised: fine-tuning
        from a checkpoint whose class branch is ``c3`` wide keeps that width (Ultralytics 8.4)."""
        ref = self.cv2[0][2].weight
        ch = [branch[0].conv.in_channels for branch in self.cv2]
        self.cv3 = nn.ModuleList(class_branch(x, c3, self.nc, self.legacy) for x in ch).to(ref.device)
        if self.end2end:
            self.one2one_cv3 = copy.deepcopy(self.cv3)
        self.bias_init()

    def forward_feats(self, xs):
        """nl neck maps -> nl raw one-to-many maps (B, 4*reg_max + nc, H_i, W_i), box channels first."""
        return [torch.cat((self.cv2[i](xs[i]), self.cv3[i](xs[i])), 1) for i in range(self.nl)]

    def forward_feats_one2one(self, xs):
        """The same maps from the one-to-one branches (end2end heads only)."""
        cv2, cv3 = self.one2one_cv2, self.one2one_cv3
        return [torch.cat((cv2[i](xs[i]), cv3[i](xs[i])), 1) for i in range(self.nl)]

    def _branch_out(self, maps, xs) -> dict:
        b = maps[0].shape[0]
        flat = torch.cat([m.reshape(b, self.no, -1) for m in maps], 2)
        boxes, scores = flat.split((4 * self.reg_max, self.nc), 1)
        return {"boxes": boxes, "scores": scores, "feats": xs, "maps": maps}

    def forward(self, xs):
        if self.training:
            if not self.end2end:
                return self.forward_feats(xs)
            xd = [x.detach() for x in xs]
            return {"one2many": self._branch_out(self.forward_feats(xs), xs),
                    "one2one": self._branch_out(self.forward_feats_one2one(xd), xd)}
        if self.nms_free and self.end2end:
            return self.topk(self.decode(self.forward_feats_one2one(xs), xywh=False).transpose(1, 2))
        return self.decode(self.forward_feats(xs))

    def topk(self, y, max_det: int | None = None, agnostic: bool | None = None):
        """(B, A, 4+nc) xyxy boxes + scores -> (B, k, 6) rows x1, y1, x2, y2, score, class (float), by
        descending score, k = min(max_det, A); no threshold. Class-aware: the top-k anchors by best class,
        then the top-k (anchor, class) pairs among them (an anchor may appear with two classes);
        ``agnostic``: each anchor's best class only."""
        b, a, _ = y.shape
        k = min(self.max_det if max_det is None else max_det, a)
        boxes, scores = y.split((4, self.nc), dim=-1)
        if self.agnostic if agnostic is None else agnostic:
            conf, cls = scores.max(-1)
            conf, idx = conf.topk(k, dim=1)
            cls = cls.gather(1, idx)
        else:
            idx = scores.amax(-1).topk(k, dim=1).indices
            scores = scores.gather(1, idx.unsqueeze(-1).expand(-1, -1, self.nc))
            conf, flat = scores.flatten(1).topk(k, dim=1)
            idx = idx.gather(1, flat // self.nc)
            cls = flat % self.nc
        boxes = boxes.gather(1, idx.unsqueeze(-1).expand(-1, -1, 4))
        return torch.cat((boxes, conf.unsqueeze(-1), cls.unsqueeze(-1).to(boxes.dtype)), -1)

    def anchors(self, feats):
        """(anchor_points (2, A) grid units, stride_tensor (1, A)), cached per feature sizes/device/dtype."""
        if torch.compiler.is_compiling():
            # Traced once per input shape anyway; a Python dict mutation here would only add guards.
            a, s = make_anchors(feats, self.strides, 0.5)
            return a.transpose(0, 1), s.transpose(0, 1)
        key = (tuple(tuple(f.shape[2:]) for f in feats), feats[0].device, feats[0].dtype)
        hit = self._anchor_cache.get(key)
        if hit is None:
            if len(self._anchor_cache) >= 8:  # multi-scale/rect validation: keep memory bounded
                self._anchor_cache.clear()
            a, s = make_anchors(feats, self.strides, 0.5)
            hit = self._anchor_cache[key] = (a.transpose(0, 1).contiguous(), s.transpose(0, 1).contiguous())
        return hit

    def decode(self, feats, xywh: bool = True):
        """Raw maps -> float32 (B, 4+nc, A): (cx, cy, w, h) in pixels (x1, y1, x2, y2 with ``xywh=False``),
        then per-class sigmoid scores. reg_max 1: the box channels are the side distances themselves.

        Anchors are ordered level by level (strides ascending), row-major (y then x) within a level.
        """
        b = feats[0].shape[0]
        # Always fp32: a bf16 pixel coordinate near 640 is only exact to 4 px (8 mantissa bits), which
        # would cost mAP50-95 under bf16 autocast; this tensor is small next to the network.
        feats = [f.float() for f in feats]
        x = torch.cat([f.reshape(b, self.no, -1) for f in feats], 2)
        box, cls = x.split((4 * self.reg_max, self.nc), 1)
        anchor_points, stride_t = self.anchors(feats)
        dbox = dist2bbox(self.dfl(box), anchor_points.unsqueeze(0), xywh=xywh, dim=1) * stride_t
        return torch.cat((dbox, cls.sigmoid()), 1)

    def __getstate__(self):
        # Pickled checkpoints should not carry device tensors of the anchor cache.
        state = self.__dict__.copy()
        state["_anchor_cache"] = {}
        return state


def class_branch(c_in: int, c3: int, nc: int, legacy: bool) -> nn.Sequential:
    """The class branch of one level: legacy (YOLOv8) Conv3x3, Conv3x3, 1x1; or YOLO11/YOLO26's
    [DWConv3x3, Conv1x1] twice, then 1x1 (state-dict names cv3.l.0.0, .0.1, .1.0, .1.1, .2)."""
    if legacy:
        return nn.Sequential(Conv(c_in, c3, 3), Conv(c3, c3, 3), nn.Conv2d(c3, nc, 1))
    return nn.Sequential(nn.Sequential(DWConv(c_in, c_in, 3), Conv(c_in, c3, 1)),
                         nn.Sequential(DWConv(c3, c3, 3), Conv(c3, c3, 1)), nn.Conv2d(c3, nc, 1))
