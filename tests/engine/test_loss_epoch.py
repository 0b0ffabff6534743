"""The loss weights' epoch (YOLO11_YOLO26.md §4.4): the schedule calls ``criterion.set_epoch(e + 1, epochs)``
right after epoch e's last batch (before on_train_epoch_end and validation), ``set_epoch(0, epochs)`` at
setup and ``set_epoch(start_epoch, epochs)`` when a run resumes, so a resumed run's weights are the
uninterrupted run's. Recorded here on the v8 loss (its set_epoch is replaced by a recorder)."""

import copy

import pytest

from yolofast import Trainer
from yolofast.data import make_shapes
from yolofast.loss import DetectionLoss
from yolofast.nn import YOLOV8

TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
FAST = dict(model=TINY, imgsz=64, batch=4, workers=0, verbose=False, plots=False)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """8 train + 4 val images of 64 px: 2 batches of 4 per epoch."""
    return str(make_shapes(root=tmp_path_factory.mktemp("shapes"), n_train=8, n_val=4, imgsz=64))


def _expected(epochs, start=0):
    out = [("set_epoch", start, epochs)]
    for e in range(start, epochs):
        out += [("on_train_batch_end", e)] * 2 + [("set_epoch", e + 1, epochs), ("on_train_epoch_end", e),
                                                  ("on_val_start", e)]
    return out


def _record(t, events):
    for name in ("on_train_batch_end", "on_train_epoch_end", "on_val_start"):
        t.add_callback(name, lambda tr, name=name: events.append((name, tr.epoch)))


def test_loss_epoch_after_last_batch_and_on_resume(shapes, tmp_path, monkeypatch, resume_after_crash):
    events = []
    monkeypatch.setattr(DetectionLoss, "set_epoch",
                        lambda self, epoch, epochs=None: events.append(("set_epoch", epoch, epochs)),
                        raising=False)
    recipe = dict(data=shapes, epochs=3, project=tmp_path, **FAST)
    t = Trainer(name="full", **recipe)
    _record(t, events)
    t.train()
    assert events[:len(_expected(3))] == _expected(3)

    r = resume_after_crash(recipe)  # trained epoch 0 and crashed: resumes at epoch 1
    events.clear()
    _record(r, events)
    r.train()
    assert events[:len(_expected(3, start=1))] == _expected(3, start=1)


def test_schedule_drives_the_e2e_weights():
    """The schedule on YOLO26's criterion: the weights of §4.4's table, with epochs read at each call."""
    from yolofast.cfg import get_cfg
    from yolofast.engine.schedule import Schedule
    from yolofast.loss import E2EDetectionLoss

    a = get_cfg(epochs=100)
    s, loss = Schedule(a, nb=10), E2EDetectionLoss(nc=3, epochs=7)  # another E: the schedule sets it
    table = {0: (0.8, 0.2), 1: (0.792929, 0.207071), 50: (0.446465, 0.553535), 98: (0.107071, 0.892929),
             99: (0.1, 0.9)}
    for e, want in table.items():
        s.loss_epoch(loss, e)
        assert loss.weights == pytest.approx(want, abs=1e-6)
    s.loss_epoch(loss, 0)
    assert loss.weights[1] == 1 - 0.8  # Python floats: 0.19999999999999996, as Ultralytics
    a.epochs = 300  # a time= run's new estimate reaches the criterion at the next call
    s.loss_epoch(loss, 150)
    assert loss.epochs == 300 and loss.weights == pytest.approx((0.448829, 0.551171), abs=1e-6)


def test_yolo26_trains_with_the_scheduled_branch_weights(shapes, tmp_path):
    """yolo26n through the Trainer: get_loss gives the end-to-end criterion, each epoch trains with §4.4's
    weights for its index (2 epochs: 0.8/0.2, then 0.1/0.9), and the run writes its checkpoints."""
    import math

    seen = []
    recipe = {**FAST, "model": "yolo26n"}
    t = Trainer(data=shapes, epochs=2, project=tmp_path, name="y26", **recipe)
    t.add_callback("on_train_epoch_start", lambda tr: seen.append(tr.criterion.weights))
    metrics = t.train()
    assert type(t.criterion).__name__ == "E2EDetectionLoss" and t.criterion.epoch == 2
    assert seen == [pytest.approx((0.8, 0.2)), pytest.approx((0.1, 0.9))]
    assert all(math.isfinite(v) for v in t.tloss.tolist()) and "fitness" in metrics
    assert t.last.is_file()
