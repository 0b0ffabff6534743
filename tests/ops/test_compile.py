"""torch.compile(fullgraph=True) through the compiled ops and the whole DetectionLoss, on CPU."""

from __future__ import annotations

import pytest
import torch

from yolofast.ops import reference
from yolofast.ops._backend import backend


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _loss_inputs(B=2, nc=5, imgsz=64, M=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = [torch.randn(B, 64 + nc, imgsz // s, imgsz // s, generator=g) for s in (8, 16, 32)]
    xy = torch.rand(B, M, 2, generator=g) * 0.6 + 0.2
    wh = torch.rand(B, M, 2, generator=g) * 0.3 + 0.05
    batch = {
        "gt_cls": torch.randint(0, nc, (B, M, 1), generator=g).float(),
        "gt_bboxes": torch.cat((xy, wh), -1),
        "gt_mask": (torch.arange(M)[None, :, None] < torch.tensor([[[M]], [[M - 2]]])[:B]).float(),
    }
    return feats, batch


def test_compiled_op_callables_fullgraph(lib):
    B, A, C = 2, 84, 5
    g = torch.Generator().manual_seed(0)
    args = (
        torch.randn(B, A, 64, generator=g),
        torch.randn(B, A, C, generator=g),
        torch.rand(A, 2, generator=g) * 8,
        torch.rand(B, A, 4, generator=g) * 8,
        torch.rand(B, A, C, generator=g),
        torch.rand(B, A, generator=g) < 0.3,
    )

    def f(pd, ps, *rest):
        return (lib.bbox_loss(pd, ps, *rest) * torch.tensor([7.5, 0.5, 1.5])).sum()

    pd, ps = args[0].clone().requires_grad_(), args[1].clone().requires_grad_()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(pd, ps, *args[2:])
    out.backward()
    pd2, ps2 = args[0].clone().requires_grad_(), args[1].clone().requires_grad_()
    want = (reference.bbox_loss_ref(pd2, ps2, *args[2:]) * torch.tensor([7.5, 0.5, 1.5])).sum()
    want.backward()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(pd.grad, pd2.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ps.grad, ps2.grad, rtol=1e-5, atol=1e-7)

    ema, model = torch.randn(1000), torch.randn(1000)
    want_ema = ema.clone()
    reference.ema_update_ref(want_ema, model, torch.tensor(0.9))
    torch.compile(lib.ema_update, fullgraph=True, backend="aot_eager")(ema, model, torch.tensor(0.9))
    torch.testing.assert_close(ema, want_ema, rtol=1e-6, atol=0)


def _recording_backend(seen: set):
    def backend_fn(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    return backend_fn


@pytest.mark.parametrize("mode", ["cpp", "auto"])
def test_detection_loss_is_one_graph_with_the_kernels(lib, mode):
    """fullgraph=True: no graph break anywhere in the loss, in forced and automatic backend choice, and
    the traced graph calls the compiled ops (not the reference)."""
    try:
        from yolofast.loss import DetectionLoss
    except ImportError as e:
        pytest.skip(f"yolofast.loss not available: {e}")
    if not torch._C._dispatch_has_kernel_for_dispatch_key("yolofast::tal_assign", "CPU"):
        pytest.skip("csrc/cpu/tal_assign_kernel.cpp is not part of this build yet")
    feats, batch = _loss_inputs(nc=5)
    seen: set = set()
    with backend(mode):
        compiled = torch.compile(DetectionLoss(5), fullgraph=True, backend=_recording_backend(seen))
        total_c, _ = compiled(feats, batch)
        total_e, _ = DetectionLoss(5)(feats, batch)
    for op in ("yolofast.tal_assign", "yolofast.bbox_loss"):
        assert any(op in t for t in seen), (op, sorted(seen))
    torch.testing.assert_close(total_c, total_e, rtol=1e-6, atol=0)


@pytest.mark.parametrize("ref_op", ["tal_assign", "bbox_loss"])
def test_per_op_backends_in_one_graph(lib, monkeypatch, ref_op):
    """The wrappers share one assume_constant_result ``backend_name(op, device_type)``: each op's choice
    must be its own in a single traced graph (one op forced to the reference, the other compiled)."""
    from yolofast.loss import DetectionLoss

    if not torch._C._dispatch_has_kernel_for_dispatch_key("yolofast::tal_assign", "CPU"):
        pytest.skip("csrc/cpu/tal_assign_kernel.cpp is not part of this build yet")
    other = {"tal_assign": "bbox_loss", "bbox_loss": "tal_assign"}[ref_op]
    monkeypatch.setenv(f"YOLOFAST_BACKEND_{ref_op.upper()}", "ref")
    monkeypatch.setenv(f"YOLOFAST_BACKEND_{other.upper()}", "cpp")
    feats, batch = _loss_inputs(nc=5)
    seen: set = set()
    compiled = torch.compile(DetectionLoss(5), fullgraph=True, backend=_recording_backend(seen))
    total_c, _ = compiled(feats, batch)
    assert any(f"yolofast.{other}" in t for t in seen), sorted(seen)
    assert not any(f"yolofast.{ref_op}" in t for t in seen), sorted(seen)
    total_e, _ = DetectionLoss(5)(feats, batch)
    torch.testing.assert_close(total_c, total_e, rtol=1e-6, atol=0)


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_detection_loss_fullgraph_equals_eager(lib, compile_backend):
    try:
        from yolofast.loss import DetectionLoss
    except ImportError as e:
        pytest.skip(f"yolofast.loss not available: {e}")
    if not torch._C._dispatch_has_kernel_for_dispatch_key("yolofast::tal_assign", "CPU"):
        pytest.skip("csrc/cpu/tal_assign_kernel.cpp is not part of this build yet")
    nc = 5
    feats, batch = _loss_inputs(nc=nc)
    loss_fn = DetectionLoss(nc)
    with backend("cpp"):
        f_eager = [f.clone().requires_grad_() for f in feats]
        total_e, items_e = loss_fn(f_eager, batch)
        total_e.backward()
        f_comp = [f.clone().requires_grad_() for f in feats]
        compiled = torch.compile(loss_fn, fullgraph=True, backend=compile_backend)
        total_c, items_c = compiled(f_comp, batch)
        total_c.backward()
    assert items_e[0] > 0  # some foreground: the box/DFL paths are exercised
    torch.testing.assert_close(total_c, total_e, rtol=1e-5, atol=0)
    torch.testing.assert_close(items_c, items_e, rtol=1e-5, atol=0)
    for a, b in zip(f_comp, f_eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
