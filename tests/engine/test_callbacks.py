"""Callbacks: registration, unknown events, and that every event fires, in order, in a real run."""

import copy

import pytest
import torch

from yolofast import Trainer
from yolofast.data import make_shapes
from yolofast.engine.callbacks import EVENTS, Callbacks
from yolofast.nn import YOLOV8

TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)


def test_run_in_order_and_unknown_event():
    cb, seen = Callbacks(), []
    cb.add("on_train_start", lambda t: seen.append(("a", t)))
    cb.add("on_train_start", lambda t: seen.append(("b", t)))
    cb.run("on_train_start", 7)
    assert seen == [("a", 7), ("b", 7)]
    with pytest.raises(ValueError, match="did you mean 'on_train_end'"):
        cb.add("on_train_ends", print)
    with pytest.raises(ValueError, match="unknown callback event"):
        cb.run("nope", None)
    with pytest.raises(TypeError, match="callable"):
        cb.add("teardown", 3)


def test_every_event_fires_in_order(tmp_path):
    data = make_shapes(root=tmp_path / "d", n_train=8, n_val=4, imgsz=64)
    t = Trainer(model=TINY, data=str(data), epochs=2, imgsz=64, batch=4, workers=0, verbose=False,
                plots=False, project=tmp_path, name="cb")
    events = []
    for e in EVENTS:
        t.add_callback(e, lambda tr, e=e: events.append(e))
    with pytest.raises(ValueError):
        t.add_callback("on_epoch_end", print)
    try:
        t.train()
    finally:
        torch.use_deterministic_algorithms(False)

    assert set(events) == set(EVENTS)  # every documented event is fired
    # 8 images, batch 4 -> 2 batches per epoch, warmup nw = round(min(3, 2 - 1) * 2) = 2 iterations over which
    # accumulate ramps 1 -> 64/4: ni=0 steps (accumulate 1), ni=1 steps (last batch of the epoch always
    # does), ni=2 accumulates (16 wanted), ni=3 steps (last batch). 4 val images -> 1 val batch.
    step = ["on_train_batch_start", "optimizer_step", "on_before_zero_grad", "on_train_batch_end"]
    acc = ["on_train_batch_start", "on_train_batch_end"]
    val = ["on_val_start", "on_val_batch_start", "on_val_batch_end", "on_val_end"]
    end = ["on_train_epoch_end", "on_params_update", *val, "on_model_save", "on_fit_epoch_end"]
    head = ["on_pretrain_routine_start", "on_pretrain_routine_end", "on_train_start",
            "on_train_epoch_start", *step, *step, *end, "on_train_epoch_start", *acc, *step, *end]
    assert events[: len(head)] == head
    tail = events[len(head):]
    assert tail in (["on_train_end", "teardown"], [*val, "on_train_end", "teardown"])  # + best.pt re-check


def test_teardown_fires_on_error(tmp_path):
    data = make_shapes(root=tmp_path / "d", n_train=8, n_val=4, imgsz=64)
    t = Trainer(model=TINY, data=str(data), epochs=1, imgsz=64, batch=4, workers=0, verbose=False,
                project=tmp_path)
    seen = []

    def boom(trainer):
        raise RuntimeError("callback failed")

    t.add_callback("on_train_batch_end", boom)
    t.add_callback("teardown", lambda tr: seen.append("teardown"))
    try:
        with pytest.raises(RuntimeError, match="callback failed"):
            t.train()
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen == ["teardown"]
