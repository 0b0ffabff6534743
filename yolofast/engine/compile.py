"""torch.compile of the train step (DESIGN §4: ``compile=True|mode``) and the DDP loss scaling.

``train_step_modules(model, criterion, device, compile=False, world_size=1) -> (train_model, train_loss)``:
the model as the loop calls it (DDP-wrapped under torchrun, then compiled) and the loss as the loop calls it
(``total × world_size``, DESIGN §2.2, compiled with ``fullgraph=True`` so a graph break is an error, not a
silent slowdown). Validation keeps the plain ``criterion`` and the uncompiled EMA model: the EMA changes
every step and the validator's batch shapes differ, so compiling them would only add recompiles.

Recompiles stay bounded: the GT arrives padded to a multiple of 16 (``data.collate.pad_targets``), so the
loss sees a handful of ``(B, Mp)`` shapes; ``dynamic=False`` keeps each one a specialised graph.
"""

from __future__ import annotations

import torch
from torch import nn

from yolofast.engine.distributed import is_distributed, wrap_ddp

__all__ = ["train_step_modules", "compile_mode", "ScaledLoss"]


_MODES = ("reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Backends instead of a mode: "eager" (Dynamo tracing only) and "aot_eager" (+ AOTAutograd) check graph
# breaks in seconds where inductor's C++ codegen takes minutes on a 2-core CPU.
_BACKENDS = ("eager", "aot_eager", "inductor")


def compile_mode(value) -> tuple[bool, str | None, str | None]:
    """``compile`` recipe value -> (enabled, mode, backend). True -> inductor, default mode; a string is a
    torch.compile mode ("reduce-overhead", ...) or a backend name ("eager", "aot_eager", "inductor")."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("", "false", "0", "none", "off"):
            return False, None, None
        if v in ("true", "1", "default"):
            return True, None, None
        if v in _MODES:
            return True, v, None
        if v in _BACKENDS:
            return True, None, v
        raise ValueError(f"compile={value!r}: use True/False, a torch.compile mode {_MODES} or a backend "
                         f"{_BACKENDS}")
    return bool(value), None, None


class ScaledLoss(nn.Module):
    """``criterion(feats, batch)`` with the total × ``world_size``: DDP averages gradients over ranks, each
    rank's loss is already × its own batch, so × world gives the gradient of the full batch."""

    def __init__(self, criterion, world_size: int = 1):
        super().__init__()
        self.criterion, self.world_size = criterion, int(world_size)

    def forward(self, feats, batch):
        total, items = self.criterion(feats, batch)
        return (total * self.world_size if self.world_size != 1 else total), items


def train_step_modules(model: nn.Module, criterion, device: torch.device, compile=False, world_size: int = 1,
                       backend: str | None = None):
    """(train_model, train_loss) for the loop; ``backend`` overrides torch.compile's (tests use "eager")."""
    train_model = wrap_ddp(model, device)
    train_loss = ScaledLoss(criterion, world_size) if world_size != 1 else criterion
    enabled, mode, cfg_backend = compile_mode(compile)
    backend = backend or cfg_backend
    if enabled:
        kw = {"backend": backend} if backend else {"mode": mode}
        # fullgraph except under DDP, where Dynamo splits the graph at gradient-bucket boundaries on purpose
        # (DDPOptimizer) to overlap the all-reduce with backward.
        train_model = torch.compile(train_model, fullgraph=not is_distributed(), dynamic=False, **kw)
        train_loss = torch.compile(train_loss, fullgraph=True, dynamic=False, **kw)
    return train_model, train_loss
