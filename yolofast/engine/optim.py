"""Optimizer parameter groups, the ``auto`` optimizer rule, warmup and learning-rate schedules (DESIGN §4).

Parameter groups, in this order (so ``lr/pg0`` in results.csv is the bias group, as in Ultralytics):
  pg0 biases (no decay), pg1 conv/linear weights (decay), pg2 norm-layer weights (no decay).
Decaying a bias or a BatchNorm scale only shrinks what the next layer's weights re-learn: they are left out.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

__all__ = ["param_groups", "build_optimizer", "lr_lambda", "warmup_iters", "warmup_values",
           "accumulate_steps", "scaled_weight_decay", "auto_optimizer", "recipe_optimizer", "OPTIMIZERS"]

OPTIMIZERS = ("SGD", "Adam", "AdamW", "NAdam", "RAdam", "RMSProp", "auto")
_NORMS = tuple(v for k, v in vars(nn).items() if "Norm" in k and isinstance(v, type))


def param_groups(model: nn.Module) -> tuple[list, list, list]:
    """(biases, decayed weights, norm weights) of every trainable parameter, each exactly once."""
    bias, decay, norm = [], [], []
    seen = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if name == "bias" or name.endswith(".bias"):
                bias.append(p)
            elif isinstance(module, _NORMS):
                norm.append(p)
            else:
                decay.append(p)
    return bias, decay, norm


def accumulate_steps(nbs: int, batch: int) -> int:
    """Batches whose gradients are summed before one optimizer step: max(round(nbs / batch), 1)."""
    return max(round(nbs / batch), 1)


def scaled_weight_decay(weight_decay: float, batch: int, accumulate: int, nbs: int) -> float:
    """Weight decay × batch·accumulate/nbs: the decay per step follows the images per step."""
    return weight_decay * batch * accumulate / nbs


def auto_optimizer(iterations: int, nc: int) -> tuple[str, float, float]:
    """``optimizer=auto``: (name, lr, momentum). AdamW with lr = round(0.002·5/(4+nc), 6) for runs of at
    most 10k iterations (it converges faster on short runs), SGD(0.01, momentum 0.9) for longer ones."""
    if iterations > 10_000:
        return "SGD", 0.01, 0.9
    return "AdamW", round(0.002 * 5 / (4 + nc), 6), 0.9


def build_optimizer(model: nn.Module, name: str = "auto", lr: float = 0.01, momentum: float = 0.937,
                    decay: float = 5e-4, iterations: int = 100_000, nc: int = 80, extra=None):
    """The optimizer over the three groups of ``param_groups``; returns (optimizer, name, lr, momentum).

    ``decay`` is the already scaled weight decay. Adam-type optimizers use betas (momentum, 0.999); SGD uses
    Nesterov momentum. ``name="auto"`` follows ``auto_optimizer``. ``extra(name) -> dict`` adds constructor
    arguments for the chosen optimizer (CUDA graphs: ``cudagraph.optimizer_kwargs``).
    """
    if name == "auto":
        name, lr, momentum = auto_optimizer(iterations, nc)
    bias, weights, norms = param_groups(model)
    key = name.lower()
    kw = extra(key) if extra is not None else {}
    if key in ("adam", "adamw", "nadam", "radam"):
        cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "nadam": torch.optim.NAdam,
               "radam": torch.optim.RAdam}[key]
        opt = cls(bias, lr=lr, betas=(momentum, 0.999), weight_decay=0.0, **kw)
    elif key == "rmsprop":
        opt = torch.optim.RMSprop(bias, lr=lr, momentum=momentum, **kw)
    elif key == "sgd":
        opt = torch.optim.SGD(bias, lr=lr, momentum=momentum, nesterov=True, **kw)
    else:
        raise ValueError(f"optimizer={name!r} is not supported; choose one of {', '.join(OPTIMIZERS)}")
    opt.add_param_group({"params": weights, "weight_decay": decay})
    opt.add_param_group({"params": norms, "weight_decay": 0.0})
    return opt, name, lr, momentum


def recipe_optimizer(model: nn.Module, a, n_images: int, accumulate: int, nc: int, resumed_auto=None,
                     extra=None, log=print):
    """The recipe's optimizer: ``(optimizer, auto choice (name, lr, momentum) or None, momentum,
    warmup bias lr)``. ``a``: the recipe (optimizer, lr0, momentum, weight_decay, batch, nbs, epochs,
    warmup_bias_lr); ``resumed_auto``: what ``optimizer=auto`` chose in the run being resumed."""
    decay = scaled_weight_decay(a.weight_decay, a.batch, accumulate, a.nbs)
    # Optimizer steps of the run, for optimizer=auto: images / max(batch, nbs) per epoch.
    iterations = math.ceil(n_images / max(a.batch, a.nbs)) * a.epochs
    name, lr, momentum = a.optimizer, a.lr0, a.momentum
    if name == "auto" and resumed_auto:
        # The resumed run's own choice: extending `epochs` changes the iteration count auto decides by,
        # and an SGD cannot load an AdamW state.
        name, lr, momentum = resumed_auto
    optimizer, name, lr, momentum = build_optimizer(model, name, lr, momentum, decay, iterations, nc=nc,
                                                    extra=extra)
    if a.optimizer != "auto":
        return optimizer, None, momentum, a.warmup_bias_lr
    log(f"optimizer: 'optimizer=auto' -> {name}(lr={lr}, momentum={momentum}) for {iterations} iterations")
    # The 0.1 bias warmup lr is sized for SGD lr 0.01; from an auto-chosen lr it would blow up biases.
    return optimizer, (name, lr, momentum), momentum, 0.0


def lr_lambda(epochs: int, lrf: float, cos_lr: bool = False):
    """Per-epoch lr factor: linear (1 − x/epochs)(1 − lrf) + lrf, or cosine from 1 down to lrf."""
    if cos_lr:
        return lambda x: ((1 - math.cos(x * math.pi / epochs)) / 2) * (lrf - 1) + 1
    return lambda x: max(1 - x / epochs, 0) * (1.0 - lrf) + lrf


def warmup_iters(warmup_epochs: float, epochs: int, nb: int) -> int:
    """Warmup length in iterations: round(min(warmup_epochs, epochs − 1) · nb) (0: no warmup)."""
    return max(round(min(warmup_epochs, epochs - 1) * nb), 0)


def warmup_values(ni: int, nw: int, *, lr_targets, bias_lr0: float, momentum0: float, momentum: float,
                  nbs: int, batch: int):
    """Values at warmup iteration ``ni`` of ``nw``: (lrs per group, momentum, accumulate).

    lr_targets: the scheduled lr of each group this epoch (initial_lr · lf(epoch)); group 0 (biases) comes
    down from ``bias_lr0``, the others go up from 0; momentum goes from ``momentum0`` to ``momentum``;
    accumulate ramps from 1 to nbs/batch — all linear in ``ni`` (np.interp over [0, nw]).
    """
    xi = [0, nw]
    lrs = [float(np.interp(ni, xi, [bias_lr0 if j == 0 else 0.0, t])) for j, t in enumerate(lr_targets)]
    mom = float(np.interp(ni, xi, [momentum0, momentum]))
    acc = max(1, int(np.interp(ni, xi, [1, nbs / batch]).round()))
    return lrs, mom, acc


def set_group_value(group: dict, key: str, value: float) -> None:
    """``group[key] = value``, in place when it is a tensor (a CUDA graph reads that tensor's memory)."""
    if torch.is_tensor(group[key]):
        group[key].fill_(value)
    else:
        group[key] = value
