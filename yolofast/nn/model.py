"""YOLOv8, YOLO11 and YOLO26 detection models: config (built-in name, yaml file or dict) -> DetectionModel.

Config structure (the Ultralytics yaml layout): ``nc``, ``scales`` {letter: [depth, width, max_channels]},
optional ``scale`` (a key of ``scales``) or explicit ``depth_multiple``/``width_multiple``/``max_channels``,
optional ``reg_max`` (16; YOLO26: 1), ``end2end`` (YOLO26: one-to-one head branches), ``head_cls_width``
(the class branch's width when it is not the rule's, as in a head fine-tuned from 80 classes) and ``ch``
(3), then
``backbone`` and ``head``: lists of ``[from, repeats, module, args]`` rows; ``from`` is -1 (previous
layer), a layer index or a list of them.
Channel args are scaled as ``ceil(min(c, max_channels) * width / 8) * 8``, repeats > 1 as
``max(round(n * depth), 1)``.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from pathlib import Path

import torch
from torch import nn

from yolofast.nn.attention import C2PSA
from yolofast.nn.blocks import SPPF, Bottleneck, C2f, C3k, C3k2, Concat, Upsample
from yolofast.nn.conv import Conv, DWConv
from yolofast.nn.head import Detect

LOGGER = logging.getLogger("yolofast")

# YOLOv8 detection architecture (P3/8, P4/16, P5/32 outputs). Channels are the l-scale (width 1.0) values.
YOLOV8 = {
    "nc": 80,
    "scales": {  # depth, width, max_channels
        "n": [0.33, 0.25, 1024],
        "s": [0.33, 0.50, 1024],
        "m": [0.67, 0.75, 768],
        "l": [1.00, 1.00, 512],
        "x": [1.00, 1.25, 512],
    },
    "backbone": [
        [-1, 1, "Conv", [64, 3, 2]],  # 0 P1/2
        [-1, 1, "Conv", [128, 3, 2]],  # 1 P2/4
        [-1, 3, "C2f", [128, True]],
        [-1, 1, "Conv", [256, 3, 2]],  # 3 P3/8
        [-1, 6, "C2f", [256, True]],
        [-1, 1, "Conv", [512, 3, 2]],  # 5 P4/16
        [-1, 6, "C2f", [512, True]],
        [-1, 1, "Conv", [1024, 3, 2]],  # 7 P5/32
        [-1, 3, "C2f", [1024, True]],
        [-1, 1, "SPPF", [1024, 5]],  # 9
    ],
    "head": [  # PAN-FPN: top-down (upsample + concat) then bottom-up (stride-2 conv + concat)
        [-1, 1, "Upsample", [None, 2, "nearest"]],
        [[-1, 6], 1, "Concat", [1]],  # cat backbone P4
        [-1, 3, "C2f", [512]],  # 12
        [-1, 1, "Upsample", [None, 2, "nearest"]],
        [[-1, 4], 1, "Concat", [1]],  # cat backbone P3
        [-1, 3, "C2f", [256]],  # 15 (P3/8 out)
        [-1, 1, "Conv", [256, 3, 2]],
        [[-1, 12], 1, "Concat", [1]],  # cat head P4
        [-1, 3, "C2f", [512]],  # 18 (P4/16 out)
        [-1, 1, "Conv", [512, 3, 2]],
        [[-1, 9], 1, "Concat", [1]],  # cat head P5
        [-1, 3, "C2f", [1024]],  # 21 (P5/32 out)
        [[15, 18, 21], 1, "Detect", ["nc"]],  # 22
    ],
}

_MODULES = {
    "Conv": Conv, "C2f": C2f, "SPPF": SPPF, "Bottleneck": Bottleneck, "Concat": Concat,
    "Upsample": Upsample, "nn.Upsample": Upsample, "Detect": Detect, "C3k2": C3k2, "C3k": C3k,
    "C2PSA": C2PSA, "DWConv": DWConv,
}
_NAMED = re.compile(r"^yolov8([nslmx])(\.yaml)?$", re.IGNORECASE)
# yolo11n.yaml, yolo26x, ... -> the bundled family yaml (cfg/yolo11.yaml, cfg/yolo26.yaml) at that scale
_FAMILY = re.compile(r"^(yolo11|yolo26)([nslmx])(\.yaml)?$", re.IGNORECASE)
_CHANNEL_ARG = (Conv, DWConv, C2f, C3k2, C3k, SPPF, Bottleneck, C2PSA)  # args[0] is a width to scale
_REPEAT = (C2f, C3k2, C3k, C2PSA)  # built once, with the depth-scaled repeat count as 3rd argument


KNOWN = "yolov8n/s/m/l/x, yolo11n/s/m/l/x, yolo26n/s/m/l/x"


def make_divisible(x: float, divisor: int = 8) -> int:
    return int(math.ceil(x / divisor) * divisor)


class DetectionModel(nn.Module):
    """A YOLO detector: ``self.model`` holds the layers in config order, the last one is ``Detect``.

    train mode ``forward(x)`` -> list of nl maps (B, 4*reg_max + nc, H/s, W/s), box channels first;
    eval mode -> (B, 4 + nc, A) decoded (cx, cy, w, h pixels, sigmoid scores). ``forward_feats`` gives the
    raw maps in either mode and ``decode`` turns them into the eval output.
    """

    def __init__(self, cfg: dict, ch: int = 3, nc: int = 80, verbose: bool = False):
        super().__init__()
        self.yaml = cfg
        self.model, self.save, strides, rows = _parse(cfg, ch, nc)
        head = self.model[-1]
        self.nc, self.reg_max = head.nc, head.reg_max
        self.stride = torch.tensor(strides, dtype=torch.float32)
        self._names = {i: f"class{i}" for i in range(self.nc)}
        if verbose:
            _print_table(rows)
            self.info()

    @property
    def names(self) -> dict[int, str]:
        return self._names

    @names.setter
    def names(self, value):
        if isinstance(value, (list, tuple)):
            value = dict(enumerate(value))
        names = {int(k): str(v) for k, v in dict(value).items()}
        if len(names) != self.nc:
            raise ValueError(f"model.names: got {len(names)} names for a model with nc={self.nc}; "
                             f"rebuild the model with build_model(cfg, nc={len(names)})")
        self._names = names

    @property
    def head(self) -> Detect:
        return self.model[-1]

    @property
    def end2end(self) -> bool:
        """True for a model with one-to-one (NMS-free) head branches (YOLO26): it trains with the
        end-to-end criterion, and ``nms=False`` makes its eval output the one-to-one top-k."""
        return self.head.end2end

    def set_head(self, nms: bool | None = None, max_det: int = 300, agnostic: bool = False) -> bool:
        """Choose what eval-mode ``forward`` returns. ``nms=False`` on an end2end model: the one-to-one
        branch's top-``max_det`` rows (B, k, 6) x1, y1, x2, y2, score, class (no NMS needed); otherwise
        (``None``, the default, or True) the one-to-many decode (B, 4+nc, A) for NMS. Returns whether the
        NMS-free output is on."""
        head = self.head
        head.nms_free = nms is False and head.end2end
        head.max_det, head.agnostic = int(max_det), bool(agnostic)
        return head.nms_free

    def _neck(self, x):
        """Run every layer but the head; returns the list of head inputs."""
        y = []
        for m in self.model[:-1]:
            if m.f != -1:
                x = y[m.f] if isinstance(m.f, int) else [x if j == -1 else y[j] for j in m.f]
            x = m(x)
            y.append(x if m.i in self.save else None)
        f = self.model[-1].f
        return [x if j == -1 else y[j] for j in ([f] if isinstance(f, int) else f)]

    def forward(self, x):
        return self.head(self._neck(x))

    def forward_feats(self, x, one2one: bool = False):
        """Raw head maps (list of nl (B, 4*reg_max + nc, H/s, W/s)) in train and eval mode alike: the
        one-to-many branch, or with ``one2one`` the one-to-one branch of an end2end model."""
        xs = self._neck(x)
        return self.head.forward_feats_one2one(xs) if one2one else self.head.forward_feats(xs)

    def forward_heads(self, x):
        """(one-to-many maps, one-to-one maps) of an end2end model from one pass through the network."""
        xs = self._neck(x)
        return self.head.forward_feats(xs), self.head.forward_feats_one2one(xs)

    def decode_one2one(self, feats, max_det: int = 300, agnostic: bool = False):
        """One-to-one raw maps -> (B, min(max_det, A), 6) rows x1, y1, x2, y2, score, class by descending
        score, unthresholded: what ``nms=False`` uses instead of NMS (see ``Detect.topk``)."""
        y = self.head.decode([f.float() for f in feats], xywh=False)
        return self.head.topk(y.transpose(1, 2), max_det, agnostic)

    def decode(self, feats):
        """Raw maps -> (B, 4 + nc, A): xywh pixels + sigmoid scores (what eval-mode forward returns)."""
        return self.head.decode(feats)

    def loss(self, batch: dict, preds=None):
        """Ultralytics' ``model.loss``: (loss vector (3,) x batch size, differentiable; items (3,) detached).

        batch: Ultralytics' dict (``img``, ``batch_idx``, ``cls``, ``bboxes`` normalised xywh). preds: the
        train-mode head output; None runs the model on ``batch["img"]`` (in eval mode: the raw maps of
        every branch). The criterion (``yolofast.loss.criterion_for``: YOLO26's end-to-end one, else v8's)
        is made on first use as ``self.criterion``; a YOLO26 run drives its epoch with
        ``self.criterion.set_epoch(epoch, epochs)``.
        """
        from yolofast.loss import criterion_for  # lazy: the criterion is built on the first loss call

        if getattr(self, "criterion", None) is None:
            self.criterion = criterion_for(self)
        if preds is None:
            if self.training:
                preds = self.forward(batch["img"])
            else:
                xs = self._neck(batch["img"])
                preds = self.head.forward_feats(xs)
                if self.end2end:
                    preds = {"one2many": preds, "one2one": self.head.forward_feats_one2one(xs)}
        return self.criterion.vector(preds, batch)

    def fuse(self) -> DetectionModel:
        """Fold every BatchNorm into its conv (for inference; the BN layers become Identity)."""
        for m in self.modules():
            if isinstance(m, Conv):
                m.fuse()
        return self

    def info(self, verbose: bool = True, imgsz: int = 640):
        """(layers, parameters, GFLOPs at imgsz x imgsz or None); prints a one-line summary when verbose."""
        layers = len(list(self.modules()))
        n_p = sum(p.numel() for p in self.parameters())
        n_g = sum(p.numel() for p in self.parameters() if p.requires_grad)
        try:
            gflops = _gflops(self, imgsz)
        except Exception:  # never let a summary break training (e.g. an unusual custom layer)
            gflops = None
        if verbose:
            name = self.yaml.get("name") or "model"
            fl = f", {gflops:.1f} GFLOPs" if gflops is not None else ""
            msg = f"{name} summary: {layers} layers, {n_p:,} parameters, {n_g:,} gradients{fl}"
            _emit(msg)
        return layers, n_p, gflops


@torch.no_grad()
def _gflops(model: DetectionModel, imgsz: int) -> float:
    """Conv multiply-adds x 2, counted with hooks on a (2*max_stride)^2 input and scaled to imgsz^2 —
    every conv output scales exactly with the input side for sizes that are multiples of the max stride."""
    p = next(model.parameters())
    s = int(model.stride.max()) * 2
    macs = [0]

    def hook(m, _inp, out):
        per_output = (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
        macs[0] += out.numel() // out.shape[0] * per_output

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    was_training = model.training
    try:
        model.eval()  # eval: BN running stats must not move
        x = torch.zeros(1, model.yaml.get("ch", 3), s, s, device=p.device, dtype=p.dtype)
        # an end2end model counts both head branch sets, as an unfused one runs both (Ultralytics too)
        model.forward_heads(x) if model.end2end else model.forward_feats(x)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return 2 * macs[0] * (imgsz / s) ** 2 / 1e9


def _parse(cfg: dict, ch: int, nc: int):
    """Build the layer list. Returns (nn.Sequential, save indices, head strides, table rows)."""
    depth, width = cfg.get("depth_multiple", 1.0), cfg.get("width_multiple", 1.0)
    max_ch = cfg.get("max_channels", float("inf"))
    reg_max = int(cfg.get("reg_max", 16))
    rows = list(cfg["backbone"]) + list(cfg["head"])
    chs, strides, layers, save, table = [], [], [], [], []
    legacy = True
    for i, row in enumerate(rows):
        if not (isinstance(row, (list, tuple)) and len(row) == 4):
            raise ValueError(f"model config layer {i}: expected [from, repeats, module, args], got {row!r}")
        f, n, name, args = row
        if name not in _MODULES:
            raise ValueError(f"model config layer {i}: unknown module {name!r}; known: {sorted(_MODULES)}")
        m = _MODULES[name]
        # Ultralytics' yamls write nn.Upsample's size as the string None
        args = [nc if a == "nc" else None if a == "None" else a for a in args]
        froms = [f] if isinstance(f, int) else list(f)
        for j in froms:
            if not (j == -1 or 0 <= j < i):
                raise ValueError(f"model config layer {i}: 'from' index {j} must be -1 or an earlier layer")
            if i == 0 and j != -1:
                raise ValueError("model config layer 0: 'from' must be -1 (the input image)")
        c_in = [ch if i == 0 else chs[j] for j in froms]
        s_in = [1.0 if i == 0 else strides[j] for j in froms]
        n_rep = max(round(n * depth), 1) if n > 1 else n
        s_out = s_in[0]
        if m in _CHANNEL_ARG:
            c2 = make_divisible(min(args[0], max_ch) * width, 8)
            args = [c_in[0], c2, *args[1:]]
            if m in _REPEAT:
                args.insert(2, n_rep)
                n_rep = 1
            if m is C3k2:
                legacy = False  # any C3k2 row: the head gets the depthwise class branch
                if cfg.get("scale") in ("m", "l", "x"):  # m/l/x: C3k inner blocks in every C3k2 row
                    args = args + [True] if len(args) == 3 else [*args[:3], True, *args[4:]]
            if m in (Conv, DWConv):
                s_out = s_in[0] * (args[3] if len(args) > 3 else 1)
        elif m is Concat:
            if len(set(s_in)) != 1:
                raise ValueError(f"model config layer {i}: Concat of inputs with different strides {s_in} "
                                 f"(from {froms}); add an Upsample or a stride-2 Conv")
            c2 = sum(c_in)
        elif m is Upsample:
            c2 = c_in[0]
            s_out = s_in[0] / (args[1] if len(args) > 1 else 2)
        elif m is Detect:
            if i != len(rows) - 1:
                raise ValueError(f"model config layer {i}: Detect must be the last layer")
            args = [args[0] if args else nc, c_in, s_in, reg_max, bool(cfg.get("end2end", False)), legacy,
                    cfg.get("head_cls_width")]
            c2 = None
        else:  # pragma: no cover - every _MODULES entry is handled above
            raise AssertionError(name)
        module = nn.Sequential(*(m(*args) for _ in range(n_rep))) if n_rep > 1 else m(*args)
        module.i, module.f, module.type = i, f, name
        save.extend(j for j in froms if j != -1)
        layers.append(module)
        chs.append(c2)
        strides.append(s_out)
        n_shown = n_rep if m not in _REPEAT else args[2]
        table.append((i, f, n_shown, sum(p.numel() for p in module.parameters()), name, args))
    if not isinstance(layers[-1], Detect):
        raise ValueError("model config: the last layer must be Detect")
    return nn.Sequential(*layers), sorted(set(save)), layers[-1].strides, table


def _print_table(rows):
    lines = [f"{'':>3}{'from':>20}{'n':>3}{'params':>10}  {'module':<12}arguments"]
    for i, f, n, n_p, name, args in rows:
        shown = [a for a in args if not isinstance(a, list)] if name == "Detect" else args
        lines.append(f"{i:>3}{str(f):>20}{n:>3}{n_p:>10}  {name:<12}{shown}")
    _emit("\n".join(lines))


def _emit(msg: str) -> None:
    """Log to the 'yolofast' logger when one is set up to show INFO, else print (a bare script)."""
    if LOGGER.isEnabledFor(logging.INFO) and LOGGER.hasHandlers():
        LOGGER.info(msg)
    else:
        print(msg)


def _load_cfg(cfg) -> dict:
    """Resolve cfg (a name like 'yolov8n', a yaml path or a dict) into a deep-copied config dict."""
    if isinstance(cfg, dict):
        return copy.deepcopy(cfg)
    if not isinstance(cfg, (str, Path)):
        raise TypeError(f"build_model(cfg=...): expected a name like 'yolov8n', a yaml path or a dict, "
                        f"got {type(cfg).__name__}")
    text = str(cfg)
    named = _NAMED.match(Path(text).name)
    if named and not Path(text).is_file():
        d = copy.deepcopy(YOLOV8)
        d["scale"] = named.group(1).lower()
        d["name"] = f"YOLOv8{d['scale']}"
        return d
    path = Path(text)
    family = _FAMILY.match(path.name)
    if family and not path.is_file():  # 'yolo26n' / 'yolo26n.yaml': the bundled family file at scale n
        fam, scale = family.group(1).lower(), family.group(2).lower()
        d = _read_yaml(Path(__file__).parent / "cfg" / f"{fam}.yaml")
        d.update(scale=scale, name=f"{fam}{scale}", yaml_file=f"{fam}{scale}.yaml")
        return d
    if not path.is_file():
        builtin = Path(__file__).parent / "cfg" / path.name
        if builtin.is_file():
            path = builtin
        else:
            raise FileNotFoundError(f"build_model(cfg={text!r}): not a known model ({KNOWN}) and no such "
                                    f"yaml file")
    d = _read_yaml(path)
    d.setdefault("yaml_file", str(path))
    m = re.search(r"yolo[v]?\d+([nslmx])", path.stem, re.IGNORECASE)
    if "scale" not in d and m and m.group(1).lower() in d.get("scales", {}):
        d["scale"] = m.group(1).lower()  # 'yolov8s.yaml' -> scale 's' of the file's scales table
    return d


def _read_yaml(path: Path) -> dict:
    import yaml

    with open(path, encoding="utf-8") as fh:
        d = yaml.safe_load(fh)
    if not isinstance(d, dict):
        raise ValueError(f"build_model: {path} does not hold a mapping")
    return d


def _resolve_scale(d: dict) -> None:
    """Fill depth_multiple/width_multiple/max_channels (explicit keys win over scales[scale])."""
    scales = d.get("scales") or {}
    scale = d.get("scale")
    explicit = all(k in d for k in ("depth_multiple", "width_multiple"))
    if scale is None and scales and not explicit:
        scale = next(iter(scales))
        LOGGER.warning(f"model config gives no scale; using the first one, {scale!r}. "
                       f"Pass cfg 'yolov8{scale}' or set 'scale' in the config to choose.")
    if scale is not None:
        if scale not in scales:
            raise ValueError(f"model config: scale {scale!r} not in scales {sorted(scales)}")
        dm, wm, mc = scales[scale]
        d["scale"] = scale
        d.setdefault("depth_multiple", dm)
        d.setdefault("width_multiple", wm)
        d.setdefault("max_channels", mc)
    d.setdefault("depth_multiple", 1.0)
    d.setdefault("width_multiple", 1.0)
    d.setdefault("max_channels", float("inf"))
    for k in ("backbone", "head"):
        if k not in d:
            raise ValueError(f"model config: missing {k!r} (a list of [from, repeats, module, args] rows)")


def build_model(cfg="yolov8n", nc: int | None = None, ch: int = 3, verbose: bool = False) -> DetectionModel:
    """Build a YOLOv8, YOLO11 or YOLO26 DetectionModel.

    cfg: 'yolov8n'..'yolov8x', 'yolo11n'..'yolo11x', 'yolo26n'..'yolo26x' (optionally with '.yaml'), a yaml
    path (Ultralytics' format; the scale letter is read from a name like 'yolo11s.yaml'), or a
    config dict (see the module docstring; ``scale`` picks a row of ``scales``, or give
    ``depth_multiple``/``width_multiple``/``max_channels`` directly).
    nc: number of classes; None -> the config's ``nc`` (80 for the built-ins). ch: input channels.
    """
    d = _load_cfg(cfg)
    if nc is not None:
        if d.get("nc") is not None and nc != d["nc"]:
            LOGGER.info(f"Overriding model config nc={d['nc']} with nc={nc}")
        d["nc"] = int(nc)
    d.setdefault("nc", 80)
    if ch != 3 or "ch" not in d:  # an explicit ch argument wins over the config's
        d["ch"] = int(ch)
    ch = d["ch"]
    _resolve_scale(d)
    d.setdefault("name", Path(d["yaml_file"]).stem if d.get("yaml_file") else "model")
    if not isinstance(d["nc"], int) or d["nc"] < 1:
        raise ValueError(f"build_model: nc must be a positive int, got {d['nc']!r}")
    return DetectionModel(d, ch=ch, nc=d["nc"], verbose=verbose)
