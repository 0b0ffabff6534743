"""The pictures a validation leaves (Ultralytics' file names), drawn from the validator's own numbers.

- ``BoxPR_curve.png``: per class the precision the reported AP50 integrates (``metrics.pr_samples``), so
  the area under each curve *is* that class's AP50 (COCO: mean of the 101 samples; ``map_convention=
  ultralytics``: their trapezoid integral); the bold mean's area is mAP50.
- ``BoxF1_curve.png``, ``BoxP_curve.png``, ``BoxR_curve.png``: per class against confidence at IoU 0.5; the
  bold F1 is the smoothed mean whose peak is the confidence the reported P and R are read at (the dotted
  line in all three).
- ``confusion_matrix.png`` / ``confusion_matrix_normalized.png`` (columns sum to 1): rows predicted, columns
  true, plus a background row (GT nothing found) and column (detections of nothing), at conf >= 0.25 and
  IoU >= 0.45 (Ultralytics' thresholds). The diagonal is the validator's own matching at that IoU, so it
  counts exactly the true positives there; unmatched detections and GT of different classes that overlap
  (IoU >= 0.45, largest IoU first) are the off-diagonal confusions (Ultralytics pairs boxes before looking
  at classes, which can move a true positive off the diagonal).
- ``labels.jpg``: instances per class, the boxes' centres and sizes; ``train_batch{0,1,2}.jpg`` and
  ``val_batch{0,1,2}_labels.jpg`` / ``_pred.jpg`` (conf >= 0.25): images with their boxes.

Drawing uses matplotlib's ``Figure`` (Agg, no display, no pyplot state) and OpenCV. A failing picture is one
warning line in the ``yolofast`` log; it never stops a run.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from yolofast.val.metrics import REC_THRESHOLDS, APResult, box_iou_np, match_indices

__all__ = ["CM_CONF", "CM_IOU", "ConfusionMatrix", "ValPlots", "plot_confusion_matrix", "plot_curves",
           "plot_images", "plot_labels", "safe_plot"]

LOGGER = logging.getLogger("yolofast")
CM_CONF, CM_IOU = 0.25, 0.45  # Ultralytics' confusion-matrix thresholds; also the pred pictures' conf
_MAX_LEGEND = 20  # more classes: thin grey lines without a legend entry each (Ultralytics draws the same)


def safe_plot(name: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; an exception becomes one warning line naming ``name`` and returns None."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a picture must never fail a training run
        LOGGER.warning(f"WARNING plots: {name} not written ({type(e).__name__}: {e}); the run goes on")
        return None


def _name(names: dict, c) -> str:
    return str(names.get(int(c), int(c)))


def _figure(figsize):
    from matplotlib.figure import Figure  # Figure + savefig = Agg canvas: headless, no pyplot globals

    return Figure(figsize=figsize, layout="constrained")


# ----------------------------------------------------------------------------------- confusion matrix
class ConfusionMatrix:
    """(nc + 1, nc + 1) counts, rows = predicted class, columns = true class; index nc = background."""

    def __init__(self, nc: int, conf: float = CM_CONF, iou: float = CM_IOU, convention: str = "coco"):
        self.nc, self.conf, self.iou, self.convention = nc, conf, iou, convention
        self.matrix = np.zeros((nc + 1, nc + 1), dtype=np.int64)

    def process(self, det, gt_boxes, gt_cls) -> None:
        """One image: det (n, 6) x1 y1 x2 y2 conf cls, gt_boxes (m, 4) xyxy, gt_cls (m,), same units."""
        det = np.asarray(det, np.float64).reshape(-1, 6)
        det = det[det[:, 4] >= self.conf]
        gt_boxes = np.asarray(gt_boxes, np.float64).reshape(-1, 4)
        gt_cls = np.asarray(gt_cls, np.int64).ravel()
        pc = det[:, 5].astype(np.int64)
        # Diagonal: the validator's matching (same convention) at IoU >= self.iou.
        gt_of = match_indices(det[:, :4], det[:, 4], pc, gt_boxes, gt_cls, iouv=np.array([self.iou]),
                              convention=self.convention)[:, 0]
        tp = gt_of >= 0
        gt_hit = np.zeros(len(gt_cls), dtype=bool)
        gt_hit[gt_of[tp]] = True
        np.add.at(self.matrix, (pc[tp], pc[tp]), 1)
        # Off-diagonal: leftover detections and GT of different classes, largest IoU first.
        d_left, g_left = np.nonzero(~tp)[0], np.nonzero(~gt_hit)[0]
        iou = box_iou_np(det[d_left, :4], gt_boxes[g_left])
        iou[pc[d_left][:, None] == gt_cls[g_left][None, :]] = -1
        di, gi = self._pair(iou, self.iou)
        np.add.at(self.matrix, (pc[d_left[di]], gt_cls[g_left[gi]]), 1)
        d_bg = np.setdiff1d(np.arange(len(d_left)), di)
        g_bg = np.setdiff1d(np.arange(len(g_left)), gi)
        np.add.at(self.matrix, (pc[d_left[d_bg]], self.nc), 1)  # detections of nothing
        np.add.at(self.matrix, (self.nc, gt_cls[g_left[g_bg]]), 1)  # GT nothing found

    @staticmethod
    def _pair(iou: np.ndarray, thr: float):
        """One-to-one (row, col) pairs with iou >= thr, taken in decreasing IoU."""
        r, c = np.nonzero(iou >= thr)
        order = np.argsort(-iou[r, c], kind="stable")
        rows, cols, used_r, used_c = [], [], set(), set()
        for i in order:
            if r[i] not in used_r and c[i] not in used_c:
                used_r.add(r[i])
                used_c.add(c[i])
                rows.append(r[i])
                cols.append(c[i])
        return np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64)

    def true_positives(self) -> np.ndarray:
        return np.diag(self.matrix)[:-1]


def plot_confusion_matrix(cm: ConfusionMatrix, names: dict, path, normalize: bool) -> Path:
    m = cm.matrix.astype(np.float64)
    if normalize:
        m = m / np.maximum(m.sum(0, keepdims=True), 1)  # each true class's column sums to 1
    n = cm.nc + 1
    labels = [_name(names, c) for c in range(cm.nc)] + ["background"]
    side = 9 if n <= 30 else min(9 + 0.09 * n, 24)  # 81 labels: 16 in, each tick ~0.2 in apart
    fig = _figure((side * 1.15, side))
    ax = fig.subplots()
    masked = np.ma.masked_where(m == 0, m)
    import matplotlib

    # Blues from 20 %: any non-zero cell is visibly blue; zero cells (masked) stay white
    cmap = matplotlib.colors.ListedColormap(matplotlib.colormaps["Blues"](np.linspace(0.2, 1, 256)))
    cmap = cmap.with_extremes(bad="white")
    from matplotlib.colors import Normalize, PowerNorm

    # counts: square-root colours, or one crowded class (COCO's person) leaves every other cell near white
    norm = Normalize(0, 1) if normalize else PowerNorm(0.5, vmin=0, vmax=max(m.max(), 1))
    im = ax.imshow(masked, cmap=cmap, norm=norm, aspect="equal")
    fig.colorbar(im, ax=ax, shrink=0.8)
    fs = 10 if n <= 30 else max(5.5, 10 - n / 14)  # 81 labels: 5.5 pt in ~11 pt per tick
    upright = n <= 12 and max(map(len, labels)) <= 10
    ax.set_xticks(range(n), labels, rotation=0 if upright else 90, fontsize=fs)
    ax.set_yticks(range(n), labels, fontsize=fs)
    ax.tick_params(length=0)
    if n <= 30:  # numbers in the cells only while they fit
        for (i, j), v in np.ndenumerate(m):
            if v:
                txt = f"{v:.2f}" if normalize else f"{int(v)}"
                ax.text(j, i, txt, ha="center", va="center", fontsize=7 if n > 15 else 9,
                        color="white" if norm(v) > 0.5 else "black")
    ax.set_xlabel("True")
    ax.set_ylabel("Predicted")
    title = "Confusion Matrix" + (" Normalized (columns sum to 1)" if normalize else "")
    n_det, n_gt = int(cm.matrix[:-1].sum()), int(cm.matrix[:, :-1].sum())
    ax.set_title(f"{title}\nconf ≥ {cm.conf:g}, IoU ≥ {cm.iou:g}: {n_det} detections, {n_gt} labels; "
                 f"diagonal = true positives")
    fig.savefig(path, dpi=150 if n <= 30 else 120)
    return Path(path)


# ----------------------------------------------------------------------------------- curves
def _class_lines(ax, x, ys, classes, names, values, fmt):
    """One line per class with its value in the legend; with more than 20 classes thin grey lines, and
    only the 5 lowest values in colour and in the legend (the classes to look at first)."""
    few = len(classes) <= _MAX_LEGEND
    if not few:
        for y in ys:
            ax.plot(x, y, linewidth=0.6, color="grey", alpha=0.4)
        ax.plot([], [], linewidth=0.6, color="grey", label=f"{len(classes)} classes, one line each; lowest:")
    show = range(len(classes)) if few else np.argsort(values, kind="stable")[:5]
    for i in show:
        ax.plot(x, ys[i], linewidth=1 if few else 1.5, color=_rgb(classes[i]),  # as in the images
                label=f"{_name(names, classes[i])} {values[i]:{fmt}}")


def _finish_axes(ax, xlabel, ylabel, title, legend_title=None, empty=False):
    if empty:  # an untrained model or the wrong data: say so instead of leaving a blank plot
        ax.text(0.5, 0.5, "no true positive at IoU 0.5: every curve is 0", ha="center", va="center",
                transform=ax.transAxes, fontsize=12, color="dimgrey")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(bbox_to_anchor=(1.02, 1), loc="upper left", fontsize=8, frameon=False, title=legend_title,
              title_fontsize=8, alignment="left")


def plot_pr_curve(r: APResult, names: dict, path) -> Path:
    fig = _figure((9, 6))
    ax = fig.subplots()
    _class_lines(ax, REC_THRESHOLDS, r.pr_curve, r.classes, names, r.ap50, ".3f")
    ax.plot(REC_THRESHOLDS, r.pr_curve.mean(0), linewidth=3, color="black",  # no class colour is black
            label=f"all classes {r.map50:.3f} mAP@0.5")
    _finish_axes(ax, "Recall", "Precision", "Precision-Recall Curve (IoU 0.5)",
                 f"AP50 = area under each curve ({r.convention})", empty=not r.pr_curve.any())
    fig.savefig(path, dpi=200)
    return Path(path)


def plot_conf_curve(r: APResult, names: dict, path, kind: str) -> Path:
    """kind: "F1", "Precision" or "Recall" against confidence; the dotted line is ``r.conf_thr``."""
    ys = {"F1": r.f1_curve, "Precision": r.p_curve, "Recall": r.r_curve}[kind]
    at = {"F1": r.f1, "Precision": r.p, "Recall": r.r}[kind]
    fig = _figure((9, 6))
    ax = fig.subplots()
    _class_lines(ax, r.px, ys, r.classes, names, at, ".2f")
    if kind == "F1":  # the curve whose peak the validator takes: smoothed mean
        mean, label = r.f1_mean(), f"all classes {r.f1_mean().max():.2f} at {r.conf_thr:.3f} (smoothed)"
    else:
        mean = ys.mean(0)
        label = f"all classes {at.mean():.2f} at {r.conf_thr:.3f} (reported)"
    ax.plot(r.px, mean, linewidth=3, color="black", label=label)  # no class colour is black
    ax.axvline(r.conf_thr, color="black", linestyle=":", linewidth=1,
               label="where the reported P, R are read")
    _finish_axes(ax, "Confidence", kind, f"{kind}-Confidence Curve (IoU 0.5)",
                 f"{kind} at conf {r.conf_thr:.3f}", empty=not r.r_curve.any())
    fig.savefig(path, dpi=200)
    return Path(path)


def plot_curves(r: APResult, names: dict, save_dir) -> dict:
    """BoxPR/F1/P/R_curve.png in ``save_dir``; {file name: path} of those written."""
    out = {}
    if r.pr_curve is None or not len(r.classes):
        LOGGER.warning("WARNING plots: no labels in the validation set, no PR/F1/P/R curves")
        return out
    for name, fn in (("BoxPR_curve.png", lambda p: plot_pr_curve(r, names, p)),
                     ("BoxF1_curve.png", lambda p: plot_conf_curve(r, names, p, "F1")),
                     ("BoxP_curve.png", lambda p: plot_conf_curve(r, names, p, "Precision")),
                     ("BoxR_curve.png", lambda p: plot_conf_curve(r, names, p, "Recall"))):
        p = safe_plot(name, fn, Path(save_dir) / name)
        if p is not None:
            out[name] = p
    return out


# ----------------------------------------------------------------------------------- labels.jpg
def plot_labels(cls, boxes, names: dict, path, max_boxes: int = 1000, seed: int = 0) -> Path:
    """cls (N,), boxes (N, 4) normalized xywh of a data set's labels -> labels.jpg: instances per class
    across the top (every class, so a missing one shows), box shapes, centres and sizes below."""
    from matplotlib.colors import PowerNorm
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import MaxNLocator

    cls = np.asarray(cls, np.int64).ravel()
    boxes = np.asarray(boxes, np.float64).reshape(-1, 4)
    nc = max(len(names), int(cls.max()) + 1 if len(cls) else 1)
    fig = _figure((15, 10))
    top, bottom = fig.subfigures(2, 1, height_ratios=[1, 1.15])
    a0 = top.subplots()
    a1, a2, a3 = bottom.subplots(1, 3)
    counts = np.bincount(cls, minlength=nc)
    colors = [_rgb(c) for c in range(nc)]
    a0.bar(range(nc), counts, color=colors)
    a0.set_ylabel("instances")
    a0.set_title(f"{len(cls)} instances, {int((counts > 0).sum())} of {nc} classes present")
    fs = 10 if nc <= 20 else max(6, 10 - nc / 20)  # 80 classes: 6 pt, ~12 pt per bar on 15 in
    a0.set_xticks(range(nc), [_name(names, c) for c in range(nc)], rotation=90 if nc > 8 else 0, fontsize=fs)
    a0.set_xlim(-0.6, nc - 0.4)
    a0.grid(axis="y", alpha=0.3)
    pick = np.random.default_rng(seed).permutation(len(cls))[:max_boxes]
    for c, (_, _, w, h) in zip(cls[pick], boxes[pick]):
        a1.add_patch(Rectangle((0.5 - w / 2, 0.5 - h / 2), w, h, fill=False, edgecolor=colors[c], alpha=0.4,
                               linewidth=0.8))
    a1.set(xlim=(0, 1), ylim=(1, 0), aspect="equal", xticks=[], yticks=[],
           xlabel="each box drawn about the image centre, to scale",
           title=f"box shapes ({len(pick)} of {len(cls)})")
    for ax, (i, j), (xl, yl), title in ((a2, (0, 1), ("x", "y"), "box centres (image coordinates)"),
                                        (a3, (2, 3), ("width", "height"), "box sizes (fraction of image)")):
        # square-root colours from 0: a lone box stays visible beside a crowded bin
        *_, im = ax.hist2d(boxes[:, i], boxes[:, j], bins=50, range=[[0, 1], [0, 1]], cmap="Blues",
                           norm=PowerNorm(0.5, vmin=0), cmin=1)
        cb = bottom.colorbar(im, ax=ax, shrink=0.6, label="boxes per bin")
        cb.ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlim=(0, 1), xlabel=xl, ylabel=yl, title=title, aspect="equal")
        ax.set_ylim((1, 0) if i == 0 else (0, 1))  # centres: y grows downwards, as in the image
    fig.savefig(path, dpi=100, pil_kwargs={"quality": 90})
    return Path(path)


def _rgb(c: int):
    from yolofast.predict.results import _color  # the colour a class has in predict's saved images

    b, g, r = _color(int(c))
    return (r / 255, g / 255, b / 255)


# ----------------------------------------------------------------------------------- images with boxes
def plot_images(images, boxes: list, names: dict, path, files=None, max_images: int = 16,
                max_side: int = 1920) -> Path:
    """A grid of up to ``max_images`` images with their boxes -> JPEG ``path``.

    images: (B, 3, H, W) RGB, uint8 or float in [0, 1] (tensor or array); boxes: per image an (n, 6) array
    x1 y1 x2 y2 conf cls in that image's pixels, conf NaN for labels (no score drawn); files: image paths,
    their names go on the tiles.
    """
    import cv2

    from yolofast.predict.results import _color

    imgs = images.detach().cpu().numpy() if hasattr(images, "detach") else np.asarray(images)
    imgs = imgs[:max_images]
    if imgs.dtype != np.uint8:
        imgs = (np.clip(imgs.astype(np.float32), 0, 1) * 255).round().astype(np.uint8)
    n, _, h, w = imgs.shape
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    s = min(1.0, max_side / max(rows * h, cols * w))
    th, tw = max(round(h * s), 1), max(round(w * s), 1)
    grid = np.full((rows * th, cols * tw, 3), 255, np.uint8)
    lw, fs = max(1, round(min(th, tw) / 320)), max(0.35, min(th, tw) / 900)
    for k in range(n):
        y0, x0 = (k // cols) * th, (k % cols) * tw
        tile = cv2.resize(np.ascontiguousarray(imgs[k].transpose(1, 2, 0)[..., ::-1]), (tw, th),
                          interpolation=cv2.INTER_AREA)
        for x1, y1, x2, y2, conf, c in np.asarray(boxes[k], np.float64).reshape(-1, 6):
            color = _color(int(c))
            p1, p2 = (int(x1 * s), int(y1 * s)), (int(x2 * s), int(y2 * s))
            cv2.rectangle(tile, p1, p2, color, lw, cv2.LINE_AA)
            text = _name(names, c) + ("" if math.isnan(conf) else f" {conf:.2f}")
            (ww, hh), _ = cv2.getTextSize(text, 0, fs, 1)
            ty = p1[1] - 2 if p1[1] - hh - 3 >= 0 else p1[1] + hh + 2
            cv2.rectangle(tile, (p1[0], ty - hh - 1), (p1[0] + ww, ty + 2), color, -1)
            cv2.putText(tile, text, (p1[0], ty), 0, fs, _ink(color), 1, cv2.LINE_AA)
        if files is not None and k < len(files):  # black on a white strip: readable on any image
            text = Path(str(files[k])).name[:40]
            (ww, hh), _ = cv2.getTextSize(text, 0, fs, 1)
            cv2.rectangle(tile, (0, th - hh - 6), (ww + 5, th), (255, 255, 255), -1)
            cv2.putText(tile, text, (2, th - 4), 0, fs, (0, 0, 0), 1, cv2.LINE_AA)
        cv2.rectangle(tile, (0, 0), (tw - 1, th - 1), (255, 255, 255), 1)
        grid[y0:y0 + th, x0:x0 + tw] = tile
    if not cv2.imwrite(str(path), grid, [cv2.IMWRITE_JPEG_QUALITY, 90]):
        raise OSError(f"could not write '{path}'")
    return Path(path)


def _ink(bgr) -> tuple:
    """Black text on light label colours (lime, cyan, yellow), white on dark ones."""
    b, g, r = bgr
    return (0, 0, 0) if 0.299 * r + 0.587 * g + 0.114 * b > 150 else (255, 255, 255)


def batch_boxes(batch: dict, h: int, w: int, n: int) -> list:
    """A collated batch's labels as per-image (k, 6) pixel boxes (conf NaN) for ``plot_images``."""
    bidx = _np(batch["batch_idx"]).reshape(-1).astype(np.int64)
    cls = _np(batch["cls"]).reshape(-1)
    xywh = _np(batch["bboxes"]).reshape(-1, 4) * np.array([w, h, w, h])
    xyxy = np.concatenate([xywh[:, :2] - xywh[:, 2:] / 2, xywh[:, :2] + xywh[:, 2:] / 2], 1)
    rows = np.concatenate([xyxy, np.full((len(cls), 1), np.nan), cls[:, None]], 1)
    return [rows[bidx == i] for i in range(n)]


def _np(x) -> np.ndarray:
    return x.detach().float().cpu().numpy() if hasattr(x, "detach") else np.asarray(x, np.float64)


# ----------------------------------------------------------------------------------- one validation
class ValPlots:
    """Collects what one validation's pictures need and writes them into ``save_dir``.

    ``add_batch`` (every batch: the confusion matrix; the first ``n_batches``: val_batch images) and
    ``finish(result)`` never raise: an error is one warning line and that picture is skipped.
    """

    def __init__(self, save_dir, names: dict, conf: float = CM_CONF, convention: str = "coco",
                 n_batches: int = 3):
        self.save_dir = Path(save_dir)
        self.names = dict(names)
        nc = max(self.names) + 1 if self.names else 1
        self.cm = ConfusionMatrix(nc, max(CM_CONF, conf), CM_IOU, convention)
        self.n_batches, self.files, self._failed = n_batches, {}, False

    def add_batch(self, bi: int, batch: dict, dets: list, h: int, w: int) -> None:
        if self._failed:
            return
        try:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            gts = batch_boxes(batch, h, w, len(dets))
            cpu = [d.detach().float().cpu().numpy() if hasattr(d, "detach") else np.asarray(d) for d in dets]
            for d, g in zip(cpu, gts):
                self.cm.process(d[:, :6], g[:, :4], g[:, 5])
            if bi < self.n_batches:
                self._batch_images(bi, batch, cpu, gts)
        except Exception as e:  # noqa: BLE001 - pictures never fail a validation
            self._failed = True
            LOGGER.warning(f"WARNING plots: confusion matrix and val_batch pictures stopped "
                           f"({type(e).__name__}: {e}); the run goes on")

    def _batch_images(self, bi, batch, dets, gts) -> None:
        files = batch.get("im_file")
        for suffix, boxes in (("labels", gts), ("pred", [d[d[:, 4] >= CM_CONF, :6] for d in dets])):
            name = f"val_batch{bi}_{suffix}.jpg"
            p = safe_plot(name, plot_images, batch["img"], boxes, self.names, self.save_dir / name, files)
            if p is not None:
                self.files[name] = p

    def finish(self, result: APResult) -> dict:
        """Write the curves and confusion matrices; returns {file name: path} of every picture written."""
        self.save_dir.mkdir(parents=True, exist_ok=True)
        if not self._failed:
            for name, norm in (("confusion_matrix.png", False), ("confusion_matrix_normalized.png", True)):
                p = safe_plot(name, plot_confusion_matrix, self.cm, self.names, self.save_dir / name, norm)
                if p is not None:
                    self.files[name] = p
        self.files.update(safe_plot("curves", plot_curves, result, self.names, self.save_dir) or {})
        return dict(self.files)
