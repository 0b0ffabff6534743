"""YOLO.predict: sources, letterbox, boxes in original pixels, Results, saving, parity with Ultralytics."""

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from yolofast import YOLO
from yolofast.nn import build_model
from yolofast.predict import letterbox_shape, scale_boxes

ULTRA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "ultralytics"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model("yolov8n", nc=3).eval()
    m.names = {0: "red", 1: "green", 2: "blue"}
    return YOLO(m)


@pytest.fixture(scope="module")
def img():
    rng = np.random.default_rng(0)
    im = np.full((90, 130, 3), 40, np.uint8)
    im[20:60, 30:100] = rng.integers(0, 255, (40, 70, 3))
    return im


def test_letterbox_shape_is_the_minimal_stride_rectangle():
    assert letterbox_shape((480, 640), 640) == (480, 640)
    assert letterbox_shape((500, 375), 640) == (640, 480)  # 375 * 1.28 = 480
    assert letterbox_shape((90, 130), 128) == (96, 128)  # 89 rounded up to the next multiple of 32
    assert letterbox_shape((90, 130), 128, auto=False) == (128, 128)
    b = torch.tensor([[10.0, 20.0, 50.0, 60.0]])
    assert scale_boxes(b * 2 + 4, 2.0, (4, 4), (100, 100)).tolist() == b.tolist()


def test_boxes_come_back_in_original_pixels(model, img):
    """A predict on a letterboxed copy equals the model run by hand, mapped back with r and the pad."""
    res = model.predict(img, imgsz=128, conf=0.001)[0]
    assert res.orig_shape == (90, 130) and res.path == "image0.jpg" and res.names[1] == "green"
    # by hand: scale 128/130, pad 90*0.985=89 -> 96 (3 px top, 4 bottom), grey 114
    r = 128 / 130
    small = cv2.resize(img, (128, 89), interpolation=cv2.INTER_LINEAR)
    padded = cv2.copyMakeBorder(small, 3, 4, 0, 0, cv2.BORDER_CONSTANT, value=(114, 114, 114))
    x = torch.from_numpy(padded[..., ::-1].copy()).permute(2, 0, 1)[None].float() / 255
    from yolofast.val.nms import non_max_suppression

    with torch.no_grad():
        det = non_max_suppression(model.model(x), 0.001, 0.7)[0]
    want = det[:, :4].clone()
    want[:, [0, 2]] = (want[:, [0, 2]] / r).clamp(0, 130)
    want[:, [1, 3]] = ((want[:, [1, 3]] - 3) / r).clamp(0, 90)
    assert len(res) == len(det) > 0
    torch.testing.assert_close(res.boxes.xyxy, want)
    torch.testing.assert_close(res.boxes.conf, det[:, 4])
    b = res.boxes
    torch.testing.assert_close(b.xyxyn, b.xyxy / torch.tensor([130, 90, 130, 90.0]))
    torch.testing.assert_close(b.xywh[:, 2], b.xyxy[:, 2] - b.xyxy[:, 0])
    torch.testing.assert_close(b.xywhn[:, 1], b.xywh[:, 1] / 90)
    assert b.data.shape == (len(b), 6) and b.cls.dtype == torch.float32


def test_sources_agree(model, img, tmp_path):
    from PIL import Image

    p = tmp_path / "a.png"
    cv2.imwrite(str(p), img)
    (tmp_path / "list.txt").write_text(f"{p}\n")
    kw = {"imgsz": 128, "conf": 0.001}
    ref = model.predict(img, **kw)[0].boxes.data
    for src in (str(p), p, tmp_path, str(tmp_path / "*.png"), str(tmp_path / "list.txt"), [str(p)],
                Image.fromarray(img[..., ::-1].copy())):
        out = model.predict(src, **kw)
        assert len(out) == 1, src
        torch.testing.assert_close(out[0].boxes.data, ref)
    t = torch.rand(2, 3, 64, 96)
    out = model(t, conf=0.001)
    assert [r.orig_shape for r in out] == [(64, 96)] * 2
    gen = model.predict([img, img], stream=True, **kw)
    assert not isinstance(gen, list) and len(list(gen)) == 2


def test_batched_folder_equals_one_by_one_and_skips_bad_files(model, img, tmp_path, caplog):
    for i in range(3):
        cv2.imwrite(str(tmp_path / f"im{i}.jpg"), np.roll(img, 7 * i, axis=1))
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    kw = {"imgsz": 128, "conf": 0.001, "verbose": False}
    with caplog.at_level("WARNING", logger="yolofast"):
        batched = model.predict(tmp_path, batch=3, **kw)
    assert "broken.jpg" in caplog.text and "skipped" in caplog.text
    single = [model.predict(str(tmp_path / f"im{i}.jpg"), **kw)[0] for i in range(3)]
    assert [Path(r.path).name for r in batched] == ["im0.jpg", "im1.jpg", "im2.jpg"]
    for a, b in zip(batched, single):
        torch.testing.assert_close(a.boxes.data, b.boxes.data, atol=1e-3, rtol=1e-4)


def test_filters_and_missing_source(model, img):
    kw = {"imgsz": 128, "conf": 0.001}
    every = model.predict(img, **kw)[0].boxes.data
    c = int(every[0, 5])
    only = model.predict(img, classes=[c], **kw)[0].boxes.data
    torch.testing.assert_close(only, every[every[:, 5] == c])  # class-aware NMS: the same rows
    assert len(model.predict(img, max_det=2, **kw)[0]) == 2
    assert len(model.predict(img, agnostic_nms=True, **kw)[0]) <= len(model.predict(img, **kw)[0])
    with pytest.raises(FileNotFoundError, match="nowhere.jpg"):
        model.predict("nowhere.jpg")


def test_save_writes_images_labels_and_increments(model, img, tmp_path):
    kw = {"imgsz": 128, "conf": 0.001, "save": True, "save_txt": True, "save_conf": True,
          "project": tmp_path / "runs", "verbose": False}
    res = model.predict(img, **kw)[0]
    model.predict(img, **kw)
    d = tmp_path / "runs" / "predict"
    assert (d / "image0.jpg").is_file() and (tmp_path / "runs" / "predict2" / "image0.jpg").is_file()
    lines = (d / "labels" / "image0.txt").read_text().splitlines()
    assert len(lines) == len(res)
    first = [float(v) for v in lines[0].split()]
    assert first[0] == res.boxes.cls[0] and len(first) == 6
    np.testing.assert_allclose(first[1:5], res.boxes.xywhn[0].tolist(), rtol=1e-4)
    np.testing.assert_allclose(first[5], res.boxes.conf[0].item(), rtol=1e-4)
    plot = res.plot()
    assert plot.shape == img.shape and (plot != img).any() and (res.orig_img == img).all()
    out = res.save(tmp_path / "x.png")
    assert cv2.imread(out).shape == img.shape
    s = res.summary()
    assert s[0]["name"] == res.names[int(res.boxes.cls[0])] and set(s[0]["box"]) == {"x1", "y1", "x2", "y2"}


def test_video_source(model, img, tmp_path):
    path = tmp_path / "clip.avi"
    w = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 5, (img.shape[1], img.shape[0]))
    if not w.isOpened():
        pytest.skip("OpenCV here cannot write MJPG/AVI")
    for i in range(3):
        w.write(np.roll(img, 5 * i, axis=1))
    w.release()
    res = model.predict(str(path), imgsz=128, conf=0.001, save=True, project=tmp_path / "runs", verbose=False)
    assert len(res) == 3 and all(r.orig_shape == (90, 130) for r in res)
    assert (tmp_path / "runs" / "predict" / "clip.mp4").is_file()


def test_detections_match_ultralytics():
    io = pytest.importorskip("yolofast.io", reason="the safe checkpoint reader (yolofast.io) is not here")
    if not (ULTRA / "yolov8n-rect3.pt").is_file():
        pytest.skip("../shared/data/ultralytics is not present")
    from yolofast.val.metrics import box_iou_np

    exp = json.loads((ULTRA / "expected.json").read_text())["predict"]
    model = YOLO(io.model_from_checkpoint(ULTRA / "yolov8n-rect3.pt"))
    files = sorted(exp["detections"])
    res = model.predict([str(ULTRA / "rect3" / f) for f in files], imgsz=exp["imgsz"], conf=exp["conf"],
                        iou=exp["iou"], verbose=False)
    n = 0
    for f, r in zip(files, res):
        want = np.array(exp["detections"][f], dtype=np.float64).reshape(-1, 6)
        got = r.boxes.data.double().numpy()
        assert len(got) == len(want), f
        if not len(want):
            continue
        iou = box_iou_np(got[:, :4], want[:, :4])
        j = iou.argmax(1)
        assert (iou.max(1) >= 0.95).all(), f
        assert (got[:, 5] == want[j, 5]).all(), f
        assert np.abs(got[:, 4] - want[j, 4]).max() <= 0.02, f
        n += len(want)
    assert n > 0
