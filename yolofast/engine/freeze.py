"""``freeze``: layers that keep their starting weights (fine-tuning a backbone, Ultralytics' key).

``freeze=10`` freezes layers 0..9 of the model (``model.0.`` ... ``model.9.``: yolov8's backbone), a list
freezes those layers (``[0, 1, 2]``) or sub-modules by name (``["22.cv2"]``: the head's box branch). Frozen
parameters get ``requires_grad=False``, so they get no gradient, the optimizer never sees them (no weight
decay either) and they never change; their BatchNorm layers stay in eval mode, so the running statistics
are fixed too (``freeze_bn`` after every ``model.train()``). The DFL's fixed bin weights are always frozen.
"""

from __future__ import annotations

from torch import nn

__all__ = ["freeze_prefixes", "freeze_layers", "freeze_bn"]


def freeze_prefixes(freeze, n_layers: int) -> list[str]:
    """Parameter-name prefixes (``model.3.``) of what ``freeze`` names; a layer past the model is an error."""
    if freeze is None:
        return []
    items = list(range(freeze)) if isinstance(freeze, int) else list(freeze)
    if isinstance(freeze, int) and freeze > n_layers:
        raise ValueError(f"freeze={freeze} but the model has {n_layers} layers; freeze at most "
                         f"{n_layers - 1} (the head, layer {n_layers - 1}, must stay trainable)")
    for x in items:
        if isinstance(x, int) and not 0 <= x < n_layers:
            raise ValueError(f"freeze={freeze}: layer {x} does not exist (the model has layers "
                             f"0..{n_layers - 1})")
    return [f"model.{x}." for x in items]


def freeze_layers(model: nn.Module, freeze) -> list[str]:
    """Set ``requires_grad=False`` on the parameters ``freeze`` names; returns the prefixes (for
    ``freeze_bn``). Freezing everything is an error (nothing left to train)."""
    prefixes = freeze_prefixes(freeze, len(model.model))
    if not prefixes:
        return []
    frozen = 0
    for name, p in model.named_parameters():
        if name.startswith(tuple(prefixes)):
            p.requires_grad_(False)
            frozen += 1
    if frozen == 0:
        raise ValueError(f"freeze={freeze} names no parameter of the model (layer names look like '22.cv2')")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"freeze={freeze} freezes the whole model: nothing left to train; freeze fewer "
                         f"layers")
    return prefixes


def freeze_bn(model: nn.Module, prefixes: list[str]) -> None:
    """Put the BatchNorm layers under ``prefixes`` in eval mode: their running mean/var stay as loaded."""
    if not prefixes:
        return
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and f"{name}.".startswith(tuple(prefixes)):
            m.eval()
