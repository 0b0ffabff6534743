import os

import cv2
import numpy as np
import pytest
import torch

from yolofast.data import DataError, build_dataloader, build_dataset, check_data, img2label_paths
from yolofast.data.dataset import YOLODataset


def _box_ok(bboxes, cls, nc):
    """Normalized xywh boxes strictly describe a region inside the image, classes valid."""
    xyxy = torch.cat([bboxes[:, :2] - bboxes[:, 2:] / 2, bboxes[:, :2] + bboxes[:, 2:] / 2], 1)
    assert (xyxy >= -1e-6).all() and (xyxy <= 1 + 1e-6).all()
    assert (bboxes[:, 2:] > 0).all()
    assert ((cls >= 0) & (cls < nc) & (cls == cls.round())).all()


def test_img2label_paths():
    sep = os.sep
    got = img2label_paths([f"{sep}d{sep}images{sep}x{sep}images{sep}a.b.jpg"])
    assert got == [f"{sep}d{sep}images{sep}x{sep}labels{sep}a.b.txt"]


def test_coco128_train_loads_and_mosaic_batch(coco128_yaml, ylog):
    d = check_data(coco128_yaml)
    ds = build_dataset(d["train"], imgsz=256, augment=True, hyp={"degrees": 10.0, "shear": 2.0},
                       nc=d["nc"], prefix="coco128 train: ")
    assert len(ds) == 128
    assert ds.stats["backgrounds"] == 2 and ds.stats["missing"] == 2 and ds.stats["corrupt"] == 0
    assert ds.stats["boxes"] == 929
    assert "coco128 train: 128 images, 2 backgrounds" in ylog.text
    batch = next(iter(build_dataloader(ds, 8, 0, shuffle=True, seed=0)))
    assert batch["img"].shape == (8, 3, 256, 256) and batch["img"].dtype == torch.uint8
    assert len(batch["cls"]) > 0
    _box_ok(batch["bboxes"], batch["cls"], 80)
    assert batch["batch_idx"].max() < 8
    # Every mosaic'd box must cover non-grey pixels: a box drawn on pure padding would be a wrong label.
    b = batch["bboxes"] * 256
    for j in range(len(b)):
        i = int(batch["batch_idx"][j])
        x1, y1 = (b[j, :2] - b[j, 2:] / 2).long().clamp(0, 255)
        x2, y2 = (b[j, :2] + b[j, 2:] / 2).ceil().long().clamp(1, 256)
        crop = batch["img"][i, :, y1:y2, x1:x2]
        assert (crop != 114).any()


def test_val_letterbox_and_ratio_pad(coco128_yaml):
    d = check_data(coco128_yaml)
    ds = build_dataset(d["val"], imgsz=320, augment=False, nc=80)
    s = ds[0]
    h0, w0 = s["ori_shape"]
    (r, _), (pw, ph) = s["ratio_pad"]
    assert s["img"].shape == (3, 320, 320)
    assert abs(r * max(h0, w0) - 320) < 1.5
    assert (pw == 0) != (ph == 0) or (pw == ph == 0)
    # the padding rows/columns are exactly 114
    if ph:
        assert (s["img"][:, : ph - 1] == 114).all()
    # labels map back to the file's labels (same image, letterbox only)
    lab = np.loadtxt(img2label_paths([s["im_file"]])[0], ndmin=2)
    xy = s["bboxes"].numpy() * 320
    cx_orig = (xy[:, 0] - pw) / r / w0
    np.testing.assert_allclose(np.sort(cx_orig), np.sort(lab[:, 1]), atol=2e-3)
    assert sorted(s["cls"].view(-1).tolist()) == sorted(lab[:, 0].tolist())


def test_bad_inputs_warn_count_and_never_crash(tmp_path, split_factory, ylog):
    items = {
        "good": "0 0.5 0.5 0.4 0.4\n1 0.25 0.25 0.2 0.2\n",
        "corrupt": "0 0.5 0.5 0.2 0.2\n",
        "malformed": "0 0.5 0.5 0.2 0.2\n0 0.5 0.5 0.2\n",
        "badcls": "7 0.5 0.5 0.2 0.2\n",
        "negcls": "-1 0.5 0.5 0.2 0.2\n",
        "oob": "0 1.2 0.5 0.2 0.2\n",
        "tolerated": "0 0.9502 0.5 0.1 0.2\n",  # x2 = 1.0002: within 1e-3, clipped to 1
        "nolabel": None,
        "empty": "",
        "dup": "2 0.5 0.5 0.2 0.2\n2 0.5 0.5 0.2 0.2\n0 0.3 0.3 0.0 0.1\n1 0.6 0.6 0.2 0.2\n",
        "truncated": "0 0.5 0.5 0.2 0.2\n",
    }
    img_dir = split_factory(tmp_path, items)
    (img_dir / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg" + bytes(range(200)))
    data = (img_dir / "truncated.jpg").read_bytes()
    (img_dir / "truncated.jpg").write_bytes(data[: len(data) * 2 // 3])

    ds = build_dataset(str(img_dir), imgsz=64, augment=True, nc=3, prefix="bad: ")
    st = ds.stats
    assert st["corrupt"] == 5, st  # corrupt, malformed, badcls, negcls, oob
    assert st["images"] == len(ds) == 6
    assert st["backgrounds"] == 2 and st["missing"] == 1
    assert st["duplicates"] == 1 and st["zero_area"] == 1
    assert st["boxes"] == 2 + 1 + 2 + 1  # good, tolerated, dup (2 left), truncated

    warnings = [r.getMessage() for r in ylog.records if r.levelname == "WARNING"]
    text = "\n".join(warnings)
    assert "corrupt.jpg: unreadable image" in text
    assert "malformed.txt:2: expected 'class cx cy w h'" in text
    assert "badcls.txt:1: class 7 out of range [0, 3)" in text
    assert "negcls.txt:1: class -1 out of range" in text
    assert "oob.txt:1: box corners" in text
    assert "dup.txt: dropped 1 zero-area box(es) (line 3); dropped 1 duplicate box(es) (line 2)" in text
    assert "truncated.jpg: truncated JPEG" in text
    assert "tolerated" not in text and "nolabel" not in text and "good" not in text
    assert len(warnings) == 7  # one per problem file
    assert "bad: 6 images, 2 backgrounds (1 without label file), 5 corrupt" in ylog.text

    names = {os.path.basename(f) for f in ds.im_files}
    assert names == {"good.jpg", "tolerated.jpg", "nolabel.jpg", "empty.jpg", "dup.jpg", "truncated.jpg"}
    tol = ds.labels[ds.im_files.index(str(img_dir / "tolerated.jpg"))]["bboxes"]
    assert tol[0, 0] + tol[0, 2] / 2 == pytest.approx(1.0, abs=1e-6)  # clipped right edge
    dup = ds.labels[ds.im_files.index(str(img_dir / "dup.jpg"))]["cls"]
    assert sorted(dup.ravel().tolist()) == [1, 2]

    # a file that disappears after the scan is replaced with a warning, not a crash mid-epoch
    os.remove(img_dir / "good.jpg")
    for augment in (True, False):
        ds.augment = augment
        for i in range(len(ds)):
            s = ds[i]
            assert s["img"].shape == (3, 64, 64)
            _box_ok(s["bboxes"], s["cls"], 3)
            assert not s["im_file"].endswith("good.jpg")
    assert "cannot read" in ylog.text and "good.jpg" in ylog.text


def test_no_usable_images_is_an_error(tmp_path, split_factory):
    img_dir = split_factory(tmp_path, {"a": "5 0.5 0.5 0.1 0.1\n"})
    with pytest.raises(DataError, match="no usable images"):
        build_dataset(str(img_dir), imgsz=64, nc=2)


def test_no_images_found(tmp_path):
    (tmp_path / "images").mkdir()
    with pytest.raises(DataError, match="no images"):
        build_dataset(str(tmp_path / "images"), imgsz=64)


def test_txt_list_source(tmp_path, split_factory):
    split_factory(tmp_path, {"a": "0 0.5 0.5 0.1 0.1\n", "b": "0 0.5 0.5 0.1 0.1\n"})
    lst = tmp_path / "list.txt"
    lst.write_text("./images/train/a.jpg\n\nimages/train/b.jpg\n")
    ds = build_dataset(str(lst), imgsz=64, nc=1)
    assert len(ds) == 2 and ds.stats["boxes"] == 2


def test_polygon_label_becomes_its_extent(tmp_path, split_factory):
    img_dir = split_factory(tmp_path, {"p": "0 0.1 0.2 0.5 0.2 0.3 0.6\n"})
    ds = build_dataset(str(img_dir), imgsz=64, nc=1)
    np.testing.assert_allclose(ds.labels[0]["bboxes"][0], [0.3, 0.4, 0.4, 0.4], atol=1e-6)


def test_labels_cache_reused_and_invalidated(tmp_path, split_factory, ylog):
    items = {"a": "0 0.5 0.5 0.2 0.2\n", "b": "1 0.5 0.5 0.2 0.2\n", "c": "9 0 0 1 1\n"}
    img_dir = split_factory(tmp_path, items)
    cache = tmp_path / "labels" / "train.yolofast.cache"
    ds1 = YOLODataset(str(img_dir), imgsz=64, nc=2)
    assert not ds1.from_cache and cache.is_file()
    ylog.clear()
    ds2 = YOLODataset(str(img_dir), imgsz=64, nc=2)
    assert ds2.from_cache and ds2.stats == ds1.stats and ds2.im_files == ds1.im_files
    assert "c.txt:1: class 9 out of range" in ylog.text  # problems are re-reported from the cache
    # a different nc or a changed label file must not reuse it
    assert not YOLODataset(str(img_dir), imgsz=64, nc=10).from_cache
    (tmp_path / "labels" / "train" / "a.txt").write_text("1 0.5 0.5 0.3 0.3\n")
    ds3 = YOLODataset(str(img_dir), imgsz=64, nc=2)
    assert not ds3.from_cache and ds3.labels[0]["cls"][0, 0] == 1


def test_readonly_label_folder_skips_cache_once(tmp_path, split_factory, ylog):
    img_dir = split_factory(tmp_path, {"a": "0 0.5 0.5 0.2 0.2\n"})
    labels = tmp_path / "labels"
    labels.chmod(0o555)
    try:
        YOLODataset(str(img_dir), imgsz=64, nc=1)
        ds = YOLODataset(str(img_dir), imgsz=64, nc=1)
    finally:
        labels.chmod(0o755)
    assert not ds.from_cache and not (labels / "train.yolofast.cache").exists()
    assert ylog.text.count("labels cache not saved") == 1


def test_ram_cache_same_samples(tmp_path, split_factory):
    img_dir = split_factory(tmp_path, {"a": "0 0.5 0.5 0.2 0.2\n", "b": "0 0.4 0.5 0.2 0.3\n"})
    a = build_dataset(str(img_dir), imgsz=64, augment=False, nc=1, cache=True)
    b = build_dataset(str(img_dir), imgsz=64, augment=False, nc=1)
    assert a.ims is not None
    for i in range(2):
        assert torch.equal(a[i]["img"], b[i]["img"]) and torch.equal(a[i]["bboxes"], b[i]["bboxes"])


def test_augment_never_writes_into_ram_cache(tmp_path, split_factory):
    img_dir = split_factory(tmp_path, {"a": "0 0.5 0.5 0.2 0.2\n"})
    # a square image of exactly imgsz: letterbox and the identity affine hand back the cached array itself
    square = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    cv2.imwrite(str(img_dir / "a.jpg"), square)
    # HSV and the flips write in place into the sample's own image: never into the cached one
    for flips in ((0.0, 0.0), (1.0, 1.0)):
        hyp = dict(mosaic=0.0, translate=0.0, scale=0.0, fliplr=flips[0], flipud=flips[1], hsv_v=0.9)
        ds = build_dataset(str(img_dir), imgsz=64, augment=True, nc=1, cache="ram", hyp=hyp)
        before = ds.ims[0][0].copy()
        outs = [ds[0]["img"] for _ in range(3)]
        assert np.array_equal(ds.ims[0][0], before)
        assert not torch.equal(outs[0], outs[1])  # HSV really ran


def test_augment_never_writes_into_mosaic_buffer(tmp_path, split_factory):
    img_dir = split_factory(tmp_path, {k: "0 0.5 0.5 0.2 0.2\n" for k in "abcd"})
    ds = build_dataset(str(img_dir), imgsz=64, augment=True, nc=1, batch_size=1, hyp=dict(flipud=0.5))
    for i in range(4):
        ds[i]
    before = {i: ds._recent[i][0].copy() for i in ds.buffer}
    assert len(before) == 4
    for k in range(12):
        ds[k % 4]
        for i in before:
            assert np.array_equal(ds._recent[i][0], before[i])


def test_no_labels_folder_warns(tmp_path, split_factory, ylog):
    img_dir = split_factory(tmp_path, {"a": None, "b": None})
    ds = build_dataset(str(img_dir), imgsz=64, nc=1)
    assert len(ds) == 2 and ds.stats["backgrounds"] == 2 and ds.stats["missing"] == 2
    assert "no labels found" in ylog.text and str(tmp_path / "labels" / "train") in ylog.text
    assert "cache not saved" not in ylog.text


def test_labels_cache_is_not_pickle_and_ignores_crafted_and_ultralytics_files(tmp_path, split_factory):
    import pickle

    img_dir = split_factory(tmp_path, {"a": "0 0.5 0.5 0.2 0.2\n", "b": "0 0.4 0.5 0.2 0.3\n"})
    ours = tmp_path / "labels" / "train.yolofast.cache"
    theirs = tmp_path / "labels" / "train.cache"  # Ultralytics' own cache of the same split
    theirs.write_bytes(b"ultralytics cache bytes")
    ds = YOLODataset(str(img_dir), imgsz=64, nc=1)
    assert theirs.read_bytes() == b"ultralytics cache bytes"  # left alone, neither read nor overwritten
    with np.load(ours, allow_pickle=False) as z:  # plain arrays: loads without pickle
        assert int(z["counts"].sum()) == 2
    assert YOLODataset(str(img_dir), imgsz=64, nc=1).from_cache

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    # a crafted file at our cache's path: a pickle (as the old format was) and an npz holding an object array
    for payload in (pickle.dumps({"version": "yolofast-labels-2", "x": Evil()}), None):
        if payload is None:
            with open(ours, "wb") as f:
                np.savez(f, meta=np.array([Evil()], dtype=object))
        else:
            ours.write_bytes(payload)
        again = YOLODataset(str(img_dir), imgsz=64, nc=1)
        assert not again.from_cache and again.stats == ds.stats  # rescanned
        assert not marker.exists()
    assert YOLODataset(str(img_dir), imgsz=64, nc=1).from_cache  # the rescan rewrote a good cache
