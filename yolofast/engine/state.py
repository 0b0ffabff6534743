"""A run in two open objects: ``RunState`` (what changes as it trains, and what a checkpoint keeps of it)
and ``TrainParts`` (what setup built: model, loaders, loss, optimizer, step). The Trainer holds one of
each (``trainer.state``, ``trainer.parts``) and shows their fields under Ultralytics' names
(``trainer.epoch``, ``trainer.tloss``, ``trainer.model``, ``trainer.optimizer``, ...), which callbacks and
subclasses read and may set. The schedule (batches per epoch, warmup, accumulation, lr factor) is
``engine/schedule.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["RunState", "RunViews", "TrainParts", "View"]


@dataclass
class RunState:
    """The run's counters and results. ``checkpoint()`` is what last.pt/best.pt keep of it (beside the
    model, EMA with its update count, optimizer, scaler, scheduler and RNG streams: ``resume.py``);
    ``RunState.resumed(ckpt)`` is where a resumed run starts."""

    epoch: int = 0  # the epoch being trained (0-based); after the loop, the last one trained
    start_epoch: int = 0  # where the epoch loop starts: 0, or the epoch after a resumed checkpoint's
    best_fitness: float | None = None
    best_epoch: int = -1
    fitness: float | None = None  # of the last validation
    metrics: dict = field(default_factory=dict)  # the last validation's metrics
    train_time: float = 0.0  # seconds, carried across resumes for results.csv's `time`
    stop: bool = False  # early stopping or the time limit ends the run after this epoch
    # Within an epoch
    batch_i: int = 0  # index of the current batch in the epoch
    batch: dict | None = None  # the current batch, preprocessed (the loggers draw it)
    loss_items: torch.Tensor | None = None  # this batch's loss items, detached on the CPU
    tloss: torch.Tensor | None = None  # the epoch's running mean of the loss items
    last_opt_step: int = -1  # iteration (batches since the run began) of the last optimizer step
    lr: dict = field(default_factory=dict)  # lr/pg0.. at the epoch's end, for results.csv
    results_row: dict = field(default_factory=dict)  # the epoch's results.csv row (TensorBoard reads it)

    def checkpoint(self) -> dict:
        """The fields a checkpoint keeps (Ultralytics' names)."""
        return {"epoch": self.epoch, "best_fitness": self.best_fitness, "best_epoch": self.best_epoch,
                "train_metrics": dict(self.metrics), "train_time": self.train_time}

    @classmethod
    def resumed(cls, ckpt: dict) -> RunState:
        """The state a run resumed from ``ckpt`` (its last finished epoch) starts with."""
        start = ckpt["epoch"] + 1
        return cls(start_epoch=start, best_fitness=ckpt["best_fitness"],
                   best_epoch=ckpt.get("best_epoch", -1), metrics=ckpt.get("train_metrics") or {},
                   train_time=ckpt.get("train_time", 0.0))


@dataclass
class TrainParts:
    """What the setup functions (``engine/setup.py``) build for one run; None until built."""

    model: nn.Module | None = None  # the student, on the device
    frozen: list = field(default_factory=list)  # layer prefixes `freeze` froze (their BatchNorm too)
    stride: int = 32  # the model's largest stride, at least 32: multi_scale rounds sizes to it
    channels_last: bool = False
    amp_dtype: torch.dtype | None = None  # bf16 / fp16 autocast, None for fp32
    scaler: Any = None  # torch.amp.GradScaler (disabled unless fp16)
    batch_size: int = 0  # per rank
    train_loader: Any = None
    val_loader: Any = None
    criterion: Any = None  # get_loss(model): what validation also uses
    step_model: nn.Module | None = None  # the model, or the distillation step around it
    train_model: Any = None  # what the step calls: DDP-wrapped and/or compiled step_model
    train_loss: Any = None  # the step's loss: x world size under DDP, compiled with compile=True
    validator: Any = None
    ema: Any = None  # ModelEMA
    optimizer: torch.optim.Optimizer | None = None
    optimizer_auto: tuple | None = None  # (name, lr, momentum) optimizer=auto chose: a resume keeps it
    scheduler: Any = None  # LambdaLR over the schedule's lr factor
    graph: Any = None  # GraphedTrainStep with cuda_graph=True, else None
    nonfinite: Any = None  # NonFiniteGuard (recovery.py)
    oom: Any = None  # OutOfMemoryHalving (recovery.py)
    cpu_threads: int = 0  # torch threads at setup on a CPU run: the most an epoch uses (device.py)


class View:
    """``trainer.<name>`` reads and writes ``trainer.<owner>.<name>``: the names callbacks and subclasses
    know (``trainer.epoch``, ``trainer.model``, ...) over the state objects that hold them."""

    def __init__(self, owner: str):
        self.owner = owner

    def __set_name__(self, cls, name: str) -> None:
        self.name = name

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        return getattr(getattr(obj, self.owner), self.name)

    def __set__(self, obj, value) -> None:
        setattr(getattr(obj, self.owner), self.name, value)


class RunViews:
    """Ultralytics' names on the Trainer (its base class) for the fields of ``trainer.state``,
    ``trainer.parts`` and ``trainer.schedule``: callbacks and subclasses read them, and may set them."""

    epoch = View("state")
    start_epoch = View("state")
    best_fitness = View("state")
    best_epoch = View("state")
    fitness = View("state")
    metrics = View("state")
    train_time = View("state")
    stop = View("state")
    batch_i = View("state")
    batch = View("state")
    loss_items = View("state")
    tloss = View("state")
    last_opt_step = View("state")
    lr = View("state")
    model = View("parts")
    frozen = View("parts")
    stride = View("parts")
    channels_last = View("parts")
    amp_dtype = View("parts")
    scaler = View("parts")
    batch_size = View("parts")
    train_loader = View("parts")
    val_loader = View("parts")
    criterion = View("parts")
    step_model = View("parts")
    train_model = View("parts")
    train_loss = View("parts")
    validator = View("parts")
    ema = View("parts")
    optimizer = View("parts")
    optimizer_auto = View("parts")
    scheduler = View("parts")
    graph = View("parts")
    nonfinite = View("parts")
    oom = View("parts")
    nb = View("schedule")
    accumulate = View("schedule")
    lf = View("schedule")

    @property
    def nw(self) -> int:
        return self.schedule.nw

    @property
    def epochs(self) -> int:
        """The recipe's epochs, read live."""
        return self.args.epochs

    @property
    def wdir(self) -> Path:
        return self.save_dir / "weights"

    @property
    def last(self) -> Path:
        return self.wdir / "last.pt"

    @property
    def best(self) -> Path:
        return self.wdir / "best.pt"

    @property
    def csv(self) -> Path:
        return self.save_dir / "results.csv"
