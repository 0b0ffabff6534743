"""Inference sources -> a stream of ``Frame`` items (one image each), read lazily.

Accepted: an image or video file, a folder (its images and videos, sorted), a glob (``"imgs/*.jpg"``), a
``.txt`` file with one path per line, a list of any of those or of arrays, a numpy HWC BGR uint8 array (as
``cv2.imread`` gives), a PIL image (converted from RGB), and a (B,3,H,W) or (3,H,W) torch tensor, RGB float
in [0, 1] with H and W multiples of the model stride (used as is, no letterbox, as Ultralytics does).
An image file that cannot be decoded is reported with its path and skipped.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch

from yolofast.data.config import IMG_FORMATS

LOGGER = logging.getLogger("yolofast")
VID_FORMATS = {"avi", "m4v", "mkv", "mov", "mp4", "mpeg", "mpg", "webm", "wmv"}

__all__ = ["Frame", "VID_FORMATS", "count_items", "iter_frames", "resolve_paths"]


@dataclass
class Frame:
    """One image to run on: ``img`` BGR HWC uint8, or an RGB (3,H,W) float tensor already at model size."""

    img: np.ndarray | torch.Tensor
    path: str  # file path, or "image0.jpg" style names for in-memory inputs
    frame: int | None = None  # frame index for videos (0-based), None for images
    video_frames: int | None = None  # total frames of the video (when OpenCV knows it)


def _ext(p) -> str:
    return os.path.splitext(str(p))[1][1:].lower()


def _folder_files(d: Path) -> list[str]:
    return sorted(str(p) for p in d.iterdir() if p.is_file() and _ext(p) in IMG_FORMATS | VID_FORMATS)


def resolve_paths(source) -> list[str]:
    """A path, folder, glob or .txt list -> the sorted media files it names (FileNotFoundError if none)."""
    s = str(source)
    p = Path(s).expanduser()
    if p.is_dir():
        files = _folder_files(p)
    elif p.is_file() and _ext(p) == "txt":
        lines = [ln.strip() for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
        files = [str((p.parent / ln) if not Path(ln).is_absolute() and not Path(ln).exists() else ln)
                 for ln in lines]
    elif p.is_file():
        files = [s]
    elif any(c in s for c in "*?["):
        files = sorted(f for f in glob.glob(s, recursive=True) if _ext(f) in IMG_FORMATS | VID_FORMATS)
    else:
        raise FileNotFoundError(f"predict: source '{s}' does not exist (give an image or video file, a "
                                "folder, a glob such as 'images/*.jpg' or a .txt list of paths)")
    if not files:
        raise FileNotFoundError(f"predict: source '{s}' holds no images ({', '.join(sorted(IMG_FORMATS))}) "
                                f"or videos ({', '.join(sorted(VID_FORMATS))})")
    return files


def _is_pil(x) -> bool:
    return type(x).__module__.startswith("PIL.") and hasattr(x, "convert")


def _expand(source) -> list:
    """The source as a flat list of items, each a path (str), an array, a PIL image or a tensor."""
    if isinstance(source, (str, Path)):
        return resolve_paths(source)
    if isinstance(source, (list, tuple)):
        out = []
        for s in source:
            out += resolve_paths(s) if isinstance(s, (str, Path)) else [s]
        return out
    return [source]


def count_items(source) -> int:
    """Images (videos count their frames when OpenCV knows them) the source will yield; for progress bars."""
    n = 0
    for item in _expand(source):
        if isinstance(item, str) and _ext(item) in VID_FORMATS:
            cap = cv2.VideoCapture(item)
            n += max(int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), 1)
            cap.release()
        elif torch.is_tensor(item) and item.dim() == 4:
            n += item.shape[0]
        else:
            n += 1
    return n


def _read_video(path: str):
    cap = cv2.VideoCapture(path)
    if not cap.isOpened():
        LOGGER.warning(f"predict: cannot open video '{path}' (not a video or no codec for it); skipped")
        return
    total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) or None
    i = 0
    try:
        while True:
            ok, img = cap.read()
            if not ok:
                break
            yield Frame(img, path, i, total)
            i += 1
    finally:
        cap.release()


def _tensor_frames(t: torch.Tensor, k: int):
    if t.dim() == 3:
        t = t[None]
    if t.dim() != 4 or t.shape[1] != 3:
        raise ValueError(f"predict: a tensor source must be (B,3,H,W) or (3,H,W) RGB in [0,1], got "
                         f"{tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"predict: a tensor source must be float in [0,1], got {t.dtype} (divide a uint8 "
                         "image by 255)")
    for i in range(t.shape[0]):
        yield Frame(t[i], f"image{k + i}.jpg")


def iter_frames(source):
    """Yield a ``Frame`` per image / video frame / tensor row of ``source``, in order."""
    k = 0  # counter naming in-memory images image0.jpg, image1.jpg, ... (Ultralytics' names)
    for item in _expand(source):
        if isinstance(item, str):
            if _ext(item) in VID_FORMATS:
                yield from _read_video(item)
                continue
            img = cv2.imread(item) if Path(item).is_file() else None
            if img is None:
                why = "not found" if not Path(item).is_file() else "not an image or corrupt"
                LOGGER.warning(f"predict: cannot read image '{item}' ({why}); skipped")
                continue
            yield Frame(img, item)
        elif isinstance(item, np.ndarray):
            if item.ndim == 2:
                item = cv2.cvtColor(item, cv2.COLOR_GRAY2BGR)
            if item.ndim != 3 or item.shape[2] not in (3, 4):
                raise ValueError(f"predict: a numpy source must be HWC BGR (H, W, 3), got shape {item.shape}")
            yield Frame(np.ascontiguousarray(item[..., :3]), f"image{k}.jpg")
            k += 1
        elif _is_pil(item):
            rgb = np.asarray(item.convert("RGB"))
            name = getattr(item, "filename", "") or f"image{k}.jpg"
            yield Frame(np.ascontiguousarray(rgb[..., ::-1]), name)
            k += 1
        elif torch.is_tensor(item):
            frames = list(_tensor_frames(item, k))
            k += len(frames)
            yield from frames
        else:
            raise TypeError(f"predict: unsupported source of type {type(item).__name__}; give a path, "
                            "folder, glob, .txt list, list, numpy HWC BGR array, PIL image or BCHW tensor")
