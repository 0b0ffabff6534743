"""The attention blocks of YOLO11 and YOLO26: Attention, PSABlock and C2PSA (after SPPF, and in YOLO26's
last neck C3k2).

Submodule names (qkv/proj/pe, attn/ffn, cv1/cv2/m) follow the Ultralytics state-dict layout, so their
checkpoints load key for key.
"""

from __future__ import annotations

import torch
from torch import nn

from yolofast.nn.conv import Conv


class Attention(nn.Module):
    """Multi-head self-attention over the H*W positions of a map, plus a depthwise 3x3 positional term.

    Every conv is linear (BN, no SiLU). ``qkv`` gives each head one contiguous slab [q (kd) | k (kd) |
    v (hd)] with hd = dim/heads and kd = hd*attn_ratio: the slabs are per head, not all-q then all-k, and
    a loaded checkpoint's qkv rows only mean the right thing in that order.
    """

    def __init__(self, dim: int, num_heads: int = 8, attn_ratio: float = 0.5):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.key_dim = int(self.head_dim * attn_ratio)
        self.scale = self.key_dim ** -0.5
        h = dim + self.key_dim * num_heads * 2
        self.qkv = Conv(dim, h, 1, act=False)
        self.proj = Conv(dim, dim, 1, act=False)
        self.pe = Conv(dim, dim, 3, 1, g=dim, act=False)

    def forward(self, x):
        b, c, hh, ww = x.shape
        n = hh * ww
        q, k, v = self.qkv(x).view(b, self.num_heads, self.key_dim * 2 + self.head_dim, n).split(
            [self.key_dim, self.key_dim, self.head_dim], dim=2)
        attn = ((q.transpose(-2, -1) @ k) * self.scale).softmax(dim=-1)  # (B, heads, N queries, N keys)
        out = (v @ attn.transpose(-2, -1)).view(b, c, hh, ww) + self.pe(v.reshape(b, c, hh, ww))
        return self.proj(out)


class PSABlock(nn.Module):
    """x + Attention(x), then x + FFN(x) with FFN = Conv 1x1 c->2c (SiLU), linear Conv 1x1 2c->c."""

    def __init__(self, c: int, attn_ratio: float = 0.5, num_heads: int = 4, shortcut: bool = True):
        super().__init__()
        self.attn = Attention(c, attn_ratio=attn_ratio, num_heads=num_heads)
        self.ffn = nn.Sequential(Conv(c, c * 2, 1), Conv(c * 2, c, 1, act=False))
        self.add = shortcut

    def forward(self, x):
        x = x + self.attn(x) if self.add else self.attn(x)
        return x + self.ffn(x) if self.add else self.ffn(x)


class C2PSA(nn.Module):
    """cv1 (1x1) splits into halves a and b; n PSABlocks run on b; cv2 (1x1) maps concat(a, b) back to c1.

    Heads are c/64 (at least 1), so every head is 64 channels wide at every scale.
    """

    def __init__(self, c1: int, c2: int, n: int = 1, e: float = 0.5):
        super().__init__()
        if c1 != c2:
            raise ValueError(f"C2PSA: input and output widths must agree, got {c1} -> {c2}")
        self.c = int(c1 * e)
        self.cv1 = Conv(c1, 2 * self.c, 1, 1)
        self.cv2 = Conv(2 * self.c, c1, 1)
        self.m = nn.Sequential(*(PSABlock(self.c, attn_ratio=0.5, num_heads=max(self.c // 64, 1))
                                 for _ in range(n)))

    def forward(self, x):
        a, b = self.cv1(x).split((self.c, self.c), dim=1)
        return self.cv2(torch.cat((a, self.m(b)), 1))
