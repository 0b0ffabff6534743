"""Ultralytics' YOLO11/YOLO26 checkpoints through the safe reader, their raw outputs, fine-tuning
(class-branch width and class rows), and yolofast's own checkpoints of these models."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from yolofast.io import model_from_checkpoint, read_checkpoint
from yolofast.io.transfer import class_row_keys, model_from_weights
from yolofast.nn import build_model

ULTRA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "ultralytics"


def _need(name):
    p = ULTRA / name
    if not p.is_file():
        pytest.skip(f"{p} not found")
    return p


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", ["yolo11n", "yolo26n"])
def test_ultralytics_best_pt_gives_its_raw_outputs(name):
    info = read_checkpoint(_need(f"{name}-rect3.pt"))
    assert "ultralytics" not in sys.modules  # read as data: no Ultralytics import, no pickle code
    assert info["source"] == "ultralytics" and info["arch"] == name and info["scale"] == "n"
    assert info["names"] == {0: "red", 1: "green", 2: "blue"}
    m = model_from_checkpoint(info)  # strict: every tensor by name, nothing missing or left over
    assert set(m.state_dict()) == set(info["state_dict"])
    assert m.end2end == (name == "yolo26n") and m.reg_max == (1 if name == "yolo26n" else 16)
    x = torch.from_numpy(np.load(_need("yolov8n-rect3-raw-input.npy")))
    with torch.no_grad():
        y = m(x)
        ref = torch.from_numpy(np.load(_need(f"{name}-rect3-raw-output.npy")))
        assert y.shape == ref.shape == (1, 7, 1029) and _rel(y, ref) < 1e-5
        if name == "yolo26n":
            assert m.set_head(nms=False)
            y = m(x)
            ref = torch.from_numpy(np.load(_need("yolo26n-rect3-raw-output-end2end.npy")))
            assert y.shape == ref.shape == (1, 300, 6) and _rel(y, ref) < 1e-5
            assert torch.equal(y[..., 5], ref[..., 5])  # the same classes in the same order
            assert not m.set_head(nms=None) and m(x).shape == (1, 7, 1029)


@pytest.mark.parametrize("file, arch, nc", [
    ("yolo11n-rect3-epoch2-last.pt", "yolo11n", 3), ("yolo26n-rect3-epoch2-last.pt", "yolo26n", 3),
    ("yolo11s-init.pt", "yolo11s", 80), ("yolo26s-init.pt", "yolo26s", 80)])
def test_other_ultralytics_files_load(file, arch, nc):
    info = read_checkpoint(_need(file))
    assert info["arch"] == arch and info["nc"] == nc
    m = model_from_checkpoint(info)
    n_ref = sum(p.numel() for p in build_model(arch, nc=nc).parameters())
    assert sum(p.numel() for p in m.parameters()) == n_ref
    if "last" in file:  # Ultralytics counts epochs from 0: the end of the 2nd epoch is epoch 1
        # 8.4.190's last.pt keeps only the EMA (model None), with the optimizer state beside it
        assert info["epoch"] == 1 and info["ema_state_dict"] is not None
        assert isinstance(info["train_state"]["optimizer"], dict)
        model_from_checkpoint(info, weights="ema")


def test_finetune_keeps_source_class_width_and_remaps_rows(tmp_path):
    """A yolo26n of 80 classes fine-tuned to 3 keeps c3 = 80 (a yaml nc=3 one has 64); rows by name."""
    from yolofast.engine.checkpoint import save_checkpoint

    torch.manual_seed(0)
    src = build_model("yolo26n", nc=80)
    names = {i: f"c{i}" for i in range(80)}
    names[7], names[2] = "Truck", "car"
    src.names = names
    save_checkpoint({"model": src, "ema": src, "epoch": 0}, tmp_path / "coco.pt")
    logs = []
    m = model_from_weights(tmp_path / "coco.pt", 3, ["car", "person", "truck"], log=logs.append)
    assert m.head.cv3[0][2].in_channels == 80 and m.head.one2one_cv3[0][2].in_channels == 80
    assert build_model("yolo26n", nc=3).head.cv3[0][2].in_channels == 64
    assert "Transferred" in logs[0] and "2/3 class rows" in logs[0]
    sd, s0 = m.state_dict(), src.state_dict()
    rows = set(class_row_keys(m))
    assert any("one2one_cv3" in k for k in rows)
    for k in rows:  # car <- row 2, truck <- row 7 ("Truck": case-insensitive); person keeps its prior
        torch.testing.assert_close(sd[k][0], s0[k][2])
        torch.testing.assert_close(sd[k][2], s0[k][7])
    assert all(torch.equal(v, s0[k]) for k, v in sd.items() if k not in rows)  # everything else copied
    # yolofast's own checkpoint of the fine-tuned model keeps its width through save and reload
    save_checkpoint({"model": m, "ema": m, "epoch": 3}, tmp_path / "ft.pt")
    info = read_checkpoint(tmp_path / "ft.pt")
    back = model_from_checkpoint(info)
    assert info["epoch"] == 3 and back.head.cv3[0][2].in_channels == 80
    assert all(torch.equal(v, sd[k]) for k, v in back.state_dict().items())


@pytest.mark.parametrize("name", ["yolo11n", "yolo26n"])
def test_own_checkpoint_roundtrip(tmp_path, name):
    from yolofast.engine.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(1)
    m = build_model(name, nc=2)
    m.names = ["a", "b"]
    save_checkpoint({"model": m, "ema": m, "epoch": 4, "updates": 9}, tmp_path / "last.pt")
    assert torch.load(tmp_path / "last.pt", weights_only=True)["model_cfg"]["cfg"]["scale"] == "n"
    ck = load_checkpoint(tmp_path / "last.pt")
    assert ck["epoch"] == 4 and ck["model"].end2end == m.end2end and ck["model"].names == {0: "a", 1: "b"}
    x = torch.rand(1, 3, 64, 64)
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(ck["ema"](x), m(x), rtol=0, atol=0)


def test_pretrained_into_a_yaml_model_takes_the_source_width(tmp_path):
    """pretrained=path into a yaml-built model: its class branches are rebuilt at the file's width."""
    from yolofast.engine.checkpoint import save_checkpoint
    from yolofast.io.transfer import load_weights

    torch.manual_seed(0)
    src = build_model("yolo26n", nc=80)
    save_checkpoint({"model": src, "ema": src, "epoch": 0}, tmp_path / "coco.pt")
    m = build_model("yolo26n", nc=3)
    load_weights(m, tmp_path / "coco.pt", ["a", "b", "c"], log=lambda s: None)
    assert m.head.cv3[0][2].weight.shape == (3, 80, 1, 1) and m.yaml["head_cls_width"] == 80
    o2o, o2o_src = m.head.one2one_cv3, src.head.one2one_cv3
    torch.testing.assert_close(o2o[1][0][0].conv.weight, o2o_src[1][0][0].conv.weight)
    assert m.head.cv3[0][2].bias[0].item() == pytest.approx(torch.log(torch.tensor(5 / 3 / 80 ** 2)).item())
    assert build_model(m.yaml, nc=3).head.cv3[0][2].in_channels == 80
