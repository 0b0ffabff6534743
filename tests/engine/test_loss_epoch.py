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
