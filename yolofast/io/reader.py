"""``read_checkpoint(path)``: any supported ``.pt`` -> a plain dict of fp32 tensors and plain config.

Supported files:
* yolofast checkpoints (tensors + plain config, ``format`` = ``FORMAT``; they also load with
  ``torch.load(weights_only=True)``), and older yolofast ones that pickled whole modules;
* Ultralytics YOLOv8, YOLO11 and YOLO26 detection checkpoints (``best.pt`` stripped to an fp16 ``model``,
  a mid-run ``last.pt`` with ``ema`` and optimizer state, ``Model.save`` output).

Every file goes through the restricted unpickler of :mod:`yolofast.io.safe_pickle`, so no code stored in a
pickle runs and Ultralytics is never imported; its modules arrive as inert stubs whose state is read here.
"""

from __future__ import annotations

import copy
import os
import pickle
from pathlib import Path

import numpy as np
import torch

from yolofast.io import safe_pickle
from yolofast.io.errors import CheckpointError, UnsupportedCheckpointError
from yolofast.io.safe_pickle import Stub, stub_name

__all__ = ["FORMAT", "read_checkpoint", "load_pickle", "to_plain", "stub_state_dict"]

FORMAT = "yolofast/2"  # tensors + plain config; "yolofast/1" (implicit) pickled the modules

# Classes a supported model may be made of, by the last part of their pickled name. Conv2d..Identity are
# torch.nn's; the rest have the same names in yolofast.nn and ultralytics.nn.modules.
_LAYERS = {"DetectionModel", "Conv", "C2f", "Bottleneck", "SPPF", "Concat", "Detect", "DFL", "Upsample",
           "Conv2d", "BatchNorm2d", "SiLU", "MaxPool2d", "Sequential", "ModuleList", "Identity",
           "C3k2", "C3k", "C2PSA", "PSABlock", "Attention", "DWConv"}
# Ultralytics model classes by task (ultralytics.nn.tasks), for the refusal message.
_TASKS = {"SegmentationModel": "segment", "PoseModel": "pose", "OBBModel": "obb",
          "ClassificationModel": "classify", "RTDETRDetectionModel": "RT-DETR detect",
          "WorldModel": "YOLO-World detect", "YOLOEModel": "YOLOE detect", "YOLOESegModel": "YOLOE segment"}
# Layer classes that tell the family apart (the yaml name is used first when it has one).
_FAMILY = {"A2C2f": "YOLO12", "C3": "YOLOv5u", "SPPELAN": "YOLOv9",
           "RepNCSPELAN4": "YOLOv9", "SCDown": "YOLOv10", "PSA": "YOLOv10", "C2fCIB": "YOLOv10"}
_STEMS = {"yolo26": "YOLO26", "yolo12": "YOLO12", "yolo11": "YOLO11", "yolov10": "YOLOv10",
          "yolov9": "YOLOv9", "yolov6": "YOLOv6", "yolov5": "YOLOv5u", "yolov3": "YOLOv3u"}
SUPPORTED = ("YOLOv8, YOLO11 and YOLO26 detection (n/s/m/l/x: DetectionModel with a Detect head), "
             "from Ultralytics or yolofast")


def load_pickle(path: Path, map_location="cpu"):
    """torch.load through the restricted unpickler; every failure is a CheckpointError naming the file."""
    try:
        if os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true"):
            # torch then refuses any pickle_module; its own loader still reads yolofast's current files
            return torch.load(path, map_location=map_location, weights_only=True)
        return torch.load(path, map_location=map_location, pickle_module=safe_pickle, weights_only=False)
    except CheckpointError as e:
        raise type(e)(f"'{path}': {e}") from None
    except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError, AttributeError, ImportError,
            TypeError, KeyError, IndexError) as e:
        raise CheckpointError(
            f"checkpoint '{path}' ({path.stat().st_size} bytes) cannot be read: truncated, corrupt or not a "
            f"torch file ({type(e).__name__}: {str(e)[:200]}). yolofast writes checkpoints atomically, so a "
            f"truncated one was copied or written by another tool; use another checkpoint") from e


def to_plain(obj):
    """Stubs -> dicts of their public state, numpy -> python/tensors, Path -> str: data torch's
    ``weights_only`` loader accepts and no caller mistakes for a live object."""
    if isinstance(obj, Stub):
        return {k: to_plain(v) for k, v in vars(obj).items() if not k.startswith("_")}
    if isinstance(obj, dict):
        return {to_plain(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [to_plain(v) for v in obj]
        return tuple(items) if type(obj) is tuple else items  # a namedtuple becomes a plain list
    if isinstance(obj, (set, frozenset)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, np.ndarray):  # uint32 (numpy's MT19937 keys) -> int64: torch barely supports uint32
        return torch.from_numpy(obj.astype(np.int64) if obj.dtype == np.uint32 else obj.copy())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    return obj


def stub_state_dict(mod: Stub, prefix: str = "", _depth: int = 0) -> dict[str, torch.Tensor]:
    """What ``nn.Module.state_dict()`` would give for the pickled module ``mod`` (its stub)."""
    if _depth > 64:  # YOLOv8 nests 5 deep; a crafted file can make a module its own child
        raise CheckpointError(f"its module tree is deeper than 64 levels (at '{prefix[:60]}...'): a "
                              f"malformed checkpoint")
    d = vars(mod)
    out = {}
    for k, v in (d.get("_parameters") or {}).items():
        if v is not None:
            out[prefix + k] = v
    skip = d.get("_non_persistent_buffers_set") or set()
    for k, v in (d.get("_buffers") or {}).items():
        if v is not None and k not in skip:
            out[prefix + k] = v
    for k, m in (d.get("_modules") or {}).items():
        if isinstance(m, Stub):
            out.update(stub_state_dict(m, f"{prefix}{k}.", _depth + 1))
    return out


def _fp32(sd: dict) -> dict[str, torch.Tensor]:
    # Ultralytics stores fp16 (best.pt halves the EMA); training and parity checks run in fp32.
    return {k: (v.detach().float() if v.is_floating_point() else v.detach()) for k, v in sd.items()}


def _classes(mod: Stub) -> list[str]:
    seen, stack, visited = [], [mod], set()
    while stack:
        m = stack.pop()
        if id(m) in visited:  # a crafted cycle must not loop forever
            continue
        visited.add(id(m))
        name = stub_name(m)
        if name not in seen:
            seen.append(name)
        stack.extend(c for c in (vars(m).get("_modules") or {}).values() if isinstance(c, Stub))
    return seen


def _check_architecture(path: Path, model: Stub) -> Stub:
    """Refuse what yolofast cannot build, naming what the file holds; returns the Detect head's stub."""
    yaml = vars(model).get("yaml") if isinstance(vars(model).get("yaml"), dict) else {}
    yaml_name = yaml.get("yaml_file") or "no yaml"
    top = type(model).__qualname__
    layers = vars(model).get("_modules", {}).get("model")
    rows = list((vars(layers).get("_modules") or {}).values()) if isinstance(layers, Stub) else []
    head = rows[-1] if rows else None
    head_name = type(head).__qualname__ if head is not None else "none"
    found = f"{stub_name(model)} (yaml {yaml_name}, head {head_name})"
    if top in _TASKS:
        raise UnsupportedCheckpointError(
            f"'{path}' holds a {_TASKS[top]} model: {found}. yolofast supports {SUPPORTED}")
    if top != "DetectionModel" or head_name != "Detect":
        raise UnsupportedCheckpointError(f"'{path}' holds {found}. yolofast supports {SUPPORTED}")
    other = [c for c in _classes(model) if c.rsplit(".", 1)[-1] not in _LAYERS]
    if other:
        short = sorted({c.rsplit(".", 1)[-1] for c in other})
        stem = Path(str(yaml_name)).stem.lower()
        family = next((f for k, f in _STEMS.items() if k in stem), None) or next(
            (_FAMILY[s] for s in short if s in _FAMILY), "another architecture")
        raise UnsupportedCheckpointError(
            f"'{path}' holds {family} ({found}) with layers yolofast does not build: {', '.join(short)}. "
            f"yolofast supports {SUPPORTED}")
    return head


def _rows(rows) -> list:
    """Ultralytics yamls write ``None`` args as the string 'None' (nn.Upsample's size)."""
    return [[f, n, m, [None if a == "None" else a for a in args]] for f, n, m, args in rows]


def _build_cfg(path: Path, yaml: dict, nc: int, sd: dict) -> tuple[dict | str, str | None]:
    """(cfg for yolofast.nn.build_model, scale letter) from a pickled model's yaml and its tensors."""
    from yolofast.nn import YOLOV8

    if not isinstance(yaml, dict) or not {"backbone", "head"} <= set(yaml):
        raise CheckpointError(f"'{path}': the model records no architecture (yaml with backbone/head); "
                              f"cannot rebuild it")
    scales = yaml.get("scales") or {}
    scale = yaml.get("scale")
    if scale not in scales and scales and "model.0.conv.weight" in sd:
        # The first conv has 64 * width output channels (n 16, s 32, m 48, l 64, x 80): unique per scale.
        c0 = sd["model.0.conv.weight"].shape[0]
        scale = next((s for s, (_, w, mc) in scales.items() if int(np.ceil(min(64, mc) * w / 8) * 8) == c0),
                     None)
    cfg = {k: copy.deepcopy(v) for k, v in yaml.items() if k in (
        "scales", "depth_multiple", "width_multiple", "max_channels", "reg_max", "end2end", "name")}
    cfg.update(nc=nc, ch=int(yaml.get("channels", yaml.get("ch", 3))), backbone=_rows(yaml["backbone"]),
               head=_rows(yaml["head"]))
    if scale in scales:
        cfg["scale"] = scale
    same = (_rows(YOLOV8["backbone"]) == cfg["backbone"]
            and [[f, n, "Upsample" if m == "nn.Upsample" else m, a] for f, n, m, a in cfg["head"]]
            == _rows(YOLOV8["head"]) and scales == YOLOV8["scales"])
    width = class_width(sd, nc)
    if same and scale in scales and cfg["ch"] == 3 and width is None:
        return f"yolov8{scale}", scale  # the built-in config: the same model, named as users know it
    if width is not None:
        cfg["head_cls_width"] = width  # read from the weights: a fine-tuned head keeps its source's width
    family = _bundled_family(cfg, scale)
    if family and cfg["ch"] == 3 and width is None:
        return family, scale
    cfg.setdefault("name", Path(str(yaml.get("yaml_file", "model"))).stem)
    return cfg, scale


def class_width(sd: dict, nc: int) -> int | None:
    """The head's class-branch width (columns of the first level's final class conv, cv3.0.2) when it is
    not what the width rule max(C_P3, min(nc, 100)) gives (a head fine-tuned from other classes), else
    None."""
    w = next((v for k, v in sd.items() if k.endswith(".cv3.0.2.weight")), None)
    box = next((v for k, v in sd.items() if k.endswith(".cv2.0.0.conv.weight")), None)
    if w is None or box is None or w.dim() != 4:
        return None
    return None if int(w.shape[1]) == max(int(box.shape[1]), min(nc, 100)) else int(w.shape[1])


def _bundled_family(cfg: dict, scale) -> str | None:
    """'yolo26n' when cfg's rows, scales and head flags are those of the bundled family yaml."""
    from yolofast.nn.model import _load_cfg

    for fam in ("yolo11", "yolo26"):
        ref = _load_cfg(f"{fam}n")
        if (scale in ref["scales"] and cfg.get("scales") == ref["scales"]
                and cfg["backbone"] == _rows(ref["backbone"]) and cfg["head"] == _rows(ref["head"])
                and bool(cfg.get("end2end", False)) == bool(ref.get("end2end", False))
                and int(cfg.get("reg_max", 16)) == int(ref.get("reg_max", 16))):
            return f"{fam}{scale}"
    return None


def _names(raw, nc: int) -> dict[int, str]:
    if isinstance(raw, (list, tuple)):
        raw = dict(enumerate(raw))
    if isinstance(raw, dict) and len(raw) == nc:
        return {int(k): str(v) for k, v in raw.items()}
    return {i: str(i) for i in range(nc)}


def _from_pickled_model(path: Path, ckpt: dict) -> dict:
    """Ultralytics and older yolofast files: the model/EMA are pickled modules (stubs here)."""
    ema, model = ckpt.get("ema"), ckpt.get("model")
    picked = ema if isinstance(ema, Stub) else model
    if not isinstance(picked, Stub):
        kinds = {k: type(ckpt.get(k)).__name__ for k in ("model", "ema")}
        raise CheckpointError(f"'{path}' has no model to read (model/ema are {kinds}); expected a pickled "
                              f"DetectionModel or a yolofast checkpoint")
    source = "yolofast" if type(picked).__module__.startswith("yolofast.") else "ultralytics"
    if source == "ultralytics" and not type(picked).__module__.startswith("ultralytics."):
        raise UnsupportedCheckpointError(f"'{path}' holds {stub_name(picked)}. yolofast supports {SUPPORTED}")
    head = _check_architecture(path, picked)
    d = vars(picked)
    sd = _fp32(stub_state_dict(picked))
    nc = int(vars(head).get("nc") or d.get("nc") or (d.get("yaml") or {}).get("nc"))
    cfg, scale = _build_cfg(path, d.get("yaml"), nc, sd)
    names = _names(d.get("_names") if source == "yolofast" else d.get("names"), nc)
    stride = d.get("stride")
    info = {
        "source": source,
        "format": "ultralytics" if source == "ultralytics" else "yolofast/1",
        "state_dict": sd,
        "model_state_dict": _fp32(stub_state_dict(model)) if isinstance(model, Stub) else None,
        "ema_state_dict": sd if picked is ema else None,
        "cfg": cfg,
        "nc": nc,
        "names": names,
        "stride": [float(s) for s in stride] if stride is not None else None,
        "scale": scale,
        "train_state": {k: to_plain(v) for k, v in ckpt.items() if k not in ("model", "ema")},
    }
    return info


def _from_tensors(path: Path, ckpt: dict) -> dict:
    rec = ckpt.get("model_cfg")
    if not isinstance(rec, dict) or not isinstance(ckpt.get("model"), dict):
        raise CheckpointError(f"'{path}' says format {ckpt.get('format')!r} but has no model_cfg/model "
                              f"state_dict; the file is damaged")
    ema = ckpt.get("ema")
    sd = _fp32(ema if isinstance(ema, dict) else ckpt["model"])
    return {
        "source": "yolofast",
        "format": ckpt["format"],
        "state_dict": sd,
        "model_state_dict": _fp32(ckpt["model"]),
        "ema_state_dict": sd if isinstance(ema, dict) else None,
        "cfg": rec["cfg"],  # None: a custom module without a config (only its weights can be used)
        "nc": int(rec["nc"]) if rec.get("nc") is not None else None,
        "names": _names(rec.get("names"), int(rec["nc"] or 0)),
        "stride": rec.get("stride"),
        "scale": rec["cfg"].get("scale") if isinstance(rec["cfg"], dict) else None,
        "train_state": {k: v for k, v in ckpt.items() if k not in ("model", "ema", "model_cfg")},
    }


def read_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Read any supported checkpoint without running pickle code (see the module docstring).

    Returns a plain dict: ``state_dict`` (fp32; the EMA when the file has one), ``model_state_dict`` /
    ``ema_state_dict`` (or None), ``cfg`` (a ``build_model`` config: a name like 'yolov8n' or a dict),
    ``arch`` (its name), ``yaml`` (the config dict), ``scale``, ``nc``, ``names`` {int: str}, ``stride``,
    ``source`` ('ultralytics' | 'yolofast'), ``format``, ``train_args`` (dict or None), ``epoch`` and
    ``train_state`` (every other top-level entry: optimizer, scaler, rng, ... as plain data).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint '{path}' not found (yolofast downloads no weights)")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint '{path}' is empty (0 bytes): a crash while it was copied? Use "
                              f"another checkpoint (weights/last.pt, best.pt or epoch{{N}}.pt)")
    ckpt = load_pickle(path, map_location)
    if not isinstance(ckpt, dict) or not ({"model", "ema"} & set(ckpt)):
        keys = f" with keys {', '.join(map(str, list(ckpt)[:8]))}" if isinstance(ckpt, dict) else ""
        raise CheckpointError(f"'{path}' is not a model checkpoint (expected a dict with 'model'/'ema', "
                              f"got {type(ckpt).__name__}{keys})")
    try:
        info = _from_tensors(path, ckpt) if ckpt.get("format") == FORMAT else _from_pickled_model(path, ckpt)
    except CheckpointError as e:
        if str(path) in str(e):
            raise
        raise type(e)(f"checkpoint '{path}': {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:  # well-formed pickle, odd data
        raise CheckpointError(f"checkpoint '{path}' is malformed: {type(e).__name__}: {str(e)[:200]}") from e
    from yolofast.nn.model import _load_cfg

    cfg = info["cfg"]
    if cfg is None:
        info["arch"], info["yaml"] = ckpt["model_cfg"].get("class", "model"), None
    else:
        info["arch"] = cfg if isinstance(cfg, str) else str(cfg.get("name", "model"))
        info["yaml"] = _load_cfg(cfg)
    ts = info["train_state"]
    info["train_args"] = ts.get("train_args") if isinstance(ts.get("train_args"), dict) else None
    info["epoch"] = ts.get("epoch")
    info["path"] = str(path)
    return info
