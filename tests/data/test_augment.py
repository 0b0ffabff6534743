import numpy as np
import pytest

from yolofast.data import augment as A


def _rect_image(h, w, box, value=255):
    img = np.zeros((h, w, 3), np.uint8)
    x1, y1, x2, y2 = box
    img[y1:y2, x1:x2] = value
    return img


def _extent(mask):
    ys, xs = np.nonzero(mask.any(1))[0], np.nonzero(mask.any(0))[0]
    return np.array([xs[0], ys[0], xs[-1] + 1, ys[-1] + 1], float)


def test_letterbox_shape_pad_and_ratio():
    img = np.full((50, 100, 3), 7, np.uint8)
    out, r, (pw, ph) = A.letterbox(img, 64)
    assert out.shape == (64, 64, 3) and r == pytest.approx(0.64)
    assert (pw, ph) == (0, 16)
    assert (out[:16] == 114).all() and (out[-16:] == 114).all() and (out[16:48] == 7).all()
    out, r, pad = A.letterbox(img, (40, 120), scaleup=False)
    assert out.shape == (40, 120, 3) and r == pytest.approx(0.8) and pad == (20, 0)


def test_resize_long_side():
    img = np.zeros((30, 90, 3), np.uint8)
    assert A.resize_long_side(img, 60, augment=False).shape == (20, 60, 3)
    assert A.resize_long_side(img, 180, augment=True).shape == (60, 180, 3)
    assert A.resize_long_side(img, 90, augment=True) is img


@pytest.mark.parametrize("seed", range(6))
def test_affine_box_encloses_transformed_content(seed):
    rng = np.random.default_rng(seed)
    img = _rect_image(128, 128, (30, 40, 70, 100))
    boxes = np.array([[30, 40, 70, 100]], np.float32)
    persp = 0.0005 if seed % 2 else 0.0
    out, b, c = A.random_affine(img, boxes, np.zeros((1, 1), np.float32), rng, degrees=30, translate=0.1,
                                scale=0.3, shear=5, perspective=persp)
    assert out.shape == img.shape
    mask = out.max(2) > 160  # the rectangle, not the 114 border
    if not len(b):  # filtered: then it must have been mostly cropped away
        assert mask.sum() < 0.1 * 40 * 60 * 0.7**2 + 50
        return
    np.testing.assert_allclose(b[0], _extent(mask), atol=2.0)
    assert (b[:, [0, 2]] <= 128).all() and (b[:, [1, 3]] <= 128).all() and (b >= 0).all()


def test_affine_identity_keeps_everything():
    rng = np.random.default_rng(0)
    img = np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    boxes = np.array([[1, 2, 30, 40], [10, 10, 20, 60]], np.float32)
    out, b, c = A.random_affine(img, boxes, np.ones((2, 1), np.float32), rng, translate=0, scale=0)
    assert np.array_equal(out, img) and np.array_equal(b, boxes) and len(c) == 2


def test_box_candidates():
    old = np.array([[0, 0, 10, 10]] * 4, float)
    new = np.array([[0, 0, 10, 10], [0, 0, 2, 10], [0, 0, 10, 0.5], [0, 0, 3, 3]], float)
    assert A.box_candidates(old, new).tolist() == [True, False, False, False]  # ok, thin, thin, area 9 %
    assert A.box_candidates(np.array([[0, 0, 1000, 5.0]]), np.array([[0, 0, 1000, 5.0]])).tolist() == [False]


def test_mosaic_boxes_cover_exactly_their_content():
    rng = np.random.default_rng(3)
    s = 64
    imgs, boxes, classes = [], [], []
    for i, (h, w) in enumerate([(64, 48), (40, 64), (64, 64), (30, 20)]):
        b = (w // 4, h // 4, w // 4 * 3, h // 4 * 3)
        imgs.append(_rect_image(h, w, b, value=200 + i))
        boxes.append(np.array([b], np.float32))
        classes.append(np.full((1, 1), i, np.float32))
    for _ in range(5):
        canvas, b, c = A.mosaic4(imgs, boxes, classes, s, rng)
        assert canvas.shape == (2 * s, 2 * s, 3)
        assert (b >= 0).all() and (b <= 2 * s).all()
        for box, cl in zip(b.astype(int), c[:, 0].astype(int)):
            x1, y1, x2, y2 = box
            if x2 > x1 and y2 > y1:
                assert (canvas[y1:y2, x1:x2] == 200 + cl).all()
        # and every labelled pixel is inside its box
        for cl in range(4):
            m = canvas[..., 0] == 200 + cl
            if m.any():
                k = np.flatnonzero(c[:, 0] == cl)[0]
                np.testing.assert_array_equal(_extent(m), b[k])


def test_flips_move_boxes_with_content():
    img = _rect_image(40, 60, (5, 8, 20, 30))
    boxes = np.array([[5, 8, 20, 30]], np.float32)
    lr, blr = A.flip_lr(img, boxes)
    np.testing.assert_array_equal(_extent(lr.max(2) > 0), blr[0])
    ud, bud = A.flip_ud(img, boxes)
    np.testing.assert_array_equal(_extent(ud.max(2) > 0), bud[0])
    assert np.array_equal(A.flip_lr(lr, blr)[0], img)


def test_hsv():
    img = np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)
    keep = img.copy()
    assert np.array_equal(A.augment_hsv(img, np.random.default_rng(0), 0, 0, 0), img)
    a = A.augment_hsv(img, np.random.default_rng(5), 0.015, 0.7, 0.4)
    b = A.augment_hsv(img, np.random.default_rng(5), 0.015, 0.7, 0.4)
    assert np.array_equal(a, b) and not np.array_equal(a, img)
    assert np.array_equal(img, keep)  # input untouched
    for gains in ((0, 0, 0), (0.015, 0.7, 0.4)):  # in place: the same bytes, written over the input
        own = img.copy()
        out = A.augment_hsv(own, np.random.default_rng(5), *gains, to_rgb=True, inplace=True)
        assert np.shares_memory(out, own)
        assert np.array_equal(own, A.augment_hsv(img, np.random.default_rng(5), *gains, to_rgb=True))


def test_flips_in_place():
    img = np.random.default_rng(1).integers(0, 255, (9, 14, 3), dtype=np.uint8)
    boxes = np.array([[1.0, 2.0, 5.0, 8.0]], np.float32)
    for flip in (A.flip_lr, A.flip_ud):
        ref, rb = flip(img, boxes)
        own = img.copy()
        out, ob = flip(own, boxes, inplace=True)
        assert np.shares_memory(out, own) and np.array_equal(own, ref) and np.array_equal(ob, rb)


def test_mixup_keeps_both_label_sets():
    rng = np.random.default_rng(0)
    i1, i2 = np.zeros((8, 8, 3), np.uint8), np.full((8, 8, 3), 200, np.uint8)
    img, b, c = A.mixup(i1, np.ones((2, 4), np.float32), np.zeros((2, 1), np.float32), i2,
                        np.ones((1, 4), np.float32), np.ones((1, 1), np.float32), rng)
    assert len(b) == 3 and len(c) == 3 and 60 < img.mean() < 140
