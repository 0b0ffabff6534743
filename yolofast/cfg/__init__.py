"""The training recipe: ``DEFAULTS`` (from default.yaml, DESIGN §4 names) and ``get_cfg(**overrides)``.

``get_cfg`` returns a ``types.SimpleNamespace`` holding every key; a key that is not a recipe key is a
``CfgError`` naming the closest valid keys, and a value of the wrong kind (``epochs="ten"``) is refused
with the key and the expected type. ``QUICKSTART`` holds the defaults ``yolofast train`` uses on the
built-in shapes set (measured to finish in minutes on a 2-core CPU); ``Trainer(...)`` keeps ``DEFAULTS``.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from types import SimpleNamespace

import yaml

__all__ = ["DEFAULTS", "QUICKSTART", "CfgError", "get_cfg", "check_keys", "DEFAULT_CFG_PATH"]

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

# Keys whose value may be of any type (model may be an nn.Module, data a dict, time/device/name None...).
_FREE = {"model", "data", "device", "name", "time", "resume", "amp", "compile", "project", "optimizer",
         "split"}


def _closest(key: str, n: int = 3) -> list[str]:
    return difflib.get_close_matches(key, list(DEFAULTS), n=n, cutoff=0.5)


def check_keys(keys) -> None:
    """Raise CfgError for the first key that is not a recipe key."""
    for k in keys:
        if k not in DEFAULTS:
            near = _closest(k)
            hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
            raise CfgError(f"'{k}' is not a valid yolofast key{hint} (`yolofast train --help` lists them)")


def _check_value(key: str, value):
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


def get_cfg(cfg: dict | str | Path | SimpleNamespace | None = None, **overrides) -> SimpleNamespace:
    """DEFAULTS, updated with ``cfg`` (a dict, a yaml file or a namespace) and then ``overrides``."""
    if isinstance(cfg, (str, Path)):
        with open(cfg, encoding="utf-8") as f:
            cfg = yaml.safe_load(f) or {}
    elif isinstance(cfg, SimpleNamespace):
        cfg = vars(cfg)
    merged = {**(cfg or {}), **overrides}
    check_keys(merged)
    out = dict(DEFAULTS)
    out.update({k: _check_value(k, v) for k, v in merged.items()})
    return SimpleNamespace(**out)
