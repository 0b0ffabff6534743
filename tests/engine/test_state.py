"""The run in the open (engine/state.py, engine/schedule.py): RunState's checkpoint round trip, the
schedule's numbers (batches per epoch, warmup, accumulation, lr factor) and the trainer's names over them.
No training here: these are the objects the loop and resume use (test_trainer.py trains with them)."""

from __future__ import annotations

import torch

from yolofast.cfg import get_cfg
from yolofast.engine.schedule import Schedule
from yolofast.engine.state import RunState, RunViews, TrainParts


def test_run_state_checkpoint_round_trip():
    s = RunState(epoch=4, best_fitness=0.5, best_epoch=3, metrics={"fitness": 0.4}, train_time=12.5)
    ck = s.checkpoint()
    assert ck == {"epoch": 4, "best_fitness": 0.5, "best_epoch": 3, "train_metrics": {"fitness": 0.4},
                  "train_time": 12.5}
    r = RunState.resumed(ck)
    assert (r.start_epoch, r.best_fitness, r.best_epoch, r.train_time) == (5, 0.5, 3, 12.5)
    assert r.epoch == 0 and r.metrics == {"fitness": 0.4}
    assert r.metrics is not s.metrics  # the checkpoint holds a copy
    old = RunState.resumed({"epoch": 0, "best_fitness": None})  # a checkpoint without the later keys
    assert (old.start_epoch, old.best_epoch, old.metrics, old.train_time) == (1, -1, {}, 0.0)


def test_schedule_numbers():
    a = get_cfg(epochs=10, batch=8, nbs=64, warmup_epochs=3.0, lrf=0.01)
    s = Schedule(a, nb=7)
    assert s.accumulate == 8 and s.nw == 21  # round(64 / 8); round(min(3, 10 - 1) * 7)
    assert s.lf(0) == 1.0 and abs(s.lf(5) - (0.5 * 0.99 + 0.01)) < 1e-12
    a.epochs = 2  # read live: the warmup is at most epochs - 1 epochs
    assert s.epochs == 2 and s.nw == 7
    a.batch = 32
    s.rebatch(nb=2)  # a smaller loader after a batch change: nb and accumulation follow
    assert (s.nb, s.accumulate, s.nw) == (2, 2, 2)
    assert Schedule(get_cfg(warmup_epochs=0.0), nb=5).nw == 0


def test_schedule_warmup_sets_groups_and_accumulate():
    a = get_cfg(epochs=3, batch=16, nbs=64, warmup_epochs=1.0, warmup_momentum=0.8, momentum=0.937)
    s = Schedule(a, nb=4)
    s.start_warmup(momentum=0.937, warmup_bias_lr=0.1)
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [w]}, {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=0.01,
                          momentum=0.937)
    for g in opt.param_groups:
        g["initial_lr"] = 0.01
    s.warmup(0, 0, opt)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.0] and opt.param_groups[0]["momentum"] == 0.8
    assert s.accumulate == 1
    s.warmup(4, 0, opt)  # the warmup's last iteration: scheduled lr, full momentum, nbs / batch
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.01] and s.accumulate == 4
    opt.param_groups[1]["lr"] = 0.5
    s.warmup(5, 1, opt)  # after the warmup: nothing is touched
    assert opt.param_groups[1]["lr"] == 0.5


def test_views_read_and_write_the_state_objects():
    class T(RunViews):
        def __init__(self):
            self.state, self.parts, self.schedule = RunState(), TrainParts(), None
            self.args = get_cfg(epochs=7)

    t = T()
    t.epoch = 3
    t.model = m = torch.nn.Linear(1, 1)
    assert t.state.epoch == 3 and t.parts.model is m and t.epochs == 7
    assert vars(t).keys() == {"state", "parts", "schedule", "args"}  # nothing landed on the trainer itself
    assert not hasattr(t, "nb")  # no schedule before setup


def test_schedule_loss_epoch_reads_epochs_live():
    seen = []

    class E2E:
        def set_epoch(self, epoch, epochs=None):
            seen.append((epoch, epochs))

    a = get_cfg(epochs=10)
    s = Schedule(a, nb=3)
    s.loss_epoch(E2E(), 0)
    a.epochs = 12  # a time= run re-estimating its epochs: the next call carries the new count
    s.loss_epoch(E2E(), 4)
    s.loss_epoch(object(), 5)  # a loss without an epoch schedule: left alone
    assert seen == [(0, 10), (4, 12)]
