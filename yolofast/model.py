"""``YOLO``: the Model-style entry Ultralytics users know.

    from yolofast import YOLO
    model = YOLO("yolov8n")                       # architecture, random init (no weights are downloaded)
    metrics = model.train(data="shapes", epochs=30, imgsz=256)   # -> Trainer(...).train()
    model.val(data="shapes")                      # validates the trained (best.pt EMA) weights
    dets = model.predict(images)                  # (B,3,H,W) float in [0,1] -> list of (n, 6) detections

``YOLO("runs/train/train/weights/best.pt")`` or ``YOLO("yolov8n.pt")`` (an Ultralytics YOLOv8 detect file)
loads its weights (the EMA when present) through ``yolofast.io``, which runs no code stored in the file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

__all__ = ["YOLO"]


class YOLO:
    """A model plus the train/val/predict calls that hand it to the Trainer and the Validator."""

    def __init__(self, model: str | Path | dict | nn.Module = "yolov8n", verbose: bool = False):
        self.ckpt_path: str | None = None
        self.ckpt: dict | None = None  # read_checkpoint(...) of a loaded .pt: weights, names, train_args
        self.trainer = None
        self.metrics: dict | None = None
        if isinstance(model, nn.Module):
            self.model, self.source = model, model
        elif isinstance(model, (str, Path)) and str(model).endswith(".pt"):
            from yolofast.io import model_from_checkpoint, read_checkpoint

            if not Path(model).is_file():
                raise FileNotFoundError(
                    f"YOLO({str(model)!r}): file not found. yolofast downloads no weights: use "
                    f"YOLO('{Path(model).stem}') to build the architecture, or a path to a yolofast or "
                    "Ultralytics (YOLOv8 detect) checkpoint")
            self.ckpt = read_checkpoint(model)  # safe: no pickle code runs, Ultralytics is not imported
            self.model = model_from_checkpoint(self.ckpt)
            self.ckpt_path, self.source = str(model), str(model)
        else:
            from yolofast.nn import build_model

            self.model, self.source = build_model(model, verbose=verbose), model

    @property
    def names(self) -> dict:
        return getattr(self.model, "names", None) or {i: str(i) for i in range(getattr(self.model, "nc", 0))}

    def train(self, trainer=None, **kwargs) -> dict:
        """Train with ``Trainer`` (or the subclass ``trainer``); recipe keys as in ``yolofast.cfg``.

        The architecture string is rebuilt for the data's classes; a loaded checkpoint is the starting
        point (or, with ``resume=True``, the run it belongs to continues); a module given to ``YOLO(...)``
        is trained as is. Afterwards ``self.model`` is best.pt's
        EMA model and the returned metrics are best.pt's.
        """
        from yolofast.engine.trainer import Trainer

        cls = trainer or Trainer
        if not (isinstance(cls, type) and issubclass(cls, Trainer)):
            raise TypeError(f"trainer= must be yolofast.Trainer or a subclass of it, got {cls!r}")
        if "model" in kwargs:
            raise TypeError("YOLO.train() got 'model'; the model is the one given to YOLO(...)")
        src = self.ckpt_path or self.source
        if kwargs.get("resume") is True and self.ckpt_path:
            # YOLO("run/weights/last.pt").train(resume=True) continues that run, not the newest under runs/
            kwargs["resume"] = self.ckpt_path
        self.trainer = cls(model=src, **kwargs)
        self.metrics = self.trainer.train()
        if self.trainer.best.exists():
            from yolofast.io import model_from_checkpoint, read_checkpoint

            self.ckpt = read_checkpoint(self.trainer.best)
            self.model = model_from_checkpoint(self.ckpt)
            self.ckpt_path = str(self.trainer.best)
        return self.metrics

    def val(self, data=None, **kwargs) -> dict:
        """Validate on ``data`` (default: the data it was trained on); keys imgsz, batch, conf, iou, ..."""
        from yolofast.val import validate

        if data is None:
            if self.trainer is None:
                raise ValueError("YOLO.val() needs data=... (no training run to take it from)")
            data = self.trainer.args.data
            kwargs.setdefault("imgsz", self.trainer.args.imgsz)
        return validate(self.model, data, **kwargs)

    @torch.inference_mode()
    def predict(self, images: torch.Tensor, conf: float = 0.25, iou: float = 0.7, max_det: int = 300):
        """images (B,3,H,W) float in [0,1] (H, W multiples of 32) -> list of (n, 6) [x1,y1,x2,y2,conf,cls]."""
        from yolofast.val.nms import non_max_suppression

        self.model.eval()
        p = next(self.model.parameters())
        return non_max_suppression(self.model(images.to(p.device, p.dtype)), conf, iou, max_det)

    __call__ = predict

    def info(self) -> str:
        n = sum(p.numel() for p in self.model.parameters())
        return f"{type(self.model).__name__}: {n:,} parameters, nc={getattr(self.model, 'nc', '?')}"
