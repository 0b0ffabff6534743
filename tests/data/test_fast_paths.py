"""The cheaper per-sample paths give the pixels (and the distribution) of the plain ones."""

import cv2
import numpy as np
import pytest
import torch

from yolofast.data import augment as A
from yolofast.data import build_dataloader, build_dataset, collate_fn


def _hsv_two_conversions(img, rng, hgain, sgain, vgain):
    """HSV gains as a LUT per split channel, then back to BGR (the plain formulation)."""
    r = rng.uniform(-1, 1, 3) * (hgain, sgain, vgain) + 1
    hue, sat, val = cv2.split(cv2.cvtColor(img, cv2.COLOR_BGR2HSV))
    x = np.arange(256, dtype=np.float64)
    luts = [((x * r[0]) % 180), np.clip(x * r[1], 0, 255), np.clip(x * r[2], 0, 255)]
    hsv = cv2.merge([cv2.LUT(c, lut.astype(np.uint8)) for c, lut in zip((hue, sat, val), luts)])
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)


@pytest.mark.parametrize("gains", [(0.015, 0.7, 0.4), (0.5, 0.5, 0.5), (0.0, 0.9, 0.0)])
def test_hsv_one_lut_same_outputs_as_split_luts(gains):
    """Same draws -> same pixels, so the output distribution is the plain one's; RGB is its channel swap."""
    img = np.random.default_rng(1).integers(0, 256, (64, 80, 3), dtype=np.uint8)
    for seed in range(50):
        ref = _hsv_two_conversions(img, np.random.default_rng(seed), *gains)
        np.testing.assert_array_equal(A.augment_hsv(img, np.random.default_rng(seed), *gains), ref)
        rgb = A.augment_hsv(img, np.random.default_rng(seed), *gains, to_rgb=True)
        np.testing.assert_array_equal(rgb, ref[..., ::-1])
    np.testing.assert_array_equal(A.augment_hsv(img, np.random.default_rng(0), 0, 0, 0, to_rgb=True),
                                  img[..., ::-1])


def test_train_batch_is_channels_last_rgb_and_scales_like_before(tmp_path, split_factory):
    src = str(split_factory(tmp_path, {f"im{i}": "0 0.5 0.5 0.5 0.5\n" for i in range(6)}))
    no_aug = dict(mosaic=0.0, translate=0.0, scale=0.0, hsv_h=0, hsv_s=0, hsv_v=0, fliplr=0.0)
    ds = build_dataset(src, imgsz=64, nc=1, hyp=no_aug)
    val = build_dataset(src, imgsz=64, nc=1, augment=False)
    s, v = ds[0], val[0]
    assert s["img"].shape == v["img"].shape == (3, 64, 64)
    assert torch.equal(s["img"], v["img"])  # same RGB pixels; the train sample is an HWC view
    b = collate_fn([ds[i] for i in range(4)])
    assert b["img"].shape == (4, 3, 64, 64) and b["img"].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(b["img"], torch.stack([val[i]["img"] for i in range(4)]))
    x = b["img"].to(torch.float32, memory_format=torch.contiguous_format).div_(255)
    assert x.is_contiguous() and torch.equal(x, b["img"].float() / 255)
    loader = build_dataloader(ds, 3, 0, shuffle=False)
    assert next(iter(loader))["img"].is_contiguous(memory_format=torch.channels_last)


def test_mosaic_fills_only_the_border_with_the_same_result(monkeypatch):
    """The canvas is not pre-filled: with garbage in it, the mosaic equals the one on a grey canvas."""
    rng = np.random.default_rng(0)
    for trial in range(30):
        hw = [(int(rng.integers(8, 33)), int(rng.integers(8, 33))) for _ in range(4)]
        ims = [np.random.default_rng(trial * 4 + k).integers(0, 256, (h, w, 3), dtype=np.uint8)
               for k, (h, w) in enumerate(hw)]
        boxes, cls = [np.zeros((0, 4), np.float32)] * 4, [np.zeros((0, 1), np.float32)] * 4
        outs = []
        for fill in (A.PAD, 7):
            monkeypatch.setattr(A, "_canvas", lambda shape, f=fill: np.full(shape, f, np.uint8))
            outs.append(A.mosaic4(ims, boxes, cls, 32, np.random.default_rng(trial))[0])
        np.testing.assert_array_equal(outs[1], outs[0])
