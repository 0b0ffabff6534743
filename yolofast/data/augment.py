"""Image + box augmentations (OpenCV/numpy). Boxes are pixel xyxy float32 (n, 4), classes (n, 1).

Every random draw comes from the `rng` (np.random.Generator) passed in, so a dataset seeded per worker
replays the same augmentations.
"""

from __future__ import annotations

import math

import cv2
import numpy as np
import torch

from yolofast.ops import _backend, _library

PAD = 114  # grey fill of letterbox/mosaic/affine borders (Ultralytics value)


def resize_long_side(img: np.ndarray, imgsz: int, augment: bool, hw0=None) -> np.ndarray:
    """Resize so the long side is imgsz, keeping the aspect ratio of ``hw0`` (the original (h, w) of an
    image decoded at reduced scale; default: img's own shape)."""
    h0, w0 = hw0 if hw0 is not None else img.shape[:2]
    r = imgsz / max(h0, w0)
    if r == 1 and img.shape[:2] == (h0, w0):
        return img
    # INTER_AREA when shrinking for eval gives cleaner pixels; training uses the cheaper INTER_LINEAR.
    interp = cv2.INTER_LINEAR if (augment or r > 1) else cv2.INTER_AREA
    w, h = min(max(round(w0 * r), 1), imgsz), min(max(round(h0 * r), 1), imgsz)
    return cv2.resize(img, (w, h), interpolation=interp)


def letterbox(img: np.ndarray, new_shape=640, color=(PAD, PAD, PAD), scaleup: bool = True,
              center: bool = True):
    """Resize keeping the aspect ratio, then pad to new_shape (int or (h, w)).

    Returns (img, r, (padw, padh)): a pixel (x, y) of the input maps to (x * r + padw, y * r + padh).
    """
    if isinstance(new_shape, int):
        new_shape = (new_shape, new_shape)
    h0, w0 = img.shape[:2]
    r = min(new_shape[0] / h0, new_shape[1] / w0)
    if not scaleup:
        r = min(r, 1.0)
    w, h = round(w0 * r), round(h0 * r)
    if (w, h) != (w0, h0):
        img = cv2.resize(img, (w, h), interpolation=cv2.INTER_LINEAR)
    dw, dh = new_shape[1] - w, new_shape[0] - h
    left, top = (dw // 2, dh // 2) if center else (0, 0)
    if dw or dh:
        img = cv2.copyMakeBorder(img, top, dh - top, left, dw - left, cv2.BORDER_CONSTANT, value=color)
    return img, r, (left, top)


def mosaic_layout(hws, imgsz: int, rng: np.random.Generator):
    """Where the 4 images of a mosaic go: a random centre of the (2*imgsz)^2 canvas, then per image
    (xa1, ya1, xa2, ya2) on the canvas, (xb1, yb1) the corner of the part of the image shown there, and
    the quadrant (y1, y2, x1, x2) it lies in. hws: the 4 images' (h, w)."""
    s = imgsz
    # Centre in the middle half so every quadrant keeps >= s/2 of its side, like Ultralytics' border -s/2.
    xc, yc = (int(v) for v in rng.uniform(s / 2, 3 * s / 2, 2).tolist())
    out = []
    for i, (h, w) in enumerate(hws):
        if i == 0:  # top-left: its bottom-right corner at the centre
            xa1, ya1, xa2, ya2 = max(xc - w, 0), max(yc - h, 0), xc, yc
            xb1, yb1 = w - (xa2 - xa1), h - (ya2 - ya1)
        elif i == 1:  # top-right
            xa1, ya1, xa2, ya2 = xc, max(yc - h, 0), min(xc + w, 2 * s), yc
            xb1, yb1 = 0, h - (ya2 - ya1)
        elif i == 2:  # bottom-left
            xa1, ya1, xa2, ya2 = max(xc - w, 0), yc, xc, min(yc + h, 2 * s)
            xb1, yb1 = w - (xa2 - xa1), 0
        else:  # bottom-right
            xa1, ya1, xa2, ya2 = xc, yc, min(xc + w, 2 * s), min(yc + h, 2 * s)
            xb1, yb1 = 0, 0
        quadrant = (0 if i < 2 else yc, yc if i < 2 else 2 * s, 0 if i % 2 == 0 else xc,
                    xc if i % 2 == 0 else 2 * s)
        out.append(((xa1, ya1, xa2, ya2), (xb1, yb1), quadrant))
    return out


def mosaic_boxes(layout, boxes, classes, imgsz: int):
    """The 4 images' pixel xyxy boxes shifted onto the mosaic canvas and clipped to it."""
    out_b, out_c = [], []
    for ((xa1, ya1, _, _), (xb1, yb1), _), b, cl in zip(layout, boxes, classes):
        if len(b):
            out_b.append(b + np.array([xa1 - xb1, ya1 - yb1] * 2, dtype=np.float32))
            out_c.append(cl)
    if not out_b:
        return np.zeros((0, 4), np.float32), np.zeros((0, 1), np.float32)
    b = np.concatenate(out_b)
    np.clip(b, 0, 2 * imgsz, out=b)  # the cut parts of each image lie outside the canvas only
    return b, np.concatenate(out_c)


def mosaic4(images, boxes, classes, imgsz: int, rng: np.random.Generator):
    """Place 4 images around a random centre of a (2*imgsz)^2 grey canvas.

    images: 4 HWC uint8 images (long side <= imgsz); boxes: their pixel xyxy boxes; classes: (n_i, 1).
    Returns (canvas, boxes, classes), boxes shifted onto the canvas and clipped to it.
    """
    s = imgsz
    canvas = _canvas((2 * s, 2 * s, images[0].shape[2]))  # only the parts no image covers are filled
    layout = mosaic_layout([im.shape[:2] for im in images], s, rng)
    for img, ((xa1, ya1, xa2, ya2), (xb1, yb1), quadrant) in zip(images, layout):
        canvas[ya1:ya2, xa1:xa2] = img[yb1:yb1 + (ya2 - ya1), xb1:xb1 + (xa2 - xa1)]
        _fill_around(canvas, (ya1, ya2, xa1, xa2), quadrant)
    b, cl = mosaic_boxes(layout, boxes, classes, s)
    return canvas, b, cl


def _canvas(shape) -> np.ndarray:
    return np.empty(shape, np.uint8)


def _fill_around(canvas, tile, quadrant) -> None:
    """Fill the grey border of one mosaic quadrant (y1, y2, x1, x2) around its image's tile: filling
    the whole (2s)^2 canvas first wrote ~40 % of a 640-px mosaic's pixels twice (coco128)."""
    ty1, ty2, tx1, tx2 = tile
    qy1, qy2, qx1, qx2 = quadrant
    canvas[qy1:ty1, qx1:qx2] = PAD
    canvas[ty2:qy2, qx1:qx2] = PAD
    canvas[ty1:ty2, qx1:tx1] = PAD
    canvas[ty1:ty2, tx2:qx2] = PAD


def box_candidates(old: np.ndarray, new: np.ndarray, wh_thr=2.0, ar_thr=100.0, area_thr=0.1, eps=1e-16):
    """Keep boxes still > wh_thr px wide and high, >= area_thr of their (scaled) area, aspect < ar_thr."""
    w1, h1 = old[:, 2] - old[:, 0], old[:, 3] - old[:, 1]
    w2, h2 = new[:, 2] - new[:, 0], new[:, 3] - new[:, 1]
    ar = np.maximum(w2 / (h2 + eps), h2 / (w2 + eps))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 + eps) > area_thr) & (ar < ar_thr)


def affine_matrix(in_hw, out_hw, rng, degrees=0.0, translate=0.1, scale=0.5, shear=0.0, perspective=0.0):
    """3x3 matrix: centre -> perspective -> rotate+scale -> shear -> translate into the output.

    Returns (M, s) with s the random scale factor (needed to judge how much of a box a crop removed).
    The 8 draws (perspective x2, angle, scale, shear x2, translation x2) are one ``rng.random(8)``, each
    mapped to low + (high - low) x u: exactly what one ``uniform(low, high)`` call per draw computes from
    the same doubles of the stream (tested). With 6 calls, 5 ``np.eye`` and their item writes it took
    22.3 us instead of 12.9 (timed alone, AMD EPYC, 1 thread).
    """
    h, w = in_hw
    oh, ow = out_hw
    lo = (-perspective, -perspective, -degrees, 1 - scale, -shear, -shear, 0.5 - translate, 0.5 - translate)
    hi = (perspective, perspective, degrees, 1 + scale, shear, shear, 0.5 + translate, 0.5 + translate)
    u = rng.random(8).tolist()
    p0, p1, a, s, sh0, sh1, tx, ty = (lo[k] + (hi[k] - lo[k]) * u[k] for k in range(8))
    (r00, r01, r02), (r10, r11, r12) = cv2.getRotationMatrix2D(center=(0, 0), angle=a, scale=s).tolist()
    t0, t1 = math.tan(math.radians(sh0)), math.tan(math.radians(sh1))
    T, S, R, P, C = np.array([
        [[1.0, 0.0, tx * ow], [0.0, 1.0, ty * oh], [0.0, 0.0, 1.0]],
        [[1.0, t0, 0.0], [t1, 1.0, 0.0], [0.0, 0.0, 1.0]],
        [[r00, r01, r02], [r10, r11, r12], [0.0, 0.0, 1.0]],
        [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [p0, p1, 1.0]],
        [[1.0, 0.0, -w / 2], [0.0, 1.0, -h / 2], [0.0, 0.0, 1.0]]])
    return T @ S @ R @ P @ C, s


def transform_boxes(boxes: np.ndarray, M: np.ndarray, out_hw) -> np.ndarray:
    """Map xyxy boxes through M by their 4 corners; new box = corners' extent clipped to the output.

    The corners go through one (4n, 3) @ M.T product in float64, rows (x1, y1), (x2, y2), (x1, y2),
    (x2, y1) per box, made with 4 NumPy calls instead of 12: the same product, so the same numbers."""
    n = len(boxes)
    if n == 0:
        return boxes
    xy = np.ones((n, 4, 3))
    xy[:, :, :2] = boxes[:, _CORNERS].reshape(n, 4, 2)
    xy = xy.reshape(-1, 3) @ M.T
    xy = xy[:, :2] / xy[:, 2:3] if M[2, 0] or M[2, 1] else xy[:, :2]
    xy = xy.reshape(n, 4, 2)
    out = np.concatenate([xy.min(1), xy.max(1)], 1)
    np.clip(out, 0.0, np.array((out_hw[1], out_hw[0]) * 2, np.float64), out=out)
    return out.astype(np.float32)


_CORNERS = np.array([0, 1, 2, 3, 0, 3, 2, 1])  # a box's 4 corners (x, y) as column indices of xyxy


def random_affine(img, boxes, classes, rng, degrees=0.0, translate=0.1, scale=0.5, shear=0.0,
                  perspective=0.0, border=0):
    """Random perspective/affine warp; border < 0 crops (mosaic canvas 2s -> s with border -s/2).

    Boxes are transformed by their corners, clipped and filtered by box_candidates.
    """
    h, w = img.shape[:2]
    oh, ow = h + 2 * border, w + 2 * border
    M, s = affine_matrix((h, w), (oh, ow), rng, degrees, translate, scale, shear, perspective)
    if border != 0 or not np.allclose(M, np.eye(3)):
        if perspective:
            img = cv2.warpPerspective(img, M, dsize=(ow, oh), borderValue=(PAD, PAD, PAD))
        else:
            img = cv2.warpAffine(img, M[:2], dsize=(ow, oh), borderValue=(PAD, PAD, PAD))
    if len(boxes):
        new = transform_boxes(boxes, M, (oh, ow))
        keep = box_candidates(boxes * s, new)
        boxes, classes = new[keep], classes[keep]
    return img, boxes, classes


def mosaic_affine(images, boxes, classes, imgsz: int, rng, degrees=0.0, translate=0.1, scale=0.5, shear=0.0,
                  perspective=0.0):
    """``mosaic4`` then ``random_affine(border=-imgsz // 2)`` -- the same draws, boxes and (within the
    warp's fixed-point rounding) pixels -- building only the part of the (2s)^2 canvas the warp reads: the
    output's preimage, 1/scale^2 of s^2 (4/3 s^2 on average for scale=0.5, against 4 s^2)."""
    s = imgsz
    if perspective:  # a projective preimage need not be the hull of the corners': the full canvas
        img, b, cl = mosaic4(images, boxes, classes, s, rng)
        return random_affine(img, b, cl, rng, degrees, translate, scale, shear, perspective, border=-(s // 2))
    layout = mosaic_layout([im.shape[:2] for im in images], s, rng)
    b, cl = mosaic_boxes(layout, boxes, classes, s)
    M, sc = affine_matrix((2 * s, 2 * s), (s, s), rng, degrees, translate, scale, shear, perspective)
    corners = np.linalg.inv(M)[:2] @ _out_corners(s)
    # +-2 px: bilinear reads the pixel right/below a sample point, and the warp rounds coordinates
    (x0, y0), (x1, y1) = np.floor(corners.min(1)).tolist(), np.ceil(corners.max(1)).tolist()
    x0, y0 = max(int(x0) - 2, 0), max(int(y0) - 2, 0)
    x1, y1 = min(int(x1) + 3, 2 * s), min(int(y1) + 3, 2 * s)
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1)
    sub = np.full((y1 - y0, x1 - x0, images[0].shape[2]), PAD, np.uint8)
    for img, ((xa1, ya1, xa2, ya2), (xb1, yb1), _) in zip(images, layout):
        cx1, cy1, cx2, cy2 = max(xa1, x0), max(ya1, y0), min(xa2, x1), min(ya2, y1)
        if cx2 > cx1 and cy2 > cy1:
            _copy(img[yb1 + cy1 - ya1:yb1 + cy2 - ya1, xb1 + cx1 - xa1:xb1 + cx2 - xa1],
                  sub[cy1 - y0:cy2 - y0, cx1 - x0:cx2 - x0])
    shift = np.array([[1, 0, x0], [0, 1, y0], [0, 0, 1]], np.float64)
    img = cv2.warpAffine(sub, (M @ shift)[:2], dsize=(s, s), borderValue=(PAD, PAD, PAD))
    if len(b):
        new = transform_boxes(b, M, (s, s))
        keep = box_candidates(b * sc, new)
        b, cl = new[keep], cl[keep]
    return img, b, cl


def _copy(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[...] = src`` for same-shape uint8 HWC views with contiguous rows (OpenCV wraps them, no copy):
    OpenCV copies ~1.7x as fast as NumPy's assignment (a cold 640x480 tile: 69 vs 118 us, AMD EPYC, 1
    thread), and a mosaic copies ~1.3 tiles' worth into the warp's window."""
    cv2.copyTo(src, None, dst)


_OUT_CORNERS: dict[int, np.ndarray] = {}


def _out_corners(s: int) -> np.ndarray:
    """The 4 corners of an s x s output, homogeneous (3, 4) float64 (made once per size)."""
    if s not in _OUT_CORNERS:
        _OUT_CORNERS[s] = np.array([[0, s, 0, s], [0, 0, s, s], [1, 1, 1, 1]], np.float64)
    return _OUT_CORNERS[s]


def hsv_gains(rng, hgain, sgain, vgain) -> np.ndarray:
    """The random (hue, saturation, value) multipliers of one image: 1 + U(-1, 1) x gain each."""
    return rng.uniform(-1, 1, 3) * (hgain, sgain, vgain) + 1


def hsv_luts(r) -> np.ndarray:
    """(256, 3) uint8 tables of gains ``r``: hue x r0 mod 180 (OpenCV's 8-bit hue), s and v x r clipped.
    Made as (3, 256) rows, each level x its gain (the same products), then cast transposed: ~30 % less
    time than three column writes into a (256, 3) table."""
    t = np.multiply.outer(np.asarray(r, np.float64), _LEVELS)
    np.remainder(t[0], 180, out=t[0])
    sv = t[1:]
    np.minimum(np.maximum(sv, 0, out=sv), 255, out=sv)  # = np.clip(sv, 0, 255) without its Python wrapper
    return np.ascontiguousarray(t.T, dtype=np.uint8)


_LEVELS = np.arange(256, dtype=np.float64)


def augment_hsv(img: np.ndarray, rng, hgain=0.5, sgain=0.5, vgain=0.5, to_rgb: bool = False,
                inplace: bool = False) -> np.ndarray:
    """Random hue/saturation/value gains on a BGR uint8 image -> BGR (RGB with ``to_rgb``: the colour swap
    rides on the conversion back from HSV for free). A new image, unless ``inplace``: then the result is
    written over ``img`` (C-contiguous), for a caller that owns it (a fresh warp output; never a RAM-cached
    or buffered image). In place saves a new image per sample (1.2 MB at 640 px) that the worker must fault
    in or pull into its cache before writing it.

    One draw of 3 gains (``hsv_gains``), their tables (``hsv_luts``), then the compiled one-pass kernel
    where the C++ extension has it (``hsv_backend``), else OpenCV (``hsv_apply_opencv``, the reference):
    the same bytes either way (tested on all 2^24 colours), 0.5 ms vs 1.7 ms at 640x640 (AMD EPYC Zen 4,
    1 thread).
    """
    if not (hgain or sgain or vgain):
        if not to_rgb:
            return img
        return cv2.cvtColor(img, cv2.COLOR_BGR2RGB, dst=img if inplace else None)
    lut = hsv_luts(hsv_gains(rng, hgain, sgain, vgain))
    if hsv_backend() == "cpp":
        return hsv_apply_compiled(img, lut, to_rgb, inplace)
    return hsv_apply_opencv(img, lut, to_rgb, inplace)


def hsv_apply_opencv(img: np.ndarray, lut: np.ndarray, to_rgb: bool = False,
                     inplace: bool = False) -> np.ndarray:
    """The reference: BGR->HSV, one 3-channel LUT (hue x gain mod 180, saturation and value x gain clipped),
    HSV->BGR/RGB (into ``img`` when ``inplace``): the same pixels as a LUT per split channel, in 1.7-2.4 ms
    instead of 5.4 ms at 640x640."""
    hsv = cv2.cvtColor(img, cv2.COLOR_BGR2HSV)
    cv2.LUT(hsv, lut.reshape(256, 1, 3), dst=hsv)
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB if to_rgb else cv2.COLOR_HSV2BGR, dst=img if inplace else None)


def hsv_apply_compiled(img: np.ndarray, lut: np.ndarray, to_rgb: bool = False,
                       inplace: bool = False) -> np.ndarray:
    """``hsv_apply_opencv`` in one pass by the C++ kernel (``yolofast::hsv_augment``, ``hsv_augment_`` in
    place): the same bytes."""
    if inplace:
        if not (img.flags.c_contiguous and img.flags.writeable):
            raise ValueError("hsv_apply_compiled: inplace needs a writeable C-contiguous image")
        _library.hsv_augment_(torch.from_numpy(img), torch.from_numpy(lut), to_rgb, opencv_step())
        return img
    if not (img.flags.c_contiguous and img.flags.writeable):  # torch.from_numpy warns on read-only arrays
        img = np.array(img, order="C")
    out = _library.hsv_augment(torch.from_numpy(img), torch.from_numpy(lut), to_rgb, opencv_step())
    return out.numpy()


def opencv_step() -> int:
    """OpenCV's pixels per vector step in its HSV->BGR code on this CPU (the widest ISA it dispatches): the
    last ``width % step`` pixels of each row go through its scalar code, which rounds where the vector code
    truncates, and the kernel follows. 64 measured here (AVX-512); 32 (AVX2) and 16 (SSE) by the same rule."""
    if not _OPENCV_STEP:
        avx512, avx2 = (cv2.checkHardwareSupport(f) for f in (_CV_CPU_AVX512_SKX, _CV_CPU_AVX2))
        _OPENCV_STEP.append(64 if avx512 else 32 if avx2 else 16)
    return _OPENCV_STEP[0]


_OPENCV_STEP: list[int] = []
_CV_CPU_AVX2, _CV_CPU_AVX512_SKX = 11, 256  # OpenCV's CpuFeatures ids (cv2 5 exports no CPU_* names)


_HSV_CHOICE: dict[str, str] = {}  # requested backend -> the one that runs (the availability check once)


def hsv_backend() -> str:
    """Which HSV implementation ``augment_hsv`` runs: "cpp" (the compiled kernel) when the C++ extension has
    it, else "ref" (OpenCV). ``YOLOFAST_BACKEND_HSV_AUGMENT=ref`` (or ``YOLOFAST_BACKEND=ref``, or
    ``yolofast.ops.backend("ref")``) forces OpenCV; ``cpp`` forces the kernel and is an error where it is
    missing. A failed build has already warned once (the ops' rule), so "auto" falls back quietly."""
    name, where = _backend.requested_backend("hsv_augment")
    if name not in ("ref", "cpp"):
        name = "auto"  # cuda / triton name device kernels; the loader's HSV runs on the CPU
    if name not in _HSV_CHOICE:
        ok, why = (True, "") if name == "ref" else _backend.availability("hsv_augment", "cpp", "cpu")
        if name == "cpp" and not ok:
            raise _backend.BackendUnavailable(f"{where} asks for backend 'cpp' for hsv_augment, but: {why}")
        _HSV_CHOICE[name] = "cpp" if ok and name != "ref" else "ref"
    return _HSV_CHOICE[name]


def flip_lr(img, boxes, inplace: bool = False):
    """Mirror left-right: a new array (the input may be cached; 3x faster than a [:, ::-1] copy), or over
    ``img`` when ``inplace`` (the caller owns it)."""
    w = img.shape[1]
    if len(boxes):
        boxes = boxes.copy()
        boxes[:, 0::2] = w - boxes[:, 2::-2]  # x1, x2 = w - x2, w - x1
    return cv2.flip(img, 1, dst=img if inplace else None), boxes


def flip_ud(img, boxes, inplace: bool = False):
    """Mirror top-bottom, as ``flip_lr``."""
    h = img.shape[0]
    if len(boxes):
        boxes = boxes.copy()
        boxes[:, 1::2] = h - boxes[:, 3::-2]  # y1, y2 = h - y2, h - y1
    return cv2.flip(img, 0, dst=img if inplace else None), boxes


def mixup(img1, boxes1, cls1, img2, boxes2, cls2, rng):
    """Blend two same-size images with r ~ Beta(32, 32) (close to 0.5) and keep both label sets."""
    r = rng.beta(32.0, 32.0)
    img = (img1.astype(np.float32) * r + img2.astype(np.float32) * (1 - r)).astype(np.uint8)
    return img, np.concatenate([boxes1, boxes2]), np.concatenate([cls1, cls2])


def cutmix(img1, boxes1, cls1, img2, boxes2, cls2, rng, area_thr: float = 0.1):
    """Paste a random rectangle of ``img2`` (same size) into ``img1``, with the labels that stay visible.

    The rectangle covers a fraction 1 - lam of the image, lam ~ U(0, 1), centred at a uniform point and
    clipped to the image. Boxes of ``img2`` are cut to the rectangle and kept when >= ``area_thr`` of their
    area lies inside it; boxes of ``img1`` are kept when >= ``area_thr`` of their area stays outside it.
    """
    h, w = img1.shape[:2]
    lam = rng.random()
    cw, ch = w * np.sqrt(1 - lam), h * np.sqrt(1 - lam)
    cx, cy = rng.uniform(0, w), rng.uniform(0, h)
    x1, x2 = int(np.clip(cx - cw / 2, 0, w)), int(np.clip(cx + cw / 2, 0, w))
    y1, y2 = int(np.clip(cy - ch / 2, 0, h)), int(np.clip(cy + ch / 2, 0, h))
    if x2 <= x1 or y2 <= y1:
        return img1, boxes1, cls1
    img = img1.copy()
    img[y1:y2, x1:x2] = img2[y1:y2, x1:x2]

    def area(b):
        return (b[:, 2] - b[:, 0]).clip(0) * (b[:, 3] - b[:, 1]).clip(0)

    def inside(b):
        c = b.copy()
        c[:, [0, 2]] = c[:, [0, 2]].clip(x1, x2)
        c[:, [1, 3]] = c[:, [1, 3]].clip(y1, y2)
        return c

    b1 = boxes1.reshape(-1, 4)
    a1 = area(b1)
    keep1 = (a1 - area(inside(b1))) >= area_thr * a1
    b2 = boxes2.reshape(-1, 4)
    cut2 = inside(b2)
    keep2 = (area(cut2) >= area_thr * area(b2)) & (area(cut2) > 0)
    boxes = np.concatenate([b1[keep1], cut2[keep2]], 0).astype(np.float32)
    cls = np.concatenate([cls1.reshape(-1, 1)[keep1], cls2.reshape(-1, 1)[keep2]], 0)
    return img, boxes, cls


def rect_batch_shapes(shapes: np.ndarray, imgsz: int, stride: int, batch_size: int, pad: float):
    """Rectangular batches: (order, batch_index, batch_shapes).

    ``shapes`` (n, 2) original (h, w). Images are ordered by aspect ratio h / w, cut into consecutive
    batches, and each batch gets the (h, w) that holds all its images at long side ``imgsz``: the batch's
    widest aspect ratio (h/w < 1) or tallest one (h/w > 1), else square; plus ``pad`` strides, rounded up to
    the stride. ``pad=0.5`` is Ultralytics' val setting (half a stride of grey around), 0.0 its train one.
    """
    ar = shapes[:, 0] / shapes[:, 1]
    order = np.argsort(ar, kind="stable")
    ar = ar[order]
    batch_index = np.arange(len(ar)) // batch_size
    out = []
    for i in range(int(batch_index[-1]) + 1 if len(ar) else 0):
        a = ar[batch_index == i]
        lo, hi = a.min(), a.max()
        out.append([hi, 1.0] if hi < 1 else [1.0, 1.0 / lo] if lo > 1 else [1.0, 1.0])
    batch_shapes = (np.ceil(np.array(out).reshape(-1, 2) * imgsz / stride + pad).astype(int) * stride)
    return order, batch_index, batch_shapes
