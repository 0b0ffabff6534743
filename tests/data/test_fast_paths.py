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


def _big_set(tmp_path, hw=((257, 199), (130, 300), (64, 64))):
    """JPEGs of smooth content (a scaled decode is close to a resize) with one box each."""
    for k, (h, w) in enumerate(hw):
        yy, xx = np.mgrid[0:h, 0:w]
        img = np.stack([(xx * 255 // w), (yy * 255 // h), ((xx + yy) * 127 // (h + w))], 2).astype(np.uint8)
        (tmp_path / "images").mkdir(exist_ok=True)
        (tmp_path / "labels").mkdir(exist_ok=True)
        cv2.imwrite(str(tmp_path / "images" / f"b{k}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 98])
        (tmp_path / "labels" / f"b{k}.txt").write_text("0 0.4 0.55 0.3 0.2\n")
    return str(tmp_path / "images")


def test_reduced_jpeg_decode_same_shape_and_labels(tmp_path, monkeypatch):
    from yolofast.data import imcache

    assert [imcache.reduction((h, 10), 64) for h in (63, 64, 127, 128, 255, 256, 511, 512, 4000)] == \
        [1, 1, 1, 2, 2, 4, 4, 8, 8]
    src = _big_set(tmp_path)
    plain = dict(mosaic=0.0, translate=0.0, scale=0.0, hsv_h=0, hsv_s=0, hsv_v=0, fliplr=0.0)
    fast = build_dataset(src, imgsz=64, nc=1, hyp=plain)
    monkeypatch.setattr(imcache, "reduction", lambda hw0, imgsz: 1)
    full = build_dataset(src, imgsz=64, nc=1, hyp=plain)
    for i in range(len(fast)):
        a, b = fast[i], full[i]
        assert a["img"].shape == b["img"].shape and a["ori_shape"] == b["ori_shape"]
        assert a["resized_shape"] == b["resized_shape"]
        assert torch.equal(a["bboxes"], b["bboxes"]) and torch.equal(a["cls"], b["cls"])
        diff = (a["img"].float() - b["img"].float()).abs().mean()
        assert diff < 4, f"image {i}: mean abs difference {diff:.1f} of a scaled decode vs a resize"


def test_disk_cache_written_then_read(tmp_path):
    from yolofast.data import imcache

    src = _big_set(tmp_path)
    a = build_dataset(src, imgsz=64, nc=1, augment=False, cache="disk")
    first = [a[i]["img"] for i in range(len(a))]
    files = sorted(tmp_path.glob("images/*.yolofast-64.npy"))
    assert len(files) == 3 and max(np.load(files[0]).shape[:2]) == 64
    np.save(files[0], np.zeros((64, 64, 3), np.uint8))  # the next run reads the files, not the JPEGs
    b = build_dataset(src, imgsz=64, nc=1, augment=False, cache="disk")
    assert b[0]["img"][:, 30:34, 30:34].max() == 0 and all(torch.equal(b[i]["img"], first[i]) for i in (1, 2))
    files[1].write_bytes(b"broken")  # a broken file is decoded again and rewritten
    assert torch.equal(b[1]["img"], first[1]) and np.load(files[1]).dtype == np.uint8
    with pytest.raises(ValueError, match="cache='ssd'"):
        imcache.cache_mode("ssd")


def test_ram_cache_refused_when_it_does_not_fit(tmp_path, split_factory, monkeypatch, ylog):
    from yolofast.data import imcache

    src = str(split_factory(tmp_path, {f"im{i}": "0 0.5 0.5 0.5 0.5\n" for i in range(4)}))
    monkeypatch.setattr(imcache, "available_memory", lambda: 20_000)  # 4 x 64x48x3 = 36864 bytes needed
    ds = build_dataset(src, imgsz=64, nc=1, cache="ram")
    assert ds.ims is None and "cache=ram needs" in ylog.text and "not caching" in ylog.text
    monkeypatch.setattr(imcache, "available_memory", lambda: 10**9)
    assert build_dataset(src, imgsz=64, nc=1, cache=True).ims is not None


@pytest.mark.parametrize("aff", [dict(), dict(degrees=30.0, shear=5.0, scale=0.9), dict(perspective=1e-4)])
def test_mosaic_affine_builds_only_what_the_warp_reads(aff):
    """== mosaic4 + random_affine(border=-s/2): same boxes, pixels within the warp's coordinate rounding."""
    s = 64
    for trial in range(40):
        rng = np.random.default_rng(trial)
        hw = [(int(rng.integers(20, s + 1)), int(rng.integers(20, s + 1))) for _ in range(4)]
        ims = [np.random.default_rng(100 + trial * 4 + k).integers(0, 256, (h, w, 3), dtype=np.uint8)
               for k, (h, w) in enumerate(hw)]
        boxes = [np.array([[2, 3, w - 4, h - 2], [0, 0, w / 2, h / 3]], np.float32) for h, w in hw]
        cls = [np.array([[k], [k + 4]], np.float32) for k in range(4)]
        a = A.mosaic_affine(ims, boxes, cls, s, np.random.default_rng(trial), **aff)
        r = np.random.default_rng(trial)
        ref = A.random_affine(*A.mosaic4(ims, boxes, cls, s, r), r, border=-(s // 2), **aff)
        np.testing.assert_array_equal(a[1], ref[1])
        np.testing.assert_array_equal(a[2], ref[2])
        d = np.abs(a[0].astype(int) - ref[0].astype(int))
        assert d.max() <= 1 and (d > 0).mean() < 1e-3, f"trial {trial}: {(d > 0).mean():.2%} differ"
