"""The compiled one-pass HSV augmentation gives the OpenCV path's bytes: on every 8-bit BGR colour, for gains
of every kind, in the native build and the AVX2 (x86-64-v3) one; and augment_hsv picks it, or OpenCV when
asked."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from yolofast.data import augment as A
from yolofast.ops import _backend

REPO = Path(__file__).resolve().parents[2]

# (hue, sat, val) multipliers: identity, all zero, the default recipe's extremes (hsv_h 0.015, s 0.7,
# v 0.4), hue wrapping past 180 (x 1.5, 1.999), halving, and saturation/value clipped at 255 (x 2)
GAINS = [(1.0, 1.0, 1.0), (0.0, 0.0, 0.0), (1.015, 1.7, 1.4), (0.985, 0.3, 0.6), (1.5, 2.0, 2.0),
         (1.999, 0.5, 1.9), (0.5, 1.3, 0.7), (1.00731, 0.8123, 1.2345)]

EXHAUSTIVE = """
import numpy as np, torch
from yolofast.data import augment as A
x = np.arange(1 << 24, dtype=np.uint32)
img = np.stack([(x >> 16) & 255, (x >> 8) & 255, x & 255], 1).astype(np.uint8).reshape(4096, 4096, 3)
rng = np.random.default_rng(0)
luts = [A.hsv_luts(np.array(g, np.float64)) for g in GAINS]
luts.append(np.stack([rng.integers(0, 180, 256), rng.integers(0, 256, 256), rng.integers(0, 256, 256)],
                     1).astype(np.uint8))  # any tables: every (h, s, v) combination the colours reach
bad = []
for k, lut in enumerate(luts):
    for rgb in (True, False):
        got = A.hsv_apply_compiled(img, lut, rgb)
        ref = A.hsv_apply_opencv(img, lut, rgb)
        n = int((got != ref).any(-1).sum())
        if n:
            bad.append((k, rgb, n))
print("BAD", bad)
"""


def _kernel_or_skip():
    ok, why = _backend.availability("hsv_augment", "cpp", "cpu")
    if not ok:
        pytest.skip(f"no compiled hsv_augment ({why}); tests/ops/test_build.py reports a failed build")


def test_all_colours_native_build():
    """Every one of the 2^24 BGR colours, 9 tables x RGB/BGR output: the same bytes as OpenCV."""
    _kernel_or_skip()
    ns = {"GAINS": GAINS}
    exec(EXHAUSTIVE, ns)
    assert ns["bad"] == [], "(table, rgb, colours that differ): " + str(ns["bad"])


@pytest.mark.slow
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 ISA levels")
def test_all_colours_avx2_build():
    """The x86-64-v3 build (AVX2 + FMA, no AVX-512: the generic lookups and shuffles) gives the same bytes."""
    _kernel_or_skip()
    code = f"GAINS = {GAINS!r}\n" + EXHAUSTIVE
    env = {**os.environ, "YOLOFAST_CPU_ARCH": "x86-64-v3"}
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0 and "BAD []" in res.stdout, res.stdout + res.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 ISA levels")
def test_generic_build_leaves_the_kernel_out():
    """A generic x86-64 build (no FMA instruction: the kernel would be ~6x slower than OpenCV) compiles the
    source without registering the op, so the loader runs OpenCV and says why."""
    code = ("import numpy as np\nfrom yolofast.data import augment as A\nfrom yolofast.ops import _build\n"
            "assert _build.extension_status('cpp')[0]\nprint('BACKEND', A.hsv_backend())\n"
            "img = np.zeros((8, 8, 3), np.uint8)\n"
            "out = A.augment_hsv(img, np.random.default_rng(0), 0.5, 0.5, 0.5, to_rgb=True)\n"
            "assert out.shape == img.shape\n")
    env = {**os.environ, "YOLOFAST_CPU_ARCH": "x86-64"}
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0 and "BACKEND ref" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("shape", [(1, 1, 3), (7, 13, 3), (480, 640, 3), (3, 1000, 3)])
def test_shapes_strides_and_draws(shape):
    """Odd sizes (tails of the 64-pixel groups and 256-pixel blocks), a non-contiguous input, RGB and BGR,
    and augment_hsv: the same draws and bytes on either backend, the input untouched."""
    _kernel_or_skip()
    rng = np.random.default_rng(3)
    img = rng.integers(0, 256, shape, dtype=np.uint8)
    keep = img.copy()
    for seed in range(5):
        with _backend.backend("cpp"):
            a = A.augment_hsv(img, np.random.default_rng(seed), 0.015, 0.7, 0.4, to_rgb=True)
        with _backend.backend("ref"):
            b = A.augment_hsv(img, np.random.default_rng(seed), 0.015, 0.7, 0.4, to_rgb=True)
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(img, keep)
    lut = A.hsv_luts(np.array([1.3, 0.6, 1.2]))
    view = np.concatenate([img, img], 1)[:, ::2]  # a strided view: the op makes it contiguous
    np.testing.assert_array_equal(A.hsv_apply_compiled(view, lut, False),
                                  A.hsv_apply_opencv(view, lut, False))
    view.flags.writeable = False
    np.testing.assert_array_equal(A.hsv_apply_compiled(view, lut, True), A.hsv_apply_opencv(view, lut, True))


@pytest.mark.parametrize("shape", [(1, 1, 3), (7, 13, 3), (480, 640, 3), (3, 1000, 3), (5, 608, 3)])
def test_in_place_gives_the_same_bytes(shape):
    """``hsv_augment_`` (and the OpenCV path's ``inplace``) write over the image the bytes the out-of-place
    op returns: sizes with 64-pixel group, 256-pixel block and OpenCV scalar-row tails (608 = 9 x 64 + 32)."""
    _kernel_or_skip()
    rng = np.random.default_rng(7)
    img = rng.integers(0, 256, shape, dtype=np.uint8)
    for gains in GAINS[2:5]:
        lut = A.hsv_luts(np.array(gains))
        for rgb in (False, True):
            ref = A.hsv_apply_opencv(img, lut, rgb)
            for apply in (A.hsv_apply_compiled, A.hsv_apply_opencv):
                own = img.copy()
                out = apply(own, lut, rgb, inplace=True)
                assert np.shares_memory(out, own)
                np.testing.assert_array_equal(own, ref)
    with pytest.raises(ValueError, match="C-contiguous"):
        A.hsv_apply_compiled(np.zeros((4, 8, 3), np.uint8)[:, ::2], A.hsv_luts(np.ones(3)), True, True)


def test_scalar_tail_follows_opencvs_vector_step():
    """The last width % step pixels of each row are rounded, the others truncated, step being OpenCV's pixels
    per vector step (64 with AVX-512 here; 32 on an AVX2 CPU): a 96-pixel row with step 32 has no tail, so
    it is the first 96 pixels of a 128-pixel row with step 64."""
    _kernel_or_skip()
    img = np.random.default_rng(4).integers(0, 256, (5, 128, 3), dtype=np.uint8)
    lut = torch.from_numpy(A.hsv_luts(np.array([1.0, 1.0, 1.0])))
    wide = torch.ops.yolofast.hsv_augment(torch.from_numpy(img), lut, True, 64)
    narrow = torch.ops.yolofast.hsv_augment(torch.from_numpy(img[:, :96].copy()), lut, True, 32)
    assert torch.equal(narrow, wide[:, :96])
    tail = torch.ops.yolofast.hsv_augment(torch.from_numpy(img[:, :96].copy()), lut, True, 64)
    assert not torch.equal(tail[:, 64:], wide[:, 64:96])  # identity tables: rounding lifts ~75 % of colours


def test_bad_tables_are_refused():
    _kernel_or_skip()
    img = np.zeros((4, 4, 3), np.uint8)
    lut = np.zeros((256, 3), np.uint8)
    lut[7, 0] = 180  # OpenCV's 8-bit hue is < 180
    with pytest.raises(RuntimeError, match="must be < 180"):
        torch.ops.yolofast.hsv_augment(torch.from_numpy(img), torch.from_numpy(lut), True)
    with pytest.raises(RuntimeError, match="uint8"):
        torch.ops.yolofast.hsv_augment(torch.zeros(4, 4, 3), torch.from_numpy(lut * 0), True)


def test_backend_choice(monkeypatch):
    """auto: the kernel where it is built; YOLOFAST_BACKEND_HSV_AUGMENT=ref: OpenCV; a forced cpp that is
    missing is an error, never a silent OpenCV."""
    monkeypatch.setattr(A, "_HSV_CHOICE", {})
    ok = _backend.availability("hsv_augment", "cpp", "cpu")[0]
    assert A.hsv_backend() == ("cpp" if ok else "ref")
    monkeypatch.setenv("YOLOFAST_BACKEND_HSV_AUGMENT", "ref")
    assert A.hsv_backend() == "ref"
    monkeypatch.setenv("YOLOFAST_BACKEND_HSV_AUGMENT", "cpp")
    monkeypatch.setattr(_backend, "availability", lambda *a: (False, "no compiler here"))
    monkeypatch.setattr(A, "_HSV_CHOICE", {})
    with pytest.raises(_backend.BackendUnavailable, match="no compiler here"):
        A.hsv_backend()
