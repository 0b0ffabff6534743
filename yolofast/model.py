"""``YOLO``: the Model-style entry Ultralytics users know.

    from yolofast import YOLO
    model = YOLO("yolov8n")                       # architecture, random init (no weights are downloaded)
    metrics = model.train(data="shapes", epochs=30, imgsz=256)   # -> Trainer(...).train()
    model.val(data="shapes")                      # validates the trained (best.pt EMA) weights
    results = model.predict("images/", save=True)   # list of Results: .boxes.xyxy/.conf/.cls, .plot()
    model.export(format="onnx")                   # (batch, 4 + nc, anchors) output, as Ultralytics' ONNX

``YOLO("runs/train/train/weights/best.pt")`` or ``YOLO("yolov8n.pt")`` (an Ultralytics YOLOv8 detect file)
loads its weights (the EMA when present) through ``yolofast.io``, which runs no code stored in the file.
"""

from __future__ import annotations

from pathlib import Path

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
        self.trainer = cls(model=src, _callbacks=getattr(self, "_callbacks", None), **kwargs)
        self.metrics = self.trainer.train()
        if self.trainer.best.exists():
            from yolofast.io import model_from_checkpoint, read_checkpoint

            self.ckpt = read_checkpoint(self.trainer.best)
            self.model = model_from_checkpoint(self.ckpt)
            self.ckpt_path = str(self.trainer.best)
        return self.metrics

    def val(self, data=None, **kwargs):
        """Validate on ``data`` (default: the data it was trained on); keys imgsz, batch, conf, iou,
        map_convention, ... Returns a ``DetMetrics``: the metrics dict, plus ``.box.map`` and the rest."""
        from yolofast.val import validate

        if data is None:
            if self.trainer is None:
                raise ValueError("YOLO.val() needs data=... (no training run to take it from)")
            data = self.trainer.args.data
            kwargs.setdefault("imgsz", self.trainer.args.imgsz)
        self.metrics = validate(self.model, data, **kwargs)
        return self.metrics

    def predict(self, source=None, stream: bool = False, **kwargs):
        """Detect objects in ``source``: an image/video path, folder, glob, .txt list, list of paths, numpy
        HWC BGR array, PIL image or (B,3,H,W) RGB tensor in [0, 1]. Keys: imgsz (640), conf (0.25), iou
        (0.7), max_det, classes, agnostic_nms, half, device, batch, save, save_txt, save_conf, project
        (runs/detect), name (predict), exist_ok, verbose, line_width, show_labels, show_conf.
        Returns a list of ``Results`` (a generator with ``stream=True``)."""
        from yolofast.predict import Predictor

        if source is None:
            raise ValueError("YOLO.predict() needs source=... (an image path, folder, array, tensor, ...)")
        return Predictor(self.model, **kwargs)(source, stream=stream)

    def __call__(self, source=None, stream: bool = False, **kwargs):
        return self.predict(source, stream=stream, **kwargs)

    def export(self, format: str = "torchscript", **kwargs) -> str:
        """Write the model as ``format`` ("torchscript", Ultralytics' default, "onnx" or "ultralytics");
        returns the file path.
        Keys: imgsz (640), dynamic, opset, half, simplify, batch, file (default: next to the weights)."""
        from yolofast.export import export

        base = self.ckpt_path or f"{self.source if isinstance(self.source, str) else 'model'}.pt"
        return export(self.model, format=format, weights=base, **kwargs)

    @property
    def callbacks(self):
        from yolofast.engine.callbacks import Callbacks

        if getattr(self, "_callbacks", None) is None:
            self._callbacks = Callbacks()
        return self._callbacks

    def add_callback(self, event: str, fn) -> None:
        """Run ``fn(trainer)`` on ``event`` (Ultralytics' names) in the next ``train()``."""
        self.callbacks.add(event, fn)

    def clear_callback(self, event: str) -> None:
        """Remove every callback of ``event`` added with ``add_callback``."""
        self.callbacks.set(event, [])

    def info(self) -> str:
        n = sum(p.numel() for p in self.model.parameters())
        return f"{type(self.model).__name__}: {n:,} parameters, nc={getattr(self.model, 'nc', '?')}"
