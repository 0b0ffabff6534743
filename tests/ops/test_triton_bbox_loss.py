"""Triton bbox_loss vs reference.bbox_loss_ref: values, gradients (vs its autograd), edge cases."""

import pytest
import torch

triton = pytest.importorskip("triton")

from yolofast.boxes import make_anchors  # noqa: E402
from yolofast.kernels import _common, triton_status  # noqa: E402
from yolofast.kernels.bbox_loss import bbox_loss  # noqa: E402
from yolofast.ops import backend  # noqa: E402
from yolofast.ops import bbox_loss as public_bbox_loss  # noqa: E402
from yolofast.ops.reference import bbox_loss_ref  # noqa: E402

pytestmark = pytest.mark.triton
DEV = "cpu" if _common.INTERPRET else "cuda"
if DEV == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

R = 16
# distinct weights per loss term, so a gradient routed to the wrong term shows
GAINS = torch.tensor([7.5, 0.5, 1.5])


def make_inputs(seed, B=2, img=160, C=20, fg_frac=0.3, dtype=torch.float32):
    """Random logits; targets in grid units near each anchor (A = 525 anchors at 160 px)."""
    g = torch.Generator().manual_seed(seed)
    feats = [torch.zeros(1, 1, img // s, img // s) for s in (8, 16, 32)]
    anc, _ = make_anchors(feats, [8, 16, 32])
    A = anc.shape[0]
    pred_dist = torch.randn(B, A, 4 * R, generator=g) * 2
    pred_scores = torch.randn(B, A, C, generator=g) * 2
    fg = torch.rand(B, A, generator=g) < fg_frac
    ctr = anc + torch.randn(B, A, 2, generator=g)
    wh = torch.rand(B, A, 2, generator=g) * 12 + 0.3  # some sides beyond reg_max - 1: clamped DFL targets
    tb = torch.cat((ctr - wh / 2, ctr + wh / 2), -1)
    ts = torch.rand(B, A, C, generator=g) * fg[..., None] * (torch.rand(B, A, C, generator=g) < 0.2)
    cast = [t.to(dtype) for t in (pred_dist, pred_scores, anc, tb, ts)]
    return [t.to(DEV) for t in cast] + [fg.to(DEV)]


def run_both(inputs, gains=GAINS):
    """(value, grad_dist, grad_scores) of the Triton op and of the reference, for sum(gains * losses)."""
    results = []
    for fn in (bbox_loss, bbox_loss_ref):
        pd = inputs[0].detach().clone().requires_grad_()
        ps = inputs[1].detach().clone().requires_grad_()
        out = fn(pd, ps, *inputs[2:])
        (out * gains.to(out)).sum().backward()
        results.append((out.detach(), pd.grad, ps.grad))
    return results


def assert_grads_close(got, ref, rel):
    for g, r in zip(got, ref):
        scale = r.abs().max().clamp(min=1e-30)
        assert g.dtype == r.dtype and g.shape == r.shape
        assert torch.isfinite(g).all()
        assert ((g.double() - r.double()).abs().max() / scale).item() < rel


def test_status_reports_available():
    ok, why = triton_status("bbox_loss")
    assert ok, why


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_float32(seed):
    (out, gd, gs), (ref, rd, rs) = run_both(make_inputs(seed))
    assert out.dtype == torch.float32 and out.shape == (3,)
    assert (ref[0] > 0) and (ref[2] > 0)  # the inputs exercise the box and DFL terms
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
    assert_grads_close((gd, gs), (rd, rs), rel=1e-5)


def test_matches_reference_float64_tightly():
    (out, gd, gs), (ref, rd, rs) = run_both(make_inputs(3, dtype=torch.float64))
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)
    assert_grads_close((gd, gs), (rd, rs), rel=1e-11)


def test_dfl_targets_on_bin_edges():
    # targets at whole-bin distances (wl = 1, wr = 0), at 0 and past the last bin (clamped to 14.99)
    inputs = make_inputs(4, fg_frac=1.0)
    anc = inputs[2]
    dists = torch.tensor([0.0, 3.0, 14.0, 15.0, 20.0, 7.0, 1.0, 2.0], device=DEV)
    B, A = inputs[5].shape
    d = dists[torch.arange(B * A * 4, device=DEV) % len(dists)].view(B, A, 4)
    inputs[3] = torch.cat((anc - d[..., :2], anc + d[..., 2:]), -1)
    (out, gd, gs), (ref, rd, rs) = run_both(inputs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
    assert_grads_close((gd, gs), (rd, rs), rel=1e-5)


def test_no_foreground():
    inputs = make_inputs(5, fg_frac=0.0)
    assert inputs[4].sum() == 0  # S = max(0, 1) = 1
    (out, gd, gs), (ref, rd, rs) = run_both(inputs)
    assert out[0] == 0 and out[2] == 0 and out[1] > 0
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
    assert torch.count_nonzero(gd) == 0
    assert_grads_close((gs,), (rs,), rel=1e-5)


def test_background_boxes_are_never_read():
    inputs = make_inputs(6)
    fg = inputs[5]
    inputs[3] = torch.where(fg[..., None], inputs[3], float("nan"))
    (out, gd, gs), (ref, rd, rs) = run_both(inputs)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
    assert_grads_close((gd, gs), (rd, rs), rel=1e-5)


def test_low_precision_inputs_compute_in_float32():
    inputs = make_inputs(7, dtype=torch.bfloat16)
    inputs[5] = inputs[5].clone()
    (out, gd, gs), (ref, rd, rs) = run_both(inputs)
    assert out.dtype == torch.float32 and gd.dtype == torch.bfloat16 and gs.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
    assert_grads_close((gd, gs), (rd, rs), rel=1e-2)  # the gradients are rounded to bf16 at the end


def test_every_output_element_is_written(monkeypatch):
    monkeypatch.setattr(_common, "POISON", True)  # outputs start as NaN: an unwritten element would show
    inputs = make_inputs(8)
    losses, gd_box, gd_dfl, gs, inv_s = torch.ops.yolofast.bbox_loss_triton(*inputs)
    for t in (losses, gd_box, gd_dfl, gs, inv_s):
        assert torch.isfinite(t).all()
    ref = bbox_loss_ref(*inputs)
    torch.testing.assert_close(losses, ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(inv_s, 1 / inputs[4].sum().clamp(min=1), rtol=1e-6, atol=0)


def test_public_op_dispatches_to_triton_and_is_deterministic():
    inputs = make_inputs(9)
    with backend("triton"):
        a = public_bbox_loss(*inputs)
        b = public_bbox_loss(*inputs)
    assert torch.equal(a, b)
    torch.testing.assert_close(a, bbox_loss_ref(*inputs), rtol=1e-5, atol=0)


def test_shape_errors_name_the_argument():
    inputs = make_inputs(10)
    with pytest.raises(ValueError, match="target_scores"):
        bbox_loss(*inputs[:4], inputs[4][:, :-1], inputs[5])


# the fake-tensor and AOT checks trace the kernels through torch.library.wrap_triton, which needs real
# (compiled) Triton kernels: on the interpreter only the eager checks apply
OPCHECK_UTILS = ("test_schema", "test_autograd_registration") + (
    () if DEV == "cpu" else ("test_faketensor", "test_aot_dispatch_dynamic")
)


def test_opcheck():
    inputs = make_inputs(11, B=1, img=64, C=3)
    inputs[0].requires_grad_()
    inputs[1].requires_grad_()
    torch.library.opcheck(
        torch.ops.yolofast.bbox_loss_triton.default, tuple(inputs), test_utils=OPCHECK_UTILS
    )


@pytest.mark.skipif(
    DEV == "cpu", reason="torch.compile traces Triton kernels only when they are compiled (CUDA)"
)
def test_torch_compile_fullgraph_matches_eager():
    inputs = make_inputs(12)

    def loss_and_grads(pd, ps, *rest):
        pd, ps = pd.detach().requires_grad_(), ps.detach().requires_grad_()
        out = bbox_loss(pd, ps, *rest)
        (out * GAINS.to(out)).sum().backward()
        return out.detach(), pd.grad, ps.grad

    eager = loss_and_grads(*inputs)
    compiled = torch.compile(lambda *a: bbox_loss(*a), fullgraph=True)
    pd, ps = inputs[0].detach().requires_grad_(), inputs[1].detach().requires_grad_()
    out = compiled(pd, ps, *inputs[2:])
    (out * GAINS.to(out)).sum().backward()
    torch.testing.assert_close(out.detach(), eager[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(pd.grad, eager[1], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(ps.grad, eager[2], rtol=1e-6, atol=1e-9)
