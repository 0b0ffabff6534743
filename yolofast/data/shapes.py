"""Built-in synthetic "shapes" detection set: filled shapes on noisy backgrounds, generated locally.

Small, deterministic, learnable in minutes on a CPU, so `yolofast train` works with no download.
Boxes are the extent of each shape's *visible* pixels (occluders removed), so labels are pixel-tight.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np

__all__ = ["SHAPE_NAMES", "make_shapes", "render_image", "shapes_cache_root"]

LOGGER = logging.getLogger("yolofast")
SHAPE_NAMES = ["circle", "square", "triangle", "star", "ellipse"]
VERSION = 1  # bump when the drawing changes so old cached sets are not reused
SIZE_RANGE = (0.05, 0.40)  # shape extent as a fraction of the image side
MAX_OBJECTS = 6
MIN_VISIBLE = 0.7  # an object keeps >= 70 % of its pixels under later shapes: labels stay unambiguous
SPLIT_CODE = {"train": 0, "val": 1}


def shapes_cache_root() -> Path:
    return Path(os.environ.get("YOLOFAST_CACHE") or Path.home() / ".cache" / "yolofast").expanduser()


def _polygon(cls: int, size: float, angle: float, rng) -> np.ndarray:
    """Vertices (k, 2) of a shape centred at 0 with extent ~size, rotated by angle (radians)."""
    r = size / 2
    if cls == 0:  # circle
        t = np.linspace(0, 2 * np.pi, 72, endpoint=False)
        pts = np.stack([np.cos(t), np.sin(t)], 1) * r
    elif cls == 1:  # square (side chosen so the rotated square spans ~size)
        pts = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], float) * r * 0.75
    elif cls == 2:  # equilateral triangle
        t = np.pi / 2 + np.arange(3) * 2 * np.pi / 3
        pts = np.stack([np.cos(t), np.sin(t)], 1) * r
    elif cls == 3:  # 5-pointed star, inner radius 0.45 r
        t = np.pi / 2 + np.arange(10) * np.pi / 5
        rad = np.where(np.arange(10) % 2 == 0, r, 0.45 * r)
        pts = np.stack([np.cos(t) * rad, np.sin(t) * rad], 1)
    else:  # ellipse, aspect 0.35-0.6 so it is never mistaken for a circle
        t = np.linspace(0, 2 * np.pi, 72, endpoint=False)
        pts = np.stack([np.cos(t) * r, np.sin(t) * r * rng.uniform(0.35, 0.6)], 1)
    c, s = math.cos(angle), math.sin(angle)
    return pts @ np.array([[c, s], [-s, c]])


def _background(rng, n: int) -> np.ndarray:
    """Float32 (n, n, 3): two-colour linear gradient + smooth colour blobs + a few clutter lines."""
    c1, c2 = rng.uniform(0, 255, 3).astype(np.float32), rng.uniform(0, 255, 3).astype(np.float32)
    a = rng.uniform(0, 2 * np.pi)
    k = 16  # built on a 16x16 grid and upscaled: both parts are smooth, and it is ~10x cheaper
    x = np.arange(k, dtype=np.float32) / (k - 1)
    t = x[None, :] * math.cos(a) + x[:, None] * math.sin(a)
    t = (t - t.min()) / (np.ptp(t) + 1e-6)
    blobs = cv2.resize(rng.normal(0, 30, (6, 6, 3)).astype(np.float32), (k, k), interpolation=cv2.INTER_CUBIC)
    bg = cv2.resize(c1 + (c2 - c1) * t[..., None] + blobs, (n, n), interpolation=cv2.INTER_LINEAR)
    for _ in range(rng.integers(0, 4)):  # thin clutter lines: edges that are not objects
        p = rng.integers(0, n, 4)
        cv2.line(bg, (int(p[0]), int(p[1])), (int(p[2]), int(p[3])), rng.uniform(0, 255, 3).tolist(),
                 int(rng.integers(1, 3)))
    return bg


def render_image(rng: np.random.Generator, imgsz: int = 256):
    """One image: (BGR uint8 (imgsz, imgsz, 3), cls (n,) int, boxes (n, 4) pixel xyxy (x2/y2 exclusive),
    masks (n, imgsz, imgsz) bool of the visible pixels)."""
    n = imgsz
    img = _background(rng, n)
    masks, classes = [], []
    areas = []
    for _ in range(int(rng.integers(1, MAX_OBJECTS + 1))):
        for _try in range(20):
            c = int(rng.integers(len(SHAPE_NAMES)))
            size = rng.uniform(*SIZE_RANGE) * n
            pts = _polygon(c, size, rng.uniform(0, 2 * np.pi), rng)
            lo, hi = pts.min(0), pts.max(0)
            centre = rng.uniform(-lo, n - hi)  # whole shape inside the image
            m = np.zeros((n, n), np.uint8)
            cv2.fillPoly(m, [np.round((pts + centre) * 16).astype(np.int32)], 1, cv2.LINE_8, shift=4)
            m = m.astype(bool)
            area = int(m.sum())
            if area < 16:
                continue
            if all((mk & ~m).sum() >= MIN_VISIBLE * a for mk, a in zip(masks, areas)):
                break
        else:
            continue
        # colour far from the local background so every shape is visible
        local = img[m].mean(0)
        for _c in range(10):
            colour = rng.uniform(0, 255, 3)
            if np.abs(colour - local).sum() > 120:
                break
        img[m] = colour
        masks = [mk & ~m for mk in masks] + [m]
        areas.append(area)
        classes.append(c)
    img += rng.integers(-10, 11, img.shape, dtype=np.int16)  # sensor-like noise, std ~6
    img = np.clip(img, 0, 255).astype(np.uint8)
    boxes = np.zeros((len(masks), 4), np.float32)
    for i, m in enumerate(masks):
        ys, xs = np.nonzero(m.any(1))[0], np.nonzero(m.any(0))[0]
        boxes[i] = xs[0], ys[0], xs[-1] + 1, ys[-1] + 1
    return img, np.array(classes, int), boxes, np.array(masks, bool).reshape(-1, n, n)


def _write_one(args):
    folder, split, i, imgsz, seed = args
    rng = np.random.default_rng([seed, SPLIT_CODE[split], i])  # per image: independent of n_train/n_val
    img, cls, boxes, _ = render_image(rng, imgsz)
    stem = f"{i:06d}"
    cv2.imwrite(str(folder / "images" / split / f"{stem}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 95])
    xywh = np.stack([(boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2,
                     boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]], 1) / imgsz
    lines = [f"{c} {x:.6f} {y:.6f} {w:.6f} {h:.6f}" for c, (x, y, w, h) in zip(cls, xywh)]
    (folder / "labels" / split / f"{stem}.txt").write_text("\n".join(lines) + "\n")


def make_shapes(root=None, n_train: int = 1000, n_val: int = 200, imgsz: int = 256, seed: int = 0) -> Path:
    """Generate (or reuse) the shapes set and return the path of its data yaml.

    root: parent folder (default $YOLOFAST_CACHE or ~/.cache/yolofast); the set lives in a sub-folder named
    by its parameters, built in a temporary folder and renamed when complete, so an interrupted run is
    never reused. Same parameters + seed -> the same files.
    """
    parent = Path(root).expanduser() if root is not None else shapes_cache_root()
    name = f"shapes-v{VERSION}-n{n_train}-v{n_val}-s{imgsz}-seed{seed}"
    folder = parent / name
    yaml_file = folder / "shapes.yaml"
    if yaml_file.exists():
        return yaml_file
    if folder.exists():  # not created by the rename below, so not a complete set
        shutil.rmtree(folder, ignore_errors=True)
    parent.mkdir(parents=True, exist_ok=True)
    LOGGER.info(f"generating shapes data set ({n_train} train + {n_val} val, {imgsz} px) in {folder}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=parent))
    try:
        jobs = []
        for split, count in (("train", n_train), ("val", n_val)):
            (tmp / "images" / split).mkdir(parents=True)
            (tmp / "labels" / split).mkdir(parents=True)
            jobs += [(tmp, split, i, imgsz, seed) for i in range(count)]
        with ThreadPoolExecutor(os.cpu_count() or 1) as ex:  # cv2/numpy release the GIL
            list(ex.map(_write_one, jobs))
        names = "\n".join(f"  {i}: {n}" for i, n in enumerate(SHAPE_NAMES))
        (tmp / "shapes.yaml").write_text(
            f"# yolofast synthetic shapes (seed {seed}, {imgsz} px)\npath: .\ntrain: images/train\n"
            f"val: images/val\nnc: {len(SHAPE_NAMES)}\nnames:\n{names}\n")
        try:
            os.rename(tmp, folder)
        except OSError:
            if not yaml_file.exists():  # not a concurrent generation that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return yaml_file
