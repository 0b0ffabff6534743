"""results.png: the curves of results.csv (losses, metrics) in a 2×5 grid, like Ultralytics' plot; a
batch's images with their boxes in one grid (TensorBoard's ``train_batch0``); and ``PlotLogger``, which
writes a training run's other pictures (``labels.jpg``, ``train_batch*.jpg``, the final validation's)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

__all__ = ["PlotLogger", "batch_mosaic", "plot_results"]

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
        if name not in rows[0] and name.endswith("/dfl_loss"):  # YOLO26 has no DFL: its L1 term sits there
            name = name.replace("dfl_loss", "l1_loss")
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


class PlotLogger:
    """A training run's pictures with ``plots=True`` (drawing: ``yolofast/val/plots.py``): ``labels.jpg``
    once the data is loaded, ``train_batch0..2.jpg`` from the first three batches (as fed to the model,
    after augmentation), and the final validation's confusion matrices, curves and ``val_batch*`` images
    (the last epoch's validation and, when it is not the last epoch, best.pt's, which overwrites them).
    Nothing is drawn in the other epochs; a failing picture is one warning line."""

    def __init__(self, trainer):
        self.t = trainer

    def register(self, cb) -> None:
        for event in ("on_pretrain_routine_end", "on_train_batch_end", "on_val_start"):
            cb.add(event, getattr(self, event))

    @staticmethod
    def _on(t) -> bool:
        from yolofast.engine.distributed import is_main_process

        return bool(t.args.plots) and is_main_process()

    def on_pretrain_routine_end(self, t) -> None:
        if not self._on(t):
            return
        from yolofast.val.plots import plot_labels, safe_plot

        labels = getattr(getattr(t.train_loader, "dataset", None), "labels", None)
        if not labels:
            return
        cls = np.concatenate([np.asarray(lb["cls"]).reshape(-1) for lb in labels])
        boxes = np.concatenate([np.asarray(lb["bboxes"]).reshape(-1, 4) for lb in labels])
        safe_plot("labels.jpg", plot_labels, cls, boxes, t.data["names"], t.save_dir / "labels.jpg")

    def on_train_batch_end(self, t) -> None:
        if t.epoch != t.start_epoch or t.batch_i >= 3 or not self._on(t):
            return
        from yolofast.val.plots import batch_boxes, plot_images, safe_plot

        b, name = t.batch, f"train_batch{t.batch_i}.jpg"
        h, w = b["img"].shape[2:]
        boxes = batch_boxes(b, h, w, min(len(b["img"]), 16))
        safe_plot(name, plot_images, b["img"][:16], boxes, t.data["names"], t.save_dir / name,
                  b.get("im_file"))

    def on_val_start(self, t) -> None:
        v = t.validator
        if hasattr(v, "plot_dir"):  # yolofast's Validator (a custom one draws nothing)
            final = t.epoch + 1 >= t.epochs or t.stop
            v.plot_dir = t.save_dir if final and self._on(t) else None
