"""Crafted checkpoints for the reader's tests: files that look like Ultralytics' without Ultralytics.

``fake_ultralytics(tree)`` registers throw-away modules named like Ultralytics' (``ultralytics.nn.tasks``,
``ultralytics.nn.modules.head``, ...) holding nn.Module classes of the given names, so ``torch.save`` pickles
them under those names; the modules are removed again before any test reads the file back."""

import sys
import types
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

ULTRALYTICS = Path(__file__).resolve().parents[3] / "shared" / "data" / "ultralytics"


@contextmanager
def fake_ultralytics(classes: dict[str, list[str]]):
    """classes: {module path: [class names]} -> {class name: class}; sys.modules is restored after."""
    before = dict(sys.modules)
    made = {}
    for mod, names in classes.items():
        parts = mod.split(".")
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        m = sys.modules[mod]
        for n in names:
            cls = type(n, (nn.Module,), {"__module__": mod, "__qualname__": n})
            setattr(m, n, cls)
            made[n] = cls
    try:
        yield made
    finally:
        for k in set(sys.modules) - set(before):
            del sys.modules[k]


def fake_checkpoint(path: Path, top: str, layers: list[str], head: str, yaml_file: str, **head_attrs) -> Path:
    """A pickled model of class ``top`` (ultralytics.nn.tasks) whose ``model`` holds one module per name in
    ``layers`` (ultralytics.nn.modules.block) and then the head ``head`` (ultralytics.nn.modules.head)."""
    mods = {"ultralytics.nn.tasks": [top], "ultralytics.nn.modules.block": sorted(set(layers)),
            "ultralytics.nn.modules.head": [head]}
    with fake_ultralytics(mods) as c:
        model = c[top]()
        rows = [c[n]() for n in layers]
        for r in rows:
            r.conv = nn.Conv2d(3, 8, 3)
        h = c[head]()
        h.nc, h.reg_max = 3, 16
        for k, v in head_attrs.items():
            setattr(h, k, v)
        model.model = nn.Sequential(*rows, h)
        model.yaml = {"nc": 3, "yaml_file": yaml_file, "backbone": [], "head": []}
        model.names = {0: "a", 1: "b", 2: "c"}
        model.stride = torch.tensor([8.0, 16.0, 32.0])
        torch.save({"model": model.half(), "ema": None, "epoch": -1, "version": "8.4.190"}, path)
    return path
