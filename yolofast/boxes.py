"""Box and anchor helpers shared by the model, the loss and the validator."""

from __future__ import annotations

import torch


def make_anchors(feats, strides, offset: float = 0.5):
    """Anchor centres of every grid cell, level by level, row-major within a level.

    feats: list of (B, C, H_i, W_i) maps (only their sizes are read); strides: one per level.
    Returns anchor_points (A, 2) in grid units of its own level (cell index + offset) and
    stride_tensor (A, 1), so ``anchor_points * stride_tensor`` is the centre in pixels.
    """
    points, stride_t = [], []
    dtype, device = feats[0].dtype, feats[0].device
    for f, s in zip(feats, strides):
        h, w = f.shape[2:]
        sy = torch.arange(h, device=device, dtype=dtype) + offset
        sx = torch.arange(w, device=device, dtype=dtype) + offset
        yy, xx = torch.meshgrid(sy, sx, indexing="ij")
        points.append(torch.stack((xx, yy), -1).view(-1, 2))
        stride_t.append(torch.full((h * w, 1), float(s), dtype=dtype, device=device))
    return torch.cat(points), torch.cat(stride_t)


def dist2bbox(distance, anchor_points, xywh: bool = True, dim: int = -1):
    """(l, t, r, b) distances from the anchor -> xywh or xyxy box, in the anchor's units."""
    lt, rb = distance.chunk(2, dim)
    x1y1 = anchor_points - lt
    x2y2 = anchor_points + rb
    if xywh:
        return torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), dim)
    return torch.cat((x1y1, x2y2), dim)


def bbox2dist(anchor_points, bbox, reg_max: float):
    """xyxy box -> (l, t, r, b) distances from the anchor, clamped to [0, reg_max - 1 - 0.01]."""
    x1y1, x2y2 = bbox.chunk(2, -1)
    return torch.cat((anchor_points - x1y1, x2y2 - anchor_points), -1).clamp_(0, reg_max - 1 - 0.01)


def xywh2xyxy(x):
    out = torch.empty_like(x)
    half_w, half_h = x[..., 2] / 2, x[..., 3] / 2
    out[..., 0] = x[..., 0] - half_w
    out[..., 1] = x[..., 1] - half_h
    out[..., 2] = x[..., 0] + half_w
    out[..., 3] = x[..., 1] + half_h
    return out


def xyxy2xywh(x):
    out = torch.empty_like(x)
    out[..., 0] = (x[..., 0] + x[..., 2]) / 2
    out[..., 1] = (x[..., 1] + x[..., 3]) / 2
    out[..., 2] = x[..., 2] - x[..., 0]
    out[..., 3] = x[..., 3] - x[..., 1]
    return out


def box_iou(box1, box2, eps: float = 1e-7):
    """Plain IoU matrix (N, M) of xyxy boxes (N, 4) and (M, 4)."""
    (a1, a2), (b1, b2) = box1[:, None].chunk(2, 2), box2.unsqueeze(0).chunk(2, 2)
    inter = (torch.min(a2, b2) - torch.max(a1, b1)).clamp_(0).prod(2)
    return inter / ((a2 - a1).prod(2) + (b2 - b1).prod(2) - inter + eps)
