"""Tiny models of each family for engine tests: the family's Ultralytics-format yaml at width 1/8."""

from __future__ import annotations

from pathlib import Path

import yaml


def tiny(family: str) -> dict:
    """The family's yaml (yolov8, yolo11, yolo26) at a tiny width (about 0.16 M parameters for YOLO26)."""
    import yolofast.nn

    d = yaml.safe_load((Path(yolofast.nn.__file__).parent / "cfg" / f"{family}.yaml").read_text())
    d.pop("scales", None)
    d.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
    return d
