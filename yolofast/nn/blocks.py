"""Building blocks of the YOLOv8 backbone and neck: Conv, Bottleneck, C2f, SPPF, Concat, Upsample.

Submodule names (conv/bn, cv1/cv2, m) follow the usual YOLOv8 state-dict layout so that a state dict
saved by another YOLOv8 implementation with the same architecture maps key for key.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
        self.act = nn.SiLU(inplace=True) if act else nn.Identity()

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


class Bottleneck(nn.Module):
    """Two convs (k[0], k[1]) with a residual add when ``shortcut`` and c1 == c2."""

    def __init__(self, c1: int, c2: int, shortcut: bool = True, g: int = 1, k=(3, 3), e: float = 0.5):
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, k[0], 1)
        self.cv2 = Conv(c_, c2, k[1], 1, g=g)
        self.add = shortcut and c1 == c2

    def forward(self, x):
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C2f(nn.Module):
    """CSP block with 2 convs and n bottlenecks whose every output is kept (YOLOv8's C2f).

    cv1 (1x1) makes 2 halves of c = c2*e channels; each of the n bottlenecks takes the last chunk and
    appends its output; cv2 (1x1) maps the (2+n)*c concatenated channels to c2.
    """

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = False, g: int = 1, e: float = 0.5):
        super().__init__()
        self.c = int(c2 * e)
        self.cv1 = Conv(c1, 2 * self.c, 1, 1)
        self.cv2 = Conv((2 + n) * self.c, c2, 1)
        self.m = nn.ModuleList(Bottleneck(self.c, self.c, shortcut, g, k=(3, 3), e=1.0) for _ in range(n))

    def forward(self, x):
        ys = list(self.cv1(x).chunk(2, 1))
        for m in self.m:
            ys.append(m(ys[-1]))
        return self.cv2(torch.cat(ys, 1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: three chained k x k max-pools (k=5 ~ SPP's 5/9/13 windows)."""

    def __init__(self, c1: int, c2: int, k: int = 5):
        super().__init__()
        c_ = c1 // 2
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c_ * 4, c2, 1, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)

    def forward(self, x):
        y = [self.cv1(x)]
        for _ in range(3):
            y.append(self.m(y[-1]))
        return self.cv2(torch.cat(y, 1))


class Concat(nn.Module):
    """Concatenate a list of tensors along ``dimension`` (channels by default)."""

    def __init__(self, dimension: int = 1):
        super().__init__()
        self.d = dimension

    def forward(self, xs):
        return torch.cat(xs, self.d)


class Upsample(nn.Module):
    """Nearest (or other ``mode``) upsampling by an integer ``scale_factor``."""

    def __init__(self, size=None, scale_factor: float = 2, mode: str = "nearest"):
        super().__init__()
        self.size, self.scale_factor, self.mode = size, scale_factor, mode

    def forward(self, x):
        return F.interpolate(x, size=self.size, scale_factor=None if self.size else self.scale_factor,
                             mode=self.mode)

    def extra_repr(self) -> str:
        return f"scale_factor={self.scale_factor}, mode={self.mode!r}"
