"""YOLO.export: ONNX in onnxruntime equals PyTorch (fixed and dynamic batch), TorchScript, Ultralytics."""

import sys

import numpy as np
import pytest
import torch

from yolofast import YOLO
from yolofast.nn import build_model


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model("yolov8n", nc=3).eval()
    m.names = {0: "a", 1: "b", 2: "c"}
    return YOLO(m)


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("dynamic", [False, True])
def test_onnx_matches_pytorch_in_onnxruntime(model, tmp_path, dynamic):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    f = model.export(format="onnx", imgsz=(96, 128), dynamic=dynamic, file=tmp_path / "m.onnx")
    sess = ort.InferenceSession(f, providers=["CPUExecutionProvider"])
    (inp,), (out,) = sess.get_inputs(), sess.get_outputs()
    assert inp.name == "images" and out.name == "output0"
    x = torch.rand(3 if dynamic else 1, 3, 96, 128)
    got = sess.run(None, {"images": x.numpy()})[0]
    with torch.no_grad():
        want = model.model(x).numpy()
    anchors = 12 * 16 + 6 * 8 + 3 * 4  # strides 8, 16, 32 on 96 x 128
    assert got.shape == want.shape == (x.shape[0], 4 + 3, anchors)
    assert _rel(got, want) <= 1e-4
    meta = {p.key: p.value for p in __import__("onnx").load(f).metadata_props}
    assert meta["stride"] == "32" and "'a'" in meta["names"]
    other = torch.rand(2, 3, 160, 64)  # another batch and another H x W (anchors 20*8 + 10*4 + 5*2)
    if dynamic:
        with torch.no_grad():
            want = model.model(other).numpy()
        got = sess.run(None, {"images": other.numpy()})[0]
        assert got.shape == want.shape == (2, 7, 210) and _rel(got, want) <= 1e-4
    else:
        with pytest.raises(Exception):  # noqa: B017  fixed shape: onnxruntime refuses another one
            sess.run(None, {"images": other.numpy()})


def test_onnx_simplify(model, tmp_path):
    pytest.importorskip("onnxslim")
    ort = pytest.importorskip("onnxruntime")
    f = model.export(format="onnx", imgsz=64, simplify=True, file=tmp_path / "s.onnx")
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        want = model.model(x).numpy()
    assert _rel(ort.InferenceSession(f).run(None, {"images": x.numpy()})[0], want) <= 1e-4


def test_torchscript(model, tmp_path):
    f = model.export(format="torchscript", imgsz=64, file=tmp_path / "m.torchscript")
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.load(f)(x), model.model(x))


def test_default_file_is_next_to_the_weights(tmp_path):
    from yolofast.export import export

    m = build_model("yolov8n", nc=2).eval()
    f = export(m, "torchscript", weights=tmp_path / "w" / "best.pt", imgsz=64)
    assert f == str(tmp_path / "w" / "best.torchscript")


def test_ultralytics_format_says_it_needs_ultralytics(model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ultralytics", None)  # import fails as when it is not installed
    monkeypatch.setitem(sys.modules, "ultralytics.nn.tasks", None)
    with pytest.raises(ImportError, match="pip install ultralytics"):
        model.export(format="ultralytics", file=tmp_path / "u.pt")


def test_bad_format_and_imgsz(model, tmp_path):
    with pytest.raises(ValueError, match="onnx, torchscript, ultralytics"):
        model.export(format="tflite")
    with pytest.raises(ValueError, match="multiple of the model stride"):
        model.export(format="torchscript", imgsz=100, file=tmp_path / "x.torchscript")
