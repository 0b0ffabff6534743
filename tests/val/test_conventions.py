"""map_convention: pycocotools' matching (by conf) vs Ultralytics' (by IoU), AP integration, DetMetrics."""

import json
from pathlib import Path

import numpy as np
import pytest

from yolofast.val.metrics import ap_per_class, coco_ap, match_predictions, ultralytics_ap

ULTRA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "ultralytics"


def test_conventions_differ_where_a_lower_conf_detection_fits_better():
    # One GT; det 0 (conf 0.9) overlaps it with IoU 0.6, det 1 (conf 0.5) with IoU 0.9.
    gt = np.array([[0.0, 0.0, 10.0, 10.0]])
    dets = np.array([[0.0, 0.0, 10.0, 6.0], [0.0, 0.0, 10.0, 9.0]])
    conf, cls = np.array([0.9, 0.5]), np.array([0, 0])
    iouv = np.array([0.5, 0.7])
    coco = match_predictions(dets, conf, cls, gt, [0], iouv)
    ultra = match_predictions(dets, conf, cls, gt, [0], iouv, convention="ultralytics")
    # COCO: the confident detection takes the GT at 0.5; at 0.7 it cannot, so det 1 does.
    assert coco.tolist() == [[True, False], [False, True]]
    # Ultralytics at 0.5: both pick the GT as their best, the GT keeps the first detection (det 0).
    assert ultra.tolist() == [[True, False], [False, True]]


def test_ultralytics_matching_does_not_fall_back_to_a_second_gt():
    # Two GTs; both detections fit GT 0 best, det 1 also fits GT 1 (IoU 0.6 > 0.5).
    gts = np.array([[0.0, 0.0, 10.0, 10.0], [0.0, 4.0, 10.0, 14.0]])
    dets = np.array([[0.0, 0.0, 10.0, 10.0], [0.0, 1.0, 10.0, 11.0]])
    conf, cls = np.array([0.9, 0.8]), np.array([0, 0])
    coco = match_predictions(dets, conf, cls, gts, [0, 0], [0.5])
    ultra = match_predictions(dets, conf, cls, gts, [0, 0], [0.5], convention="ultralytics")
    assert coco[:, 0].tolist() == [True, True]  # det 1 takes the still unmatched GT 1
    assert ultra[:, 0].tolist() == [True, False]  # its best GT is taken: a false positive


def test_matching_respects_classes_and_empty_inputs():
    for conv in ("coco", "ultralytics"):
        tp = match_predictions(np.array([[0, 0, 5, 5.0]]), [0.9], [1], np.array([[0, 0, 5, 5.0]]), [0],
                               convention=conv)
        assert not tp.any()
        assert match_predictions(np.zeros((0, 4)), [], [], np.zeros((2, 4)), [0, 1], convention=conv).shape \
            == (0, 10)


def test_unknown_convention_names_the_choices():
    with pytest.raises(ValueError, match="coco.*ultralytics"):
        match_predictions(np.zeros((1, 4)), [1.0], [0], np.zeros((1, 4)), [0], convention="voc")


def test_ap_integrations():
    # A perfect detector: COCO gives 1; Ultralytics' curve drops to precision 0 at recall 1 itself, so the
    # last trapezoid (recall 0.99 -> 1) is half lost: 0.995, the familiar ceiling of its mAP50.
    assert coco_ap(np.array([[1.0]]), np.array([[1.0]]))[0] == pytest.approx(1.0)
    assert ultralytics_ap(np.array([[1.0]]), np.array([[1.0]]))[0] == pytest.approx(0.995)
    r, p = np.array([[0.5]]), np.array([[1.0]])
    assert coco_ap(r, p)[0] == pytest.approx(51 / 101)
    expected = 0.5 + 0.5 * 0.5  # flat to 0.5, then linear from (0.5, 1) to (1, 0)
    assert ultralytics_ap(r, p)[0] == pytest.approx(expected, abs=1e-9)
    res = ap_per_class(np.array([[True], [False]]), [0.9, 0.1], [0, 0], [0, 0], convention="ultralytics")
    assert res.map == pytest.approx(ultralytics_ap(np.array([[0.5], [0.5]]), np.array([[1.0], [0.5]]))[0])


def test_val_returns_metrics_object_that_is_still_the_dict(tmp_path):
    import torch

    from yolofast.nn import build_model
    from yolofast.val import DetMetrics, validate

    torch.manual_seed(0)
    model = build_model("yolov8n", nc=3).eval()
    data = ULTRA / "rect3" / "data.yaml"
    if not data.is_file():
        pytest.skip("../shared/data/ultralytics is not present")
    m = validate(model, str(data), imgsz=64, batch=8, verbose=False)
    assert isinstance(m, DetMetrics) and isinstance(m, dict)
    assert m.box.map == m["metrics/mAP50-95(B)"] and m.box.map50 == m["metrics/mAP50(B)"]
    assert m.box.mp == m["metrics/precision(B)"] and m.box.mr == m["metrics/recall(B)"]
    assert m.box.maps.shape == (3,) and 0.0 <= m.box.map75 <= 1.0
    assert m.results_dict["fitness"] == m.fitness == m["fitness"]
    assert set(m.speed) == {"preprocess", "inference", "loss", "postprocess"}
    assert m.speed["inference"] > 0


def _ultralytics_model():
    io = pytest.importorskip("yolofast.io", reason="the safe checkpoint reader (yolofast.io) is not here")
    path = ULTRA / "yolov8n-rect3.pt"
    if not path.is_file():
        pytest.skip("../shared/data/ultralytics is not present")
    return io.model_from_checkpoint(path)


@pytest.mark.slow
def test_ultralytics_convention_reproduces_its_val_number():
    from yolofast.val import validate

    model = _ultralytics_model()
    exp = json.loads((ULTRA / "expected.json").read_text())["val"]
    data = str(ULTRA / "rect3" / "data.yaml")
    m = validate(model, data, imgsz=224, batch=16, verbose=False, map_convention="ultralytics")
    assert m.box.map == pytest.approx(exp["mAP50-95"], abs=0.002)
    assert m.box.map50 == pytest.approx(exp["mAP50"], abs=0.002)
    coco = validate(model, data, imgsz=224, batch=16, verbose=False)
    assert abs(coco.box.map - exp["mAP50-95"]) > 0.005  # the default is a different convention
