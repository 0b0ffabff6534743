"""Image decoding for training: scaled JPEG decode, and the ``cache=ram`` / ``cache=disk`` image caches.

Every function returns the image as training reads it: BGR uint8, long side ``imgsz``, aspect kept.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import cv2
import numpy as np

from yolofast.data import augment as A

LOGGER = logging.getLogger("yolofast")
RAM_HEADROOM = 0.6  # cache=ram may take at most this share of the memory available now (workers, model)
_REDUCED = {8: cv2.IMREAD_REDUCED_COLOR_8, 4: cv2.IMREAD_REDUCED_COLOR_4, 2: cv2.IMREAD_REDUCED_COLOR_2}
_REPORTED: set[str] = set()


def cache_mode(cache) -> str:
    """``cache`` as the recipe gives it (False/True/"ram"/"disk"/"") -> "", "ram" or "disk"."""
    if cache in (None, False, "", "False", "false", "none"):
        return ""
    if cache in (True, "True", "true", "ram"):
        return "ram"
    if cache == "disk":
        return "disk"
    raise ValueError(f"cache={cache!r}: use false, ram (decoded images in memory) or disk (.npy files next "
                     f"to the images)")


def reduction(hw0, imgsz: int) -> int:
    """The JPEG scale-down factor (1, 2, 4 or 8) that still decodes at least ``imgsz`` on the long side."""
    long = max(hw0)
    for f in (8, 4, 2):
        if long >= f * imgsz:
            return f
    return 1


def read_image(path: str, imgsz: int, augment: bool, hw0=None):
    """-> (BGR image with long side imgsz, (h0, w0)), or None when it cannot be decoded.

    A training JPEG at least twice as large as needed (``hw0``, its size from the label scan) is decoded
    at 1/2, 1/4 or 1/8 scale by libjpeg (DCT scaling: ~3x faster at 1/2, and anti-aliased) and then
    resized to the same shape the full decode gives (from ``hw0``), so normalized labels stay exact."""
    f = reduction(hw0, imgsz) if (augment and hw0 is not None and path.lower().endswith((".jpg", ".jpeg"))) \
        else 1
    img = cv2.imread(path, _REDUCED[f]) if f > 1 else None
    if img is not None:
        h, w = img.shape[:2]
        if abs(h * f - hw0[0]) > f or abs(w * f - hw0[1]) > f:  # not the scanned orientation/size: refuse
            img = None
        else:
            h0, w0 = hw0
    if img is None:
        img = cv2.imread(path)  # BGR, EXIF orientation applied
        if img is None:
            return None
        h0, w0 = img.shape[:2]
    return A.resize_long_side(img, imgsz, augment, hw0=(h0, w0)), (h0, w0)


def available_memory() -> int:
    """Bytes of memory available to a new allocation (Linux MemAvailable; else free physical pages)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: do not refuse


def ram_cache_fits(shapes, imgsz: int, prefix: str = "") -> bool:
    """Whether ``cache=ram`` of images with original (h, w) ``shapes`` at long side imgsz fits in
    RAM_HEADROOM of the available memory; logs the sizes either way."""
    shapes = np.asarray(shapes, dtype=np.float64).reshape(-1, 2)
    r = np.minimum(imgsz / shapes.max(1), 1e9)
    need = int((np.round(shapes[:, 0] * r) * np.round(shapes[:, 1] * r) * 3).sum())
    avail = available_memory()
    if need > RAM_HEADROOM * avail:
        LOGGER.warning(f"{prefix}cache=ram needs {need / 2**30:.1f} GiB for {len(shapes)} images at imgsz "
                       f"{imgsz}, more than {RAM_HEADROOM:.0%} of the {avail / 2**30:.1f} GiB available: "
                       f"not caching. Use cache=disk, a smaller imgsz or fraction=, or free memory")
        return False
    LOGGER.info(f"{prefix}caching {len(shapes)} images in RAM ({need / 2**30:.2f} GiB of "
                f"{avail / 2**30:.1f} GiB available)")
    return True


def disk_path(im_file: str, imgsz: int) -> Path:
    """``cache=disk`` file of an image: ``<image>.yolofast-<imgsz>.npy`` next to it (its own name:
    Ultralytics' ``<stem>.npy`` holds another size)."""
    return Path(f"{im_file}.yolofast-{imgsz}.npy")


def read_disk_cached(im_file: str, imgsz: int, augment: bool, hw0, prefix: str = ""):
    """``read_image`` through the disk cache: the resized image is loaded from its .npy when present and
    valid, else decoded and saved (atomically) for the next epoch."""
    p = disk_path(im_file, imgsz)
    if p.is_file():
        try:
            img = np.load(p, allow_pickle=False)
            if img.dtype == np.uint8 and img.ndim == 3 and max(img.shape[:2]) == imgsz:
                return img, tuple(hw0) if hw0 is not None else img.shape[:2]
        except (OSError, ValueError):
            pass  # a broken cache file is decoded and written again
    out = read_image(im_file, imgsz, augment, hw0)
    if out is not None:
        tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                np.save(f, out[0], allow_pickle=False)
            os.replace(tmp, p)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if str(p.parent) not in _REPORTED:
                _REPORTED.add(str(p.parent))
                LOGGER.warning(f"{prefix}cache=disk: cannot write '{p}' ({e}); these images are decoded "
                               f"every epoch")
    return out
