"""The training recipe: ``DEFAULTS`` (from default.yaml, DESIGN §4 names) and ``get_cfg(**overrides)``.

``get_cfg`` returns a ``types.SimpleNamespace`` holding every key; a key that is not a recipe key is a
``CfgError`` naming the closest valid keys, a key of Ultralytics' default.yaml that belongs to another task
(``overlap_mask``, ``pose``, ...) is refused naming that task (``OTHER_TASK_KEYS``), and a value of the wrong
kind (``epochs="ten"``) is refused with the key and the expected type. ``cfg=file.yaml`` replaces the
defaults with that file's keys; keys given directly win over it. ``QUICKSTART`` holds the defaults
``yolofast train`` uses on the built-in shapes set (measured to finish in minutes on a 2-core CPU);
``Trainer(...)`` keeps ``DEFAULTS``.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from types import SimpleNamespace

import yaml

__all__ = ["DEFAULTS", "QUICKSTART", "OTHER_TASK_KEYS", "CfgError", "get_cfg", "check_keys",
           "DEFAULT_CFG_PATH", "quantize_half"]

DEFAULT_CFG_PATH = Path(__file__).with_name("default.yaml")


class CfgError(ValueError):
    """An unknown recipe key or a value of the wrong type; the message names the key and the fix."""


def _load_defaults() -> dict:
    with open(DEFAULT_CFG_PATH, encoding="utf-8") as f:
        return yaml.safe_load(f)


DEFAULTS: dict = _load_defaults()

# `yolofast train` with the shapes data (1000 train / 200 val images): a real yolov8n run sized so that a
# 2-core CPU WITHOUT native bf16 (AVX2 only: fp32 there, bf16 would be emulated at ~0.1x) finishes in about
# 5 minutes: 7 epochs at 192 px. Measured under AVX2 emulation on the 2-core dev CPU (fp32, x86-64-v3
# build): 28-32 s an epoch with validation, mAP50-95 0.493 after epoch 6 and 0.542 after epoch 7.
# nbs=16 (no gradient accumulation): 63 optimizer steps per epoch instead of 16, which a short run needs;
# warmup 1 epoch of 3 so the short run spends its steps learning; mosaic off for the last 3 epochs. The
# previous 15-epoch recipe took 15 min 23 s in fp32 on a 2-core AMD EPYC (AVX2), hence the shorter one.
QUICKSTART: dict = {
    "epochs": 7,
    "imgsz": 192,
    "batch": 16,
    "nbs": 16,
    "warmup_epochs": 1.0,
    "close_mosaic": 3,
    "workers": 2,
}

# Keys of Ultralytics 8.4's default.yaml that only make sense for another task or mode, with what they are.
OTHER_TASK_KEYS = {
    "overlap_mask": "segment task (merges instance masks)",
    "mask_ratio": "segment task (mask downsample ratio)",
    "retina_masks": "segment task (high-resolution masks)",
    "pose": "pose task (keypoint loss gain)",
    "kobj": "pose task (keypoint objectness gain)",
    "rle": "pose task (keypoint RLE loss gain)",
    "angle": "obb task (oriented-box angle loss gain)",
    "dlog": "depth task (SILog loss gain)",
    "dgrad": "depth task (depth gradient loss gain)",
    "dlam": "depth task (SILog variance focus)",
    "auto_augment": "classify task (classification augmentation policy)",
    "erasing": "classify task (random erasing)",
    "tracker": "track mode (object tracking)",
}

# Keys whose value may be of any type (model may be an nn.Module, data a dict, time/device/name None...);
# the ones with a rule of their own are checked in _CHECKS.
_FREE = {"model", "data", "device", "name", "time", "resume", "amp", "compile", "project", "optimizer",
         "split", "fraction", "freeze", "pretrained", "quantize", "nms", "channels_last", "cfg", "cache"}
_MODES = ("train", "val", "predict", "export")


def _check_fraction(v):
    vals = v if isinstance(v, (list, tuple)) else [v]
    if not 1 <= len(vals) <= 3 or any(isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0
                                      for x in vals):
        raise CfgError(f"fraction={v!r} must be a ratio in (0, 1], an image count (int > 1) or a list "
                       f"[train, val, test] of those")
    if isinstance(vals[0], float) and vals[0] > 1:
        raise CfgError(f"fraction={v!r}: a ratio is at most 1.0; an image count is an integer (e.g. 500)")
    return list(v) if isinstance(v, tuple) else v


def _check_freeze(v):
    if v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in v):
        return list(v)
    raise CfgError(f"freeze={v!r} must be the number of first layers to freeze (e.g. 10) or a list of layer "
                   f"indices / names (e.g. [0, 1, '22.cv2'])")


def _check_quantize(v):
    if v is None or str(v).lower() in ("16", "fp16", "32", "fp32"):
        return v
    if str(v).lower() in ("8", "int8"):
        raise CfgError(f"quantize={v!r}: int8 quantization-aware training is not supported by yolofast; use "
                       f"quantize=16 (fp16/bf16 autocast) or None")
    raise CfgError(f"quantize={v!r}: use 16 / 'fp16', 32 / 'fp32' or None")


def quantize_half(quantize, default: bool) -> bool:
    """Whether val/predict run under autocast: quantize 16/'fp16' yes, 32/'fp32' no, None: ``default``."""
    if quantize is None:
        return default
    return str(_check_quantize(quantize)).lower() in ("16", "fp16")


def _check_nms(v):
    if v is None or v is False:
        return v
    if v is True:
        raise CfgError("nms=True (NMS inside the exported model) is not supported yet: export writes the raw "
                       "head and NMS runs after it; leave nms unset")
    raise CfgError(f"nms={v!r} must be None, True or False")


def _check_optional_bool(key):
    def check(v):
        if v is not None and not isinstance(v, bool):
            raise CfgError(f"{key}={v!r} must be True, False or None")
        return v
    return check


def _check_pretrained(v):
    if isinstance(v, bool) or (isinstance(v, (str, Path)) and str(v).endswith(".pt")):
        return str(v) if isinstance(v, Path) else v
    raise CfgError(f"pretrained={v!r} must be True, False or a path to a .pt checkpoint")


def _in_range(key, lo, hi, hi_open=False):
    def check(v):
        if v < lo or v > hi or (hi_open and v == hi):
            raise CfgError(f"{key}={v!r} must be in [{lo}, {hi}{')' if hi_open else ']'}")
        return v
    return check


def _one_of(key, choices):
    def check(v):
        if v not in choices:
            raise CfgError(f"{key}={v!r} must be one of {', '.join(map(repr, choices))}")
        return v
    return check


def _check_task(v):
    if v != "detect":
        raise CfgError(f"task={v!r}: yolofast trains detectors only (task=detect); {v} models need "
                       f"Ultralytics")
    return v


_CHECKS = {
    "task": _check_task,
    "mode": _one_of("mode", _MODES),
    "fraction": _check_fraction,
    "freeze": _check_freeze,
    "quantize": _check_quantize,
    "nms": _check_nms,
    "channels_last": _check_optional_bool("channels_last"),
    "pretrained": _check_pretrained,
    "multi_scale": _in_range("multi_scale", 0.0, 1.0, hi_open=True),
    "cls_pw": _in_range("cls_pw", 0.0, 1.0),
    "dropout": _in_range("dropout", 0.0, 1.0, hi_open=True),
    "bgr": _in_range("bgr", 0.0, 1.0),
    "cutmix": _in_range("cutmix", 0.0, 1.0),
    "copy_paste": _in_range("copy_paste", 0.0, 1.0),
    "copy_paste_mode": _one_of("copy_paste_mode", ("flip", "mixup")),
    "cache": _one_of("cache", (False, True, "ram", "disk")),  # True: "ram" (Ultralytics' names)
}


def _closest(key: str, n: int = 3) -> list[str]:
    return difflib.get_close_matches(key, list(DEFAULTS), n=n, cutoff=0.5)


def check_keys(keys) -> None:
    """Raise CfgError for the first key that is not a recipe key."""
    for k in keys:
        if k in OTHER_TASK_KEYS:
            raise CfgError(f"'{k}' belongs to Ultralytics' {OTHER_TASK_KEYS[k]}; yolofast trains and "
                           f"validates detectors only, so it would have no effect: remove it")
        if k not in DEFAULTS:
            near = _closest(k)
            hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
            raise CfgError(f"'{k}' is not a valid yolofast key{hint} (`yolofast train --help` lists them)")


def _check_value(key: str, value):
    value = _check_type(key, value)
    return _CHECKS[key](value) if key in _CHECKS and value is not None else value


def _check_type(key: str, value):
    default = DEFAULTS[key]
    if key in _FREE or default is None:
        return value
    if key == "batch" and isinstance(value, float) and 0 < value < 1:
        return value  # AutoBatch: the fraction of GPU memory to fill (batch=-1 uses 0.60)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise CfgError(f"{key}={value!r} must be True or False")
        return value
    if isinstance(default, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CfgError(f"{key}={value!r} must be a number (default {default!r})")
        if isinstance(default, int) and not isinstance(default, bool) and float(value) != int(value):
            raise CfgError(f"{key}={value!r} must be an integer (default {default!r})")
        return type(default)(value) if isinstance(default, int) else float(value)
    if isinstance(default, str) and not isinstance(value, (str, Path)):
        raise CfgError(f"{key}={value!r} must be a string (default {default!r})")
    return value


def get_cfg(base: dict | str | Path | SimpleNamespace | None = None, /, **overrides) -> SimpleNamespace:
    """DEFAULTS, updated with ``base`` (a dict, a yaml file or a namespace) and then ``overrides`` (the key
    ``cfg=file.yaml`` among them: that file's keys, under the other overrides)."""
    if isinstance(base, (str, Path)):
        with open(base, encoding="utf-8") as f:
            base = yaml.safe_load(f) or {}
    elif isinstance(base, SimpleNamespace):
        base = vars(base)
    merged = {**(base or {}), **overrides}
    if merged.get("cfg") not in (None, ""):  # Ultralytics' custom config: its keys under the given ones
        path = Path(str(merged["cfg"]))
        if not path.is_file():
            raise CfgError(f"cfg={str(path)!r}: file not found (a yaml of recipe keys)")
        with open(path, encoding="utf-8") as f:
            extra = yaml.safe_load(f) or {}
        if not isinstance(extra, dict):
            raise CfgError(f"cfg={str(path)!r} must hold a mapping of recipe keys, got "
                           f"{type(extra).__name__}")
        extra.pop("cfg", None)
        merged = {**extra, **merged}
    check_keys(merged)
    out = dict(DEFAULTS)
    out.update({k: _check_value(k, v) for k, v in merged.items()})
    return SimpleNamespace(**out)
