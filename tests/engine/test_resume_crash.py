"""Crash-safe resume: SIGKILL during an epoch and during a checkpoint write, then resume=True gives the
weights of an uninterrupted run; truncated/foreign checkpoints and resume-argument rules."""

import copy
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from yolofast import Trainer
from yolofast.cfg import CfgError
from yolofast.data import make_shapes
from yolofast.engine.checkpoint import CheckpointError, load_checkpoint
from yolofast.nn import YOLOV8

ULTRALYTICS = Path(__file__).resolve().parents[3] / "shared" / "data" / "ultralytics"  # Ultralytics 8.4 files
TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)

# Every run of the test happens in a child process (same interpreter, same thread count), so the runs
# compared bit for bit differ only in being killed and resumed.
CHILD = textwrap.dedent('''
    import copy, os, signal, sys
    from yolofast import Trainer
    from yolofast.nn import YOLOV8

    data, project, name, mode = sys.argv[1:5]
    tiny = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
    tiny.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
    if mode == "resume":
        Trainer(resume=os.path.join(project, name, "weights", "last.pt"), verbose=False).train()
        sys.exit(0)
    t = Trainer(model=tiny, data=data, epochs=2, imgsz=64, batch=2, nbs=4, workers=0, verbose=False,
                plots=False, close_mosaic=1, project=project, name=name)
    batches = []

    def kill_mid_epoch(tr):  # the 2nd batch of the 2nd epoch: last.pt holds epoch 1
        batches.append(tr.epoch)
        if batches.count(1) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    real_fsync = os.fsync

    def kill_in_save(fd):  # the 2nd epoch's last.pt is written to its temp file but not yet renamed
        if t.epoch == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        real_fsync(fd)

    if mode == "epoch":
        t.add_callback("on_train_batch_end", kill_mid_epoch)
    elif mode == "save":
        os.fsync = kill_in_save
    t.train()
''')


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return str(make_shapes(root=tmp_path_factory.mktemp("shapes"), n_train=8, n_val=2, imgsz=64))



def _run_all(tmp_path, shapes, modes):
    """Run CHILD for each (name, mode) in parallel; returns {name: returncode}."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    procs = {n: subprocess.Popen([sys.executable, str(script), shapes, str(tmp_path), n, m],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for n, m in modes}
    out = {}
    for n, p in procs.items():
        log, _ = p.communicate(timeout=300)
        out[n] = p.returncode
        if p.returncode not in (0, -9):
            pytest.fail(f"child {n} failed ({p.returncode}):\n{log.decode()[-3000:]}")
    return out


def _weights(path):
    ck = load_checkpoint(path)
    return ck["model"].state_dict(), ck["ema"].state_dict(), ck["updates"], ck["epoch"]


@pytest.mark.slow  # 5 child processes (~35 s on 2 cores)
def test_sigkill_during_epoch_and_during_save_resume_exactly(shapes, tmp_path):
    rc = _run_all(tmp_path, shapes, [("full", "none"), ("cut_epoch", "epoch"), ("cut_save", "save")])
    assert rc == {"full": 0, "cut_epoch": -9, "cut_save": -9}
    wdir = tmp_path / "cut_save" / "weights"
    assert list(wdir.glob(".last.pt.*.tmp")), "the killed save should have left its temp file"
    for n in ("cut_epoch", "cut_save"):  # the last complete checkpoint is epoch 1's, readable
        assert load_checkpoint(tmp_path / n / "weights" / "last.pt")["epoch"] == 0

    rc = _run_all(tmp_path, shapes, [("cut_epoch", "resume"), ("cut_save", "resume")])
    assert rc == {"cut_epoch": 0, "cut_save": 0}
    assert not list(wdir.glob(".*.tmp")), "resume removes the killed save's temp file"
    m1, e1, u1, ep1 = _weights(tmp_path / "full/weights/last.pt")
    for n in ("cut_epoch", "cut_save"):
        m2, e2, u2, ep2 = _weights(tmp_path / n / "weights" / "last.pt")
        assert (u2, ep2) == (u1, ep1) == (u1, 1)
        for k in m1:
            torch.testing.assert_close(m2[k], m1[k], rtol=0, atol=1e-6, msg=f"{n} model {k}")
            torch.testing.assert_close(e2[k], e1[k], rtol=0, atol=1e-6, msg=f"{n} ema {k}")
        rows = (tmp_path / n / "results.csv").read_text().splitlines()
        assert [r.split(",")[0] for r in rows[1:]] == ["1", "2"], rows


@pytest.fixture(scope="module")
def one_epoch_run(shapes, tmp_path_factory):
    """A 2-epoch run stopped (by a callback) after epoch 1 was saved."""
    root = tmp_path_factory.mktemp("runs")
    t = Trainer(model=TINY, data=shapes, epochs=2, imgsz=64, batch=2, workers=0, verbose=False, plots=False,
                project=root, name="r")

    def stop(tr):
        raise KeyboardInterrupt

    t.add_callback("on_fit_epoch_end", stop)
    with pytest.raises(KeyboardInterrupt):
        t.train()
    return root / "r" / "weights" / "last.pt"


def test_truncated_and_foreign_checkpoints_are_detected(one_epoch_run, tmp_path):
    data = one_epoch_run.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut\.pt.*truncated, corrupt or not a torch file"):
        load_checkpoint(cut)
    with pytest.raises(CheckpointError, match="truncated"):
        Trainer(resume=str(cut))
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        load_checkpoint(empty)
    text = tmp_path / "text.pt"
    text.write_text("not a checkpoint\n")
    with pytest.raises(CheckpointError, match="text.pt"):
        load_checkpoint(text)
    # a model that is no detector: named, with what is supported
    linear = tmp_path / "linear.pt"
    torch.save({"model": torch.nn.Linear(2, 2), "ema": None, "epoch": 3, "date": "x"}, linear)
    with pytest.raises(CheckpointError, match=r"linear\.pt.*torch\.nn\.modules\.linear\.Linear.*supports"):
        Trainer(resume=str(linear))
    # another tool's checkpoint (Ultralytics' mid-run last.pt): weights, but not yolofast's training state
    foreign = ULTRALYTICS / "yolov8n-rect3-epoch2-last.pt"
    if foreign.is_file():  # ../shared/data/ultralytics, beside the checkout
        with pytest.raises(CheckpointError, match="another tool.*missing.*scheduler.*model=") as e:
            Trainer(resume=str(foreign))
        assert str(foreign) in str(e.value)
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="not a model checkpoint"):
        load_checkpoint(tmp_path / "list.pt")


def test_resume_argument_rules(one_epoch_run):
    path = str(one_epoch_run)
    # safe changes are honoured
    t = Trainer(resume=path, batch=4, workers=0, patience=5, val=False, save_period=1, time=1.0, plots=True,
                epochs=5, verbose=False)
    a = t.args
    assert (a.batch, a.patience, a.val, a.save_period, a.time, a.plots, a.epochs) == (4, 5, False, 1, 1.0,
                                                                                      True, 5)
    assert a.imgsz == 64 and a.resume == path
    # recipe changes are refused, each named with the run's value (lr0 as optimizer=auto recorded it:
    # AdamW's round(0.01 / (4 + nc), 6) for this short run, written to args.yaml like Ultralytics does)
    assert a.optimizer == "AdamW" and a.lr0 != 0.1
    lr0 = re.escape(str(a.lr0))
    with pytest.raises(CfgError, match=rf"refused: lr0=0\.1 \(run has {lr0}\), imgsz=128 \(run has 64\)"):
        Trainer(resume=path, lr0=0.1, imgsz=128)
    with pytest.raises(CfgError, match="epochs may only be extended"):
        Trainer(resume=path, epochs=1)
    # the same value as the run's is not a change
    assert Trainer(resume=path, imgsz=64, verbose=False).args.imgsz == 64
