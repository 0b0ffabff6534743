import numpy as np
import pytest

from yolofast.data import SHAPE_NAMES, build_dataset, check_data, make_shapes
from yolofast.data.shapes import render_image


def _small(root, seed=0):
    return make_shapes(root=root, n_train=6, n_val=3, imgsz=64, seed=seed)


def test_generation_deterministic_and_reused(tmp_path):
    a = _small(tmp_path / "a")
    b = _small(tmp_path / "b")
    la = sorted((a.parent / "labels" / "train").glob("*.txt"))
    assert len(la) == 6 and len(list((a.parent / "images" / "val").glob("*.jpg"))) == 3
    for f in la:
        assert f.read_bytes() == (b.parent / "labels" / "train" / f.name).read_bytes()
    assert (a.parent / "images" / "train" / "000000.jpg").read_bytes() == \
        (b.parent / "images" / "train" / "000000.jpg").read_bytes()
    c = _small(tmp_path / "c", seed=1)
    assert any(f.read_bytes() != (c.parent / "labels" / "train" / f.name).read_bytes() for f in la)
    # reused: a second call returns the same yaml without rewriting anything
    mtime = la[0].stat().st_mtime_ns
    assert _small(tmp_path / "a") == a and la[0].stat().st_mtime_ns == mtime
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no temp folder left


def test_incomplete_folder_is_not_reused(tmp_path):
    y = _small(tmp_path)
    y.unlink()  # as if generation had stopped before the end
    (y.parent / "labels" / "train" / "000000.txt").write_text("garbage")
    y2 = _small(tmp_path)
    assert y2.exists() and (y.parent / "labels" / "train" / "000000.txt").read_text() != "garbage"


def test_yaml_loads_as_data(tmp_path, ylog):
    d = check_data(_small(tmp_path))
    assert d["names"] == dict(enumerate(SHAPE_NAMES)) and d["nc"] == len(SHAPE_NAMES)
    ds = build_dataset(d["train"], imgsz=64, augment=False, nc=d["nc"])
    assert len(ds) == 6 and ds.stats["corrupt"] == 0 and ds.stats["boxes"] >= 6
    assert not [r for r in ylog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("seed", range(8))
def test_boxes_are_tight_to_visible_pixels(seed):
    rng = np.random.default_rng(seed)
    img, cls, boxes, masks = render_image(rng, 96)
    assert img.shape == (96, 96, 3) and img.dtype == np.uint8
    assert 1 <= len(cls) <= 6 and len(boxes) == len(cls) == len(masks)
    assert ((cls >= 0) & (cls < len(SHAPE_NAMES))).all()
    for (x1, y1, x2, y2), m in zip(boxes.astype(int), masks):
        assert m.sum() > 0
        inside = np.zeros_like(m)
        inside[y1:y2, x1:x2] = True
        assert not (m & ~inside).any()  # nothing outside the box
        # each box edge touches the shape: the box cannot shrink
        assert m[y1, x1:x2].any() and m[y2 - 1, x1:x2].any() and m[y1:y2, x1].any() and m[y1:y2, x2 - 1].any()
        # the shape's pixels carry one colour distinct from the noise-free background
        assert (x2 - x1) >= 0.05 * 96 * 0.45 - 1 and (x2 - x1) <= 0.4 * 96 + 1


def test_label_file_matches_rendered_boxes(tmp_path):
    y = _small(tmp_path, seed=2)
    _, cls, boxes, _ = render_image(np.random.default_rng([2, 0, 3]), 64)  # seed, split train, image 3
    lab = np.loadtxt(y.parent / "labels" / "train" / "000003.txt", ndmin=2)
    assert lab[:, 0].astype(int).tolist() == cls.tolist()
    xyxy = np.concatenate([lab[:, 1:3] - lab[:, 3:] / 2, lab[:, 1:3] + lab[:, 3:] / 2], 1) * 64
    np.testing.assert_allclose(xyxy, boxes, atol=1e-3)
