"""YOLO-format detection data set: sample loading, the mosaic buffer, the training augmentation order.
The label side (file discovery, checks, the label cache) is ``yolofast.data.labels``."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from yolofast.data import augment as A
from yolofast.data.collate import collate_fn
from yolofast.data.config import DataError
from yolofast.data.device_aug import check_device_hyp, plan_sample
from yolofast.data.imcache import cache_mode, ram_cache_fits, read_disk_cached, read_image
from yolofast.data.labels import get_img_files, load_labels

__all__ = ["HYP_DEFAULTS", "YOLODataset"]

LOGGER = logging.getLogger("yolofast")
HYP_DEFAULTS = dict(hsv_h=0.015, hsv_s=0.7, hsv_v=0.4, degrees=0.0, translate=0.1, scale=0.5, shear=0.0,
                    perspective=0.0, flipud=0.0, fliplr=0.5, mosaic=1.0, mixup=0.0, bgr=0.0, cutmix=0.0,
                    copy_paste=0.0)
_COPY_PASTE_REPORTED: list[bool] = []


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
        self._norm_xyxy: dict[int, np.ndarray] = {}  # normalized xyxy boxes of the images held (_pixel_xyxy)
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
        self.buffer, self._recent, self._norm_xyxy = [], {}, {}

    def buffer_state(self) -> list[int]:
        """The mosaic buffer's image indices, oldest first (with the generator's state: exact resume)."""
        return list(self.buffer)

    def set_buffer_state(self, indices) -> None:
        """Restore ``buffer_state()``; the images are decoded again when a mosaic first draws them."""
        self.buffer = [int(i) for i in indices][-self.max_buffer:] if self.max_buffer else []
        self._recent, self._norm_xyxy = {}, {}

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
            j = self.buffer.pop(0)
            self._recent.pop(j, None)
            self._norm_xyxy.pop(j, None)

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
        h, w = img.shape[:2]
        return i, img, ori, self._pixel_xyxy(i, h, w), self.labels[i]["cls"].copy()

    def _pixel_xyxy(self, i: int, h: int, w: int) -> np.ndarray:
        """Image i's boxes as pixel xyxy on its (h, w) image, a new array: (x -/+ w/2) x w, (y -/+ h/2) x h.
        The normalized corners are kept while the image is (in the mosaic buffer, or the RAM cache): a
        mosaic's 3 companions then cost one multiply each (1.4 us timed alone, against 9.0 us for the
        12 column ops before, 7 us for the 4 below)."""
        nx = self._norm_xyxy.get(i)
        if nx is None:
            b = self.labels[i]["bboxes"]
            nx, half = np.empty_like(b), b[:, 2:] / 2
            np.subtract(b[:, :2], half, out=nx[:, :2])
            np.add(b[:, :2], half, out=nx[:, 2:])
            if self.ims is not None or i in self._recent:
                self._norm_xyxy[i] = nx
        return nx * np.array((w, h, w, h), nx.dtype)

    # -- samples
    def _train_sample(self, index, mosaic_p: float):
        """(index, image, original shape, boxes, classes) of a mosaic or a single warped image: an image of
        its own (never the buffered or cached one), which the later steps may overwrite."""
        rng, hyp, s = self.rng, self.hyp, self.imgsz
        aff = {k: hyp[k] for k in ("degrees", "translate", "scale", "shear", "perspective")}
        if mosaic_p > 0 and rng.random() < mosaic_p:
            parts = [self._load(index)]  # first: a freshly decoded image joins the buffer it draws from
            parts += [self._load(j) for j in self._mosaic_companions(rng)]
            index, ori = parts[0][0], parts[0][2]
            img, boxes, cls = A.mosaic_affine([p[1] for p in parts], [p[3] for p in parts],
                                              [p[4] for p in parts], s, rng, **aff)
        else:
            shape = self._shape(index)
            index, loaded, ori, boxes, cls = self._load(index)
            img, r, (pw, ph) = A.letterbox(loaded, shape, scaleup=not self.rect)
            boxes = boxes * r + np.array([pw, ph, pw, ph], np.float32)
            img, boxes, cls = A.random_affine(img, boxes, cls, rng, **aff)
            if np.may_share_memory(img, loaded):  # no resize, pad or warp: the buffered/cached image itself
                img = np.array(img, order="C")
        return index, img, ori, boxes, cls

    def _shape(self, index):
        """Output (h, w) of sample ``index``: its rect batch's shape, else the square imgsz."""
        return tuple(int(v) for v in self.batch_shapes[self.batch_index[index]]) if self.rect else self.imgsz

    def __getitem__(self, index):
        if self.augment_device:  # decoded here for a CPU device, by nvJPEG on a CUDA one
            return plan_sample(self, index, "device" if self.augment_device.startswith("cuda") else "cpu")
        rng, hyp = self.rng, self.hyp
        if self.augment:
            # one read of the shared probabilities: 0.2 us, against 3.6 us for float(self._aug[k]) x 3
            mosaic_p, mixup_p, cutmix_p = self._aug.tolist()
            index, img, ori, boxes, cls = self._train_sample(index, mosaic_p)
            if mixup_p > 0 and rng.random() < mixup_p:
                _, img2, _, boxes2, cls2 = self._train_sample(int(rng.integers(len(self))), mosaic_p)
                img, boxes, cls = A.mixup(img, boxes, cls, img2, boxes2, cls2, rng)
            if cutmix_p > 0 and rng.random() < cutmix_p:
                _, img2, _, boxes2, cls2 = self._train_sample(int(rng.integers(len(self))), mosaic_p)
                img, boxes, cls = A.cutmix(img, boxes, cls, img2, boxes2, cls2, rng)
            # in place from here: img is the sample's own (mixup/cutmix keep that); RGB from here on
            img = A.augment_hsv(img, rng, hyp["hsv_h"], hyp["hsv_s"], hyp["hsv_v"], to_rgb=True, inplace=True)
            if rng.random() < hyp["flipud"]:
                img, boxes = A.flip_ud(img, boxes, inplace=True)
            if rng.random() < hyp["fliplr"]:
                img, boxes = A.flip_lr(img, boxes, inplace=True)
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
        xywh = _normalized_xywh(boxes, *img.shape[:2])
        if self.augment:  # RGB HWC; (3, h, w) is a view: the layout change is the device's (preprocess_batch)
            img = torch.from_numpy(img).permute(2, 0, 1)
        else:  # BGR HWC -> RGB CHW
            img = torch.from_numpy(np.ascontiguousarray(img[..., ::-1].transpose(2, 0, 1)))
        return {
            "img": img,
            "cls": torch.from_numpy(cls.reshape(-1, 1).astype(np.float32)),
            "bboxes": torch.from_numpy(xywh),
            "im_file": self.im_files[index],
            "ori_shape": tuple(ori),
            "resized_shape": tuple(resized),
            "ratio_pad": ratio_pad,
        }


def _normalized_xywh(boxes: np.ndarray, h: int, w: int) -> np.ndarray:
    """Pixel xyxy boxes -> float32 (n, 4) xywh normalized by the (h, w) image, the boxes clipped to it first:
    centre (x1 + x2) / 2w, (y1 + y2) / 2h, size (x2 - x1) / w, (y2 - y1) / h, each in float32 as before
    it was one op per column (4 ops on whole (n, 2) halves instead of ~16 on columns)."""
    b = boxes.reshape(-1, 4).astype(np.float32)
    np.clip(b, 0, np.array((w, h, w, h), np.float32), out=b)
    out = np.empty_like(b)
    np.add(b[:, :2], b[:, 2:], out=out[:, :2])
    np.subtract(b[:, 2:], b[:, :2], out=out[:, 2:])
    out /= np.array((2 * w, 2 * h, w, h), np.float32)
    return out
