import math
from itertools import islice
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from yolofast.boxes import xyxy2xywh
from yolofast.val import Validator, load_model, validate

H, W = 64, 96  # non-square, so swapped width/height scaling would break the matching
NC = 2


class FakeModel(nn.Module):
    """Returns prepared decoded predictions, one (B, 4+nc, A) tensor per batch, and records how it ran."""

    def __init__(self, preds):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.preds = preds
        self.calls = 0
        self.seen_modes = []

    def forward_feats(self, img):
        assert img.dtype == torch.float32 and img.max() <= 1.0
        self.seen_modes.append((self.training, torch.is_inference_mode_enabled()))
        return [img[:, :1] + self.w]

    def decode(self, feats):
        out = self.preds[self.calls]
        self.calls += 1
        return out


def pred_tensor(dets, a=8):
    """dets: list of (x1, y1, x2, y2, conf, cls) px for one image -> (4+NC, a) decoded model output."""
    p = torch.zeros(4 + NC, a)
    for k, (x1, y1, x2, y2, conf, cls) in enumerate(dets):
        p[:4, k] = xyxy2xywh(torch.tensor([x1, y1, x2, y2], dtype=torch.float32))
        p[4 + int(cls), k] = conf
    return p


def make_batch(labels, b):
    """labels: list of (image index, cls, x1, y1, x2, y2) px -> a yolofast.data style batch."""
    t = torch.tensor(labels, dtype=torch.float32).reshape(-1, 6)
    scale = torch.tensor([W, H, W, H])
    return {
        "img": torch.randint(0, 256, (b, 3, H, W), dtype=torch.uint8),
        "batch_idx": t[:, 0],
        "cls": t[:, 1:2],
        "bboxes": xyxy2xywh(t[:, 2:6]) / scale,
        "im_file": [f"im{i}.jpg" for i in range(b)],
        "ori_shape": [(H, W)] * b,
    }


A, B, C = (10, 8, 40, 30), (50, 20, 90, 60), (5, 5, 25, 50)


def scene():
    """Class 0: 2 GT hit at conf 0.9 and 0.7 with a false positive at 0.8 between -> AP 253/303 (see
    test_metrics.test_ap_hand_worked); class 1: one GT never detected -> AP 0. Two batches of one image."""
    batches = [make_batch([(0, 0, *A), (0, 1, *B)], 1), make_batch([(0, 0, *C)], 1)]
    preds = [
        pred_tensor([(*A, 0.9, 0), (*B, 0.8, 0)]).unsqueeze(0),  # B predicted with the wrong class
        pred_tensor([(*C, 0.7, 0)]).unsqueeze(0),
    ]
    return batches, preds


@pytest.mark.parametrize("half", [False, True])
def test_metrics_on_fabricated_predictions(half):
    batches, preds = scene()
    model = FakeModel(preds)
    out = Validator(batches, {0: "a", 1: "b"}, progress=False, half=half)(model)
    assert model.w.dtype == torch.float32  # half runs under autocast, the weights are untouched
    expected_map = (253 / 303 + 0.0) / 2
    assert out["metrics/mAP50(B)"] == pytest.approx(expected_map)
    assert out["metrics/mAP50-95(B)"] == pytest.approx(expected_map)
    assert out["fitness"] == out["metrics/mAP50-95(B)"]
    assert 0.0 < out["metrics/precision(B)"] < 1.0 and 0.0 < out["metrics/recall(B)"] < 1.0
    assert not any(k.startswith("val/") for k in out)
    assert all(isinstance(v, float) for v in out.values())


def test_perfect_predictions_eval_inference_mode_and_mode_restored():
    batches, _ = scene()
    preds = [
        pred_tensor([(*A, 0.9, 0), (*B, 0.8, 1)]).unsqueeze(0),
        pred_tensor([(*C, 0.7, 0)]).unsqueeze(0),
    ]
    model = FakeModel(preds).train()
    out = Validator(batches, ["a", "b"], progress=False)(model)
    assert out["metrics/mAP50-95(B)"] == pytest.approx(1.0)
    assert out["metrics/precision(B)"] == pytest.approx(1.0, abs=1e-3)
    assert out["metrics/recall(B)"] == pytest.approx(1.0, abs=1e-3)
    assert model.seen_modes == [(False, True), (False, True)]  # eval mode, inference mode
    assert model.training  # restored
    model.eval()
    model.calls = 0
    Validator(batches, ["a", "b"], progress=False)(model)
    assert not model.training


def test_loss_items_averaged_over_batches():
    batches, preds = scene()
    seen = []

    def loss(feats, batch):
        seen.append((feats[0].shape, batch["gt_cls"].shape if "gt_cls" in batch else batch["cls"].shape))
        k = len(seen)
        return torch.tensor(6.0 * k), torch.tensor([1.0, 2.0, 3.0]) * k

    out = Validator(batches, ["a", "b"], loss=loss, progress=False)(FakeModel(preds))
    assert len(seen) == 2 and seen[0][0] == (1, 1, H, W)
    assert out["val/box_loss"] == pytest.approx(1.5)  # (1 + 2) / 2
    assert out["val/cls_loss"] == pytest.approx(3.0)
    assert out["val/dfl_loss"] == pytest.approx(4.5)


def test_no_labels_and_no_predictions():
    batch = make_batch([], 2)
    preds = [torch.zeros(2, 4 + NC, 8)]
    out = Validator([batch], ["a", "b"], progress=False, verbose=True)(FakeModel(preds))
    assert out["metrics/mAP50-95(B)"] == 0.0 and out["fitness"] == 0.0


def test_model_on_other_device_is_refused():
    model = FakeModel([]).to("meta")
    with pytest.raises(ValueError, match="model.to"):
        Validator([], ["a"], device="cpu", progress=False)(model)


def test_load_model_accepts_checkpoint_forms(tmp_path):
    from yolofast.nn import YOLOV8 as YOLOV8_ROWS

    m = nn.Linear(2, 2)
    assert load_model(m) is m
    assert load_model({"ema": m, "model": None}) is m
    assert load_model({"ema": None, "model": m}) is m
    # a path is read safely (no pickle code runs): a detection model comes back fp32, any other pickled
    # module is refused by name
    from yolofast.io import CheckpointError
    from yolofast.nn import build_model

    det = build_model({"nc": 1, "depth_multiple": 0.33, "width_multiple": 0.125, "max_channels": 256,
                       "backbone": YOLOV8_ROWS["backbone"], "head": YOLOV8_ROWS["head"]})
    torch.save({"ema": det.half(), "epoch": 3}, tmp_path / "last.pt")
    loaded = load_model(tmp_path / "last.pt")
    assert loaded.nc == 1 and next(loaded.parameters()).dtype == torch.float32
    torch.save({"ema": m, "epoch": 3}, tmp_path / "linear.pt")
    with pytest.raises(CheckpointError, match=r"linear\.pt.*torch\.nn\.modules\.linear\.Linear"):
        load_model(tmp_path / "linear.pt")
    with pytest.raises(ValueError, match="'ema' or 'model'"):
        load_model({"optimizer": {}})
    with pytest.raises(TypeError, match="state_dict"):
        load_model({"model": {"weight": torch.zeros(1)}})
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_model(tmp_path / "nope.pt")


# ------------------------------------------------------------------ smoke test with the real model and data


def _real_parts():
    try:
        from yolofast.data import build_dataloader, build_dataset, check_data
        from yolofast.nn import build_model
    except ImportError as e:
        pytest.skip(f"yolofast.nn.build_model / yolofast.data not importable yet ({e})")
    return build_model, check_data, build_dataset, build_dataloader


def test_smoke_real_tiny_model_on_coco128(coco128_yaml, tmp_path):
    build_model, check_data, build_dataset, build_dataloader = _real_parts()
    info = check_data(coco128_yaml)
    model = build_model("yolov8n", nc=info["nc"]).train()
    dataset = build_dataset(info["val"], imgsz=128, augment=False, nc=info["nc"])
    batches = list(islice(build_dataloader(dataset, 2, 0, shuffle=False), 1))  # 2 images
    from yolofast.loss import DetectionLoss

    out = Validator(batches, info["names"], loss=DetectionLoss(info["nc"]), progress=False)(model)
    assert model.training
    metric_keys = ("metrics/precision(B)", "metrics/recall(B)", "metrics/mAP50(B)", "metrics/mAP50-95(B)")
    for k in (*metric_keys, "fitness"):
        assert 0.0 <= out[k] <= 1.0
    for k in ("val/box_loss", "val/cls_loss", "val/dfl_loss"):
        assert math.isfinite(out[k]) and out[k] > 0

    # validate() end to end (checkpoint file + data yaml) on a 3-image copy of the coco128 yaml
    cfg = yaml.safe_load(Path(coco128_yaml).read_text())
    root = Path(coco128_yaml).parent
    cfg["path"] = str(root)
    cfg["val"] = [str(p) for p in sorted((root / "images" / "val2017").glob("*.jpg"))[:3]]
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    torch.save({"ema": model, "epoch": 0}, tmp_path / "last.pt")
    out = validate(tmp_path / "last.pt", tmp_path / "tiny.yaml", imgsz=64, batch=2, verbose=True)
    assert 0.0 <= out["fitness"] <= 1.0
    with pytest.raises(ValueError, match="nc=80"):
        validate(build_model("yolov8n", nc=3), tmp_path / "tiny.yaml", imgsz=64, verbose=False)
