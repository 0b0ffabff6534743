"""Recovery from a non-finite loss (DESIGN §4 "Recovery"), kept out of the loop so the loop stays readable.

``NonFiniteGuard(trainer)``: the loop calls ``guard.snapshot()`` at the start of every epoch (the state
last.pt holds, or the start state) and ``guard.check(loss, batch, epoch, step)`` after each loss:

* finite -> True, the streak resets;
* non-finite -> False: the caller skips the step (no backward, no optimizer or EMA update); the batch's
  files are logged and counted in ``guard.skipped``;
* ``patience`` (3) non-finite losses in a row -> model, EMA, optimizer, scaler and, with a teacher, the
  distillation projectors are restored from the snapshot (said in the log) and training goes on;
* still non-finite ``patience`` more times in a row after ``max_restores`` restores -> ``NonFiniteLossError``
  naming the epoch, the step and the last good checkpoint.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from yolofast.engine import distill
from yolofast.engine.loader import halved_batch

__all__ = ["NonFiniteGuard", "NonFiniteLossError", "OutOfMemoryHalving", "is_out_of_memory"]


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
            # The projectors are trained with the model (the optimizer's state covers them): restoring the
            # optimizer without them would pair the epoch-start moments with diverged projector weights.
            **_cpu_copy(distill.checkpoint_state(getattr(t, "step_model", None))),
        }
        self._epoch = getattr(t, "epoch", 0)

    def check(self, loss: torch.Tensor, batch: dict, epoch: int, step: int) -> bool:
        """True when ``loss`` is finite; otherwise log, count, maybe restore or raise, and return False."""
        own = torch.isfinite(loss.detach()).all()  # this rank's; `finite` (a copy) becomes every rank's
        finite = own.to(torch.int32)
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
        if not bool(own):  # under DDP the rank that saw it names its batch; the others skip silently
            warnings.warn(f"non-finite loss ({value}) at epoch {epoch + 1} step {step}: step skipped (no "
                          f"optimizer/EMA update; {self.streak} in a row); batch files: {shown or '?'}",
                          stacklevel=2)
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

    def restore(self, count: bool = True) -> None:
        """Load the snapshot; ``count=False`` does not use up one of ``max_restores``."""
        from yolofast.engine.distributed import unwrap_model

        t, s = self.trainer, self._state
        unwrap_model(t.model).load_state_dict(s["model"])
        distill.restore_state(getattr(t, "step_model", None), s, "the start-of-epoch snapshot")
        t.ema.load_state_dict(copy.deepcopy(s["ema"]))
        t.optimizer.load_state_dict(copy.deepcopy(s["optimizer"]))
        t.scaler.load_state_dict(copy.deepcopy(s["scaler"]))
        t.optimizer.zero_grad(set_to_none=True)
        if getattr(t, "graph", None) is not None:  # the load replaced the tensors a captured step points at
            t.graph.disable("the last good state was restored")
        for g in t.optimizer.param_groups:  # the snapshot's tensor lrs are CPU copies
            if torch.is_tensor(g.get("lr")):
                g["lr"] = float(g["lr"])
        self.restores += int(count)
        self.streak = 0

    def _last_good(self) -> str:
        last = getattr(self.trainer, "last", None)
        if last is not None and Path(last).is_file():
            return str(last)
        return "none written yet (the start of training)"


def is_out_of_memory(e: BaseException) -> bool:
    # cuDNN/cuBLAS report a failed workspace allocation as a plain RuntimeError, not OutOfMemoryError.
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("out of memory" in str(e) or "ALLOC_FAILED" in str(e)))


class OutOfMemoryHalving:
    """Out of memory in a train step -> the batch is halved, the loader rebuilt and the epoch goes on from
    the batch that failed (its images are trained on at the new size): at most ``max_halvings`` (3) times a
    run, then an error naming the batch size that still failed.

    ``trainer`` needs ``batch_size``, ``optimizer``, ``device``, ``log`` and ``rebuild_train_loader(batch,
    epoch, skip)``. Under DDP every rank would have to agree on the new size before its next all-reduce, so
    there the error is raised at once with the batch to use instead.
    """

    def __init__(self, trainer, max_halvings: int = 3):
        self.trainer, self.max_halvings = trainer, max_halvings
        self.halvings = 0

    def halve(self, err: BaseException, epoch: int, step: int, images_done: int) -> int:
        """Handle ``err`` raised in step ``step`` of ``epoch`` after ``images_done`` images of the epoch were
        trained on; returns the step index (at the new batch size) to go on from."""
        t = self.trainer
        old = t.batch_size
        where = f"at epoch {epoch + 1} step {step}"
        if dist.is_available() and dist.is_initialized():
            raise torch.OutOfMemoryError(
                f"out of memory {where} with batch {old} per rank under DDP (halving is single-process "
                f"only); restart with batch={old * dist.get_world_size() // 2}") from err
        if self.halvings >= self.max_halvings or old < 2:
            raise torch.OutOfMemoryError(
                f"out of memory {where} with batch={old} after {self.halvings} halving(s); use a smaller "
                f"batch or imgsz, amp=True, or a larger device") from err
        if getattr(t.train_loader, "dataset", None) is None:
            raise torch.OutOfMemoryError(
                f"out of memory {where} with batch={old}; the train loader (a custom get_dataloader) has no "
                f".dataset to rebuild at a smaller batch: restart with batch={old // 2}") from err
        # The step's gradients may be half-written (backward died part-way): drop them, and with them the
        # at most `accumulate - 1` batches accumulated before it.
        t.optimizer.zero_grad(set_to_none=True)
        self.halvings += 1
        new = halved_batch(t.train_loader.dataset, old, images_done)
        why = f" (rect: a divisor of {old}, so each batch keeps its rect shape)" if new != old // 2 else ""
        warnings.warn(f"out of memory {where} with batch={old}: halving to batch={new}{why} ({self.halvings}/"
                      f"{self.max_halvings}); the epoch goes on from image {images_done}", stacklevel=2)
        t.rebuild_train_loader(new, epoch, skip=images_done)
        return images_done // new
