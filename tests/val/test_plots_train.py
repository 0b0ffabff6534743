"""The pictures of a training run and of ``yolofast val`` (plots=True, the default): every file under
Ultralytics' name, the validation's only after the final one, TensorBoard images; plots=False writes none;
a failing picture is one warning and the run finishes."""

from __future__ import annotations

import copy
import logging

import pytest

from yolofast import Trainer, cli
from yolofast.data import make_shapes
from yolofast.nn import YOLOV8
from yolofast.val import plots as vp

TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
FAST = dict(model=TINY, imgsz=64, batch=4, workers=0, verbose=False)
CURVES = {"BoxPR_curve.png", "BoxF1_curve.png", "BoxP_curve.png", "BoxR_curve.png", "confusion_matrix.png",
          "confusion_matrix_normalized.png"}
PICTURES = {"labels.jpg", "train_batch0.jpg", "train_batch1.jpg", "train_batch2.jpg", "results.png",
            "val_batch0_labels.jpg", "val_batch0_pred.jpg", "val_batch1_labels.jpg", "val_batch1_pred.jpg",
            *CURVES}


def pictures(folder) -> set:
    return {p.name for p in folder.iterdir() if p.suffix in (".png", ".jpg")}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """12 train images (3 batches of 4) and 16 val images (2 validation batches of 8), 64 px."""
    return str(make_shapes(root=tmp_path_factory.mktemp("shapes"), n_train=12, n_val=16, imgsz=64))


@pytest.fixture(scope="module")
def run(shapes, tmp_path_factory):
    """Two epochs with plots=True; the validator's plot folder seen at the end of each validation."""
    seen = []
    t = Trainer(data=shapes, epochs=2, project=tmp_path_factory.mktemp("runs"), name="p", **FAST)
    t.add_callback("on_val_end", lambda tr: seen.append((tr.epoch, tr.validator.plot_dir,
                                                         set(tr.validator.plot_files))))
    t.train()
    return t, seen


def test_training_writes_every_picture_once(run):
    t, seen = run
    assert pictures(t.save_dir) == PICTURES
    # the validation pictures come from the final validation only (a best.pt revalidation redraws them)
    assert seen[0][1] is None and seen[0][2] == set()
    assert all(d == t.save_dir and files == PICTURES - {"labels.jpg", "results.png"} - {
        f"train_batch{i}.jpg" for i in range(3)} for _, d, files in seen[1:])


def test_tensorboard_gets_the_validation_pictures(run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t, _ = run
    acc = EventAccumulator(str(t.save_dir), size_guidance={"images": 0})
    acc.Reload()
    tags = set(acc.Tags()["images"])
    assert {"val/PR_curve", "val/confusion_matrix", "val/F1_curve"} <= tags
    (img,) = acc.Images("val/PR_curve")[-1:]
    assert img.step == 2 and img.width > 500


def test_plots_false_writes_no_picture(shapes, tmp_path):
    t = Trainer(data=shapes, epochs=1, project=tmp_path, name="off", plots=False, **FAST)
    t.train()
    assert pictures(t.save_dir) == set()


def test_a_failing_picture_is_a_warning_and_the_run_finishes(shapes, tmp_path, monkeypatch, caplog):
    def boom(*a, **k):
        raise ValueError("bad pixels")

    for name in ("plot_images", "plot_labels", "plot_confusion_matrix", "plot_pr_curve", "plot_conf_curve"):
        monkeypatch.setattr(vp, name, boom)
    t = Trainer(data=shapes, epochs=1, project=tmp_path, name="boom", **FAST)
    with caplog.at_level(logging.WARNING, logger="yolofast"):
        metrics = t.train()
    assert "metrics/mAP50-95(B)" in metrics and (t.save_dir / "weights" / "best.pt").exists()
    lines = [r.getMessage() for r in caplog.records if "bad pixels" in r.getMessage()]
    # labels, 3 train batches, 2 x 2 val batches, 2 confusion matrices, 4 curves: one line each
    assert len(lines) == 1 + 3 + 4 + 2 + 4
    assert all(line.startswith("WARNING plots:") and "\n" not in line for line in lines)
    assert pictures(t.save_dir) == {"results.png"}


def test_cli_val_writes_the_pictures_into_runs_detect_val(run, tmp_path, monkeypatch):
    t, _ = run
    monkeypatch.chdir(tmp_path)
    assert cli.main(["val", f"model={t.best}", "batch=8", "verbose=False"]) == 0
    assert pictures(tmp_path / "runs" / "detect" / "val") == CURVES | {
        f"val_batch{i}_{k}.jpg" for i in range(2) for k in ("labels", "pred")}
    assert cli.main(["val", f"model={t.best}", "batch=8", "verbose=False", "plots=False"]) == 0
    assert not (tmp_path / "runs" / "detect" / "val2").exists()
