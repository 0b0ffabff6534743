"""AutoBatch (yolofast/engine/autobatch.py): batch choice from a memory profile, OOM handling, fallbacks,
model state left untouched, recipe values, GT sizing; one real CUDA profile when a GPU is present."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_models import tiny

from yolofast.data import build_dataset, check_data, make_shapes
from yolofast.engine.autobatch import (
    MAX_AUTOBATCH_GT,
    _train_step,
    autobatch,
    autobatch_gt,
    max_gt_count,
    resolve_batch,
)
from yolofast.loss import DetectionLoss
from yolofast.nn import build_model

GiB = 2**30


def linear(a_gib, s_gib, oom_from=None, calls=None):
    """profile(b) = a + s*b GiB; raises OutOfMemoryError for b >= oom_from."""

    def profile(b):
        if calls is not None:
            calls.append(b)
        if oom_from is not None and b >= oom_from:
            raise torch.OutOfMemoryError(f"CUDA out of memory (fake, b={b})")
        return int((a_gib + s_gib * b) * GiB)

    return profile


def run(profile, total_gib=40, **kw):
    logs = []
    b = autobatch(torch.nn.Linear(2, 2), None, 64, "cpu", profile=profile, total_memory=int(total_gib * GiB),
                  log=logs.append, **kw)
    return b, "\n".join(logs)


def test_linear_profile_picks_fitted_batch():
    calls = []
    b, log = run(linear(1.0, 0.5, calls=calls))  # (0.6*40 - 1) / 0.5 = 46
    assert b == 46
    assert calls == [1, 2, 4, 8, 16]
    assert "AutoBatch: batch 46 for 60% of 40.0 GiB (predicted 24.0 GiB)" in log
    assert run(linear(1.0, 0.5), fraction=0.3)[0] == 22  # (12 - 1) / 0.5
    assert run(linear(2.0, 0.25), total_gib=10)[0] == 16  # (6 - 2) / 0.25


def test_clamped_to_1_and_1024():
    b, log = run(linear(30.0, 0.5))  # the intercept alone is over 60% of 40 GiB
    assert b == 1 and "even batch 1" in log
    assert run(linear(0.1, 0.001))[0] == 1024


def test_oom_at_larger_sizes():
    calls = []
    b, log = run(linear(1.0, 0.5, oom_from=16, calls=calls))  # fit asks 46 but 16 ran out of memory
    assert b == 8 and calls == [1, 2, 4, 8, 16]
    assert "batch 16 ran out of memory" in log and "using 8" in log
    assert run(linear(1.0, 0.5, oom_from=16), total_gib=10)[0] == 10  # fit (6-1)/0.5 = 10 < 16: kept
    b, log = run(linear(1.0, 0.5, oom_from=2), default=16)  # one size measured: no fit, largest fitted
    assert b == 1 and "no fit" in log
    b, log = run(linear(1.0, 0.5, oom_from=1), default=12)  # nothing fitted: the default
    assert b == 12 and "no fit" in log


def test_other_errors_propagate():
    def broken(b):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        run(broken)


@pytest.mark.parametrize("profile", [lambda b: 5 * GiB, lambda b: int((5 - 0.1 * b) * GiB)])
def test_flat_or_decreasing_profile_falls_back(profile):
    b, log = run(profile, default=13)
    assert b == 13
    assert "does not grow with the batch" in log


def test_cpu_device_keeps_default():
    model, logs = build_model("yolov8n", nc=2), []
    before = [p.detach().clone() for p in model.parameters()]
    b = autobatch(model, DetectionLoss(2), 64, torch.device("cpu"), default=7, log=logs.append)
    assert b == 7
    assert len(logs) == 1 and "needs a CUDA device" in logs[0] and "default batch 7" in logs[0]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_profiling_leaves_model_state_unchanged():
    """The real step runs under autobatch's state guard; mode, params, BN stats and grads come back."""
    model, crit = build_model("yolov8n", nc=2).eval(), DetectionLoss(2)
    params = [p.detach().clone() for p in model.parameters()]
    bufs = [b.clone() for b in model.buffers()]
    seen = []

    def profile(b):
        _train_step(model, crit, 64, b, 16, torch.device("cpu"))
        seen.append((model.training, all(p.grad is not None for p in model.parameters() if p.requires_grad)))
        model.zero_grad(set_to_none=True)
        return int((1 + b) * GiB)

    out = autobatch(model, crit, 64, "cpu", batch_sizes=(1, 2), profile=profile, total_memory=20 * GiB,
                    log=lambda s: None)
    assert out == 11  # (12 - 1) / 1
    assert seen == [(True, True), (True, True)]  # the step really ran in train mode with a backward
    assert not model.training
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert all(torch.equal(b, q) for b, q in zip(model.buffers(), bufs))  # BN running stats restored
    assert all(p.grad is None for p in model.parameters())


def test_fraction_validated():
    with pytest.raises(ValueError, match="fraction"):
        run(linear(1, 0.5), fraction=1.5)


@pytest.mark.parametrize("value,expected", [(-1, (True, 0.60)), (0.7, (True, 0.7)), (0.05, (True, 0.05)),
                                            (16, (False, 0.0)), (1, (False, 0.0)),
                                            (np.int64(8), (False, 0.0))])
def test_resolve_batch(value, expected):
    assert resolve_batch(value) == expected


@pytest.mark.parametrize("value", [0, -2, 1.0, 1.5, 0.0, -0.5, True, "16", None])
def test_resolve_batch_rejects(value):
    with pytest.raises(ValueError, match=r"batch=.*int >= 1.*-1.*fraction in \(0, 1\)"):
        resolve_batch(value)


def fake(counts):
    return SimpleNamespace(labels=[{"cls": np.zeros((n, 1), np.float32)} for n in counts])


def test_gt_counts_fake():
    assert max_gt_count(fake([3, 0, 7, 2])) == 7
    assert max_gt_count(fake([0, 0])) == 1
    assert autobatch_gt(fake([3, 7]), mosaic=1.0) == 32  # 4*7 = 28 -> bucket 32
    assert autobatch_gt(fake([3, 7]), mosaic=0.0) == 16
    assert autobatch_gt(fake([17]), mosaic=0.0) == 32
    assert autobatch_gt(fake([0]), mosaic=0.5) == 16
    assert autobatch_gt(fake([100]), mosaic=1.0) == MAX_AUTOBATCH_GT  # 400 capped


def test_gt_counts_generated_dataset(tmp_path):
    data = check_data(str(make_shapes(root=tmp_path / "d", n_train=8, n_val=2, imgsz=64)))
    ds = build_dataset(data["train"], imgsz=64, augment=False)
    files = sorted(Path(data["train"]).parent.parent.glob("labels/train/*.txt"))
    expected = max(len(f.read_text().split("\n")) - (f.read_text().endswith("\n")) for f in files)
    assert expected >= 1 and max_gt_count(ds) == expected
    assert autobatch_gt(ds, mosaic=1.0) == min(16 * -(-4 * expected // 16), MAX_AUTOBATCH_GT)


@pytest.mark.cuda
def test_cuda_profile_real():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device("cuda")
    model, crit = build_model("yolov8n", nc=80).to(dev), DetectionLoss(80)
    params = [p.detach().clone() for p in model.parameters()]
    logs = []
    b = autobatch(model, crit, 320, dev, max_gt=32, amp_dtype=torch.bfloat16, log=logs.append)
    text = "\n".join(logs)
    assert 1 <= b <= 1024, text
    line = next(s for s in logs if s.startswith("AutoBatch: measured "))
    mems = [float(t.split()[1]) for t in line.removeprefix("AutoBatch: measured ").split(", ")]
    assert len(mems) >= 2 and mems[-1] > mems[0], text  # memory rose with the batch
    assert f"AutoBatch: batch {b} for 60% of" in text
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("family", ["yolo11", "yolo26"])
def test_autobatch_step_takes_the_family_head_output(family):
    """AutoBatch's profiling step (forward, fp32 loss, backward) with the family's criterion: YOLO26's head
    output is a dict of branches, not a list of maps."""
    from yolofast.engine.autobatch import _train_step
    from yolofast.loss import criterion_for
    from yolofast.nn import build_model

    model = build_model(tiny(family), nc=3).train()
    _train_step(model, criterion_for(model), 64, 2, 4, torch.device("cpu"))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
