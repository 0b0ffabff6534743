"""results.png: the curves of results.csv (losses, metrics) in a 2×5 grid, like Ultralytics' plot."""

from __future__ import annotations

import csv
from pathlib import Path

__all__ = ["plot_results"]

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
