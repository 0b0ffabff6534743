"""Every key of Ultralytics 8.4.190's default.yaml and what yolofast does with it (docs/recipe-keys.md).

``python -m yolofast.cfg.keys_table`` prints the markdown table; ``tests/cfg/test_keys.py`` keeps the copy
in docs/recipe-keys.md equal to it, and checks every key is accepted (in ``DEFAULTS``, with Ultralytics'
default unless ``DIFFERENT_DEFAULTS`` says why not) or refused with the task it belongs to
(``OTHER_TASK_KEYS``).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from yolofast.cfg import DEFAULT_CFG_PATH, DEFAULTS, OTHER_TASK_KEYS

__all__ = ["ULTRALYTICS_DEFAULTS", "DIFFERENT_DEFAULTS", "rows", "markdown"]

with open(Path(__file__).with_name("ultralytics_8_4_190.yaml"), encoding="utf-8") as _f:
    ULTRALYTICS_DEFAULTS: dict = yaml.safe_load(_f)

# Keys whose yolofast default is not Ultralytics', and why.
DIFFERENT_DEFAULTS = {
    "model": "`yolofast train` with no arguments trains yolov8n (Ultralytics requires model=)",
    "data": "the built-in synthetic shapes set, so `yolofast train` runs with no download",
    "project": "runs/train; Ultralytics' None writes to runs/detect",
    "simplify": "onnxslim is an optional extra; simplify=True needs it installed",
}


def _comments() -> dict[str, str]:
    out = {}
    for line in DEFAULT_CFG_PATH.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#") and ":" in line:
            k, rest = line.split(":", 1)
            out[k.strip()] = rest.split("#", 1)[1].strip() if "#" in rest else ""
    return out


def _fmt(v) -> str:
    return "None" if v is None else repr(v) if isinstance(v, str) else str(v)


def rows() -> list[tuple[str, str, str, str]]:
    """(key, Ultralytics default, yolofast status, what it does) for every Ultralytics key, in its order."""
    comments = _comments()
    out = []
    for k, v in ULTRALYTICS_DEFAULTS.items():
        if k in OTHER_TASK_KEYS:
            status, what = "refused", f"belongs to the {OTHER_TASK_KEYS[k]}"
        elif k in DEFAULTS:
            status = "accepted"
            if DEFAULTS[k] != v:
                status = f"accepted, default {_fmt(DEFAULTS[k])}"
            what = comments.get(k, "")
            if k in DIFFERENT_DEFAULTS:
                what = f"{what} (default: {DIFFERENT_DEFAULTS[k]})"
        else:
            status, what = "MISSING", ""
        out.append((k, _fmt(v), status, what.replace("|", "\\|")))
    return out


def markdown() -> str:
    lines = ["| key | Ultralytics 8.4.190 default | yolofast | what it does |", "| --- | --- | --- | --- |"]
    lines += [f"| `{k}` | {d} | {s} | {w} |" for k, d, s, w in rows()]
    extra = [k for k in DEFAULTS if k not in ULTRALYTICS_DEFAULTS]
    lines += ["", f"yolofast's own keys (not in Ultralytics 8.4.190): {', '.join(f'`{k}`' for k in extra)}."]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
