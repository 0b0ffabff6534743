"""Label side of a YOLO-format data set: image-file discovery, image/label checks, the label scan and its
``<split>.yolofast.cache`` file."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np

from yolofast.data.config import IMG_FORMATS, DataError

LOGGER = logging.getLogger("yolofast")
# v2: numpy .npz without pickle, named <split>.yolofast.cache (Ultralytics owns <split>.cache: sharing that
# name made each engine rescan and overwrite the other's file on every run).
CACHE_VERSION = "yolofast-labels-2"
CACHE_SUFFIX = ".yolofast.cache"
COORD_TOL = 1e-3  # label corners may overshoot [0, 1] by this much (rounding in converters), then clipped
MIN_IMG_SIDE = 10  # px; smaller "images" are almost always broken files
_READONLY_REPORTED: set[str] = set()

try:  # header-only size/format check; Pillow comes with matplotlib
    from PIL import Image
except ImportError:  # pragma: no cover - fallback decodes with OpenCV
    Image = None


# ----------------------------------------------------------------------------------------------- files
def img2label_paths(im_files) -> list[str]:
    """.../images/.../x.jpg -> .../labels/.../x.txt (the last '/images/' only, like Ultralytics)."""
    sa, sb = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    out = []
    for f in im_files:
        head, sep, tail = str(f).rpartition(sa)
        p = f"{head}{sb}{tail}" if sep else str(f)
        out.append(os.path.splitext(p)[0] + ".txt")
    return out


def _is_image(p) -> bool:
    return os.path.splitext(str(p))[1][1:].lower() in IMG_FORMATS


def get_img_files(img_path) -> list[str]:
    """Image files of a folder (recursive), a .txt list (paths relative to the list's folder), a single
    image, or a list of those; sorted, absolute."""
    files = []
    for p in img_path if isinstance(img_path, (list, tuple)) else [img_path]:
        p = Path(p).expanduser()
        if p.is_dir():
            files += [str(f) for f in p.rglob("*") if _is_image(f)]
        elif p.is_file() and p.suffix == ".txt":
            parent = p.parent
            for line in p.read_text(encoding="utf-8").splitlines():
                line = line.strip()
                if line:
                    f = Path(line)
                    files.append(str(f if f.is_absolute() else parent / f))
        elif p.is_file() and _is_image(p):
            files.append(str(p))
        else:
            raise DataError(f"image source '{p}' does not exist or is not a folder / .txt list / image "
                            f"({', '.join(sorted(IMG_FORMATS))})")
    files = sorted({os.path.abspath(f) for f in files if _is_image(f)})
    if not files:
        raise DataError(f"no images ({', '.join(sorted(IMG_FORMATS))}) found in {img_path}")
    return files


# ---------------------------------------------------------------------------------------------- checks
def verify_image(im_file: str):
    """-> ((h, w), warning or None), or (None, reason) for an unusable image. Reads the header only,
    plus a full decode for JPEGs without their end marker."""
    fmt = "JPEG" if im_file.lower().endswith((".jpg", ".jpeg")) else None
    try:
        if Image is not None:
            with Image.open(im_file) as im:
                im.verify()
            with Image.open(im_file) as im:  # verify() leaves the object unusable; reopen for the size
                w, h = im.size
                fmt = im.format  # by content: a PNG named .jpg has no JPEG end marker to check
                if im.getexif().get(274, 1) in (5, 6, 7, 8):  # EXIF rotation by 90: OpenCV applies it
                    w, h = h, w
        else:
            img = cv2.imread(im_file)
            if img is None:
                raise ValueError("OpenCV cannot decode it")
            h, w = img.shape[:2]
    except Exception as e:  # PIL raises many types for broken files
        return None, f"unreadable image ({type(e).__name__}: {e})"
    if min(h, w) < MIN_IMG_SIDE:
        return None, f"image size {w}x{h} is below {MIN_IMG_SIDE} px"
    msg = None
    if fmt == "JPEG":
        with open(im_file, "rb") as f:
            f.seek(-2, 2)
            truncated = f.read() != b"\xff\xd9"
        if truncated:
            if cv2.imread(im_file) is None:
                return None, "truncated JPEG that OpenCV cannot decode"
            msg = "truncated JPEG (no end marker); it decodes, the missing tail is grey"
    return (h, w), msg


def parse_label_file(lb_file: str, nc: int | None):
    """Read one YOLO label file. Returns (cls (n,1), boxes (n,4) xywh in [0,1], problem, notes, stats):
    problem is a 'line N: reason' string when the file must be refused (its image is skipped), notes lists
    dropped boxes (duplicates, zero area). Lines with 1+2k values (k >= 3) are polygons -> their extent."""
    empty = np.zeros((0, 1), np.float32), np.zeros((0, 4), np.float32)
    with open(lb_file, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    rows, line_nos = [], []
    for ln, line in enumerate(lines, 1):
        parts = line.split()
        if not parts:
            continue
        try:
            vals = [float(v) for v in parts]
        except ValueError:
            return *empty, f"line {ln}: non-numeric value in {line.strip()!r}", [], {}
        if len(vals) != 5 and (len(vals) < 7 or len(vals) % 2 == 0):
            return *empty, f"line {ln}: expected 'class cx cy w h' (5 values), got {len(vals)}", [], {}
        if not all(np.isfinite(vals)):
            return *empty, f"line {ln}: non-finite value in {line.strip()!r}", [], {}
        c = vals[0]
        if c != int(c):
            return *empty, f"line {ln}: class {parts[0]!r} is not an integer", [], {}
        if c < 0 or (nc is not None and c >= nc):
            rng = f"[0, {nc})" if nc is not None else ">= 0"
            return *empty, f"line {ln}: class {int(c)} out of range {rng}", [], {}
        if len(vals) == 5:
            cx, cy, w, h = vals[1:]
            if w < 0 or h < 0:
                return *empty, f"line {ln}: negative width/height in {line.strip()!r}", [], {}
            x1, y1, x2, y2 = cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2
        else:
            xy = np.asarray(vals[1:]).reshape(-1, 2)
            (x1, y1), (x2, y2) = xy.min(0), xy.max(0)
        if min(x1, y1) < -COORD_TOL or max(x2, y2) > 1 + COORD_TOL:
            return *empty, (f"line {ln}: box corners ({x1:.4g}, {y1:.4g}, {x2:.4g}, {y2:.4g}) outside the "
                            f"normalized range [0, 1]"), [], {}
        rows.append((c, x1, y1, x2, y2))
        line_nos.append(ln)
    if not rows:
        return *empty, None, [], {}
    a = np.asarray(rows, dtype=np.float64)
    a[:, 1:] = a[:, 1:].clip(0, 1)
    notes, stats = [], {}
    zero = (a[:, 3] - a[:, 1] <= 0) | (a[:, 4] - a[:, 2] <= 0)
    if zero.any():
        stats["zero_area"] = int(zero.sum())
        notes.append(f"dropped {zero.sum()} zero-area box(es) (line "
                     f"{', '.join(str(line_nos[i]) for i in np.flatnonzero(zero))})")
    _, first = np.unique(a.astype(np.float32), axis=0, return_index=True)
    dup = np.ones(len(a), bool)
    dup[first] = False
    dup &= ~zero
    if dup.any():
        stats["duplicates"] = int(dup.sum())
        notes.append(f"dropped {dup.sum()} duplicate box(es) (line "
                     f"{', '.join(str(line_nos[i]) for i in np.flatnonzero(dup))})")
    a = a[~zero & ~dup]
    x1, y1, x2, y2 = a[:, 1:].T
    xywh = np.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], 1)
    return a[:, :1].astype(np.float32), xywh.astype(np.float32), None, notes, stats


def _check_one(args):
    """Check one image + its label file -> (label dict or None if refused, warning or None, stats)."""
    im_file, lb_file, nc = args
    shape, img_msg = verify_image(im_file)
    if shape is None:
        return None, f"{im_file}: {img_msg}; image skipped", {"corrupt": 1}
    stats, notes = {}, []
    if os.path.isfile(lb_file):
        try:
            cls, boxes, problem, notes, stats = parse_label_file(lb_file, nc)
        except OSError as e:
            problem = f"unreadable label file ({e})"
        if problem:
            where = f"{lb_file}:{problem[5:]}" if problem.startswith("line ") else f"{lb_file}: {problem}"
            return None, f"{where}; image skipped", {"corrupt": 1}
    else:  # no label file = background image (YOLO convention), counted in the summary
        cls, boxes = np.zeros((0, 1), np.float32), np.zeros((0, 4), np.float32)
        stats = {"missing": 1}
    parts = [f"{im_file}: {img_msg}"] if img_msg else []
    parts += [f"{lb_file}: {'; '.join(notes)}"] if notes else []
    stats = {**stats, "backgrounds": int(len(cls) == 0), "boxes": len(cls)}
    return {"im_file": im_file, "cls": cls, "bboxes": boxes, "shape": shape}, " | ".join(parts) or None, stats


# ----------------------------------------------------------------------------------------------- cache
def _files_hash(im_files, lb_files, nc) -> str:
    h = hashlib.sha256(f"{CACHE_VERSION}|{nc}".encode())
    for f in (*im_files, *lb_files):
        try:
            st = os.stat(f)
            h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{f}|-\n".encode())
    return h.hexdigest()


def _writable(folder: Path) -> bool:
    # Honour the permission bits even as root: a folder marked read-only (shared data) is left untouched.
    try:
        return os.access(folder, os.W_OK) and bool(folder.stat().st_mode & 0o222)
    except OSError:
        return False


def _load_cache(path: Path, key: str):
    """The cache at ``path`` if it is ours and current, else None (rescan). Read with allow_pickle=False:
    a crafted file there (a downloaded data set) can hold arrays only, nothing that runs."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if not isinstance(meta, dict) or (meta.get("version"), meta.get("hash")) != (CACHE_VERSION, key):
                return None
            files, counts, shapes = z["im_files"], z["counts"], z["shapes"]
            cls, boxes = z["cls"], z["bboxes"]
            if not (len(files) == len(counts) == len(shapes) and counts.sum() == len(cls) == len(boxes)):
                return None
            ends = np.cumsum(counts)
            labels = [{"im_file": str(f), "cls": cls[e - n:e], "bboxes": boxes[e - n:e],
                       "shape": tuple(int(v) for v in sh)}
                      for f, n, e, sh in zip(files, counts, ends, shapes)]
            return dict(version=CACHE_VERSION, hash=key, labels=labels, msgs=list(meta["msgs"]),
                        stats=dict(meta["stats"]))
    except Exception:  # missing, stale, corrupt or crafted (pickled objects are refused): rescan
        return None


def _cache_arrays(cache: dict) -> dict:
    labels = cache["labels"]
    meta = {k: cache[k] for k in ("version", "hash", "msgs", "stats")}
    return {
        "meta": np.array(json.dumps(meta)),
        "im_files": np.array([lab["im_file"] for lab in labels], dtype=str),
        "counts": np.array([len(lab["cls"]) for lab in labels], dtype=np.int64),
        "shapes": np.array([lab["shape"] for lab in labels], dtype=np.int64).reshape(-1, 2),
        "cls": np.concatenate([lab["cls"] for lab in labels] or [np.zeros((0, 1), np.float32)]),
        "bboxes": np.concatenate([lab["bboxes"] for lab in labels] or [np.zeros((0, 4), np.float32)]),
    }


def _save_cache(path: Path, cache: dict, prefix: str) -> None:
    folder = path.parent
    if not folder.is_dir():  # no labels folder at all: nothing worth caching (the scan warns)
        return
    if not _writable(folder):
        if str(folder) not in _READONLY_REPORTED:
            _READONLY_REPORTED.add(str(folder))
            LOGGER.info(f"{prefix}labels cache not saved: '{folder}' is read-only (labels are rescanned "
                        f"per run)")
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to a path
            np.savez(f, **_cache_arrays(cache))
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a cache
    except OSError as e:
        tmp.unlink(missing_ok=True)
        LOGGER.info(f"{prefix}labels cache not saved to '{path}': {e}")


def load_labels(im_files, nc, prefix="", use_cache=True):
    """Scan images + labels (or reuse ``<split>.yolofast.cache`` next to the labels folder; Ultralytics'
    ``<split>.cache`` there is neither read nor touched). Logs one warning per problem
    file and a summary. Returns (labels list of dicts for usable images, stats dict, from_cache bool)."""
    lb_files = img2label_paths(im_files)
    folder = Path(lb_files[0]).parent
    cache_path = folder.with_name(folder.name + CACHE_SUFFIX)
    key = _files_hash(im_files, lb_files, nc)
    cache = _load_cache(cache_path, key) if use_cache else None
    from_cache = cache is not None
    if cache is None:
        workers = min(8, os.cpu_count() or 1)
        with ThreadPoolExecutor(workers) as ex:
            results = list(ex.map(_check_one, [(i, lb, nc) for i, lb in zip(im_files, lb_files)]))
        stats = dict(images=0, backgrounds=0, missing=0, corrupt=0, boxes=0, duplicates=0, zero_area=0)
        labels, msgs = [], []
        for lab, msg, st in results:
            for k, v in st.items():
                stats[k] += v
            if lab is not None:
                labels.append(lab)
            if msg:
                msgs.append(msg)
        stats["images"] = len(labels)
        cache = dict(version=CACHE_VERSION, hash=key, labels=labels, msgs=msgs, stats=stats)
        if use_cache:
            _save_cache(cache_path, cache, prefix)
    for m in cache["msgs"]:
        LOGGER.warning(f"{prefix}{m}")
    s = cache["stats"]
    extra = "".join(f", {s[k]} {name}" for k, name in (("duplicates", "duplicate boxes removed"),
                                                          ("zero_area", "zero-area boxes removed")) if s[k])
    missing = f" ({s['missing']} without label file)" if s["missing"] else ""
    LOGGER.info(f"{prefix}{s['images']} images, {s['backgrounds']} backgrounds{missing}, {s['corrupt']} "
                f"corrupt, {s['boxes']} boxes{extra}{' (from cache)' if from_cache else ''}")
    if s["images"] and s["boxes"] == 0:
        LOGGER.warning(f"{prefix}no labels found; labels are read from '{Path(lb_files[0]).parent}' "
                       f"(the images path with its last /images/ replaced by /labels/)")
    return cache["labels"], dict(s), from_cache
