"""Recovery from a non-finite loss (DESIGN §4 "Recovery"), kept out of the loop so the loop stays readable.

``NonFiniteGuard(trainer)``: the loop calls ``guard.snapshot()`` at the start of every epoch (the state
last.pt holds, or the start state) and ``guard.check(loss, batch, epoch, step)`` after each loss:

* finite -> True, the streak resets;
* non-finite -> False: the caller skips the step (no backward, no optimizer or EMA update); the batch's
  files are logged and counted in ``guard.skipped``;
* ``patience`` (3) non-finite losses in a row -> model, EMA, optimizer and scaler are restored from the
  snapshot (said in the log) and training goes on;
* still non-finite ``patience`` more times in a row after ``max_restores`` restores -> ``NonFiniteLossError``
  naming the epoch, the step and the last good checkpoint.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["NonFiniteGuard", "NonFiniteLossError"]


class NonFiniteLossError(RuntimeError):
    """The loss stayed non-finite after restoring the last good state."""


def _cpu_copy(obj):
    """A deep copy with every tensor on the CPU (a snapshot must not cost GPU memory)."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


class NonFiniteGuard:
    """Skip non-finite steps, restore the last good state after ``patience`` in a row, give up after
    ``max_restores`` restores. ``trainer`` needs ``model``, ``ema``, ``optimizer``, ``scaler``, ``last``
    (last.pt path) and ``log``."""

    def __init__(self, trainer, patience: int = 3, max_restores: int = 1):
        self.trainer = trainer
        self.patience, self.max_restores = patience, max_restores
        self.streak = 0  # non-finite losses in a row
        self.skipped = 0  # steps skipped in the whole run
        self.restores = 0
        self._state = None
        self._epoch = None

    def snapshot(self) -> None:
        """Remember the current (good) state; called at the start of each epoch."""
        t = self.trainer
        from yolofast.engine.distributed import unwrap_model

        self._state = {
            "model": _cpu_copy(unwrap_model(t.model).state_dict()),
            "ema": _cpu_copy(t.ema.state_dict()),
            "optimizer": _cpu_copy(t.optimizer.state_dict()),
            "scaler": _cpu_copy(t.scaler.state_dict()),
        }
        self._epoch = getattr(t, "epoch", 0)

    def check(self, loss: torch.Tensor, batch: dict, epoch: int, step: int) -> bool:
        """True when ``loss`` is finite; otherwise log, count, maybe restore or raise, and return False."""
        finite = torch.isfinite(loss.detach()).all().to(torch.int32)
        if dist.is_available() and dist.is_initialized():
            # All ranks skip together: a rank that ran backward alone would wait forever in DDP's all-reduce.
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if bool(finite):
            self.streak = 0
            return True
        self.streak += 1
        self.skipped += 1
        files = batch.get("im_file") or []
        more = f" (+{len(files) - 4} more)" if len(files) > 4 else ""
        shown = ", ".join(str(f) for f in files[:4]) + more
        value = loss.detach().float().cpu().tolist()
        warnings.warn(f"non-finite loss ({value}) at epoch {epoch + 1} step "
                      f"{step}: step skipped (no optimizer/EMA update; {self.streak} in a row); batch files: "
                      f"{shown or '?'}", stacklevel=2)
        if self.streak >= self.patience:
            if self.restores >= self.max_restores or self._state is None:
                raise NonFiniteLossError(
                    f"the loss stayed non-finite at epoch {epoch + 1} step {step} ({self.streak} steps in a "
                    f"row after {self.restores} restore(s) of the last good state); last good checkpoint: "
                    f"{self._last_good()}. Lower lr0, check the data, or try amp=False")
            self.restore()
            warnings.warn(f"{self.patience} non-finite losses in a row at epoch {epoch + 1} step {step}: "
                          f"restored model, EMA, optimizer and scaler to the start of epoch "
                          f"{(self._epoch or 0) + 1} ({self._last_good()})", stacklevel=2)
        return False

    def restore(self) -> None:
        from yolofast.engine.distributed import unwrap_model

        t, s = self.trainer, self._state
        unwrap_model(t.model).load_state_dict(s["model"])
        t.ema.load_state_dict(copy.deepcopy(s["ema"]))
        t.optimizer.load_state_dict(copy.deepcopy(s["optimizer"]))
        t.scaler.load_state_dict(copy.deepcopy(s["scaler"]))
        t.optimizer.zero_grad(set_to_none=True)
        self.restores += 1
        self.streak = 0

    def _last_good(self) -> str:
        last = getattr(self.trainer, "last", None)
        if last is not None and Path(last).is_file():
            return str(last)
        return "none written yet (the start of training)"
