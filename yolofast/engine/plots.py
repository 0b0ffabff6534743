"""results.png: the curves of results.csv (losses, metrics) in a 2×5 grid, like Ultralytics' plot; and a
batch's images with their boxes in one grid (TensorBoard's ``train_batch0``)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

__all__ = ["batch_mosaic", "plot_results"]

_PANELS = ("train/box_loss", "train/cls_loss", "train/dfl_loss", "metrics/precision(B)", "metrics/recall(B)",
           "val/box_loss", "val/cls_loss", "val/dfl_loss", "metrics/mAP50(B)", "metrics/mAP50-95(B)")


def plot_results(csv_file: str | Path, out: str | Path | None = None) -> Path | None:
    """Plot results.csv to ``out`` (default: results.png beside it); None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers/CI; must precede pyplot
    import matplotlib.pyplot as plt

    csv_file = Path(csv_file)
    with open(csv_file, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return None
    out = Path(out) if out else csv_file.with_name("results.png")

    def col(name):
        vals = []
        for r in rows:
            try:
                vals.append(float(r.get(name, "nan")))
            except ValueError:
                vals.append(float("nan"))
        return vals

    x = col("epoch")
    fig, axes = plt.subplots(2, 5, figsize=(12, 6), tight_layout=True)
    for ax, name in zip(axes.ravel(), _PANELS):
        ax.plot(x, col(name), marker=".", linewidth=2, markersize=8)
        ax.set_title(name, fontsize=12)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


_COLORS = ((255, 56, 56), (72, 249, 10), (0, 194, 255), (255, 157, 151), (255, 178, 29), (146, 204, 23),
           (61, 219, 134), (52, 69, 147), (255, 55, 199), (132, 56, 255))


def batch_mosaic(batch: dict, max_images: int = 16):
    """(H, W, 3) uint8 grid of a collated batch's images (up to ``max_images``) with their boxes drawn,
    one colour per class: ``img`` (B, 3, h, w) float in [0, 1] or uint8, ``batch_idx``, ``cls``, ``bboxes``
    (normalized xywh)."""
    import torch

    img = batch["img"][:max_images].detach().float().cpu()
    if batch["img"].dtype == torch.uint8:
        img = img / 255
    n, _, h, w = img.shape
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = torch.zeros(3, rows * h, cols * w)
    for k in range(n):
        r, c = divmod(k, cols)
        grid[:, r * h:(r + 1) * h, c * w:(c + 1) * w] = img[k]
    bidx = batch["batch_idx"].detach().cpu().long().reshape(-1)
    cls = batch["cls"].detach().cpu().long().reshape(-1)
    boxes = batch["bboxes"].detach().cpu().float().reshape(-1, 4)
    for b, k, (cx, cy, bw, bh) in zip(bidx.tolist(), cls.tolist(), boxes.tolist()):
        if b >= n:
            continue
        r, c = divmod(b, cols)
        x1 = c * w + int(max(0, min(w - 1, (cx - bw / 2) * w)))
        x2 = c * w + int(max(0, min(w - 1, (cx + bw / 2) * w)))
        y1 = r * h + int(max(0, min(h - 1, (cy - bh / 2) * h)))
        y2 = r * h + int(max(0, min(h - 1, (cy + bh / 2) * h)))
        color = torch.tensor(_COLORS[k % len(_COLORS)], dtype=torch.float32).view(3, 1) / 255
        grid[:, y1, x1:x2 + 1] = grid[:, y2, x1:x2 + 1] = color
        grid[:, y1:y2 + 1, x1] = grid[:, y1:y2 + 1, x2] = color
    return (grid.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
