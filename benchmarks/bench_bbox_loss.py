"""bbox_loss forward + backward: pure-PyTorch reference vs the fused C++ kernel, in one run (2 threads).

    python -m pytest benchmarks/bench_bbox_loss.py --benchmark-columns=min,median,max,rounds

B=8, 640 px (A=8400), 80 classes, reg_max 16; ~6 % foreground anchors (50 GT/img x ~10 anchors each,
which is what the assigner gives). One pytest-benchmark group, ref and cpp rows side by side.
"""

from __future__ import annotations

import pytest
import torch

from yolofast.boxes import make_anchors

B, IMGSZ, C, REG_MAX, FG_FRAC = 8, 640, 80, 16, 0.06
GROUP = "bbox_loss fwd+bwd B8 640px C80"
# No DESIGN goal for this op alone (the loss step has one); a regression below 1x would still be news.
GOALS = [(GROUP, "cpp", "ref", 1.0, "fused bbox_loss faster than its reference")]


def make_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    feats = [torch.empty(1, 1, IMGSZ // s, IMGSZ // s) for s in (8, 16, 32)]
    anc, _ = make_anchors(feats, (8, 16, 32))
    A = anc.shape[0]
    pred_dist = torch.randn(B, A, 4 * REG_MAX, generator=g) * 2.5
    pred_scores = torch.randn(B, A, C, generator=g) * 2.0 - 4.0
    centre = anc + (torch.rand(B, A, 2, generator=g) - 0.5) * 2
    wh = torch.rand(B, A, 2, generator=g) * 12 + 1
    target_bboxes = torch.cat((centre - wh / 2, centre + wh / 2), -1)
    fg = torch.rand(B, A, generator=g) < FG_FRAC
    label = torch.randint(0, C, (B, A), generator=g)
    score = torch.rand(B, A, generator=g) * fg
    target_scores = torch.zeros(B, A, C).scatter_(-1, label[..., None], score[..., None])
    return pred_dist, pred_scores, anc, target_bboxes, target_scores, fg


def get_impl(impl: str):
    if impl == "ref":
        from yolofast.ops.reference import bbox_loss_ref

        return bbox_loss_ref
    from yolofast.ops import _build

    ok, why = _build.extension_status("cpp")
    if not ok:
        pytest.skip(f"C++ extension unavailable: {why}")
    from yolofast.ops import _backend

    return _backend.implementation("bbox_loss", "cpp")


@pytest.mark.parametrize("impl", ["ref", "cpp"])
def test_bbox_loss_fwd_bwd(measure, impl):
    fn = get_impl(impl)
    pd, ps, *rest = make_inputs()
    pd.requires_grad_()
    ps.requires_grad_()
    gains = torch.tensor([7.5, 0.5, 1.5])

    def step():
        pd.grad = ps.grad = None
        (fn(pd, ps, *rest) * gains).sum().backward()

    measure(step, group=GROUP, variant=impl, rounds=10 if impl == "ref" else 30, warmup_rounds=2)
