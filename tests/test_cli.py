"""CLI: help, info, key=value parsing, clean errors (exit 2, no traceback), train -> val round trip."""

import copy
import subprocess
import sys

import pytest
import torch
import yaml

from yolofast import cli
from yolofast.cfg import DEFAULTS, QUICKSTART
from yolofast.data import make_shapes
from yolofast.nn import YOLOV8


def test_help_lists_every_key_with_default(capsys):
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for k in ("epochs=100", "lr0=0.01", "imgsz=640", "mosaic=1.0", "warmup_bias_lr=0.1", "close_mosaic=10"):
        assert k in out
    assert all(f"  {k}=" in out for k in DEFAULTS)
    assert "quick-start" in out and f"epochs={QUICKSTART['epochs']}" in out
    assert cli.main([]) == 0 and "usage: yolofast" in capsys.readouterr().out


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out and "python" in out and "threads" in out
    for op in ("tal_assign", "bbox_loss", "ema_update"):
        assert op in out
    assert "data loader HSV augmentation: " in out  # which implementation the loader runs, and why


def test_parse_values():
    got = cli.parse_args(["epochs=3", "lr0=1e-3", "amp=False", "name=None", "data=a.yaml", "cos_lr=true"])
    assert got == {"epochs": 3, "lr0": 1e-3, "amp": False, "name": None, "data": "a.yaml", "cos_lr": True}


def test_non_finite_words_stay_strings():
    # float() reads "nan"/"inf"; a run folder called name=nan must stay a name (numeric keys still convert)
    assert cli.parse_args(["name=nan", "project=inf"]) == {"name": "nan", "project": "inf"}


@pytest.mark.parametrize("argv,needle", [
    (["train", "epoch=3"], "did you mean 'epochs'"),
    (["train", "epochs"], "not key=value"),
    (["train", "epochs=ten"], "must be a number"),
    (["train", "data=/nonexistent/data.yaml"], "not found"),
    (["val", "model=/nonexistent/best.pt"], "not found"),
    (["val", "modle=x.pt"], "did you mean 'model'"),
    (["frobnicate"], "unknown command"),
])
def test_errors_are_one_clean_line(capsys, argv, needle):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("yolofast: error:") and needle in err and "Traceback" not in err


def test_python_dash_m_same_program():
    r = subprocess.run([sys.executable, "-m", "yolofast", "train", "lr_0=0.1"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "yolofast: error: 'lr_0' is not a valid yolofast key" in r.stderr


def test_quickstart_defaults_only_for_shapes(monkeypatch, tmp_path):
    seen = []

    class Fake:
        def __init__(self, **kw):
            seen.append(kw)
            self.save_dir = tmp_path

        def train(self):
            return {"metrics/mAP50(B)": 1.0, "metrics/mAP50-95(B)": 1.0}

    monkeypatch.setattr("yolofast.engine.trainer.Trainer", Fake)
    assert cli.main(["train"]) == 0
    assert seen[-1] == QUICKSTART
    assert cli.main(["train", "epochs=2"]) == 0
    assert seen[-1] == {**QUICKSTART, "epochs": 2}
    other = tmp_path / "d.yaml"
    assert cli.main(["train", f"data={other}", "epochs=2"]) == 0
    assert seen[-1] == {"data": str(other), "epochs": 2}  # Trainer keeps the DESIGN defaults


def test_train_then_val_round_trip(tmp_path, capsys):
    data = make_shapes(root=tmp_path / "d", n_train=8, n_val=4, imgsz=64)
    tiny = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
    tiny.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
    model_yaml = tmp_path / "tiny.yaml"
    model_yaml.write_text(yaml.safe_dump(tiny))
    try:
        rc = cli.main(["train", f"model={model_yaml}", f"data={data}", "epochs=1", "imgsz=64", "batch=4",
                       "workers=0", f"project={tmp_path}", "name=r", "verbose=False"])
    finally:
        torch.use_deterministic_algorithms(False)
    assert rc == 0
    assert f"results in {tmp_path / 'r'}" in capsys.readouterr().out
    best = tmp_path / "r" / "weights" / "best.pt"
    assert cli.main(["val", f"model={best}", "batch=4", "verbose=False"]) == 0  # data, imgsz from the ckpt
    out = capsys.readouterr().out
    assert "metrics/mAP50-95(B)=" in out and "fitness=" in out
