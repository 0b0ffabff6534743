"""``export(model, format=...)``: the model out of yolofast, in the layouts Ultralytics users deploy.

- ``onnx``: one input ``images`` (B, 3, H, W) float RGB in [0, 1] and one output ``output0``
  (B, 4 + nc, anchors): cx, cy, w, h in input pixels, then the class probabilities -- the layout of
  Ultralytics' ONNX files, so code written for them runs unchanged. This is also a YOLO26 model's default
  (its one-to-many head, for NMS after the model). ``nms=False`` on a YOLO26 model exports the NMS-free
  one-to-one head instead: (B, min(max_det, anchors), 6) rows x1, y1, x2, y2, score, class id, sorted by
  score and not thresholded (filter by score yourself). Needs the ``export`` extra
  (``pip install "yolofast[export]"``: onnx, onnxruntime, onnxslim for ``simplify=True``).
- ``torchscript``: the same forward, traced (``torch.jit.load`` runs it without yolofast).
- ``ultralytics``: a checkpoint Ultralytics 8.4 loads (``YOLO("x_ultralytics.pt")``), so its TensorRT,
  CoreML or TFLite exporters are one command away. Needs ``ultralytics`` installed (an optional import
  used only here: yolofast never imports it otherwise).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from torch import nn

from yolofast.boxes import dist2bbox, make_anchors

LOGGER = logging.getLogger("yolofast")
FORMATS = ("onnx", "torchscript", "ultralytics")

__all__ = ["FORMATS", "export"]


class _Exported(nn.Module):
    """The eval-mode forward with the anchor cache bypassed (a traced dict lookup would freeze it)."""

    def __init__(self, model: nn.Module, nms_free: bool = False, max_det: int = 300):
        super().__init__()
        self.model, self.nms_free, self.max_det = model, nms_free, max_det

    def forward(self, x):
        head = self.model.head
        if self.nms_free:  # one-to-one head: xyxy decode, then its top-k rows (B, k, 6)
            feats = self.model.forward_feats(x, one2one=True)
            return head.topk(self._decode(head, feats, xywh=False).transpose(1, 2), self.max_det)
        return self._decode(head, self.model.forward_feats(x))

    @staticmethod
    def _decode(head, feats, xywh: bool = True):
        # The head's decode with fresh anchors: its cache is keyed by Python ints, which tracing would
        # freeze into the graph; make_anchors reads the traced sizes, so H and W can stay dynamic.
        b = feats[0].shape[0]
        y = torch.cat([f.reshape(b, head.no, -1) for f in feats], 2)
        box, cls = y.split((4 * head.reg_max, head.nc), 1)
        points, strides = make_anchors(feats, head.strides, 0.5)
        dbox = dist2bbox(head.dfl(box), points.transpose(0, 1).unsqueeze(0), xywh=xywh, dim=1)
        return torch.cat((dbox * strides.transpose(0, 1), cls.sigmoid()), 1)


def _prepare(model: nn.Module, imgsz, batch: int, half: bool, device, nms_free: bool = False,
             max_det: int = 300):
    m = copy.deepcopy(model).float().eval()
    for p in m.parameters():
        p.requires_grad_(False)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if half and device.type != "cuda":
        raise ValueError("export(half=True) needs a CUDA device (fp16 convolutions on the CPU are slow and "
                         "not what a deployment wants); pass device=0, or half=False")
    m.to(device)
    h, w = (imgsz, imgsz) if isinstance(imgsz, int) else tuple(imgsz)
    stride = int(max(getattr(m, "stride", torch.tensor([32.0])).max().item(), 32))
    if h % stride or w % stride:
        raise ValueError(f"export: imgsz={imgsz} must be a multiple of the model stride {stride}")
    x = torch.zeros(batch, 3, h, w, device=device)
    if half:
        m, x = m.half(), x.half()
    return _Exported(m, nms_free, max_det), x


def _onnx(wrapped, x, file: Path, dynamic: bool, opset: int | None, simplify: bool) -> Path:
    try:
        import onnx
    except ImportError as e:
        raise ImportError("export(format='onnx') needs the onnx package: pip install \"yolofast[export]\" "
                          "(onnx, onnxruntime, onnxslim)") from e
    out_axes = {0: "batch"} if wrapped.nms_free else {0: "batch", 2: "anchors"}  # (B, k, 6): k is fixed
    axes = {"images": {0: "batch", 2: "height", 3: "width"}, "output0": out_axes}
    axes = axes if dynamic else None
    # dynamo=False: the TorchScript-based exporter works offline with onnx alone (the dynamo one needs
    # onnxscript, which is not a dependency).
    torch.onnx.export(wrapped, (x,), str(file), dynamo=False, opset_version=opset or 17,
                      input_names=["images"], output_names=["output0"], dynamic_axes=axes,
                      do_constant_folding=True)
    proto = onnx.load(str(file))
    onnx.checker.check_model(proto)
    if simplify:
        try:
            import onnxslim
        except ImportError as e:
            raise ImportError("export(simplify=True) needs onnxslim: pip install onnxslim (or "
                              "\"yolofast[export]\"), or export with simplify=False") from e
        proto = onnxslim.slim(proto)
    names = getattr(wrapped.model, "names", {})
    for k, v in {"stride": int(wrapped.model.stride.max()), "names": str(dict(names)),
                 "imgsz": str(list(x.shape[2:])), "batch": str(x.shape[0]), "task": "detect",
                 "end2end": str(wrapped.nms_free)}.items():
        meta = proto.metadata_props.add()
        meta.key, meta.value = k, str(v)
    onnx.save(proto, str(file))
    return file


def _ultralytics(model: nn.Module, file: Path) -> Path:
    try:
        from ultralytics.nn.tasks import DetectionModel  # optional interop: only this function imports it
    except ImportError as e:
        raise ImportError(
            "export(format='ultralytics') writes a checkpoint for Ultralytics and needs it installed "
            "to build its model class: pip install ultralytics (yolofast itself never needs it); or export "
            "format='onnx' / 'torchscript'") from e
    import datetime

    scale = getattr(model, "scale", None) or _guess_scale(model)
    um = DetectionModel(f"yolov8{scale}.yaml", nc=model.nc, verbose=False)
    missing, unexpected = um.load_state_dict(model.float().state_dict(), strict=False)
    if missing or unexpected:
        raise ValueError(f"export(format='ultralytics'): the yolov8{scale} model Ultralytics built does not "
                         f"match this one ({len(missing)} missing, {len(unexpected)} unexpected tensors)")
    um.names = dict(model.names)
    torch.save({"model": um.half(), "ema": None, "optimizer": None, "epoch": -1,
                "train_args": {"task": "detect", "imgsz": 640}, "date": datetime.datetime.now().isoformat(),
                "version": "8.4.0"}, file)
    return file


def _guess_scale(model: nn.Module) -> str:
    """yolov8 n/s/m/l/x from the width of the first conv (16, 32, 48, 64, 80 channels)."""
    c = model.model[0].conv.weight.shape[0]
    scales = {16: "n", 32: "s", 48: "m", 64: "l", 80: "x"}
    if c not in scales:
        raise ValueError(f"export(format='ultralytics'): first conv has {c} channels, not a yolov8 n/s/m/l/x")
    return scales[c]


def export(model: nn.Module, format: str = "torchscript", weights: str | Path = "model.pt", imgsz=640,
           dynamic: bool = False, opset: int | None = None, half: bool = False, simplify: bool = False,
           batch: int = 1, device=None, file: str | Path | None = None, nms: bool | None = None,
           max_det: int = 300) -> str:
    """Export ``model`` (a yolofast DetectionModel) next to ``weights`` (``best.onnx`` for ``best.pt``)
    or to ``file``; returns the path written. See the module docstring for the formats; ``nms=False``
    exports a YOLO26 model's one-to-one head (top ``max_det`` rows), ``nms=None`` the one-to-many maps.
    ``nms=True`` (NMS inside the graph) is not supported yet."""
    if nms is True:
        raise ValueError("export(nms=True): NMS inside the exported graph is not supported yet; export with "
                         "nms=None (NMS after the model) or, for a YOLO26 model, nms=False (NMS-free)")
    nms_free = nms is False and bool(getattr(model, "end2end", False))
    fmt = str(format).lower()
    if fmt not in FORMATS:
        raise ValueError(f"export: format={format!r} is not supported; use one of {', '.join(FORMATS)} "
                         "(format='ultralytics' then gives Ultralytics' own exporters)")
    suffix = {"onnx": ".onnx", "torchscript": ".torchscript", "ultralytics": "_ultralytics.pt"}[fmt]
    out = Path(file) if file else Path(weights).with_name(Path(weights).stem + suffix)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "ultralytics":
        return str(_ultralytics(copy.deepcopy(model).cpu(), out))
    wrapped, x = _prepare(model, imgsz, batch, half, device, nms_free, max_det)
    with torch.no_grad():
        if fmt == "onnx":
            _onnx(wrapped, x, out, dynamic, opset, simplify)
        else:
            traced = torch.jit.trace(wrapped, (x,), check_trace=False)
            torch.jit.save(traced, str(out))
    LOGGER.info(f"export: wrote {out} ({out.stat().st_size / 2**20:.1f} MB)")
    return str(out)
