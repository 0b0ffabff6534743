"""Argument checks that run before any work starts (no data generated, no model built).

``validate_args(args, model_obj=None)`` raises ``CfgError`` naming the argument and what is valid:
``imgsz`` (a positive multiple of the max stride 32: the error gives the nearest valid sizes) and ``model``
(a built-in name, an existing yaml or .pt, or an nn.Module). ``device`` is checked by ``select_device``
and the data yaml (missing paths, names vs nc) by ``yolofast.data.check_data``, both in ``Trainer.__init__``.
"""

from __future__ import annotations

import re
from pathlib import Path

from torch import nn

from yolofast.cfg import CfgError

__all__ = ["validate_args", "check_imgsz", "check_model", "recipe_overrides", "MODEL_NAMES", "MAX_STRIDE"]

MAX_STRIDE = 32  # P5 output: the input must divide into 32-px cells at the coarsest level
MODEL_NAMES = tuple(f"{family}{s}" for family in ("yolov8", "yolo11", "yolo26") for s in "nsmlx")
_NAMED = re.compile(r"^(yolov8|yolo11|yolo26)[nsmlx](\.yaml)?$", re.IGNORECASE)


def recipe_overrides(overrides: dict) -> tuple[dict, object]:
    """(the recipe's keys, the nn.Module given as ``model`` or None): a module stands in the recipe by its
    class name (args.yaml and checkpoints record that), a Path ``data`` as a str."""
    overrides = dict(overrides)
    model_obj = overrides.get("model") if isinstance(overrides.get("model"), nn.Module) else None
    if model_obj is not None:
        overrides["model"] = type(model_obj).__name__
    if isinstance(overrides.get("data"), Path):
        overrides["data"] = str(overrides["data"])
    return overrides, model_obj


def check_imgsz(imgsz, stride: int = MAX_STRIDE, name: str = "imgsz") -> int:
    """``imgsz`` as an int, or CfgError naming the nearest valid sizes (multiples of ``stride``)."""
    if isinstance(imgsz, bool) or not isinstance(imgsz, (int, float)) or imgsz != int(imgsz):
        raise CfgError(f"{name}={imgsz!r} must be an integer multiple of {stride} (e.g. 640)")
    imgsz = int(imgsz)
    if imgsz < stride or imgsz % stride:
        lo = max(imgsz // stride * stride, stride)
        hi = lo + stride if lo <= imgsz else lo
        near = f"{lo} or {hi}" if lo != hi else f"{lo}"
        raise CfgError(f"{name}={imgsz} is not a multiple of the max stride {stride}; the nearest valid "
                       f"values are {near}")
    return imgsz


def check_model(model, model_obj=None) -> None:
    """A built-in name, a yaml file, a .pt file that exists, a dict, or an nn.Module."""
    if model_obj is not None or isinstance(model, dict):
        return
    if not isinstance(model, (str, Path)) or not str(model).strip():
        raise CfgError(f"model={model!r}: give a name ({', '.join(MODEL_NAMES)}), a model yaml, a yolofast "
                       f".pt checkpoint or an nn.Module")
    s = str(model)
    if _NAMED.match(Path(s).name) or Path(s).is_file():
        return
    if s.endswith(".pt"):
        raise CfgError(f"model={s!r}: checkpoint not found (yolofast downloads no weights); use one of "
                       f"{', '.join(MODEL_NAMES)} to train from scratch or a path to a yolofast or "
                       f"Ultralytics .pt")
    if s.endswith((".yaml", ".yml")):
        builtin = Path(__file__).resolve().parents[1] / "nn" / "cfg" / Path(s).name
        if builtin.is_file():
            return
        raise CfgError(f"model={s!r}: yaml file not found; valid model names: {', '.join(MODEL_NAMES)}")
    raise CfgError(f"model={s!r} is not a known model; valid names: {', '.join(MODEL_NAMES)} (or a model "
                   f"yaml / yolofast .pt path)")


def validate_args(args, model_obj=None) -> None:
    """Check ``args`` (a get_cfg namespace) in place; imgsz is normalised to an int."""
    args.imgsz = check_imgsz(args.imgsz)
    check_model(args.model, model_obj)


def training_data(args, world_size: int) -> dict:
    """The checked data dict of ``args.data`` (DataError on a wrong yaml), with single_cls applied; CfgError
    for a ``split`` the data lacks, rect under DDP, or a bad ``batch``."""
    from yolofast.data import check_data
    from yolofast.engine.autobatch import resolve_batch

    data = check_data(args.data)  # fails fast on a wrong yaml
    if args.single_cls:  # labels are still checked against the data's own classes
        data = {**data, "label_nc": data["nc"], "nc": 1, "names": {0: "item"}}
    if args.rect and world_size > 1:
        raise CfgError("rect=True trains in one process only (its batches follow one sorted order); "
                       "drop rect or run without torchrun")
    if args.split not in data:
        raise CfgError(f"split={args.split!r} but the data has no such split "
                       f"(it has {', '.join(k for k in ('train', 'val', 'test') if k in data)})")
    try:
        resolve_batch(args.batch)
    except ValueError as e:
        raise CfgError(str(e)) from None
    return data
