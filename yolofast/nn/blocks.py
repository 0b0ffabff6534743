"""Building blocks of the YOLOv8/YOLO11/YOLO26 backbones and necks: Bottleneck, C2f, C3k, C3k2, SPPF,
Concat, Upsample (Conv and DWConv are in ``yolofast.nn.conv``, re-exported here; the attention blocks are
in ``yolofast.nn.attention``).

Submodule names (conv/bn, cv1/cv2, m) follow the usual YOLOv8 state-dict layout so that a state dict
saved by another YOLOv8 implementation with the same architecture maps key for key.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from yolofast.nn.attention import PSABlock
from yolofast.nn.conv import BN_EPS, BN_MOMENTUM, Conv, DWConv, autopad

# Conv, DWConv, autopad and the BN settings live in nn/conv.py (attention builds on them too); they stay
# importable from here.
__all__ = ["BN_EPS", "BN_MOMENTUM", "SPPF", "Bottleneck", "C2f", "C3k", "C3k2", "Concat", "Conv", "DWConv",
           "Upsample", "autopad"]


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


class C3k(nn.Module):
    """A CSP block of n 3x3 bottlenecks (YOLO11/YOLO26's inner block of C3k2 at m/l/x and in the neck).

    cv1 and cv2 (1x1) halve the width; the bottleneck chain runs on cv1's half and its output comes first
    in the concat that cv3 (1x1) maps back to c2.
    """

    def __init__(self, c1: int, c2: int, n: int = 2, shortcut: bool = True, g: int = 1, e: float = 0.5,
                 k: int = 3):
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c1, c_, 1, 1)
        self.cv3 = Conv(2 * c_, c2, 1)
        # Throw-away C3-style bottlenecks (1x1, 3x3) first: they consume the same random draws as
        # Ultralytics' constructor, so a seeded build gives the same initial weights.
        nn.Sequential(*(Bottleneck(c_, c_, shortcut, g, k=(1, 3), e=1.0) for _ in range(n)))
        self.m = nn.Sequential(*(Bottleneck(c_, c_, shortcut, g, k=(k, k), e=1.0) for _ in range(n)))

    def forward(self, x):
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class C3k2(C2f):
    """C2f's dataflow with YOLO11/YOLO26 inner blocks: a 0.5-hidden Bottleneck, a C3k (``c3k``), or a
    Bottleneck followed by a PSABlock (``attn``, YOLO26's last neck block). Each block maps c -> c."""

    def __init__(self, c1: int, c2: int, n: int = 1, c3k: bool = False, e: float = 0.5, attn: bool = False,
                 g: int = 1, shortcut: bool = True):
        super().__init__(c1, c2, n, shortcut, g, e)  # builds C2f's bottlenecks first (seeded-init order)
        c = self.c
        if attn:
            blocks = (nn.Sequential(Bottleneck(c, c, shortcut, g), PSABlock(c, 0.5, max(c // 64, 1)))
                      for _ in range(n))
        elif c3k:
            blocks = (C3k(c, c, 2, shortcut, g) for _ in range(n))
        else:
            blocks = (Bottleneck(c, c, shortcut, g) for _ in range(n))
        self.m = nn.ModuleList(blocks)


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: ``n`` chained k x k max-pools (k=5 ~ SPP's 5/9/13 windows).

    ``shortcut`` (YOLO26's ``[c2, k, n, True]`` row) makes cv1 linear and adds the input to the output;
    YOLOv8/YOLO11 rows ``[c2, k]`` keep a SiLU on cv1 and no residual. The parameters are the same.
    """

    def __init__(self, c1: int, c2: int, k: int = 5, n: int = 3, shortcut: bool | None = None):
        super().__init__()
        c_ = c1 // 2
        self.cv1 = Conv(c1, c_, 1, 1, act=shortcut is None)
        self.cv2 = Conv(c_ * (n + 1), c2, 1, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)
        self.n = n
        self.add = bool(shortcut) and c1 == c2

    def forward(self, x):
        y = [self.cv1(x)]
        for _ in range(self.n):
            y.append(self.m(y[-1]))
        y = self.cv2(torch.cat(y, 1))
        return y + x if self.add else y


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
