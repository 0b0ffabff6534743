"""The per-sample label and matrix work, written with fewer NumPy calls, gives bit for bit what the plain
formulation (one op per column, one ``uniform`` call per draw: the code before) gives, and leaves the
generator in the same state."""

import math

import cv2
import numpy as np
import pytest

from yolofast.data import augment as A
from yolofast.data.dataset import _normalized_xywh

AFF = [dict(), dict(degrees=10.0, shear=3.0, scale=0.9, translate=0.2), dict(perspective=0.0005, degrees=5.0),
       dict(translate=0.0, scale=0.0), dict(degrees=30, scale=0.3, shear=5, perspective=0.0005)]


def _affine_matrix_plain(in_hw, out_hw, rng, degrees=0.0, translate=0.1, scale=0.5, shear=0.0,
                         perspective=0.0):
    h, w = in_hw
    oh, ow = out_hw
    C = np.eye(3)
    C[0, 2], C[1, 2] = -w / 2, -h / 2
    P = np.eye(3)
    P[2, 0], P[2, 1] = rng.uniform(-perspective, perspective, 2)
    R = np.eye(3)
    a = rng.uniform(-degrees, degrees)
    s = rng.uniform(1 - scale, 1 + scale)
    R[:2] = cv2.getRotationMatrix2D(center=(0, 0), angle=a, scale=s)
    S = np.eye(3)
    S[0, 1], S[1, 0] = (math.tan(math.radians(v)) for v in rng.uniform(-shear, shear, 2))
    T = np.eye(3)
    T[0, 2] = rng.uniform(0.5 - translate, 0.5 + translate) * ow
    T[1, 2] = rng.uniform(0.5 - translate, 0.5 + translate) * oh
    return T @ S @ R @ P @ C, s


def _transform_boxes_plain(boxes, M, out_hw):
    n = len(boxes)
    x1, y1, x2, y2 = boxes.T
    xy = np.ones((n * 4, 3), dtype=np.float64)
    xy[:, 0] = np.stack([x1, x2, x1, x2], 1).reshape(-1)
    xy[:, 1] = np.stack([y1, y2, y2, y1], 1).reshape(-1)
    xy = xy @ M.T
    xy = xy[:, :2] / xy[:, 2:3] if M[2, 0] or M[2, 1] else xy[:, :2]
    xs, ys = xy[:, 0].reshape(n, 4), xy[:, 1].reshape(n, 4)
    out = np.stack([xs.min(1), ys.min(1), xs.max(1), ys.max(1)], 1)
    out[:, 0::2] = out[:, 0::2].clip(0, out_hw[1])
    out[:, 1::2] = out[:, 1::2].clip(0, out_hw[0])
    return out.astype(np.float32)


def _hsv_luts_plain(r):
    x = np.arange(256, dtype=np.float64)
    lut = np.empty((256, 3), np.uint8)
    lut[:, 0] = (x * r[0]) % 180
    lut[:, 1] = np.clip(x * r[1], 0, 255)
    lut[:, 2] = np.clip(x * r[2], 0, 255)
    return lut


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("aff", AFF)
def test_affine_matrix_same_bits_and_stream(aff):
    for seed in range(300):
        r1, r2 = np.random.default_rng(seed), np.random.default_rng(seed)
        M1, s1 = _affine_matrix_plain((1280, 1280), (640, 608), r1, **aff)
        M2, s2 = A.affine_matrix((1280, 1280), (640, 608), r2, **aff)
        assert _same(M1, M2) and type(s1) is type(s2) and s1 == s2
        assert r1.bit_generator.state == r2.bit_generator.state


@pytest.mark.parametrize("aff", AFF)
def test_transform_boxes_same_bits(aff):
    rng = np.random.default_rng(7)
    for _ in range(200):
        M, _ = A.affine_matrix((1280, 1280), (640, 640), rng, **aff)
        n = int(rng.integers(1, 30))
        xy = rng.uniform(-50, 1330, (n, 2))
        boxes = np.concatenate([xy, xy + rng.uniform(0, 400, (n, 2))], 1).astype(np.float32)
        assert _same(_transform_boxes_plain(boxes, M, (640, 608)), A.transform_boxes(boxes, M, (640, 608)))


def test_hsv_luts_same_tables():
    rng = np.random.default_rng(0)
    gains = [rng.uniform(-1, 1, 3) * rng.uniform(0, 3, 3) + 1 for _ in range(3000)]
    gains += [np.array(g, np.float64) for g in ((1, 1, 1), (0, 0, 0), (1.015, 1.7, 1.4), (0.985, 0.3, 0.6),
                                                  (2.5, -0.5, 3.0))]
    for g in gains:
        lut = A.hsv_luts(g)
        assert _same(_hsv_luts_plain(g), lut) and lut.flags.c_contiguous


def test_normalized_xywh_same_bits():
    rng = np.random.default_rng(1)
    for _ in range(500):
        h, w = (int(v) for v in rng.integers(16, 1000, 2))
        n = int(rng.integers(0, 20))
        xy = rng.uniform(-20, max(h, w) + 20, (n, 2))
        boxes = np.concatenate([xy, xy + rng.uniform(0, 300, (n, 2))], 1)
        boxes = boxes.astype(np.float32 if rng.random() < 0.5 else np.float64)
        b = boxes.reshape(-1, 4).astype(np.float32)
        b[:, 0::2] = b[:, 0::2].clip(0, w)
        b[:, 1::2] = b[:, 1::2].clip(0, h)
        plain = np.stack([(b[:, 0] + b[:, 2]) / (2 * w), (b[:, 1] + b[:, 3]) / (2 * h),
                          (b[:, 2] - b[:, 0]) / w, (b[:, 3] - b[:, 1]) / h], 1).astype(np.float32)
        assert _same(plain, _normalized_xywh(boxes, h, w))


def test_flipped_boxes_same_bits():
    rng = np.random.default_rng(2)
    for _ in range(300):
        n = int(rng.integers(0, 25))
        xy = rng.uniform(-20, 700, (n, 2))
        old = np.concatenate([xy, xy + rng.uniform(0, 300, (n, 2))], 1).astype(np.float32)
        w, h = (int(v) for v in rng.integers(100, 700, 2))
        flipped = old.copy()
        flipped[:, [0, 2]] = w - flipped[:, [2, 0]]
        assert _same(flipped, A.flip_lr(np.zeros((h, w, 3), np.uint8), old)[1])
        flipped = old.copy()
        flipped[:, [1, 3]] = h - flipped[:, [3, 1]]
        assert _same(flipped, A.flip_ud(np.zeros((h, w, 3), np.uint8), old)[1])


def test_tile_copy_writes_into_the_window_view():
    """mosaic_affine's tile copy (OpenCV) lands in the window itself, from read-only sources too."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        src = rng.integers(0, 256, (int(rng.integers(2, 90)), int(rng.integers(2, 90)), 3), dtype=np.uint8)
        src.flags.writeable = False
        h, w = src.shape[:2]
        y, x = int(rng.integers(0, h)), int(rng.integers(0, w))
        part = src[y:, x:]
        win = np.full((100, 100, 3), A.PAD, np.uint8)
        ref = win.copy()
        oy, ox = int(rng.integers(0, 100 - part.shape[0] + 1)), int(rng.integers(0, 100 - part.shape[1] + 1))
        ref[oy:oy + part.shape[0], ox:ox + part.shape[1]] = part
        A._copy(part, win[oy:oy + part.shape[0], ox:ox + part.shape[1]])
        assert _same(ref, win)
