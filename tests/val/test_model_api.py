"""The Model API around val: YOLO(...).val() metrics object, add_callback / clear_callback."""

from pathlib import Path

import pytest

from yolofast import YOLO
from yolofast.val import DetMetrics

ULTRA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "ultralytics"


def test_yolo_val_on_an_ultralytics_checkpoint_returns_det_metrics():
    pytest.importorskip("yolofast.io", reason="the safe checkpoint reader (yolofast.io) is not here")
    if not (ULTRA / "yolov8n-rect3.pt").is_file():
        pytest.skip("../shared/data/ultralytics is not present")
    model = YOLO(str(ULTRA / "yolov8n-rect3.pt"))
    m = model.val(data=str(ULTRA / "rect3" / "data.yaml"), imgsz=224, verbose=False)
    assert isinstance(m, DetMetrics) and model.metrics is m
    assert m["metrics/mAP50-95(B)"] == m.box.map == pytest.approx(0.1702, abs=1e-3)  # coco, the default
    assert m.box.maps.shape == (3,) and list(m.results_dict)[-1] == "fitness"


def test_add_and_clear_callback():
    model = YOLO("yolov8n")
    calls = []
    model.add_callback("on_train_epoch_end", calls.append)
    model.add_callback("on_train_epoch_end", print)
    assert model.callbacks.get("on_train_epoch_end") == [calls.append, print]
    model.clear_callback("on_train_epoch_end")
    assert model.callbacks.get("on_train_epoch_end") == []
    with pytest.raises(ValueError, match="did you mean 'on_train_epoch_end'"):
        model.add_callback("on_train_epoch_ends", print)
