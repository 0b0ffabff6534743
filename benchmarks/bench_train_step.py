"""The whole train step (forward, fp32 loss, backward, SGD step) of yolov8n: images/s per variant, one run.

    python -m pytest benchmarks/bench_train_step.py --benchmark-columns=min,median,max,rounds
    python benchmarks/bench_train_step.py            # the same, printed as images/s (no pytest)

CPU: 320 px batch 16, 2 threads. Variants: fp32 (NCHW, the baseline), bf16 autocast, channels_last (fp32 and
bf16), torch.compile (inductor; its first call compiles for minutes on 2 cores, outside the timing — set
YOLOFAST_BENCH_COMPILE=0 to skip it). GPU (when CUDA is present): 640 px batch 64, bf16 channels_last,
eager vs compiled. Ultralytics' same step is measured beside them only when ``ultralytics`` is importable
(never a dependency); DESIGN §7 goal: >= 1.5x its images/s on CPU.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from yolofast.engine.compile import train_step_modules
from yolofast.loss import DetectionLoss
from yolofast.nn import build_model

CPU = dict(imgsz=320, batch=16, nc=80)
GPU = dict(imgsz=640, batch=64, nc=80)
GROUP_CPU = "train step yolov8n 320px b16 CPU"
GROUP_GPU = "train step yolov8n 640px b64 CUDA"
GOALS = [(GROUP_CPU, "compiled", "fp32", 1.0, "compiled step faster than eager fp32")]


def make_batch(imgsz, batch, nc, device, n_gt=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    img = torch.rand(batch, 3, imgsz, imgsz, generator=g)
    m = 16  # padded GT bucket (data.collate.pad_targets)
    xy = torch.rand(batch, m, 2, generator=g) * 0.6 + 0.2
    wh = torch.rand(batch, m, 2, generator=g) * 0.2 + 0.05
    out = {"gt_cls": torch.randint(0, nc, (batch, m, 1), generator=g).float(),
           "gt_bboxes": torch.cat([xy, wh], -1),
           "gt_mask": (torch.arange(m)[None, :, None] < n_gt).float().expand(batch, m, 1).contiguous()}
    return img.to(device), {k: v.to(device) for k, v in out.items()}


def make_step(variant: str, imgsz: int, batch: int, nc: int, device: torch.device):
    """A zero-argument train step; ``variant``: fp32, bf16, fp32_cl, bf16_cl, compiled, compiled_bf16_cl."""
    torch.manual_seed(0)
    model = build_model("yolov8n", nc=nc).to(device).train()
    crit = DetectionLoss(nc)
    img, gt = make_batch(imgsz, batch, nc, device)
    cl = variant.endswith("_cl")
    if cl:
        model.to(memory_format=torch.channels_last)
        img = img.contiguous(memory_format=torch.channels_last)
    dtype = torch.bfloat16 if "bf16" in variant else None
    fwd, loss_fn = train_step_modules(model, crit, device, compile=variant.startswith("compiled"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, nesterov=True)

    def step():
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            feats = fwd(img)
        loss, _ = loss_fn([f.float() for f in feats], gt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step


def ultralytics_step(imgsz: int, batch: int, device: torch.device):
    """Ultralytics' own model + loss for the same step, or pytest.skip when it is not installed."""
    pytest.importorskip("ultralytics")
    from ultralytics.nn.tasks import DetectionModel as UDetectionModel
    from ultralytics.utils import IterableSimpleNamespace

    m = UDetectionModel("yolov8n.yaml", nc=80, verbose=False).to(device).train()
    m.args = IterableSimpleNamespace(box=7.5, cls=0.5, dfl=1.5)
    img, gt = make_batch(imgsz, batch, 80, device)
    mask = gt["gt_mask"][..., 0].bool()
    ubatch = {"batch_idx": torch.arange(batch, device=device)[:, None].expand_as(mask)[mask].float(),
              "cls": gt["gt_cls"][mask], "bboxes": gt["gt_bboxes"][mask], "img": img}
    opt = torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9, nesterov=True)

    def step():
        loss, _ = m.loss(ubatch)
        loss.sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


_CPU_VARIANTS = ["fp32", "bf16", "fp32_cl", "bf16_cl", "compiled"]


@pytest.mark.parametrize("variant", _CPU_VARIANTS)
def test_train_step_cpu(measure, variant):
    if variant.startswith("compiled") and os.environ.get("YOLOFAST_BENCH_COMPILE", "1") == "0":
        pytest.skip("YOLOFAST_BENCH_COMPILE=0")
    step = make_step(variant, device=torch.device("cpu"), **CPU)
    measure(step, group=GROUP_CPU, variant=variant, rounds=5, warmup_rounds=2)


def test_train_step_cpu_ultralytics(measure):
    step = ultralytics_step(CPU["imgsz"], CPU["batch"], torch.device("cpu"))
    measure(step, group=GROUP_CPU, variant="ultralytics", rounds=5, warmup_rounds=2)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["bf16_cl", "compiled_bf16_cl"])
def test_train_step_cuda(measure, variant):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    step = make_step(variant, device=torch.device("cuda"), **GPU)
    measure(step, group=GROUP_GPU, variant=variant, rounds=20, warmup_rounds=3)


def main(variants=None, rounds: int = 5) -> dict:
    """images/s of each CPU variant (median of ``rounds`` after 2 warm-ups), printed and returned."""
    torch.set_num_threads(2)
    out = {}
    for v in variants or _CPU_VARIANTS:
        step = make_step(v, device=torch.device("cpu"), **CPU)
        for _ in range(2):
            step()
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        out[v] = CPU["batch"] / sorted(times)[len(times) // 2]
        print(f"{v:>10}: {out[v]:6.2f} images/s  ({out[v] / out[next(iter(out))]:.2f}x {next(iter(out))})",
              flush=True)
    return out


if __name__ == "__main__":
    import sys

    main(sys.argv[1:] or None)
