"""The run's schedule, computed here and nowhere else (DESIGN §4): batches per epoch ``nb``, warmup
iterations ``nw``, gradient accumulation ``accumulate`` (ramping from 1 over the warmup) and the per-epoch
lr factor ``lf``. The formulas are ``optim.py``'s; this object owns their inputs and results.

    schedule = Schedule(args, nb=len(train_loader))      # accumulate for the optimizer's weight decay
    schedule.start_warmup(momentum, warmup_bias_lr)      # what the optimizer chose
    scheduler = schedule.lr_scheduler(optimizer)          # LambdaLR over lf, stepped once per epoch
    schedule.warmup(ni, epoch, optimizer)                 # per batch: lr, momentum and accumulate
    schedule.rebatch(nb)                                  # another batch size (AutoBatch, out of memory)
    schedule.loss_epoch(criterion, epoch)                 # the loss weights' epoch (YOLO26's E2E loss)
"""

from __future__ import annotations

import torch

from yolofast.engine import optim

__all__ = ["Schedule"]


class Schedule:
    """``args``: the recipe (read live: epochs, batch, nbs, warmup_epochs, warmup_momentum, lrf, cos_lr);
    ``nb``: batches per epoch of the train loader."""

    def __init__(self, args, nb: int):
        self.args = args
        self.nb = nb
        self.accumulate = self.steady_accumulate()
        self.momentum = args.momentum  # where the warmup momentum ends (the optimizer's own)
        self.warmup_bias_lr = args.warmup_bias_lr  # where the bias lr starts (0 for optimizer=auto)
        # Built once, from the epochs at the start (a LambdaLR's checkpoint holds no lambda): as before.
        self.lf = optim.lr_lambda(args.epochs, args.lrf, args.cos_lr)

    @property
    def epochs(self) -> int:
        return self.args.epochs

    @property
    def nw(self) -> int:
        """Warmup iterations: round(min(warmup_epochs, epochs − 1) · nb)."""
        return optim.warmup_iters(self.args.warmup_epochs, self.epochs, self.nb)

    def steady_accumulate(self) -> int:
        """Batches per optimizer step after the warmup: max(round(nbs / batch), 1), batch of all ranks."""
        return optim.accumulate_steps(self.args.nbs, self.args.batch)

    def start_warmup(self, momentum: float, warmup_bias_lr: float) -> None:
        """The optimizer's momentum (the warmup's end) and the bias lr the warmup starts from."""
        self.momentum, self.warmup_bias_lr = momentum, warmup_bias_lr

    def rebatch(self, nb: int) -> None:
        """The train loader changed its batch size (``args.batch`` already the new total): ``nb`` batches
        per epoch now, and the accumulation that keeps nbs images per step."""
        self.nb = nb
        self.accumulate = self.steady_accumulate()

    def lr_scheduler(self, optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=self.lf)

    def in_warmup(self, ni: int) -> bool:
        return self.nw > 0 and ni <= self.nw

    def warmup(self, ni: int, epoch: int, optimizer) -> None:
        """At iteration ``ni`` (batches since the run began) of the warmup: each group's lr (biases down
        from warmup_bias_lr, the others up from 0 to this epoch's scheduled lr), SGD momentum up from
        warmup_momentum, and ``accumulate`` up from 1. Nothing after the warmup."""
        if not self.in_warmup(ni):
            return
        a = self.args
        targets = [g["initial_lr"] * self.lf(epoch) for g in optimizer.param_groups]
        lrs, mom, self.accumulate = optim.warmup_values(
            ni, self.nw, lr_targets=targets, bias_lr0=self.warmup_bias_lr, momentum0=a.warmup_momentum,
            momentum=self.momentum, nbs=a.nbs, batch=a.batch,
            tags=[g.get("param_group") for g in optimizer.param_groups])  # MuSGD's bias groups: pg4, pg5
        for g, lr in zip(optimizer.param_groups, lrs):
            optim.set_group_value(g, "lr", lr)
            if "momentum" in g:  # SGD/RMSProp only; Adam's beta1 stays `momentum`
                g["momentum"] = mom

    def loss_epoch(self, loss, epoch: int) -> None:
        """Make ``epoch`` (0-based) the one whose loss weights apply, with ``epochs`` read now (a time= run
        may change it): ``loss.set_epoch(epoch, epochs)``. YOLO26's end-to-end criterion weighs its
        one-to-many and one-to-one branches by it (YOLO11_YOLO26.md §4.4); a loss without ``set_epoch``
        has no epoch schedule and is left alone. The loop calls it with ``e + 1`` right after epoch e's
        last batch (before on_train_epoch_end and validation), setup with ``start_epoch`` (0, or where a
        resumed run goes on: a checkpoint holds no loss state, the epoch gives it)."""
        set_epoch = getattr(loss, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch, self.epochs)
