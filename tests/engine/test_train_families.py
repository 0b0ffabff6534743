"""Training YOLO26 and YOLO11 (tiny widths, 64 px shapes): YOLO26's loss items are named by its criterion
(``box_loss, cls_loss, l1_loss``) in the progress header, results.csv and TensorBoard, and the validation
columns follow (``val/l1_loss``); YOLO11 keeps v8's columns. Validation during training uses the run's ``nms``
(None: one-to-many + NMS) and raises ``max_det`` from the train/val labels. A YOLO26 run resumed from
last.pt gets its E2E weights from the epoch and ends where the uninterrupted run ends."""

from __future__ import annotations

import contextlib
import csv
import io
import math
import sys

import numpy as np
import pytest
import torch
from tiny_models import tiny as _tiny

from yolofast import Trainer
from yolofast.data import make_shapes
from yolofast.engine.checkpoint import load_checkpoint
from yolofast.engine.loggers import RESULTS_COLUMNS, results_columns
from yolofast.loss import DetectionLoss, E2EDetectionLoss

FAST = dict(imgsz=64, batch=4, workers=0, verbose=False, plots=False)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """8 train + 4 val images of 64 px: 2 batches of 4 per epoch."""
    return str(make_shapes(root=tmp_path_factory.mktemp("shapes"), n_train=8, n_val=4, imgsz=64))


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def yolo26_run(shapes, tmp_path_factory):
    """A verbose 2-epoch tiny YOLO26 run and what it printed."""
    t = Trainer(model=_tiny("yolo26"), data=shapes, epochs=2, project=tmp_path_factory.mktemp("runs"),
                name="y26", **{**FAST, "verbose": True})
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        t.train()
    return t, out.getvalue()


def test_yolo26_loss_names_in_header_csv_and_tensorboard(yolo26_run):
    t, printed = yolo26_run
    assert isinstance(t.criterion, E2EDetectionLoss)
    assert t.loss_names == ["box_loss", "cls_loss", "l1_loss"]
    header = [ln.split() for ln in printed.splitlines() if ln.strip().startswith("Epoch")]
    assert header and all(h[2:5] == ["box_loss", "cls_loss", "l1_loss"] for h in header)
    rows = _rows(t.csv)
    assert len(rows) == 2 and list(rows[0]) == list(results_columns(t.loss_names))
    assert "train/l1_loss" in rows[0] and "val/l1_loss" in rows[0]
    assert not any("dfl" in k for k in rows[0])
    for r in rows:  # every loss column is filled (a name mismatch would leave NaN)
        for k in ("train/box_loss", "train/cls_loss", "train/l1_loss", "val/box_loss", "val/cls_loss",
                  "val/l1_loss"):
            assert math.isfinite(float(r[k])) and float(r[k]) > 0, k
    if "tensorboard" in sys.modules or _has_tensorboard():
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(t.save_dir), size_guidance={"scalars": 0})
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        assert {"train/l1_loss", "val/l1_loss", "batch/l1_loss"} <= tags
        assert not {"train/dfl_loss", "val/dfl_loss", "batch/dfl_loss"} & tags
        got = [e.value for e in acc.Scalars("val/l1_loss")]
        assert got == pytest.approx([float(r["val/l1_loss"]) for r in rows], rel=1e-5)


def _has_tensorboard() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def test_yolo26_validates_one_to_many_with_nms_by_default(yolo26_run):
    t, _ = yolo26_run
    assert t.args.nms is None and t.validator.nms is None
    # the final metrics (best.pt's) are the default validator's: one-to-many head + NMS
    assert {"metrics/mAP50-95(B)", "val/l1_loss"} <= set(t.metrics)


def test_yolo11_trains_with_v8_loss_and_columns(shapes, tmp_path):
    t = Trainer(model=_tiny("yolo11"), data=shapes, epochs=1, project=tmp_path, name="y11", **FAST)
    t.train()
    assert type(t.criterion) is DetectionLoss and t.loss_names == ["box_loss", "cls_loss", "dfl_loss"]
    rows = _rows(t.csv)
    assert list(rows[0]) == list(RESULTS_COLUMNS)  # the v8 columns, unchanged
    assert math.isfinite(float(rows[0]["val/dfl_loss"]))


def test_validator_gets_nms_and_raised_max_det(shapes, tmp_path):
    """nms=False reaches the training validator; max_det 300 follows the train/val label maximum, other
    values stay."""
    t = Trainer(model=_tiny("yolo26"), data=shapes, epochs=1, project=tmp_path, nms=False, **FAST)
    t._setup_train()
    assert t.validator.nms is False and t.validator.max_det == 300
    labels = t.train_loader.dataset.labels
    labels[0] = {**labels[0], "cls": np.zeros((350, 1), np.float32)}
    assert t.get_validator().max_det == 350
    t.args.max_det = 100
    assert t.get_validator().max_det == 100


def test_yolo26_resume_restores_e2e_weights_and_matches(shapes, tmp_path, resume_after_crash):
    recipe = dict(model=_tiny("yolo26"), data=shapes, epochs=2, project=tmp_path, deterministic=True,
                  **FAST)
    full = Trainer(name="full", **recipe)
    full.train()
    r = resume_after_crash(recipe)  # trained epoch 0, crashed: resumes at epoch 1
    seen = []
    r.add_callback("on_train_epoch_start", lambda tr: seen.append((tr.epoch, tr.criterion.weights)))
    r.train()
    assert r.start_epoch == 1 and isinstance(r.criterion, E2EDetectionLoss)
    assert seen == [(1, (0.1, 0.9))]  # epoch 1 of 2: w_o2m 0.1, w_o2o 0.9 (not epoch 0's 0.8 / 0.2)
    a = load_checkpoint(full.save_dir / "weights" / "last.pt")
    b = load_checkpoint(r.save_dir / "weights" / "last.pt")
    sa, sb = a["ema"].state_dict(), b["ema"].state_dict()
    assert sa.keys() == sb.keys()
    assert any("one2one" in k for k in sa)
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=0, atol=0, msg=k)
    assert _rows(r.csv)[-1]["val/l1_loss"] == _rows(full.csv)[-1]["val/l1_loss"]


def test_doctor_refuses_yolo26_with_a_reason(shapes, tmp_path):
    """The doctor traces one head's v8 loss stages: for an end-to-end model it says so instead of failing
    inside its trace."""
    from yolofast.cfg import CfgError

    t = Trainer(model=_tiny("yolo26"), data=shapes, epochs=1, project=tmp_path, **FAST)
    with pytest.raises(CfgError, match="end-to-end head.*yolo11 or yolov8"):
        t.doctor()
    assert t.parts.model is None  # the trainer's own parts were handed back


def test_distill_refuses_a_yolo26_student_with_a_reason(shapes, tmp_path):
    from yolofast.cfg import CfgError

    teacher = tmp_path / "teacher.pt"
    teacher.write_bytes(b"")  # refused before the teacher is read
    t = Trainer(model=_tiny("yolo26"), data=shapes, epochs=1, project=tmp_path, distill_model=str(teacher),
                **FAST)
    with pytest.raises(CfgError, match="student has an end-to-end head"):
        t.train()


def test_amp_bf16_trains_yolo26(shapes, tmp_path):
    """amp=True on a CPU with native BF16 runs the forward in bf16 (the loss in fp32); elsewhere fp32."""
    from yolofast.engine.device import cpu_has_native_bf16

    t = Trainer(model=_tiny("yolo26"), data=shapes, epochs=1, project=tmp_path, amp=True, **FAST)
    t.train()
    assert t.amp_dtype == (torch.bfloat16 if cpu_has_native_bf16() else None)
    assert math.isfinite(float(_rows(t.csv)[0]["train/l1_loss"]))
