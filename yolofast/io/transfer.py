"""Start a model from a checkpoint's weights when the data has other classes (fine-tuning).

Every tensor whose name and shape match is copied. The head's class rows (the last conv of each ``cv3``
branch, and of each ``one2one_cv3`` branch of YOLO26: one weight row and one bias entry per class) are
matched by class name (case-insensitive), as Ultralytics 8.4 does with ``cls_remap=True``: a class of the
new data that the checkpoint also knows gets its rows, the others keep their fresh initialisation (the
prior bias of ``Detect.bias_init``). With ``remap=False`` (``cls_remap=False``) the class rows are copied
by index, and only when both have the same number of classes.

A model started from a checkpoint for other classes keeps the checkpoint's class-branch width (a
yolo26n from 80 COCO classes keeps 80 channels for 3 classes, where a yaml-built one has 64), so every
class-branch tensor but the last conv transfers, as in Ultralytics 8.4.
"""

from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["transfer_weights", "class_row_keys", "model_from_weights", "load_weights", "read_weights"]


def class_row_keys(model: nn.Module) -> list[str]:
    """State-dict names of the head's per-class tensors (the last conv of each cv3 branch)."""
    head = f"model.{len(model.model) - 1}."
    pat = re.compile(rf"^{re.escape(head)}(one2one_)?cv3\.\d+\.2\.(weight|bias)$")
    return [k for k in model.state_dict() if pat.match(k)]


@torch.no_grad()
def transfer_weights(model: nn.Module, src: dict[str, torch.Tensor], src_names: dict[int, str],
                     dst_names: dict[int, str], remap: bool = True) -> dict:
    """Copy ``src`` into ``model`` (see the module docstring). Returns counts for the log:
    ``tensors``/``total`` (fully copied / all tensors of ``model``), ``rows``/``classes`` (classes of the new
    data whose rows came from ``src``) and ``matched`` (their names)."""
    own = model.state_dict()
    rows = set(class_row_keys(model))
    by_name = {str(v).lower(): k for k, v in src_names.items()}
    pairs = [(j, by_name[n.lower()]) for j, n in sorted(dst_names.items())
             if str(n).lower() in by_name]  # (new index, old index)
    same_classes = dict(src_names) == dict(dst_names)
    if not remap:  # by index: rows line up when the counts match, whatever the names
        same_classes = len(src_names) == len(dst_names)
        pairs = []
    copied = 0
    for k, v in own.items():
        s = src.get(k)
        if s is None:
            continue
        if k in rows and not same_classes:
            if s.shape[1:] != v.shape[1:]:
                continue  # a narrower/wider class branch: nothing lines up
            for j, i in pairs:
                v[j].copy_(s[i])
        elif s.shape == v.shape:
            v.copy_(s)
            copied += 1
    matched = [dst_names[j] for j, _ in pairs] if not same_classes else list(dst_names.values())
    if not same_classes and any(src.get(k) is not None and src[k].shape[1:] != own[k].shape[1:]
                                for k in rows):
        matched = []
    return {"tensors": copied, "total": len(own), "rows": len(matched), "classes": len(dst_names),
            "matched": matched}


def read_weights(path, key: str = "model") -> dict:
    """``read_checkpoint(path)`` with the error a user of ``key=path`` needs when the file is missing."""
    from pathlib import Path

    from yolofast.cfg import CfgError
    from yolofast.io import read_checkpoint

    if not Path(path).is_file():
        raise CfgError(f"{key}={str(path)!r}: checkpoint not found (yolofast downloads no weights; use "
                       f"'yolov8n' to train from scratch or a path to a yolofast or Ultralytics .pt)")
    return read_checkpoint(path)


def load_weights(model: nn.Module, path, names, remap: bool = True, log=print,
                 src: dict | None = None) -> None:
    """``path``'s weights into ``model`` (``pretrained=path``, or ``model=path.pt``), class rows carried
    over by name (``remap``, Ultralytics' ``cls_remap``) or by index; logs what was transferred."""
    src = src or read_weights(path, "pretrained")
    _match_class_width(model, src["state_dict"])
    names = dict(enumerate(names)) if isinstance(names, (list, tuple)) else dict(names)
    names = {int(k): str(v) for k, v in names.items()}
    n = transfer_weights(model, src["state_dict"], src["names"], names, remap=remap)
    log(f"Transferred {n['tensors']}/{n['total']} tensors, {n['rows']}/{n['classes']} class rows "
        f"from {path} ({src['source']} {src['arch']}, {src['nc']} classes)")


def _match_class_width(model: nn.Module, sd: dict) -> None:
    """Rebuild ``model``'s class branches at the width of ``sd``'s when the head inputs agree but the
    widths do not (a yaml-built nc=3 yolo26n has 64, weights fine-tuned from COCO have 80)."""
    head = getattr(model, "head", None)
    w = next((v for k, v in sd.items() if k.endswith(".cv3.0.2.weight")), None)
    box = next((v for k, v in sd.items() if k.endswith(".cv2.0.0.conv.weight")), None)
    if head is None or w is None or box is None or not hasattr(head, "rebuild_class_branches"):
        return
    own = head.cv3[0][2].weight
    if int(w.shape[1]) == own.shape[1] or int(box.shape[1]) != head.cv2[0][0].conv.in_channels:
        return
    head.rebuild_class_branches(int(w.shape[1]))
    if isinstance(getattr(model, "yaml", None), dict):
        model.yaml["head_cls_width"] = int(w.shape[1])  # so that its checkpoints rebuild the same model


def model_from_weights(path, nc: int, names, log=print, load: bool = True, remap: bool = True) -> nn.Module:
    """A fresh model of the checkpoint's architecture for ``nc`` classes ``names``, started from its weights
    (yolofast's or Ultralytics' .pt, read safely; ``load=False``: ``pretrained=False``, the architecture
    only). The trainer's ``model=path.pt``."""
    from yolofast.cfg import CfgError
    from yolofast.io.reader import class_width
    from yolofast.nn import build_model
    from yolofast.nn.model import _load_cfg

    src = read_weights(path, "model")
    if src["cfg"] is None:
        raise CfgError(f"model={str(path)!r} holds a custom {src['arch']} without a model config; pass "
                       f"the module itself (Trainer(model=module)) with its weights loaded")
    cfg = src["cfg"]
    width = class_width(src["state_dict"], nc)
    if width is not None:  # the source's class-branch width, not the width rule's for nc classes
        cfg = _load_cfg(cfg)
        cfg["head_cls_width"] = width
    model = build_model(cfg, nc=nc)
    if load:
        load_weights(model, path, names, remap=remap, log=log, src=src)
    else:
        log(f"pretrained=False: {path}'s architecture ({src['arch']}) with fresh weights")
    return model
