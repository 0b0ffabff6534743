"""``Predictor``: source -> letterbox -> model -> NMS -> boxes in original pixels -> ``Results``.

With ``nms=False`` a YOLO26 model's one-to-one head answers instead: its top-k rows, thresholded by ``conf``
(and ``classes``), no NMS (Ultralytics' ``nms=False``). The default (None) is NMS on the one-to-many head.

Consecutive images of the same size run as one batch (up to ``batch``), each letterboxed to the minimal
stride-multiple rectangle as Ultralytics does for one image, so a result never depends on the batch size.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import cv2
import numpy as np
import torch
from tqdm import tqdm

from yolofast.io.paths import increment_path  # the same folder rule as runs/train
from yolofast.predict.letterbox import letterbox, letterbox_shape, scale_boxes
from yolofast.predict.results import Results
from yolofast.predict.sources import Frame, count_items, iter_frames
from yolofast.val.nms import non_max_suppression, topk_filter

LOGGER = logging.getLogger("yolofast")

__all__ = ["Predictor"]


class Predictor:
    def __init__(self, model, imgsz: int = 640, conf: float = 0.25, iou: float = 0.7, max_det: int = 300,
                 classes=None, agnostic_nms: bool = False, half: bool = False, device=None, batch: int = 1,
                 save: bool = False, save_txt: bool = False, save_conf: bool = False,
                 project: str | Path = "runs/detect", name: str | None = "predict", exist_ok: bool = False,
                 verbose: bool = True, line_width: int | None = None, show_labels: bool = True,
                 show_conf: bool = True, nms: bool | None = None):
        self.model = model.eval()
        # nms=False on an end2end (YOLO26) model: its one-to-one head's top-k, no NMS; else NMS
        self.nms_free = nms is False and bool(getattr(model, "end2end", False))
        p = next(model.parameters())
        self.device = torch.device(device) if device not in (None, "") else p.device
        if isinstance(device, (int, str)) and str(device).isdigit():
            self.device = torch.device(f"cuda:{device}")
        if p.device != self.device:
            self.model.to(self.device)
        self.stride = int(max(getattr(model, "stride", torch.tensor([32.0])).max().item(), 32))
        if imgsz % self.stride:
            raise ValueError(f"predict: imgsz={imgsz} must be a multiple of the model stride {self.stride}")
        self.imgsz, self.conf, self.iou, self.max_det = imgsz, conf, iou, max_det
        self.classes = None if classes is None else [int(c) for c in np.atleast_1d(classes)]
        self.agnostic, self.half, self.batch = agnostic_nms, half, max(int(batch), 1)
        self.save, self.save_txt, self.save_conf = save, save_txt, save_conf
        self.project, self.name = Path(project), name or "predict"
        self.exist_ok, self.verbose = exist_ok, verbose
        self.plot_args = {"line_width": line_width, "labels": show_labels, "conf": show_conf}
        self.names = getattr(model, "names", None) or {i: str(i) for i in range(model.nc)}
        self.save_dir: Path | None = None
        self._writers: dict[str, cv2.VideoWriter] = {}

    def _autocast(self):
        if not self.half:
            return contextlib.nullcontext()
        dtype = torch.float16 if self.device.type == "cuda" else torch.bfloat16
        return torch.autocast(self.device.type, dtype=dtype)

    def _batches(self, frames):
        """Group consecutive frames of one kind and size into lists of at most ``batch``."""
        group, key = [], None
        for f in frames:
            k = ("t", tuple(f.img.shape)) if torch.is_tensor(f.img) else ("a", f.img.shape)
            if group and (k != key or len(group) == self.batch):
                yield group
                group = []
            group.append(f)
            key = k
        if group:
            yield group

    def _preprocess(self, group: list[Frame]):
        if torch.is_tensor(group[0].img):
            x = torch.stack([f.img for f in group]).to(self.device, torch.float32)
            if x.shape[2] % self.stride or x.shape[3] % self.stride:
                raise ValueError(f"predict: tensor input {tuple(x.shape)}: H and W must be multiples of the "
                                 f"stride {self.stride} (tensors are used as is, without letterbox)")
            origs = [np.ascontiguousarray((f.img.permute(1, 2, 0).cpu().numpy()[..., ::-1] * 255)
                                          .clip(0, 255).astype(np.uint8)) for f in group]
            return x, origs, [(1.0, (0, 0))] * len(group)
        shape = letterbox_shape(group[0].img.shape[:2], self.imgsz, self.stride)
        ims, maps = [], []
        for f in group:
            im, r, pad = letterbox(f.img, shape)
            ims.append(im)
            maps.append((r, pad))
        x = np.stack(ims)[..., ::-1].transpose(0, 3, 1, 2)  # BGR -> RGB, BHWC -> BCHW
        x = torch.from_numpy(np.ascontiguousarray(x)).to(self.device).float() / 255
        return x, [f.img for f in group], maps

    @torch.inference_mode()
    def _infer(self, group: list[Frame]) -> list[Results]:
        t0 = time.perf_counter()
        x, origs, maps = self._preprocess(group)
        t1 = time.perf_counter()
        with self._autocast():
            feats = self.model.forward_feats(x, one2one=True) if self.nms_free else \
                self.model.forward_feats(x)
        if self.nms_free:  # the head keeps >= 300 candidates so that a classes= filter still finds some
            pred = self.model.decode_one2one(feats, max(self.max_det, 300), self.agnostic)
        else:
            pred = self.model.decode([f.float() for f in feats])
        t2 = time.perf_counter()
        if self.nms_free:
            dets = topk_filter(pred, self.conf, self.max_det, classes=self.classes)
        else:
            dets = non_max_suppression(pred, self.conf, self.iou, self.max_det, classes=self.classes,
                                       agnostic=self.agnostic)
        out = []
        for det, orig, (r, pad), f in zip(dets, origs, maps, group):
            det = det.float().clone()
            det[:, :4] = scale_boxes(det[:, :4], r, pad, orig.shape[:2])
            out.append(Results(orig, f.path, self.names, det))
        t3 = time.perf_counter()
        n = len(group)
        speed = {"preprocess": (t1 - t0) * 1e3 / n, "inference": (t2 - t1) * 1e3 / n,
                 "postprocess": (t3 - t2) * 1e3 / n}
        for r_ in out:
            r_.speed = speed
        return out

    def _save(self, res: Results, frame: Frame):
        if self.save_dir is None:
            self.save_dir = increment_path(self.project / self.name, self.exist_ok)
            self.save_dir.mkdir(parents=True, exist_ok=True)
        stem = Path(frame.path).stem
        if self.save_txt:
            name = stem if frame.frame is None else f"{stem}_{frame.frame}"
            res.save_txt(self.save_dir / "labels" / f"{name}.txt", save_conf=self.save_conf)
        if not self.save:
            return
        if frame.frame is None:
            res.save(self.save_dir / Path(frame.path).name, **self.plot_args)
            return
        w = self._writers.get(frame.path)
        if w is None:
            cap = cv2.VideoCapture(frame.path)
            fps = cap.get(cv2.CAP_PROP_FPS) or 30
            cap.release()
            h, wd = res.orig_shape
            w = self._writers[frame.path] = cv2.VideoWriter(str(self.save_dir / f"{stem}.mp4"),
                                                            cv2.VideoWriter_fourcc(*"mp4v"), fps, (wd, h))
        w.write(res.plot(**self.plot_args))

    def stream(self, source):
        """Yield one ``Results`` per image / video frame of ``source``, in order."""
        total = count_items(source) if self.verbose else 0
        bar = tqdm(total=total, desc="predict", unit="img", disable=total < 2)
        try:
            for group in self._batches(iter_frames(source)):
                for res, frame in zip(self._infer(group), group):
                    if self.save or self.save_txt:
                        self._save(res, frame)
                    bar.update(1)
                    yield res
        finally:
            bar.close()
            for w in self._writers.values():
                w.release()
            self._writers.clear()
            if self.save_dir is not None and self.verbose:
                LOGGER.info(f"predict: results saved to {self.save_dir}")

    def __call__(self, source, stream: bool = False):
        gen = self.stream(source)
        return gen if stream else list(gen)
