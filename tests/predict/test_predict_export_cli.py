"""`yolofast predict|export`, and Ultralytics' task word (`yolofast detect train ...`)."""

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from yolofast.cli import main

ULTRA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "ultralytics"


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    pytest.importorskip("yolofast.io", reason="the safe checkpoint reader (yolofast.io) is not here")
    p = ULTRA / "yolov8n-rect3.pt"
    if not p.is_file():
        pytest.skip("../shared/data/ultralytics is not present")
    return p


def test_cli_predict_saves(weights, tmp_path, capsys):
    src = ULTRA / "rect3" / "images" / "val" / "val_001.jpg"
    rc = main(["predict", f"model={weights}", f"source={src}", "imgsz=224", f"project={tmp_path}"])
    assert rc == 0
    assert (tmp_path / "predict" / "val_001.jpg").is_file()
    assert "1 image(s) processed" in capsys.readouterr().out


def test_cli_export(weights, tmp_path, capsys):
    pytest.importorskip("onnx")
    import shutil

    w = tmp_path / "w.pt"
    shutil.copy(weights, w)
    assert main(["export", f"model={w}", "format=torchscript", "imgsz=64"]) == 0
    assert (tmp_path / "w.torchscript").is_file()
    m = torch.jit.load(str(tmp_path / "w.torchscript"))
    assert m(torch.rand(1, 3, 64, 64)).shape == (1, 7, 84)


def test_cli_key_errors_and_tasks(capsys):
    assert main(["predict", "model=x.pt", "sorce=a.jpg"]) == 2
    assert "did you mean 'source'" in capsys.readouterr().err
    assert main(["predict", "model=x.pt"]) == 2
    assert "needs source=" in capsys.readouterr().err
    for task in ("segment", "pose", "obb", "classify"):
        assert main([task, "train"]) == 2
        err = capsys.readouterr().err
        assert f"task '{task}' is not supported" in err and "detection" in err
    assert main(["detect", "--help"]) == 0
    assert main(["detect", "val", "--help"]) == 0
    assert "usage: yolofast val" in capsys.readouterr().out


def test_detect_task_word_runs_the_command(tmp_path, monkeypatch):
    img = np.full((64, 64, 3), 90, np.uint8)
    cv2.imwrite(str(tmp_path / "a.jpg"), img)
    assert main(["detect", "predict", "model=yolov8n", f"source={tmp_path / 'a.jpg'}", "imgsz=64",
                 f"project={tmp_path / 'runs'}", "conf=0.001"]) == 0
    assert (tmp_path / "runs" / "predict" / "a.jpg").is_file()
