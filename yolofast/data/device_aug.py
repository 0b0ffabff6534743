"""Training augmentation on the device (``augment_device=``): mosaic, affine warp, HSV and flips as batched
torch ops, so that on a GPU the CPU only reads files (and, with nvJPEG, does not even decode them).

The loader's workers make a *plan* per sample (``plan_sample``): the same random draws, in the same order,
from the dataset's generator as the CPU path (``YOLODataset.__getitem__``), the boxes computed from them on
the CPU exactly as there, and the images (decoded, or JPEG bytes for the device to decode). ``apply_plans``
then renders a batch of plans on any device: the CPU path's pixels within interpolation rounding (OpenCV's
fixed-point warp and HSV against float torch ops), the same boxes.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from yolofast.data import augment as A

__all__ = ["apply_plans", "plan_sample", "check_device_hyp"]

_UNSUPPORTED = ("mixup", "cutmix", "bgr")


def check_device_hyp(hyp: dict) -> None:
    """Refuse hyper-parameters the device path does not render (rather than silently skipping them)."""
    bad = [f"{k}={hyp[k]}" for k in _UNSUPPORTED if hyp.get(k)]
    if bad:
        raise ValueError(f"augment_device renders mosaic, affine, HSV and flips; {', '.join(bad)} needs the "
                         f"CPU path: set them to 0 or leave augment_device unset")


def _tile(ds, i, decode: str):
    """(index, tile, (h0, w0), xyxy boxes, cls) of image i: tile is the resized BGR HWC array (CPU decode)
    or (JPEG bytes, (h, w) resized shape) for the device to decode."""
    if decode == "cpu":
        return ds._load(i)
    lab = ds.labels[i]
    h0, w0 = lab["shape"]
    r = ds.imgsz / max(h0, w0)
    s = ds.imgsz
    h, w = (h0, w0) if r == 1 else (min(max(round(h0 * r), 1), s), min(max(round(w0 * r), 1), s))
    if i not in ds.buffer and ds.max_buffer:  # the same buffer of recent images, by index
        ds.buffer.append(i)
        del ds.buffer[:-ds.max_buffer]
    b = lab["bboxes"]
    xyxy = np.stack([(b[:, 0] - b[:, 2] / 2) * w, (b[:, 1] - b[:, 3] / 2) * h,
                     (b[:, 0] + b[:, 2] / 2) * w, (b[:, 1] + b[:, 3] / 2) * h], 1).astype(np.float32)
    return i, (np.fromfile(ds.im_files[i], np.uint8), (h, w)), (h0, w0), xyxy, lab["cls"].copy()


def _hw(tile):
    return tile[1] if isinstance(tile, tuple) else tile.shape[:2]


def plan_sample(ds, index: int, decode: str = "cpu") -> dict:
    """The plan of training sample ``index``: the draws of ``YOLODataset.__getitem__`` (train, no mixup /
    cutmix / bgr) in its order, the boxes made from them, and the images to render."""
    rng, hyp, s = ds.rng, ds.hyp, ds.imgsz
    aff = {k: hyp[k] for k in ("degrees", "translate", "scale", "shear", "perspective")}
    mosaic_p = float(ds._aug[0])
    if mosaic_p > 0 and rng.random() < mosaic_p:
        parts = [_tile(ds, index, decode)]
        companions = (ds._mosaic_companions(rng) if decode == "cpu" or ds.ims is not None
                      else [ds.buffer[j] for j in rng.integers(0, len(ds.buffer), 3).tolist()])
        parts += [_tile(ds, j, decode) for j in companions]
        layout = A.mosaic_layout([_hw(p[1]) for p in parts], s, rng)
        boxes, cls = A.mosaic_boxes(layout, [p[3] for p in parts], [p[4] for p in parts], s)
        tiles = [(p[1], (xa1, ya1, xa2, ya2), (xb1, yb1)) for p, ((xa1, ya1, xa2, ya2), (xb1, yb1), _) in
                 zip(parts, layout)]
        in_hw, border = (2 * s, 2 * s), -(s // 2)
    else:
        parts = [_tile(ds, index, decode)]
        h, w = _hw(parts[0][1])
        pw, ph = (s - w) // 2, (s - h) // 2  # letterbox of an image already at long side s: padding only
        boxes = parts[0][3] + np.array([pw, ph, pw, ph], np.float32)
        cls = parts[0][4]
        tiles = [(parts[0][1], (pw, ph, pw + w, ph + h), (0, 0))]
        in_hw, border = (s, s), 0
    out_hw = (in_hw[0] + 2 * border, in_hw[1] + 2 * border)
    M, sc = A.affine_matrix(in_hw, out_hw, rng, **aff)
    if len(boxes):
        new = A.transform_boxes(boxes, M, out_hw)
        keep = A.box_candidates(boxes * sc, new)
        boxes, cls = new[keep], cls[keep]
    gains = A.hsv_gains(rng, hyp["hsv_h"], hyp["hsv_s"], hyp["hsv_v"]) if (
        hyp["hsv_h"] or hyp["hsv_s"] or hyp["hsv_v"]) else None
    flipud = bool(rng.random() < hyp["flipud"])
    fliplr = bool(rng.random() < hyp["fliplr"])
    h, w = out_hw
    boxes = boxes.reshape(-1, 4).astype(np.float32)
    if flipud and len(boxes):
        boxes[:, [1, 3]] = h - boxes[:, [3, 1]]
    if fliplr and len(boxes):
        boxes[:, [0, 2]] = w - boxes[:, [2, 0]]
    boxes[:, 0::2] = boxes[:, 0::2].clip(0, w)
    boxes[:, 1::2] = boxes[:, 1::2].clip(0, h)
    xywh = np.stack([(boxes[:, 0] + boxes[:, 2]) / (2 * w), (boxes[:, 1] + boxes[:, 3]) / (2 * h),
                     (boxes[:, 2] - boxes[:, 0]) / w, (boxes[:, 3] - boxes[:, 1]) / h], 1)
    return {"tiles": tiles, "canvas": in_hw, "M": M, "out": out_hw, "hsv": gains, "flipud": flipud,
            "fliplr": fliplr, "cls": torch.from_numpy(cls.reshape(-1, 1).astype(np.float32)),
            "bboxes": torch.from_numpy(xywh.astype(np.float32)), "im_file": ds.im_files[parts[0][0]],
            "ori_shape": tuple(parts[0][2]), "resized_shape": out_hw, "ratio_pad": None}


# ------------------------------------------------------------------------------------------ rendering
def _decode(tile, device) -> torch.Tensor:
    """A tile as a (3, h, w) BGR uint8 tensor on ``device``."""
    if not isinstance(tile, tuple):
        return torch.from_numpy(tile).to(device).permute(2, 0, 1)
    from torchvision.io import ImageReadMode, decode_jpeg

    data, (h, w) = tile
    img = decode_jpeg(torch.from_numpy(data), mode=ImageReadMode.RGB, device=device).flip(0)  # RGB -> BGR
    if img.shape[1:] != (h, w):
        img = F.interpolate(img[None].float(), size=(h, w), mode="bilinear", align_corners=False)
        img = img[0].round_().clamp_(0, 255).to(torch.uint8)
    return img


def _canvases(plans, device) -> torch.Tensor:
    """(B, 3, Hc, Wc) uint8 BGR canvases (the largest canvas of the batch; smaller ones top-left), grey."""
    hc = max(p["canvas"][0] for p in plans)
    wc = max(p["canvas"][1] for p in plans)
    canvas = torch.full((len(plans), 3, hc, wc), A.PAD, dtype=torch.uint8, device=device)
    for b, p in enumerate(plans):
        for tile, (xa1, ya1, xa2, ya2), (xb1, yb1) in p["tiles"]:
            img = _decode(tile, device)
            canvas[b, :, ya1:ya2, xa1:xa2] = img[:, yb1:yb1 + (ya2 - ya1), xb1:xb1 + (xa2 - xa1)]
    return canvas


def _warp(canvas: torch.Tensor, plans) -> torch.Tensor:
    """cv2.warpAffine/warpPerspective (bilinear, constant grey border) of each canvas by its plan's M."""
    oh, ow = plans[0]["out"]
    B, _, hc, wc = canvas.shape
    dev = canvas.device
    minv = torch.tensor(np.stack([np.linalg.inv(p["M"]) for p in plans]), dtype=torch.float64, device=dev)
    ys, xs = torch.meshgrid(torch.arange(oh, device=dev, dtype=torch.float64),
                            torch.arange(ow, device=dev, dtype=torch.float64), indexing="ij")
    pts = torch.stack([xs, ys, torch.ones_like(xs)], -1).reshape(1, -1, 3)  # (1, oh*ow, 3)
    src = pts @ minv.transpose(1, 2)  # (B, oh*ow, 3)
    xy = src[..., :2] / src[..., 2:3]
    # grid_sample (align_corners=False) samples pixel x at (2x + 1) / W - 1, as OpenCV's pixel centres
    grid = torch.stack([(2 * xy[..., 0] + 1) / wc - 1, (2 * xy[..., 1] + 1) / hc - 1], -1)
    x = canvas.float() - A.PAD  # zero padding of (img - grey) == a grey constant border
    out = F.grid_sample(x, grid.reshape(B, oh, ow, 2).float(), mode="bilinear", padding_mode="zeros",
                        align_corners=False)
    return (out + A.PAD).round_().clamp_(0, 255)


def _bgr_to_hsv(img: torch.Tensor):
    """OpenCV's 8-bit BGR -> HSV (hue 0..179), in float, rounded like it: (B, 3, H, W) -> h, s, v."""
    b, g, r = img[:, 0], img[:, 1], img[:, 2]
    v, _ = img.max(1)
    mn, _ = img.min(1)
    diff = v - mn
    s = torch.where(v > 0, diff * 255 / v.clamp(min=1), torch.zeros_like(v)).round()
    d = diff.clamp(min=1e-6)
    h = torch.where(v == r, (g - b) / d, torch.where(v == g, 2 + (b - r) / d, 4 + (r - g) / d)) * 30
    h = torch.where(diff > 0, h, torch.zeros_like(h))
    h = torch.where(h < 0, h + 180, h).round()
    return h, s, v


def _hsv_to_rgb(h, s, v) -> torch.Tensor:
    """OpenCV's 8-bit HSV (hue 0..179) -> RGB, in float: (B, 3, H, W), rounded."""
    h6 = (h / 30) % 6
    s, v = s / 255, v / 255
    i = h6.floor()
    f = h6 - i
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    i = i.long().clamp(0, 5)
    r = torch.stack([v, q, p, p, t, v], 0).gather(0, i[None])[0]
    g = torch.stack([t, v, v, q, p, p], 0).gather(0, i[None])[0]
    b = torch.stack([p, p, t, v, v, q], 0).gather(0, i[None])[0]
    return (torch.stack([r, g, b], 1) * 255).round_().clamp_(0, 255)


def _hsv(img: torch.Tensor, plans) -> torch.Tensor:
    """BGR float (B, 3, H, W) -> RGB float with each plan's HSV gains (the LUTs of augment.hsv_luts)."""
    idx = [k for k, p in enumerate(plans) if p["hsv"] is not None]
    out = img.flip(1)  # RGB for the samples without gains
    if not idx:
        return out
    h, s, v = _bgr_to_hsv(img[idx])
    luts = torch.tensor(np.stack([A.hsv_luts(plans[k]["hsv"]) for k in idx]), device=img.device,
                        dtype=torch.float32)  # (n, 256, 3)
    n = len(idx)
    hsv = [torch.gather(luts[:, :, c], 1, ch.reshape(n, -1).long().clamp(0, 255)).reshape(ch.shape)
           for c, ch in enumerate((h, s, v))]
    out = out.clone()
    out[idx] = _hsv_to_rgb(*hsv)
    return out


def apply_plans(plans, device="cpu") -> torch.Tensor:
    """Render a batch of plans (same output size) on ``device`` -> (B, 3, H, W) uint8 RGB."""
    canvas = _canvases(plans, device)
    img = _warp(canvas, plans)
    img = _hsv(img, plans)
    ud = [k for k, p in enumerate(plans) if p["flipud"]]
    if ud:
        img[ud] = img[ud].flip(2)
    lr = [k for k, p in enumerate(plans) if p["fliplr"]]
    if lr:
        img[lr] = img[lr].flip(3)
    return img.to(torch.uint8)
