"""YOLO-format detection data set: file discovery, label scan/validation/cache, sample loading."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset

from yolofast.data import augment as A
from yolofast.data.collate import collate_fn
from yolofast.data.config import IMG_FORMATS, DataError
from yolofast.data.device_aug import check_device_hyp, plan_sample
from yolofast.data.imcache import cache_mode, ram_cache_fits, read_disk_cached, read_image

LOGGER = logging.getLogger("yolofast")
# v2: numpy .npz without pickle, named <split>.yolofast.cache (Ultralytics owns <split>.cache: sharing that
# name made each engine rescan and overwrite the other's file on every run).
CACHE_VERSION = "yolofast-labels-2"
CACHE_SUFFIX = ".yolofast.cache"
COORD_TOL = 1e-3  # label corners may overshoot [0, 1] by this much (rounding in converters), then clipped
MIN_IMG_SIDE = 10  # px; smaller "images" are almost always broken files
HYP_DEFAULTS = dict(hsv_h=0.015, hsv_s=0.7, hsv_v=0.4, degrees=0.0, translate=0.1, scale=0.5, shear=0.0,
                    perspective=0.0, flipud=0.0, fliplr=0.5, mosaic=1.0, mixup=0.0, bgr=0.0, cutmix=0.0,
                    copy_paste=0.0)
_READONLY_REPORTED: set[str] = set()
_COPY_PASTE_REPORTED: list[bool] = []

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


# --------------------------------------------------------------------------------------------- dataset
class _BadImage(Exception):
    pass


class YOLODataset(Dataset):
    """YOLO-format detection data set.

    img_path: folder / .txt list / list of them. imgsz: square output side (rounded up to a multiple of
    stride). augment: mosaic + affine + mixup + cutmix + HSV + flips + BGR swap (train); else letterbox only
    (val). hyp: Ultralytics names (see HYP_DEFAULTS; other keys ignored). cache: False | True/"ram" keep the
    resized images in memory (when they fit) | "disk" .npy files of them next to the images. nc: number
    of classes (labels outside [0, nc) refuse their image).
    single_cls: every label becomes class 0. fraction: the first ratio (float) or count (int) of the sorted
    image files. rect: rectangular batches (``augment.rect_batch_shapes``; mosaic, mixup and cutmix off):
    the images are reordered by aspect ratio, and sample i is letterboxed to the shape of its batch of
    ``batch_size``; the loader must keep that order and batch size (no shuffle). pad: rect padding in strides.
    augment_device: None (augment here) or a device ("cpu", "cuda:0"): training samples are then plans
    (``device_aug.plan_sample``, same draws) that ``device_aug.apply_plans`` renders on that device.
    A sample is a dict: img (3, s, s) uint8 RGB, cls (n, 1) float32, bboxes (n, 4) float32 normalized
    xywh, im_file, ori_shape (h0, w0), resized_shape (h, w), ratio_pad ((r, r), (padw, padh)).
    """

    def __init__(self, img_path, imgsz=640, augment=True, hyp=None, stride=32, cache=False, prefix="",
                 nc=None, seed=0, single_cls=False, fraction=1.0, rect=False, batch_size=16, pad=0.0,
                 augment_device=None):
        super().__init__()
        if imgsz % stride:
            new = -(-imgsz // stride) * stride
            LOGGER.warning(f"{prefix}imgsz={imgsz} is not a multiple of stride {stride}; using {new}")
            imgsz = new
        self.img_path, self.imgsz, self.augment, self.stride, self.nc = img_path, imgsz, augment, stride, nc
        first = img_path[0] if isinstance(img_path, (list, tuple)) else img_path
        self.prefix = prefix or f"{Path(first).name}: "
        hyp = dict(hyp or {}) if hyp is None or isinstance(hyp, dict) else vars(hyp)
        self.hyp = {k: float(hyp[k]) if hyp.get(k) is not None else v for k, v in HYP_DEFAULTS.items()}
        im_files = get_img_files(img_path)
        n = len(im_files)
        count = fraction if isinstance(fraction, int) and fraction > 1 else max(1, round(n * fraction))
        if count < n:
            LOGGER.info(f"{self.prefix}fraction={fraction}: using the first {count} of {n} images")
            im_files = im_files[:count]
        self.labels, self.stats, self.from_cache = load_labels(im_files, nc, self.prefix)
        if not self.labels:
            raise DataError(f"{self.prefix}no usable images in {img_path} ({self.stats['corrupt']} corrupt); "
                            f"see the warnings above")
        if single_cls:  # copies: the label cache's arrays stay as read
            self.labels = [{**lb, "cls": np.zeros_like(lb["cls"])} for lb in self.labels]
        self.rect, self.rect_pad = bool(rect), pad
        if self.rect:  # reorder by aspect ratio; batch i of the loader is batch i of these shapes
            order = self._cut_rect_batches(batch_size)
            self.labels = [self.labels[i] for i in order]
            for k in ("mosaic", "mixup", "cutmix"):  # whole-image mixes need one shape: off (as Ultralytics)
                self.hyp[k] = 0.0
        if augment and self.hyp["copy_paste"] > 0 and not _COPY_PASTE_REPORTED:
            _COPY_PASTE_REPORTED.append(True)
            LOGGER.warning(f"{self.prefix}copy_paste={self.hyp['copy_paste']}: copy-paste moves instance "
                        f"segments and box-only labels have none, so it changes nothing here")
        self.im_files = [lb["im_file"] for lb in self.labels]
        # Shared memory so close_mosaic() reaches persistent DataLoader workers (they hold dataset copies).
        on = self.augment
        self._aug = torch.tensor([self.hyp["mosaic"] * on, self.hyp["mixup"] * on,
                                  self.hyp["cutmix"] * on]).share_memory_()
        self.rng = np.random.default_rng(seed)
        self._bad: set[int] = set()
        self.ims = None
        # Mosaic companions come from the images decoded last (see _mosaic_companions): at most
        # min(n, 8 batches, 1000) of them stay in memory, so a mosaic decodes one new image, not four.
        self.max_buffer = min(len(self), 8 * max(int(batch_size), 1), 1000) if augment else 0
        self.buffer: list[int] = []
        self._recent: dict[int, tuple] = {}
        # augment_device: training samples are plans (device_aug) that the device renders in preprocess_batch
        self.augment_device = str(augment_device) if (augment and augment_device not in (None, False, "")) \
            else None
        if self.augment_device:
            check_device_hyp(self.hyp)
            if self.rect:
                raise ValueError("augment_device renders square training images; rect=True needs the CPU "
                                 "path: leave augment_device unset or set rect=False")
        self.cache = cache_mode(cache)
        if self.cache == "ram" and ram_cache_fits([lb["shape"] for lb in self.labels], imgsz, self.prefix):
            self._cache_images()

    def __len__(self):
        return len(self.labels)

    collate_fn = staticmethod(collate_fn)

    def reseed(self, seed: int) -> None:
        """A fresh augmentation stream: the generator from ``seed`` and an empty mosaic buffer."""
        self.rng = np.random.default_rng(seed)
        self.buffer, self._recent = [], {}

    def buffer_state(self) -> list[int]:
        """The mosaic buffer's image indices, oldest first (with the generator's state: exact resume)."""
        return list(self.buffer)

    def set_buffer_state(self, indices) -> None:
        """Restore ``buffer_state()``; the images are decoded again when a mosaic first draws them."""
        self.buffer = [int(i) for i in indices][-self.max_buffer:] if self.max_buffer else []
        self._recent = {}

    def set_rect_batch_size(self, batch_size: int) -> None:
        """Re-cut the rect batches for a loader of ``batch_size`` (the images keep their aspect-ratio
        order, so loader batch i is again rect batch i). For a loader that starts at an epoch's first
        image: AutoBatch's size, or an out-of-memory halving on an epoch's first batch."""
        if not self.rect:
            return
        order = self._cut_rect_batches(batch_size)
        assert (order == np.arange(len(order))).all(), "rect labels lost their aspect-ratio order"

    def _cut_rect_batches(self, batch_size: int) -> np.ndarray:
        """Set batch_index/batch_shapes for rect batches of ``batch_size`` over the labels as they stand;
        returns the aspect-ratio order of the labels (``augment.rect_batch_shapes``)."""
        order, self.batch_index, self.batch_shapes = A.rect_batch_shapes(
            np.array([lb["shape"] for lb in self.labels], dtype=np.float64), self.imgsz, self.stride,
            batch_size, self.rect_pad)
        return order

    def close_mosaic(self) -> None:
        """Switch mosaic, mixup and cutmix off (the last `close_mosaic` epochs); affine/HSV/flips stay."""
        self._aug.zero_()
        self.hyp["mosaic"] = self.hyp["mixup"] = self.hyp["cutmix"] = 0.0

    # -- images
    def _cache_images(self):
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as ex:
            self.ims = list(ex.map(self._read, range(len(self))))
        nbytes = sum(im[0].nbytes for im in self.ims if im is not None)
        LOGGER.info(f"{self.prefix}cached images in RAM ({nbytes / 2**30:.2f} GiB)")

    def _read(self, i):
        hw0 = self.labels[i]["shape"]
        if self.cache == "disk":
            return read_disk_cached(self.im_files[i], self.imgsz, self.augment, hw0, self.prefix)
        return read_image(self.im_files[i], self.imgsz, self.augment, hw0)

    def load_image(self, i):
        """-> (BGR image with long side imgsz, (h0, w0)); raises _BadImage when it cannot be decoded.

        Training without a RAM cache keeps the last ``max_buffer`` distinct decoded images: image i joins
        the buffer when it is decoded (the oldest one leaves), and is reused while it stays there."""
        if self.ims is not None:
            im = self.ims[i]
        elif i in self._recent:
            im = self._recent[i]
        else:
            im = self._read(i)
            if im is not None and self.max_buffer:
                self._remember(i, im)
        if im is None:
            raise _BadImage(i)
        return im

    def _remember(self, i: int, im) -> None:
        if i in self.buffer:  # restored by set_buffer_state: decoded again, keeps its place
            self._recent[i] = im
            return
        self.buffer.append(i)
        self._recent[i] = im
        while len(self.buffer) > self.max_buffer:
            self._recent.pop(self.buffer.pop(0), None)

    def _mosaic_companions(self, rng) -> list[int]:
        """The 3 other images of a mosaic: drawn uniformly, with replacement, from the buffer of recently
        decoded images (the current one included); with a RAM cache every image is in memory, so from the
        whole set."""
        if self.ims is None and self.buffer:
            return [self.buffer[j] for j in rng.integers(0, len(self.buffer), 3).tolist()]
        return rng.integers(0, len(self), 3).tolist()

    def _load(self, i):
        """Image i with its labels (pixel xyxy on the resized image), or a replacement if i is unreadable."""
        for _ in range(16):
            if i not in self._bad:
                try:
                    img, ori = self.load_image(i)
                    break
                except _BadImage:
                    self._bad.add(i)
                    LOGGER.warning(f"{self.prefix}cannot read '{self.im_files[i]}' now; it is "
                                   f"replaced by another image of the set")
            i = int(self.rng.integers(len(self)))
        else:
            raise DataError(f"{self.prefix}no readable image found after 16 tries (files changed on disk?)")
        lab = self.labels[i]
        h, w = img.shape[:2]
        b = lab["bboxes"]
        xyxy = np.empty_like(b)
        xyxy[:, 0], xyxy[:, 2] = (b[:, 0] - b[:, 2] / 2) * w, (b[:, 0] + b[:, 2] / 2) * w
        xyxy[:, 1], xyxy[:, 3] = (b[:, 1] - b[:, 3] / 2) * h, (b[:, 1] + b[:, 3] / 2) * h
        return i, img, ori, xyxy, lab["cls"].copy()

    # -- samples
    def _train_sample(self, index):
        rng, hyp, s = self.rng, self.hyp, self.imgsz
        mosaic_p = float(self._aug[0])
        aff = {k: hyp[k] for k in ("degrees", "translate", "scale", "shear", "perspective")}
        if mosaic_p > 0 and rng.random() < mosaic_p:
            parts = [self._load(index)]  # first: a freshly decoded image joins the buffer it draws from
            parts += [self._load(j) for j in self._mosaic_companions(rng)]
            index, ori = parts[0][0], parts[0][2]
            img, boxes, cls = A.mosaic_affine([p[1] for p in parts], [p[3] for p in parts],
                                              [p[4] for p in parts], s, rng, **aff)
        else:
            shape = self._shape(index)
            index, img, ori, boxes, cls = self._load(index)
            img, r, (pw, ph) = A.letterbox(img, shape, scaleup=not self.rect)
            boxes = boxes * r + np.array([pw, ph, pw, ph], np.float32)
            img, boxes, cls = A.random_affine(img, boxes, cls, rng, **aff)
        return index, img, ori, boxes, cls

    def _shape(self, index):
        """Output (h, w) of sample ``index``: its rect batch's shape, else the square imgsz."""
        return tuple(int(v) for v in self.batch_shapes[self.batch_index[index]]) if self.rect else self.imgsz

    def __getitem__(self, index):
        if self.augment_device:  # decoded here for a CPU device, by nvJPEG on a CUDA one
            return plan_sample(self, index, "device" if self.augment_device.startswith("cuda") else "cpu")
        rng, hyp = self.rng, self.hyp
        if self.augment:
            index, img, ori, boxes, cls = self._train_sample(index)
            mixup_p = float(self._aug[1])
            if mixup_p > 0 and rng.random() < mixup_p:
                _, img2, _, boxes2, cls2 = self._train_sample(int(rng.integers(len(self))))
                img, boxes, cls = A.mixup(img, boxes, cls, img2, boxes2, cls2, rng)
            cutmix_p = float(self._aug[2])
            if cutmix_p > 0 and rng.random() < cutmix_p:
                _, img2, _, boxes2, cls2 = self._train_sample(int(rng.integers(len(self))))
                img, boxes, cls = A.cutmix(img, boxes, cls, img2, boxes2, cls2, rng)
            img = A.augment_hsv(img, rng, hyp["hsv_h"], hyp["hsv_s"], hyp["hsv_v"], to_rgb=True)  # RGB on
            if rng.random() < hyp["flipud"]:
                img, boxes = A.flip_ud(img, boxes)
            if rng.random() < hyp["fliplr"]:
                img, boxes = A.flip_lr(img, boxes)
            if hyp["bgr"] and rng.random() < hyp["bgr"]:
                img = np.ascontiguousarray(img[..., ::-1])  # RGB <-> BGR: the model sees the swapped order
            resized, ratio_pad = img.shape[:2], None
        else:
            shape = self._shape(index)
            index, img, ori, boxes, cls = self._load(index)
            resized = img.shape[:2]
            img, r, (pw, ph) = A.letterbox(img, shape, scaleup=not self.rect)
            boxes = boxes * r + np.array([pw, ph, pw, ph], np.float32)
            # relative to the original image, for mapping predictions back
            r0 = r * resized[0] / ori[0] if ori[0] else r
            ratio_pad = ((r0, r0), (pw, ph))
        h, w = img.shape[:2]
        boxes = boxes.reshape(-1, 4).astype(np.float32)
        boxes[:, 0::2] = boxes[:, 0::2].clip(0, w)
        boxes[:, 1::2] = boxes[:, 1::2].clip(0, h)
        xywh = np.stack([(boxes[:, 0] + boxes[:, 2]) / (2 * w), (boxes[:, 1] + boxes[:, 3]) / (2 * h),
                         (boxes[:, 2] - boxes[:, 0]) / w, (boxes[:, 3] - boxes[:, 1]) / h], 1)
        if self.augment:  # RGB HWC; (3, h, w) is a view: the layout change is the device's (preprocess_batch)
            img = torch.from_numpy(img).permute(2, 0, 1)
        else:  # BGR HWC -> RGB CHW
            img = torch.from_numpy(np.ascontiguousarray(img[..., ::-1].transpose(2, 0, 1)))
        return {
            "img": img,
            "cls": torch.from_numpy(cls.reshape(-1, 1).astype(np.float32)),
            "bboxes": torch.from_numpy(xywh.astype(np.float32)),
            "im_file": self.im_files[index],
            "ori_shape": tuple(ori),
            "resized_shape": tuple(resized),
            "ratio_pad": ratio_pad,
        }
