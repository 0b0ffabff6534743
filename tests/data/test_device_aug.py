"""augment_device: the batched torch rendering of a sample's plan == the CPU path's sample (same draws)."""

import pytest
import torch

from yolofast.data import build_dataset
from yolofast.data.device_aug import apply_plans, check_device_hyp, plan_sample


def _compare(ds, idx, decode="cpu", hyp_note=""):
    ds.reseed(7)
    cpu = [ds[i] for i in idx]
    ds.reseed(7)
    plans = [plan_sample(ds, i, decode) for i in idx]
    out = apply_plans(plans, "cpu")
    for k, (c, p) in enumerate(zip(cpu, plans)):
        torch.testing.assert_close(p["bboxes"], c["bboxes"], atol=1e-4, rtol=0)
        assert torch.equal(p["cls"], c["cls"]) and p["im_file"] == c["im_file"]
        d = (out[k].float() - c["img"].float()).abs()
        # OpenCV warps with 1/32-pixel fixed-point coordinates and converts HSV with integer tables: a few
        # levels at sharp edges and at saturated hues, otherwise the same pixels
        assert d.mean() < 0.5, f"sample {k}{hyp_note}: mean |diff| {d.mean():.2f}"
        off = (d > 4).float().mean()
        assert off < 0.005, f"sample {k}{hyp_note}: {off:.3%} of the pixels off by > 4"
    return out


@pytest.mark.parametrize("hyp", [dict(), dict(degrees=10.0, shear=2.0, flipud=0.5),
                                 dict(mosaic=0.0), dict(hsv_h=0, hsv_s=0, hsv_v=0)])
def test_device_path_matches_cpu_path_on_coco128(coco128_yaml, hyp):
    from yolofast.data import check_data

    d = check_data(coco128_yaml)
    ds = build_dataset(d["train"], imgsz=160, nc=d["nc"], batch_size=2, hyp=hyp, fraction=24)
    _compare(ds, list(range(8)), hyp_note=f" {hyp}")


def test_unsupported_hyp_refused():
    with pytest.raises(ValueError, match="mixup=0.5 needs the CPU path"):
        check_device_hyp(dict(mixup=0.5, mosaic=1.0))
    check_device_hyp(dict(mixup=0.0, mosaic=1.0))


def test_jpeg_bytes_path_same_boxes(coco128_yaml):
    """decode='device' (nvJPEG on CUDA; torchvision's CPU decoder here): same draws and boxes."""
    from yolofast.data import check_data

    d = check_data(coco128_yaml)
    ds = build_dataset(d["train"], imgsz=160, nc=d["nc"], batch_size=2, fraction=24)
    ds.reseed(3)
    a = [plan_sample(ds, i, "cpu") for i in range(6)]
    ds.reseed(3)
    b = [plan_sample(ds, i, "device") for i in range(6)]
    for p, q in zip(a, b):
        torch.testing.assert_close(q["bboxes"], p["bboxes"], atol=1e-4, rtol=0)
    x, y = apply_plans(a), apply_plans(b)
    assert x.shape == y.shape == (6, 3, 160, 160)
    assert (x.float() - y.float()).abs().mean() < 6  # torchvision's decode + resize vs OpenCV's


def test_loader_sends_plans_and_the_device_renders_the_cpu_batch(tmp_path, split_factory):
    from yolofast.data import build_dataloader

    src = str(split_factory(tmp_path, {f"im{i}": f"{i % 2} 0.5 0.5 0.4 0.3\n" for i in range(8)}))
    ref = build_dataset(src, imgsz=64, nc=2)
    dev = build_dataset(src, imgsz=64, nc=2, augment_device="cpu")
    a = next(iter(build_dataloader(ref, 4, 0, shuffle=True, seed=1)))
    b = next(iter(build_dataloader(dev, 4, 0, shuffle=True, seed=1)))
    assert "img" not in b and len(b["plans"]) == 4
    for k in ("batch_idx", "cls", "gt_mask"):
        assert torch.equal(a[k], b[k])
    torch.testing.assert_close(b["bboxes"], a["bboxes"], atol=1e-4, rtol=0)
    img = apply_plans(b["plans"], "cpu")
    assert (img.float() - a["img"].float()).abs().mean() < 1.0  # random-noise test images: sharp everywhere
    with pytest.raises(ValueError, match="cutmix=0.3 needs the CPU path"):
        build_dataset(src, imgsz=64, nc=2, augment_device="cpu", hyp=dict(cutmix=0.3))
    assert build_dataset(src, imgsz=64, nc=2, augment=False, augment_device="cpu").augment_device is None
    with pytest.raises(ValueError, match="rect=True needs the CPU path"):
        build_dataset(src, imgsz=64, nc=2, augment_device="cpu", rect=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_render_and_nvjpeg(coco128_yaml):
    """On the GPU: the CPU path's pixels and boxes (CPU-decoded tiles), and nvJPEG-decoded plans render."""
    from yolofast.data import check_data

    d = check_data(coco128_yaml)
    ds = build_dataset(d["train"], imgsz=160, nc=d["nc"], batch_size=2, fraction=24)
    ds.reseed(7)
    cpu = [ds[i] for i in range(8)]
    ds.reseed(7)
    plans = [plan_sample(ds, i, "cpu") for i in range(8)]
    out = apply_plans(plans, "cuda").cpu()
    for k, c in enumerate(cpu):
        assert (out[k].float() - c["img"].float()).abs().mean() < 0.5
        torch.testing.assert_close(plans[k]["bboxes"], c["bboxes"], atol=1e-4, rtol=0)
    ds.reseed(7)
    gpu = apply_plans([plan_sample(ds, i, "device") for i in range(8)], "cuda")
    assert gpu.is_cuda and gpu.shape == (8, 3, 160, 160)
    assert (gpu.cpu().float() - out.float()).abs().mean() < 6  # nvJPEG + bilinear resize vs OpenCV's
