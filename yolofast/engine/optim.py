"""Optimizer parameter groups, the ``auto`` optimizer rule, warmup and learning-rate schedules (DESIGN §4,
YOLO11_YOLO26.md §5).

Parameter groups, in this order (so ``lr/pg0`` in results.csv is the bias group, as in Ultralytics):
  pg0 biases (no decay), pg1 conv/linear weights (decay), pg2 norm-layer weights (no decay).
Decaying a bias or a BatchNorm scale only shrinks what the next layer's weights re-learn: they are left out.
MuSGD has 8 groups in Ultralytics 8.4.190's order (``musgd_groups``): weight, bn, bias and muon, each
split into the class branches' ×3-lr part and the rest. Every group carries its tag in ``param_group``
("weight", "bn", "bias", "muon"); the warmup starts the "bias" groups from ``warmup_bias_lr``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from yolofast.optim import MuSGD

__all__ = ["param_groups", "build_optimizer", "lr_lambda", "warmup_iters", "warmup_values",
           "accumulate_steps", "scaled_weight_decay", "auto_optimizer", "recipe_optimizer", "musgd_groups",
           "OPTIMIZERS"]

OPTIMIZERS = ("SGD", "MuSGD", "Adam", "AdamW", "NAdam", "RAdam", "RMSProp", "auto")
# MuSGD's mix inside a Muon group (YOLO11_YOLO26.md §5.3): the orthogonalised step at 0.2, SGD at 1.0.
MUON_WEIGHT, SGD_WEIGHT = 0.2, 1.0
# Ultralytics boosts the class branches' lr under MuSGD (all runs, not only fine-tuning).
CLASS_BRANCH_LR_GAIN = 3.0
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
    """``optimizer=auto`` (Ultralytics 8.4.190, every model): (name, lr, constructor momentum). AdamW with
    lr = round(0.002·5/(4+nc), 6) for runs of at most 10k iterations, MuSGD(0.01, momentum 0.9) for
    longer ones. The warmup still ramps momentum to the recipe's ``momentum`` (``recipe_optimizer``)."""
    if iterations > 10_000:
        return "MuSGD", 0.01, 0.9
    return "AdamW", round(0.002 * 5 / (4 + nc), 6), 0.9


def optimizer_name(name: str) -> str:
    """``name`` spelled as in OPTIMIZERS (case-insensitive, as Ultralytics reads it: "musgd" -> "MuSGD")."""
    canon = {o.lower(): o for o in OPTIMIZERS}
    canon["rmsprop"] = "RMSProp"
    return canon.get(str(name).lower(), str(name))


def _class_branch_ids(model: nn.Module) -> set[int]:
    """ids of the Detect head's class-branch parameters (``cv3``, and ``one2one_cv3`` of end-to-end heads)."""
    layers = getattr(model, "model", None)
    head = layers[-1] if isinstance(layers, (nn.Sequential, nn.ModuleList)) and len(layers) else None
    branches = [getattr(head, n, None) for n in ("cv3", "one2one_cv3")] if head is not None else []
    return {id(p) for b in branches if isinstance(b, nn.Module) for p in b.parameters()}


def musgd_groups(model: nn.Module, lr: float, momentum: float, decay: float) -> list[dict]:
    """MuSGD's 8 parameter groups in Ultralytics 8.4.190's order (YOLO11_YOLO26.md §5.2): weight ×3, weight,
    bn ×3, bn, bias ×3, bias, muon ×3, muon. ndim 2 or 4 -> muon (decay λ); the rest as ``param_groups``.
    ×3: the class branches' parameters get lr·3. Empty groups are kept (they fix the ``lr/pgN`` indices)."""
    bias, decayed, norms = param_groups(model)
    boosted = _class_branch_ids(model)
    muon = [p for p in decayed + norms + bias if p.ndim in (2, 4)]
    is_muon = {id(p) for p in muon}
    tags = (("weight", [p for p in decayed if id(p) not in is_muon], decay, False),
            ("bn", [p for p in norms if id(p) not in is_muon], 0.0, False),
            ("bias", [p for p in bias if id(p) not in is_muon], 0.0, False),
            ("muon", muon, decay, True))
    groups = []
    for tag, params, wd, use_muon in tags:
        base = {"momentum": momentum, "nesterov": True, "weight_decay": wd, "use_muon": use_muon,
                "param_group": tag}
        groups.append({"params": [p for p in params if id(p) in boosted], **base,
                       "lr": lr * CLASS_BRANCH_LR_GAIN})
        groups.append({"params": [p for p in params if id(p) not in boosted], **base, "lr": lr})
    return groups


def build_optimizer(model: nn.Module, name: str = "auto", lr: float = 0.01, momentum: float = 0.937,
                    decay: float = 5e-4, iterations: int = 100_000, nc: int = 80, extra=None):
    """The optimizer over the three groups of ``param_groups``; returns (optimizer, name, lr, momentum).

    ``decay`` is the already scaled weight decay. Adam-type optimizers use betas (momentum, 0.999); SGD uses
    Nesterov momentum. ``name="auto"`` follows ``auto_optimizer``. ``extra(name) -> dict`` adds constructor
    arguments for the chosen optimizer (CUDA graphs: ``cudagraph.optimizer_kwargs``).
    """
    name = optimizer_name(name)
    if name == "auto":
        name, lr, momentum = auto_optimizer(iterations, nc)
    key = name.lower()
    kw = extra(key) if extra is not None else {}
    if key == "musgd":
        opt = MuSGD(musgd_groups(model, lr, momentum, decay), lr=lr, momentum=momentum, nesterov=True,
                    muon=MUON_WEIGHT, sgd=SGD_WEIGHT, **kw)
        return opt, name, lr, momentum
    bias, weights, norms = param_groups(model)
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
    opt.param_groups[0]["param_group"] = "bias"
    opt.add_param_group({"params": weights, "weight_decay": decay, "param_group": "weight"})
    opt.add_param_group({"params": norms, "weight_decay": 0.0, "param_group": "bn"})
    return opt, name, lr, momentum


def recipe_optimizer(model: nn.Module, a, n_images: int, accumulate: int, nc: int, resumed_auto=None,
                     extra=None, log=print):
    """The recipe's optimizer: ``(optimizer, auto choice (name, lr, momentum) or None, momentum the warmup
    ramps to, warmup bias lr)``. ``a``: the recipe (optimizer, lr0, momentum, weight_decay, batch, nbs,
    epochs, warmup_bias_lr); ``resumed_auto``: what ``optimizer=auto`` chose in a run being resumed whose
    recipe still says ``auto`` (checkpoints of earlier yolofast versions).

    ``optimizer=auto`` rewrites the recipe as Ultralytics 8.4.190 does: ``a.optimizer`` and ``a.lr0`` become
    the choice and ``a.warmup_bias_lr`` 0.0, so args.yaml and the checkpoints' ``train_args`` say what ran
    and a resume rebuilds exactly that optimizer whatever its epochs. ``a.momentum`` is kept: the warmup
    ramps every momentum group to it (0.937), the auto choice's 0.9 only survives without warmup."""
    decay = scaled_weight_decay(a.weight_decay, a.batch, accumulate, a.nbs)
    # Optimizer steps of the run, for optimizer=auto: images / max(batch, nbs) per epoch.
    iterations = math.ceil(n_images / max(a.batch, a.nbs)) * a.epochs
    name, lr, momentum = optimizer_name(a.optimizer), a.lr0, a.momentum
    auto = name == "auto"
    if auto and resumed_auto:
        # The resumed run's own choice: extending `epochs` changes the iteration count auto decides by,
        # and an SGD cannot load an AdamW state.
        name, lr, momentum = resumed_auto
    optimizer, name, lr, momentum = build_optimizer(model, name, lr, momentum, decay, iterations, nc=nc,
                                                    extra=extra)
    if not auto:
        return optimizer, None, a.momentum, a.warmup_bias_lr
    log(f"optimizer: 'optimizer=auto' -> {name}(lr={lr}, momentum={momentum}) for {iterations} iterations")
    # The 0.1 bias warmup lr is sized for SGD lr 0.01; from an auto-chosen lr it would blow up biases.
    a.optimizer, a.lr0, a.warmup_bias_lr = name, lr, 0.0
    return optimizer, (name, lr, momentum), a.momentum, 0.0


def lr_lambda(epochs: int, lrf: float, cos_lr: bool = False):
    """Per-epoch lr factor: linear (1 − x/epochs)(1 − lrf) + lrf, or cosine from 1 down to lrf."""
    if cos_lr:
        return lambda x: ((1 - math.cos(x * math.pi / epochs)) / 2) * (lrf - 1) + 1
    return lambda x: max(1 - x / epochs, 0) * (1.0 - lrf) + lrf


def warmup_iters(warmup_epochs: float, epochs: int, nb: int) -> int:
    """Warmup length in iterations: round(min(warmup_epochs, epochs − 1) · nb) (0: no warmup)."""
    return max(round(min(warmup_epochs, epochs - 1) * nb), 0)


def warmup_values(ni: int, nw: int, *, lr_targets, bias_lr0: float, momentum0: float, momentum: float,
                  nbs: int, batch: int, tags=None):
    """Values at warmup iteration ``ni`` of ``nw``: (lrs per group, momentum, accumulate).

    lr_targets: the scheduled lr of each group this epoch (initial_lr · lf(epoch)); the bias groups (those
    tagged "bias" in ``tags``, the groups' ``param_group``; without tags group 0) come down from
    ``bias_lr0``, the others go up from 0; momentum goes from ``momentum0`` to ``momentum``; accumulate
    ramps from 1 to nbs/batch — all linear in ``ni`` (np.interp over [0, nw]).
    """
    xi = [0, nw]
    if tags is None or all(t is None for t in tags):  # untagged groups: the DESIGN order, biases first
        tags = ["bias" if j == 0 else None for j in range(len(lr_targets))]
    is_bias = [t == "bias" for t in tags]
    lrs = [float(np.interp(ni, xi, [bias_lr0 if b else 0.0, t])) for b, t in zip(is_bias, lr_targets)]
    mom = float(np.interp(ni, xi, [momentum0, momentum]))
    acc = max(1, int(np.interp(ni, xi, [1, nbs / batch]).round()))
    return lrs, mom, acc


def set_group_value(group: dict, key: str, value: float) -> None:
    """``group[key] = value``, in place when it is a tensor (a CUDA graph reads that tensor's memory)."""
    if torch.is_tensor(group[key]):
        group[key].fill_(value)
    else:
        group[key] = value
