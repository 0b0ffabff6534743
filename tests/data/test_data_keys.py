"""Data keys of the recipe: single_cls, fraction, rect, bgr, cutmix, copy_paste."""

import logging
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from yolofast.data import build_dataloader
from yolofast.data.augment import cutmix, rect_batch_shapes
from yolofast.data.dataset import _COPY_PASTE_REPORTED, YOLODataset
from yolofast.data.loader import split_fraction

OFF = dict(hsv_h=0, hsv_s=0, hsv_v=0, degrees=0, translate=0, scale=0, shear=0, perspective=0, flipud=0,
           fliplr=0, mosaic=0, mixup=0)

# (h, w) of the images: tall, wide and square, so rect batches differ
SIZES = [(64, 32), (32, 64), (64, 64), (48, 64), (64, 48), (40, 64), (64, 40), (56, 64)]


def make_set(root: Path, sizes=SIZES):
    """One image per size, each with a box of class i % 3 in its middle (colour blocks, not noise)."""
    for i, (h, w) in enumerate(sizes):
        img = np.full((h, w, 3), 40 * (i + 1) % 255, np.uint8)
        img[h // 4: 3 * h // 4, w // 4: 3 * w // 4] = (255, 0, 0)  # blue in BGR
        (root / "images").mkdir(parents=True, exist_ok=True)
        (root / "labels").mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(root / "images" / f"{i:02d}.png"), img)
        (root / "labels" / f"{i:02d}.txt").write_text(f"{i % 3} 0.5 0.5 0.5 0.5\n")
    return str(root / "images")


def test_single_cls_makes_every_label_class_0(tmp_path):
    src = make_set(tmp_path)
    ds = YOLODataset(src, imgsz=64, augment=False, nc=3, single_cls=True)
    assert {int(c) for lb in ds.labels for c in lb["cls"].ravel()} == {0}
    assert all(float(ds[i]["cls"].max()) == 0 for i in range(len(ds)))
    plain = YOLODataset(src, imgsz=64, augment=False, nc=3)
    assert {int(c) for lb in plain.labels for c in lb["cls"].ravel()} == {0, 1, 2}  # the cache is untouched


def test_fraction_ratio_and_count(tmp_path):
    src = make_set(tmp_path)
    assert len(YOLODataset(src, imgsz=64, augment=False, nc=3, fraction=0.25)) == 2
    ds = YOLODataset(src, imgsz=64, augment=False, nc=3, fraction=3)
    assert [Path(f).stem for f in ds.im_files] == ["00", "01", "02"]  # the first files in sorted order
    assert len(YOLODataset(src, imgsz=64, augment=False, nc=3, fraction=1.0)) == 8
    assert split_fraction(0.5, "train") == 0.5 and split_fraction(0.5, "val") == 1.0
    assert split_fraction([0.5, 10], "val") == 10 and split_fraction([0.5], "test") == 1.0
    assert split_fraction(1, "train") == 1.0 and isinstance(split_fraction(1, "train"), float)
    with pytest.raises(ValueError, match="val split must keep"):
        split_fraction([1.0, 0], "val")


def test_rect_batch_shapes_follow_the_aspect_ratios():
    shapes = np.array(SIZES, dtype=float)
    order, bi, bs = rect_batch_shapes(shapes, 64, 32, batch_size=2, pad=0.0)
    ar = shapes[order, 0] / shapes[order, 1]
    assert (np.diff(ar) >= 0).all()  # sorted by h / w
    assert bi.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    # batch 0 holds h/w 0.5 and 0.625: 64 wide, 0.625 * 64 = 40 high, rounded up to the stride: 64
    # batch 3 holds h/w 1.6 and 2.0: 64 high, 64 / 1.6 = 40 wide -> 64; batches 1-2 span 1.0: square
    assert bs.tolist() == [[64, 64]] * 4
    # a batch of only 2:1 wide images is 32 x 64; of 1:2 tall ones 64 x 32
    _, _, wide = rect_batch_shapes(np.array([[32, 64], [32, 64]], float), 64, 32, 2, 0.0)
    _, _, tall = rect_batch_shapes(np.array([[64, 32], [64, 32]], float), 64, 32, 2, 0.0)
    assert wide.tolist() == [[32, 64]] and tall.tolist() == [[64, 32]]
    _, _, padded = rect_batch_shapes(np.array([[32, 64], [32, 64]], float), 64, 32, 2, 0.5)
    assert padded.tolist() == [[64, 96]]  # half a stride more on each side, rounded up: Ultralytics' val


@pytest.mark.parametrize("augment", [False, True])
def test_rect_batches_are_non_square_with_their_boxes(tmp_path, augment):
    sizes = [(32, 64)] * 4 + [(64, 32)] * 4  # 4 wide, 4 tall
    src = make_set(tmp_path, sizes)
    ds = YOLODataset(src, imgsz=64, augment=augment, hyp=dict(OFF, mosaic=1.0, mixup=1.0), nc=3, rect=True,
                     batch_size=4)
    assert ds.hyp["mosaic"] == ds.hyp["mixup"] == ds.hyp["cutmix"] == 0.0  # mosaic is off with rect
    loader = build_dataloader(ds, 4, 0, shuffle=False, epoch_sampler=augment)
    got = [tuple(b["img"].shape[2:]) for b in loader]
    assert got == [(32, 64), (64, 32)]
    for b in loader:
        # the box is the middle half of each image: cx, cy 0.5, w, h 0.5 of the (unpadded) image
        assert torch.allclose(b["bboxes"], torch.tensor([[0.5, 0.5, 0.5, 0.5]]).expand(4, 4), atol=0.02)


def test_bgr_swaps_the_channels(tmp_path):
    src = make_set(tmp_path, [(64, 64)])
    rgb = YOLODataset(src, imgsz=64, augment=True, hyp=dict(OFF), nc=3)[0]["img"]
    bgr = YOLODataset(src, imgsz=64, augment=True, hyp=dict(OFF, bgr=1.0), nc=3)[0]["img"]
    assert torch.equal(bgr, rgb.flip(0)) and not torch.equal(bgr, rgb)
    assert rgb[2, 32, 32] == 255 and bgr[0, 32, 32] == 255  # the blue block: channel 2 in RGB, 0 swapped


def test_cutmix_pastes_a_region_with_its_boxes():
    rng = np.random.default_rng(0)
    a, b = np.zeros((64, 64, 3), np.uint8), np.full((64, 64, 3), 200, np.uint8)
    ba, ca = np.array([[0, 0, 10, 10]], np.float32), np.array([[0.0]])
    bb, cb = np.array([[0, 0, 64, 64]], np.float32), np.array([[1.0]])
    for _ in range(20):
        img, boxes, cls = cutmix(a, ba, ca, b, bb, cb, rng)
        pasted = img[..., 0] == 200
        if not pasted.any():
            continue
        ys, xs = np.nonzero(pasted)
        region = [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
        assert pasted.sum() == (region[2] - region[0]) * (region[3] - region[1])  # one rectangle
        # b's box (the whole image) is cut to the pasted rectangle, kept when >= 10 % of it is inside
        area = (region[2] - region[0]) * (region[3] - region[1])
        assert (1.0 in cls.ravel()) == (area >= 0.1 * 64 * 64)
        if 1.0 in cls.ravel():
            assert boxes[cls.ravel() == 1][0].tolist() == pytest.approx(region)
        # a's box is kept when >= 10 % of it stays visible
        covered = (np.clip(min(10, region[2]) - region[0], 0, None)
                   * np.clip(min(10, region[3]) - region[1], 0, None))
        assert (0.0 in cls.ravel()) == (100 - covered >= 10)


def test_cutmix_in_the_dataset_mixes_two_images(tmp_path):
    src = make_set(tmp_path, [(64, 64)] * 6)
    ds = YOLODataset(src, imgsz=64, augment=True, hyp=dict(OFF, cutmix=1.0), nc=3, seed=1)
    n_boxes = [len(ds[0]["cls"]) for _ in range(10)]
    assert max(n_boxes) == 2  # the image's own box plus one from the pasted region, in some draws
    ds.close_mosaic()
    assert ds.hyp["cutmix"] == 0 and all(len(ds[0]["cls"]) == 1 for _ in range(5))


def test_copy_paste_is_a_logged_no_op(tmp_path, ylog):
    src = make_set(tmp_path, [(64, 64)] * 2)
    _COPY_PASTE_REPORTED.clear()
    with ylog.at_level(logging.WARNING, logger="yolofast"):
        a = YOLODataset(src, imgsz=64, augment=True, hyp=dict(OFF, fliplr=0.5, copy_paste=1.0), nc=3, seed=3)
        YOLODataset(src, imgsz=64, augment=True, hyp=dict(OFF, copy_paste=1.0), nc=3)
    assert sum("copy_paste=1.0" in r.message and "changes nothing" in r.message for r in ylog.records) == 1
    b = YOLODataset(src, imgsz=64, augment=True, hyp=dict(OFF, fliplr=0.5), nc=3, seed=3)
    for i in range(2):
        sa, sb = a[i], b[i]
        assert torch.equal(sa["img"], sb["img"]) and torch.equal(sa["bboxes"], sb["bboxes"])
