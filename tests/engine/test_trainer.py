"""Trainer: overfit, exact resume, early stopping, time limit, fail-fast errors, outputs, warmup values."""

import copy
import csv
import math
import time

import pytest
import torch

from yolofast import YOLO, Trainer
from yolofast.cfg import CfgError
from yolofast.data import DataError, build_dataloader, build_dataset, check_data, make_shapes
from yolofast.engine.checkpoint import load_checkpoint, save_checkpoint
from yolofast.engine.trainer import RESULTS_COLUMNS, cpu_has_native_bf16
from yolofast.loss import DetectionLoss
from yolofast.nn import YOLOV8, build_model

# yolov8 layout at 1/8 width (8..32 channels): ~50k parameters, a step at 64 px takes milliseconds.
TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
FAST = dict(model=TINY, imgsz=64, batch=4, workers=0, verbose=False, plots=False)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """8 train + 4 val synthetic images of 64 px (2 batches of 4 per epoch)."""
    return str(make_shapes(root=tmp_path_factory.mktemp("shapes"), n_train=8, n_val=4, imgsz=64))



def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("precision", ["fp32", "bf16_channels_last"])
def test_overfit_one_batch(tmp_path, precision):
    """100 Adam steps on one fixed batch of 4 shapes images (yolov8n, 128 px): the loss falls >= 80 %, in
    fp32 and in the CPU default where the CPU has native bf16 (bf16 autocast, channels_last, fp32 loss)."""
    d = check_data(make_shapes(root=tmp_path, n_train=4, n_val=1, imgsz=128))
    ds = build_dataset(d["train"], imgsz=128, augment=False, nc=d["nc"])
    batch = next(iter(build_dataloader(ds, 4, 0, shuffle=False)))
    model = build_model("yolov8n", nc=d["nc"]).train()
    crit = DetectionLoss(model.nc)
    opt = torch.optim.Adam(model.parameters(), lr=0.002)
    img = batch["img"].float() / 255
    bf16 = precision != "fp32"
    if bf16:
        model.to(memory_format=torch.channels_last)
        img = img.contiguous(memory_format=torch.channels_last)
    losses = []
    for _ in range(100):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            feats = model(img)
        loss, _ = crit([f.float() for f in feats], batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] <= 0.2 * losses[0], (losses[0], losses[-1])


def test_train_outputs_and_metrics(shapes, tmp_path):
    m = Trainer(data=shapes, epochs=2, project=tmp_path, name="run", **FAST)
    metrics = m.train()
    out = tmp_path / "run"
    for f in ("weights/last.pt", "weights/best.pt", "results.csv", "args.yaml"):
        assert (out / f).is_file(), f
    rows = _rows(out / "results.csv")
    assert list(rows[0]) == list(RESULTS_COLUMNS)
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    assert float(rows[1]["time"]) > float(rows[0]["time"]) > 0
    for k in ("metrics/mAP50-95(B)", "metrics/mAP50(B)", "fitness", "val/box_loss"):
        assert k in metrics and math.isfinite(metrics[k])
    ck = load_checkpoint(out / "weights" / "last.pt")
    assert ck["epoch"] == 1 and ck["train_args"]["epochs"] == 2 and ck["version"]
    assert {"optimizer", "scaler", "scheduler", "rng", "ema", "updates", "date"} <= set(ck)
    assert ck["updates"] > 0
    assert not list((out / "weights").glob("*.tmp"))  # atomic writes leave nothing behind
    # The run in the open (engine/state.py): the Trainer itself holds few attributes; Ultralytics' names
    # read and write the state, the parts and the schedule.
    assert len(vars(m)) <= 20, sorted(vars(m))
    assert m.epoch == m.state.epoch == 1 and m.model is m.parts.model and m.nb == m.schedule.nb == 2
    assert m.metrics is m.state.metrics and m.best_fitness == ck["best_fitness"]


def test_name_increments(shapes, tmp_path):
    a = Trainer(data=shapes, project=tmp_path, **FAST)
    (tmp_path / "train").mkdir()
    b = Trainer(data=shapes, project=tmp_path, **FAST)
    (tmp_path / "train2").mkdir()
    c = Trainer(data=shapes, project=tmp_path, **FAST)
    assert (a.save_dir.name, b.save_dir.name, c.save_dir.name) == ("train", "train2", "train3")
    assert Trainer(data=shapes, project=tmp_path, exist_ok=True, **FAST).save_dir.name == "train"


def _state(path):
    ck = load_checkpoint(path)
    return ck["model"].state_dict(), ck["ema"].state_dict(), ck["updates"], ck["optimizer"]


@pytest.mark.parametrize("close_mosaic", [1, 10])
def test_resume_equals_uninterrupted(shapes, tmp_path, close_mosaic, resume_after_crash):
    """2 epochs straight == 1 epoch, crash, resume=last.pt (warmup across both epochs). close_mosaic=1:
    mosaic closes in epoch 2; 10 > epochs: it never closes, also not in the resumed run."""
    recipe = dict(data=shapes, epochs=2, close_mosaic=close_mosaic, project=tmp_path, **FAST)
    Trainer(name="full", **recipe).train()
    r = resume_after_crash(recipe)
    assert r.save_dir == tmp_path / "cut" and r.args.epochs == 2
    r.train()

    m1, e1, u1, o1 = _state(tmp_path / "full/weights/last.pt")
    m2, e2, u2, o2 = _state(tmp_path / "cut/weights/last.pt")
    assert u1 == u2
    for k in m1:
        torch.testing.assert_close(m2[k], m1[k], rtol=0, atol=1e-6, msg=f"model {k}")
        torch.testing.assert_close(e2[k], e1[k], rtol=0, atol=1e-6, msg=f"ema {k}")
    assert [g["lr"] for g in o1["param_groups"]] == [g["lr"] for g in o2["param_groups"]]
    assert [int(r["epoch"]) for r in _rows(tmp_path / "cut/results.csv")] == [1, 2]


def test_resume_true_finds_latest_and_refuses_finished(shapes, tmp_path):
    Trainer(data=shapes, epochs=1, project=tmp_path, name="done", **FAST).train()
    with pytest.raises(CfgError, match="nothing to resume"):
        Trainer(resume=True, project=tmp_path)
    with pytest.raises(FileNotFoundError, match="no last.pt"):
        Trainer(resume=True, project=tmp_path / "empty")


class ConstValidator:
    """A validator stand-in returning a scripted fitness per call (tests subclassing get_validator)."""

    def __init__(self, fitness):
        self.fitness, self.calls = list(fitness), 0

    def __call__(self, model):
        f = self.fitness[min(self.calls, len(self.fitness) - 1)]
        self.calls += 1
        return {"metrics/mAP50-95(B)": f, "metrics/mAP50(B)": f, "fitness": f}


def _scripted_trainer(fitness):
    class Scripted(Trainer):
        def get_validator(self):
            return ConstValidator(fitness)

    return Scripted


def test_early_stopping_patience(shapes, tmp_path):
    cls = _scripted_trainer([0.1, 0.3, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2])
    t = cls(data=shapes, epochs=8, patience=2, project=tmp_path, name="es", **FAST)
    metrics = t.train()
    rows = _rows(tmp_path / "es/results.csv")
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4]  # best at epoch 2, then 2 epochs without gain
    assert t.best_epoch == 1 and load_checkpoint(tmp_path / "es/weights/best.pt")["epoch"] == 1
    assert metrics["fitness"] == 0.2  # 5th call: best.pt re-validated at the end (scripted value)


def test_time_limit_stops_cleanly(shapes, tmp_path):
    t = Trainer(data=shapes, epochs=50, time=1e-9, project=tmp_path, name="t", **FAST)
    seen = []
    t.add_callback("on_train_batch_end", lambda tr: seen.append(tr.epoch))
    t0 = time.time()
    metrics = t.train()
    assert seen == [0]  # stopped after the first batch
    assert len(_rows(tmp_path / "t/results.csv")) == 1
    assert load_checkpoint(tmp_path / "t/weights/last.pt")["epoch"] == 0
    assert "fitness" in metrics and time.time() - t0 < 120


def test_bad_key_fails_fast_with_suggestion(shapes):
    with pytest.raises(CfgError, match="'epochs'"):
        Trainer(data=shapes, epoch=3)
    with pytest.raises(CfgError, match="lr0"):
        Trainer(data=shapes, lr_0=0.1)
    with pytest.raises(CfgError, match="must be a number"):
        Trainer(data=shapes, epochs="ten")


def test_bad_data_fails_fast(tmp_path):
    with pytest.raises(DataError, match="not found"):
        Trainer(data=str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("path: .\ntrain: images/train\nnames: [a]\n")
    with pytest.raises(DataError, match="'val'"):
        Trainer(data=str(bad))


def test_warmup_lr_values_by_hand(shapes, tmp_path):
    """SGD lr0 0.01, 3 epochs of 2 batches: nw = round(min(3, 3 - 1) * 2) = 4 warmup iterations."""
    t = Trainer(data=shapes, epochs=3, optimizer="SGD", lr0=0.01, momentum=0.937, warmup_bias_lr=0.1,
                warmup_momentum=0.8, val=False, project=tmp_path, **FAST)
    seen = []
    t.add_callback("on_train_batch_end",
                   lambda tr: seen.append([(g["lr"], g["momentum"]) for g in tr.optimizer.param_groups]))
    t.train()
    assert t.nw == 4
    lf1 = (1 - 1 / 3) * (1 - 0.01) + 0.01  # linear schedule factor of epoch 1
    expect = [  # (bias lr, other lr, momentum) at ni = 0, 1, 2
        (0.1, 0.0, 0.8),
        (0.1 + (0.01 - 0.1) / 4, 0.01 / 4, 0.8 + 0.137 / 4),
        (0.1 + (0.01 * lf1 - 0.1) / 2, 0.01 * lf1 / 2, 0.8 + 0.137 / 2),
    ]
    for ni, (b, o, m) in enumerate(expect):
        (lb, mb), (l1, m1), (l2, m2) = seen[ni]
        assert lb == pytest.approx(b, abs=1e-12) and l1 == pytest.approx(o, abs=1e-12) == l2
        assert mb == pytest.approx(m, abs=1e-12) == m1 == m2
    # after warmup (epoch 2, ni = 4, 5) every group follows the schedule: lr0 * lf(2), momentum 0.937
    lf2 = (1 - 2 / 3) * (1 - 0.01) + 0.01
    for lr, mom in seen[4] + seen[5]:
        assert lr == pytest.approx(0.01 * lf2, abs=1e-12) and mom == pytest.approx(0.937)


def test_auto_optimizer_short_run_is_adamw(shapes, tmp_path):
    t = Trainer(data=shapes, epochs=1, project=tmp_path, **FAST)
    t.train()
    assert type(t.optimizer).__name__ == "AdamW"
    assert t.optimizer.param_groups[1]["initial_lr"] == pytest.approx(round(0.002 * 5 / (4 + 5), 6))
    assert t.optimizer.param_groups[1]["weight_decay"] == pytest.approx(5e-4 * 4 * 16 / 64)
    assert [g["weight_decay"] for g in t.optimizer.param_groups][::2] == [0.0, 0.0]


def test_module_and_checkpoint_as_model_and_yolo_subclass(shapes, tmp_path):
    nc = check_data(shapes)["nc"]
    module = build_model(TINY, nc=nc)
    t = Trainer(data=shapes, epochs=1, project=tmp_path, name="mod", **{**FAST, "model": module})
    t.train()
    assert t.model is module  # trained in place, as given
    best = tmp_path / "mod/weights/best.pt"

    calls = []

    class Counting(Trainer):
        def get_loss(self, model):
            crit = super().get_loss(model)

            def loss(feats, batch):
                calls.append(1)
                return crit(feats, batch)

            return loss

    y = YOLO(best)
    before = {k: v.clone() for k, v in y.model.state_dict().items()}
    epochs_seen = []
    y.add_callback("on_train_epoch_end", lambda trainer: epochs_seen.append(trainer.epoch))
    metrics = y.train(data=shapes, epochs=1, trainer=Counting, project=tmp_path, name="ft",
                      **{k: v for k, v in FAST.items() if k != "model"})
    assert calls and "fitness" in metrics  # the subclass' loss ran (train and val)
    assert epochs_seen == [0]  # YOLO.add_callback reaches the trainer
    start = load_checkpoint(tmp_path / "ft/weights/last.pt")
    assert start["train_args"]["model"] == str(best)
    assert any(not torch.equal(before[k], v) for k, v in y.model.state_dict().items())
    out = y.val(imgsz=64, batch=4, verbose=False)
    assert "metrics/mAP50-95(B)" in out
    with pytest.raises(FileNotFoundError, match="downloads no weights"):
        YOLO("yolov8n.pt")


def test_atomic_save_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint({"model": torch.nn.Linear(2, 2), "epoch": 0}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        save_checkpoint({"model": torch.nn.Linear(2, 2), "epoch": 1, "x": Unpicklable()}, path)
    assert load_checkpoint(path)["epoch"] == 0
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_one_epoch_coco128(coco128_yaml, tmp_path):
    t = Trainer(model="yolov8n", data=coco128_yaml, epochs=1, imgsz=160, batch=16, workers=0,
                project=tmp_path, name="c", verbose=False)
    metrics = t.train()
    for f in ("weights/last.pt", "weights/best.pt", "results.csv", "results.png"):
        assert (tmp_path / "c" / f).is_file(), f
    rows = _rows(tmp_path / "c/results.csv")
    assert len(rows) == 1 and list(rows[0]) == list(RESULTS_COLUMNS)
    assert all(math.isfinite(float(rows[0][k])) for k in RESULTS_COLUMNS)
    assert 0.0 <= metrics["metrics/mAP50-95(B)"] <= 1.0


def test_cpu_precision_defaults(shapes, tmp_path):
    """amp=True (the default) is bf16 on CPUs with native bf16 and fp32 elsewhere; NHWC either way."""
    t = Trainer(data=shapes, epochs=1, project=tmp_path, **FAST)
    t._setup_train()
    assert t.amp_dtype is (torch.bfloat16 if cpu_has_native_bf16() else None)
    assert t.channels_last and next(t.model.parameters()).is_contiguous(memory_format=torch.channels_last)
    off = Trainer(data=shapes, epochs=1, amp=False, project=tmp_path, **FAST)
    off._setup_train()
    assert off.amp_dtype is None and not off.scaler.is_enabled()


def test_cpu_bf16_autocast_and_amp_errors(shapes, tmp_path):
    t = Trainer(data=shapes, epochs=1, amp="bf16", project=tmp_path, **FAST)
    metrics = t.train()
    assert t.amp_dtype is torch.bfloat16 and t.channels_last and not t.scaler.is_enabled()
    assert math.isfinite(metrics["val/box_loss"])
    assert all(p.dtype == torch.float32 for p in t.model.parameters())  # fp32 master weights
    with pytest.raises(CfgError, match="fp16.*CUDA"):
        Trainer(data=shapes, epochs=1, amp="fp16", project=tmp_path, **FAST).train()


def test_sync_bn_needs_ddp_on_cuda(shapes, tmp_path):
    t = Trainer(data=shapes, epochs=1, sync_bn=True, project=tmp_path, **FAST)
    with pytest.warns(UserWarning, match="sync_bn=True needs DDP on CUDA"):
        t._setup_train()
    assert not any(isinstance(m, torch.nn.SyncBatchNorm) for m in t.model.modules())


def test_resume_keeps_the_optimizer_auto_chose(shapes, tmp_path):
    """optimizer=auto picks AdamW for short runs and SGD past 10k iterations: a resume that extends epochs
    past that line must keep the run's AdamW (an SGD cannot load its state)."""
    Trainer(data=shapes, epochs=1, project=tmp_path, name="auto", **FAST).train()
    last = tmp_path / "auto" / "weights" / "last.pt"
    assert load_checkpoint(last)["optimizer_auto"][0] == "AdamW"
    t = Trainer(resume=str(last), epochs=20_000)  # 20k iterations: a fresh auto choice would be SGD
    t._setup_train()
    assert isinstance(t.optimizer, torch.optim.AdamW) and t.start_epoch == 1


def test_compiled_runs_drop_the_short_last_batch(shapes, tmp_path):
    """compile=True: 8 images at batch 3 -> 2 full batches (a third of 2 images would be another compile)."""
    t = Trainer(data=shapes, epochs=1, project=tmp_path, compile=True, **{**FAST, "batch": 3})
    t._setup_train()
    assert t.train_loader.drop_last and t.nb == 2
    eager = Trainer(data=shapes, epochs=1, project=tmp_path, **{**FAST, "batch": 3})
    eager._setup_train()
    assert not eager.train_loader.drop_last and eager.nb == 3
