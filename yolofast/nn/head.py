"""Decoupled, anchor-free YOLOv8 detection head with the DFL box decode."""

from __future__ import annotations

import math

import torch
from torch import nn

from yolofast.boxes import dist2bbox, make_anchors
from yolofast.nn.blocks import Conv


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
    """Per level: a box branch (Conv3x3, Conv3x3, Conv2d 1x1 -> 4*reg_max) and a class branch
    (Conv3x3, Conv3x3, Conv2d 1x1 -> nc); their outputs are concatenated box-first.

    Training consumes the raw maps; ``decode`` turns them into (B, 4+nc, A): xywh in pixels + sigmoid scores.
    """

    def __init__(self, nc: int = 80, ch: tuple[int, ...] = (), strides: tuple[float, ...] = (8, 16, 32),
                 reg_max: int = 16):
        super().__init__()
        if len(ch) != len(strides):
            raise ValueError(f"Detect: got {len(ch)} input levels but {len(strides)} strides")
        self.nc, self.nl, self.reg_max = nc, len(ch), reg_max
        self.no = nc + 4 * reg_max
        self.strides = tuple(float(s) for s in strides)
        # YOLOv8's width rules: box branch >= 16 and >= 4*reg_max channels; class branch at least
        # min(nc, 100) so that many-class heads are not starved by a narrow P3.
        c2 = max(16, ch[0] // 4, reg_max * 4)
        c3 = max(ch[0], min(nc, 100))
        self.cv2 = nn.ModuleList(
            nn.Sequential(Conv(x, c2, 3), Conv(c2, c2, 3), nn.Conv2d(c2, 4 * reg_max, 1)) for x in ch)
        self.cv3 = nn.ModuleList(
            nn.Sequential(Conv(x, c3, 3), Conv(c3, c3, 3), nn.Conv2d(c3, nc, 1)) for x in ch)
        self.dfl = DFL(reg_max) if reg_max > 1 else nn.Identity()
        self._anchor_cache: dict = {}
        self.bias_init()

    @torch.no_grad()
    def bias_init(self):
        """Box logits start at 1.0; class logits at log(5 / nc / (640/s)^2), a prior of ~5 objects per
        class spread over a 640-px image's (640/s)^2 cells of level s (e.g. -11.0 for s=8, nc=80)."""
        for box, cls, s in zip(self.cv2, self.cv3, self.strides):
            box[-1].bias.fill_(1.0)
            cls[-1].bias.fill_(math.log(5 / self.nc / (640 / s) ** 2))

    def forward_feats(self, xs):
        """nl neck maps -> nl raw maps (B, 4*reg_max + nc, H_i, W_i), box channels first."""
        return [torch.cat((self.cv2[i](xs[i]), self.cv3[i](xs[i])), 1) for i in range(self.nl)]

    def forward(self, xs):
        feats = self.forward_feats(xs)
        return feats if self.training else self.decode(feats)

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

    def decode(self, feats):
        """Raw maps -> float32 (B, 4+nc, A): (cx, cy, w, h) in pixels, then per-class sigmoid scores.

        Anchors are ordered level by level (strides ascending), row-major (y then x) within a level.
        """
        b = feats[0].shape[0]
        # Always fp32: a bf16 pixel coordinate near 640 is only exact to 4 px (8 mantissa bits), which
        # would cost mAP50-95 under bf16 autocast; this tensor is small next to the network.
        feats = [f.float() for f in feats]
        x = torch.cat([f.reshape(b, self.no, -1) for f in feats], 2)
        box, cls = x.split((4 * self.reg_max, self.nc), 1)
        anchor_points, stride_t = self.anchors(feats)
        dbox = dist2bbox(self.dfl(box), anchor_points.unsqueeze(0), xywh=True, dim=1) * stride_t
        return torch.cat((dbox, cls.sigmoid()), 1)

    def __getstate__(self):
        # Pickled checkpoints should not carry device tensors of the anchor cache.
        state = self.__dict__.copy()
        state["_anchor_cache"] = {}
        return state
