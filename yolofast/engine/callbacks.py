"""Trainer events (Ultralytics' names) and where each one fires.

  on_pretrain_routine_start  train() begins, before anything is built
  on_pretrain_routine_end    model, data, optimizer, EMA, scheduler are built (and a resume restored)
  on_train_start             just before the first epoch
  on_train_epoch_start       each epoch, after model.train(), set_epoch and close_mosaic
  on_train_batch_start       each batch, before warmup values and the forward pass
  optimizer_step             right after optimizer.step() (and the scaler update)
  on_before_zero_grad        after the step, before optimizer.zero_grad()
  on_train_batch_end         each batch, after backward (and the step, when one was taken)
  on_train_epoch_end         after the last batch of an epoch, before the scheduler steps
  on_params_update           after the per-epoch scheduler step changed the learning rates
  on_val_start               a validation pass begins
  on_val_batch_start         before each validation batch is processed
  on_val_batch_end           after each validation batch
  on_val_end                 a validation pass ended (trainer.metrics holds its result)
  on_model_save              after last.pt / best.pt / epoch{N}.pt were written
  on_fit_epoch_end           end of an epoch: after validation, results.csv and saving
  on_train_end               training finished (final evaluation done, plots written)
  teardown                   last event: resources released
Each callback is called as ``fn(trainer)``.
"""

from __future__ import annotations

import difflib
from collections import defaultdict

__all__ = ["EVENTS", "Callbacks", "ValBatchEvents"]

EVENTS = (
    "on_pretrain_routine_start", "on_pretrain_routine_end", "on_train_start", "on_train_epoch_start",
    "on_train_batch_start", "optimizer_step", "on_before_zero_grad", "on_train_batch_end",
    "on_train_epoch_end", "on_params_update", "on_val_start", "on_val_batch_start", "on_val_batch_end",
    "on_val_end", "on_model_save", "on_fit_epoch_end", "on_train_end", "teardown",
)


def check_event(event: str) -> str:
    if event not in EVENTS:
        near = difflib.get_close_matches(event, EVENTS, n=2, cutoff=0.5)
        hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
        raise ValueError(f"unknown callback event '{event}'{hint} (events: {', '.join(EVENTS)})")
    return event


class Callbacks:
    """A list of functions per event; ``run(event, trainer)`` calls them in the order they were added."""

    def __init__(self):
        self._fns = defaultdict(list)

    def add(self, event: str, fn) -> None:
        if not callable(fn):
            raise TypeError(f"callback for '{event}' must be callable, got {type(fn).__name__}")
        self._fns[check_event(event)].append(fn)

    def set(self, event: str, fns) -> None:
        """Replace every callback of ``event`` (Ultralytics' ``set_callback``)."""
        self._fns[check_event(event)] = list(fns)

    def get(self, event: str) -> list:
        return list(self._fns[check_event(event)])

    def run(self, event: str, trainer) -> None:
        for fn in self._fns[check_event(event)]:
            fn(trainer)


class ValBatchEvents:
    """Wraps a validation loader so ``on_val_batch_start/end`` fire around every batch the validator runs."""

    def __init__(self, loader, fire):
        self.loader, self.fire = loader, fire

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):  # dataset, batch_size, ... of the wrapped loader
        return getattr(self.loader, name)

    def __iter__(self):
        for batch in self.loader:
            self.fire("on_val_batch_start")
            yield batch
            self.fire("on_val_batch_end")
