"""``nms`` semantics for YOLO11/YOLO26 in val, predict and export, against Ultralytics' own numbers."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from yolofast import YOLO
from yolofast.nn import build_model
from yolofast.val.nms import topk_filter

ULTRA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "ultralytics"


CASES = [("yolo11n", "default"), ("yolo26n", "default"), ("yolo26n", "nms=False")]


def _need(name):
    p = ULTRA / name
    if not p.exists():
        pytest.skip(f"{p} not found")
    return p


def _expected(name):
    return json.loads(_need("expected.json").read_text())[name]


@pytest.mark.parametrize("name, key", CASES)
def test_predict_matches_ultralytics(name, key):
    """The first 10 rect3 val images: the same rows (x1 y1 x2 y2 conf cls, original pixels) as Ultralytics'
    predict, by default (one-to-many + NMS) and with nms=False (one-to-one top-k, no NMS)."""
    model = YOLO(str(_need(f"{name}-rect3.pt")))
    kw = {"nms": False} if key == "nms=False" else {}
    exp = _expected(name)[key]["predict"]
    files = [str(_need("rect3") / f) for f in exp]
    for res, rows in zip(model.predict(files, imgsz=224, conf=0.25, verbose=False, **kw), exp.values()):
        got = res.boxes.data.numpy()
        rows = np.asarray(rows, dtype=np.float32).reshape(-1, 6)
        assert got.shape == rows.shape
        np.testing.assert_allclose(got, rows, atol=1e-3, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name, key", CASES)
def test_val_matches_ultralytics(name, key):
    from yolofast.val import validate

    exp = _expected(name)[key]["val"]
    m = validate(str(_need(f"{name}-rect3.pt")), str(_need("rect3") / "data.yaml"), imgsz=224, batch=16,
                 verbose=False, map_convention="ultralytics", nms=False if key == "nms=False" else None)
    # P and R come from the same matches at conf 0.001; AP integration differs in the 4th decimal, as for v8
    assert m.box.mp == pytest.approx(exp["precision"], abs=1e-4)
    assert m.box.mr == pytest.approx(exp["recall"], abs=1e-4)
    assert m.box.map == pytest.approx(exp["mAP50-95"], abs=0.002)
    assert m.box.map50 == pytest.approx(exp["mAP50"], abs=0.002)


def test_nms_false_head_path_and_filter():
    torch.manual_seed(0)
    m = build_model("yolo26n", nc=4).eval()
    x = torch.rand(2, 3, 96, 64)
    with torch.no_grad():
        default = m(x)
        o2m, o2o = m.forward_heads(x)
        rows = m.decode_one2one(o2o, max_det=50)
        m.set_head(nms=False, max_det=50)
        torch.testing.assert_close(m(x), rows)
    assert default.shape == (2, 8, 96 // 8 * 64 // 8 + 96 // 16 * 64 // 16 + 96 // 32 * 64 // 32)
    torch.testing.assert_close(m.decode(o2m), default)
    assert rows.shape == (2, 50, 6) and (rows[..., 4].diff(dim=1) <= 0).all()  # sorted by score
    assert not build_model("yolo11n", nc=4).set_head(nms=False)  # no one-to-one head: NMS stays
    conf = rows[0, 10, 4].item()
    kept = topk_filter(rows, conf=conf, max_det=5, classes=[0, 1, 2, 3])
    assert len(kept) == 2 and kept[0].shape[0] <= 5 and (kept[0][:, 4] > conf).all()  # strict threshold
    agn = m.decode_one2one(o2o, max_det=50, agnostic=True)
    assert agn.shape == (2, 50, 6)


@pytest.mark.parametrize("name", ["yolov8n", "yolo11n", "yolo26n"])
def test_results_for_every_family(name):
    model = YOLO(name)
    res = model.predict(torch.rand(1, 3, 64, 64), conf=0.0, verbose=False)[0]
    assert res.boxes.data.shape[1] == 6 and len(res.boxes) <= 300
    res.plot()


def test_max_det_auto_raise():
    from yolofast.val.validator import raise_max_det

    labels = [{"cls": np.zeros((n, 1))} for n in (3, 412, 10)]
    assert raise_max_det(300, labels) == 412 and raise_max_det(100, labels) == 100
    assert raise_max_det(300, labels[:1]) == 300


def test_onnx_layouts_in_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from yolofast.io import model_from_checkpoint

    m = model_from_checkpoint(_need("yolo26n-rect3.pt"))
    x = np.load(_need("yolov8n-rect3-raw-input.npy"))
    for nms, ref in ((None, "yolo26n-rect3-raw-output.npy"), (False, "yolo26n-rect3-raw-output-end2end.npy")):
        f = YOLO(m).export(format="onnx", imgsz=224, file=tmp_path / f"m{nms}.onnx", nms=nms)
        y = ort.InferenceSession(f, providers=["CPUExecutionProvider"]).run(None, {"images": x})[0]
        r = np.load(_need(ref))
        assert y.shape == r.shape  # (1, 4+nc, A) by default, (1, 300, 6) with nms=False
        assert np.abs(y - r).max() / np.abs(r).max() < 1e-5
        meta = {p.key: p.value for p in onnx.load(f).metadata_props}
        assert meta["end2end"] == str(nms is False)
    with pytest.raises(ValueError, match="nms=True"):
        YOLO(m).export(format="onnx", imgsz=224, file=tmp_path / "t.onnx", nms=True)


def test_cli_predict_nms_false(tmp_path, capsys):
    from yolofast.cli import main

    img = next((_need("rect3") / "images" / "val").glob("*.jpg"))
    rc = main(["predict", f"model={_need('yolo26n-rect3.pt')}", f"source={img}", "imgsz=224", "nms=False",
               f"project={tmp_path}", "save=False"])
    assert rc == 0 and "1 image(s) processed" in capsys.readouterr().out


def test_validator_feeds_an_end2end_criterion_both_branches():
    """Validation of a YOLO26 model with its criterion (as training validates): the loss gets both
    branches' maps, under nms=None and nms=False."""
    from yolofast.data import build_dataloader, build_dataset, check_data
    from yolofast.loss import criterion_for
    from yolofast.val import Validator

    info = check_data(str(_need("rect3") / "data.yaml"))
    ds = build_dataset(info["val"], imgsz=64, augment=False, stride=32, prefix="val: ", nc=3, batch_size=8,
                       pad=0.5)
    loader = build_dataloader(ds, 8, 0, shuffle=False)
    torch.manual_seed(0)
    m = build_model("yolo26n", nc=3)
    out = [Validator(loader, info["names"], loss=criterion_for(m), progress=False, nms=nms)(m)
           for nms in (None, False)]
    assert out[0]["val/box_loss"] > 0 and out[0]["val/box_loss"] == out[1]["val/box_loss"]
