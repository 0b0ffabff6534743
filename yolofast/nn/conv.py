"""The convolution units every other block is built of: Conv (conv -> BN -> SiLU), DWConv, autopad and
YOLOv8's BatchNorm settings.

A leaf of ``yolofast.nn``: ``blocks`` and ``attention`` both build on it, so neither imports the other for
its Conv. ``yolofast.nn.blocks`` re-exports these names (``from yolofast.nn.blocks import Conv`` keeps
working); checkpoints name classes by their last part (``Conv``), so the module they live in is not part
of the file format.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# YOLOv8's BatchNorm settings: eps 1e-3 (not 1e-5) and momentum 0.03 (not 0.1), i.e. running stats that
# average over ~33 batches; the recipe's numbers depend on them.
BN_EPS = 1e-3
BN_MOMENTUM = 0.03


def autopad(k: int, d: int = 1) -> int:
    """'Same' padding for an odd kernel k with dilation d (output size = input size / stride)."""
    return d * (k - 1) // 2


class Conv(nn.Module):
    """Conv2d (no bias) -> BatchNorm2d -> SiLU; ``fuse()`` folds the BN into the conv for inference."""

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, p: int | None = None, g: int = 1,
                 d: int = 1, act: bool = True):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, autopad(k, d) if p is None else p, dilation=d, groups=g,
                              bias=False)
        self.bn = nn.BatchNorm2d(c2, eps=BN_EPS, momentum=BN_MOMENTUM)
        # Out of place: under autograd an in-place SiLU saves a copy of its input for the backward anyway
        # (one extra write of every activation); yolo26n 320 px b16 fwd+bwd measured 0.3-3.6 % faster.
        self.act = nn.SiLU() if act else nn.Identity()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))

    @torch.no_grad()
    def fuse(self) -> Conv:
        """Fold BN (running stats) into the conv: k = gamma/sqrt(var+eps), w' = w*k, b' = beta - mean*k."""
        if isinstance(self.bn, nn.Identity):
            return self
        bn = self.bn
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        bias = bn.bias - bn.running_mean * scale
        if self.conv.bias is not None:
            bias = bias + self.conv.bias * scale
        conv = self.conv
        # Elementwise ops keep the weight's memory format (channels_last stays channels_last).
        conv.weight = nn.Parameter(conv.weight * scale.view(-1, 1, 1, 1), requires_grad=False)
        conv.bias = nn.Parameter(bias.to(conv.weight.dtype), requires_grad=False)
        self.bn = nn.Identity()
        return self


class DWConv(Conv):
    """A Conv unit with groups = gcd(c1, c2): depthwise when c1 == c2 (the YOLO11/YOLO26 class branch)."""

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, d: int = 1, act: bool = True):
        super().__init__(c1, c2, k, s, g=math.gcd(c1, c2), d=d, act=act)
