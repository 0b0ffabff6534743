"""The whole loss step (assign + losses, forward + backward): backend "ref" vs "cpp", in one run (2 threads).

    python -m pytest benchmarks/bench_loss_step.py --benchmark-columns=min,median,max,rounds

yolofast.loss.DetectionLoss(80) on the three raw head maps of a B=8, 640 px batch (80x80, 40x40, 20x20,
144 channels), 50 GT per image (sides log-uniform in 8..320 px), then backward to the maps. The same
inputs run once with every op on the pure-PyTorch reference and once on the C++ kernels.
Goal (DESIGN §7): the cpp step >= 5x faster than the reference.
"""

from __future__ import annotations

import math

import pytest
import torch

B, IMGSZ, NC, M = 8, 640, 80, 50
GROUP = "loss step fwd+bwd B8 640px 80cls 50gt"
GOALS = [(GROUP, "cpp", "ref", 0.2, "loss step >= 5x faster than the reference")]


def make_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    feats = [torch.randn(B, 64 + NC, IMGSZ // s, IMGSZ // s, generator=g) for s in (8, 16, 32)]
    lo, hi = math.log(8 / IMGSZ), math.log(320 / IMGSZ)
    wh = torch.exp(torch.rand(B, M, 2, generator=g) * (hi - lo) + lo)
    xy = wh / 2 + torch.rand(B, M, 2, generator=g) * (1 - wh)
    batch = {
        "gt_cls": torch.randint(0, NC, (B, M, 1), generator=g).float(),
        "gt_bboxes": torch.cat((xy, wh), -1),
        "gt_mask": torch.ones(B, M, 1),
    }
    return feats, batch


@pytest.mark.parametrize("impl", ["ref", "cpp"])
def test_loss_step(measure, impl):
    from yolofast.loss import DetectionLoss
    from yolofast.ops import backend
    from yolofast.ops._backend import availability

    if impl == "cpp":
        for op in ("tal_assign", "bbox_loss"):
            ok, why = availability(op, "cpp", "cpu")
            if not ok:
                pytest.skip(f"{op}: {why}")
    feats, batch = make_batch()
    feats = [f.requires_grad_() for f in feats]
    loss_fn = DetectionLoss(NC)

    def step():
        for f in feats:
            f.grad = None
        with backend(impl):
            total, _ = loss_fn(feats, batch)
        total.backward()

    measure(step, group=GROUP, variant=impl, rounds=5 if impl == "ref" else 20, warmup_rounds=1)
