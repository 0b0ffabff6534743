"""bbox_loss for reg_max 1 (YOLO26: raw distances, CIoU + L1 + BCE, YOLO11_YOLO26.md §4.2) on the (B, A, .)
kernels: the CUDA one (``bbox_loss.l1``, on a GPU or the CPU emulation: the ``impl`` fixture) and the Triton
one (the interpreter or a GPU), against reference.bbox_loss_ref(..., stride_tensor, img_hw): the three losses
and both gradients, on random inputs and edge cases (empty images, no positives, tiny boxes, negative target
distances, NaN background boxes, float64, bf16 inputs). The C++ kernel's reg_max 1 path (the maps read in
place) is tested in test_bbox_loss_l1.py, the CUDA and Triton maps kernels in test_bbox_loss_l1_maps.py."""

from __future__ import annotations

import pytest
import torch
from op_inputs import TRITON_DEV, losses_and_grads, needs_triton

from yolofast.boxes import make_anchors
from yolofast.ops import bbox_loss as public_bbox_loss
from yolofast.ops import bbox_loss_maps
from yolofast.ops._backend import backend
from yolofast.ops.bbox_loss import maps_to_rows
from yolofast.ops.reference import bbox_loss_ref

STRIDES = (8.0, 16.0, 32.0)


def l1_inputs(B, C, hw, seed, fg_frac=0.3, dtype=torch.float32, tiny=False):
    """(pred_dist (B, A, 4) raw distances, pred_scores, anchors, target boxes (grid units; some anchors
    outside their box: negative target distances), target scores, fg_mask, stride_tensor (A, 1), hw) of an
    H x W batch image; NaN boxes on the background (never read). tiny: boxes of 0.01-0.1 grid units."""
    g = torch.Generator().manual_seed(seed)
    H, W = hw
    feats = [torch.empty(1, 1, int(H // s), int(W // s)) for s in STRIDES]
    anc, stride = make_anchors(feats, STRIDES)
    A = anc.shape[0]
    pd = torch.rand(B, A, 4, generator=g) * 6 - 0.5  # a few negative raw distances too
    ps = torch.randn(B, A, C, generator=g) * 2.0 - 3.0
    centre = anc + (torch.rand(B, A, 2, generator=g) - 0.5) * 4  # up to 2 cells off: outside small boxes
    wh = torch.rand(B, A, 2, generator=g) * (0.09 if tiny else 8) + 0.01
    tb = torch.cat((centre - wh / 2, centre + wh / 2), -1)
    fg = torch.rand(B, A, generator=g) < fg_frac
    tb = torch.where(fg[..., None], tb, torch.full_like(tb, float("nan")))
    label = torch.randint(0, C, (B, A), generator=g)
    score = torch.rand(B, A, generator=g) * fg
    ts = torch.zeros(B, A, C).scatter_(-1, label[..., None], score[..., None])
    cast = [t.to(dtype) for t in (pd, ps, anc, tb, ts)]
    return [*cast, fg, stride.to(dtype), hw]


def check(fn, args, rtol=1e-5):
    """fn's losses to rtol and gradients elementwise to rtol with a floor of rtol x the largest entry."""
    got = losses_and_grads(fn, args)
    want = losses_and_grads(bbox_loss_ref, args)
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=0)
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.isfinite(a).all()
        scale = float(b.abs().max()) if b.numel() else 0.0
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * scale + 1e-30)
    return got


def _cases():
    """(name, args): random scenes, edge cases."""
    yield "random", l1_inputs(2, 7, (64.0, 96.0), 0)
    yield "random_wide", l1_inputs(1, 80, (96.0, 160.0), 1, fg_frac=0.2)
    yield "one_class", l1_inputs(3, 1, (64.0, 64.0), 2, fg_frac=0.5)
    yield "tiny_boxes", l1_inputs(2, 5, (64.0, 64.0), 3, fg_frac=0.6, tiny=True)
    no_fg = l1_inputs(2, 4, (64.0, 64.0), 4, fg_frac=0.0)
    yield "no_positives", no_fg
    empty = l1_inputs(2, 6, (64.0, 64.0), 5, fg_frac=0.4)
    empty[5][0] = False  # image 0 has no GT: no foreground, no targets
    empty[4][0] = 0
    yield "empty_image", empty
    allfg = l1_inputs(1, 3, (64.0, 64.0), 6, fg_frac=1.0)
    yield "all_foreground", allfg
    yield "empty_batch", l1_inputs(0, 3, (64.0, 64.0), 18)  # no rows at all: S = 1, every loss 0


CASES = dict(_cases())


def test_cases_exercise_what_they_claim():
    for name in ("random", "tiny_boxes", "empty_image"):
        pd, _, anc, tb, _, fg, _, _ = CASES[name]
        t = torch.cat((anc - tb[..., :2], tb[..., 2:] - anc), -1)
        assert bool((t[fg] < 0).any()), name  # negative target distances (anchors outside their box)
    assert not CASES["no_positives"][5].any() and not CASES["empty_image"][5][0].any()
    assert CASES["empty_image"][5][1].any()


# --------------------------------------------------------------------- CUDA (a GPU or the CPU emulation)
@pytest.fixture(scope="module")
def cuda_impl(impl):
    if impl.name == "cpp":
        pytest.skip("the C++ kernel serves reg_max 1 through bbox_loss_maps (test_bbox_loss_l1.py)")
    return impl


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_matches_reference(cuda_impl, case):
    got = check(cuda_impl.loss_l1, cuda_impl.to(CASES[case]))
    if case == "no_positives":
        assert got[0][0] == 0 and got[0][2] == 0 and torch.count_nonzero(got[1]) == 0


def test_cuda_float64_tight(cuda_impl):
    check(cuda_impl.loss_l1, cuda_impl.to(l1_inputs(2, 5, (64.0, 96.0), 7, fg_frac=0.6, dtype=torch.float64)),
          rtol=1e-12)


def test_cuda_low_precision_inputs_compute_in_float32(cuda_impl):
    pd, ps, *rest = l1_inputs(2, 6, (64.0, 64.0), 8)
    args = cuda_impl.to((pd.bfloat16(), ps.bfloat16(), *rest))
    got = losses_and_grads(cuda_impl.loss_l1, args)
    want = losses_and_grads(bbox_loss_ref, args)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)


def test_cuda_every_output_written_and_deterministic(cuda_impl, monkeypatch):
    *six, stride, hw = cuda_impl.to(l1_inputs(3, 13, (64.0, 96.0), 9))
    raw = cuda_impl.ops.bbox_loss.l1
    clean = raw(*six, stride, *hw)
    monkeypatch.setenv("YOLOFAST_POISON_OUTPUTS", "1")
    poisoned = raw(*six, stride, *hw)
    for a, b in zip(clean, poisoned):
        assert torch.isfinite(b).all() and torch.equal(a, b)  # bitwise: no float atomics


def test_cuda_bad_shapes_raise_clear_errors(cuda_impl):
    pd, ps, anc, tb, ts, fg, stride, hw = cuda_impl.to(l1_inputs(1, 3, (64.0, 64.0), 10))
    raw = cuda_impl.ops.bbox_loss.l1
    with pytest.raises(RuntimeError, match="stride_tensor"):
        raw(pd, ps, anc, tb, ts, fg, stride[:-1], *hw)
    with pytest.raises(RuntimeError, match=r"\(B, A, 4\)"):
        raw(pd.repeat(1, 1, 2), ps, anc, tb, ts, fg, stride, *hw)
    with pytest.raises(RuntimeError, match="anchor_points"):
        raw(pd, ps, anc[:-1], tb, ts, fg, stride, *hw)


def l1_maps(B, C, hw, seed, device):
    """(feats, anchors, target boxes, target scores, fg) of reg_max 1 maps, for the public maps form."""
    pd, ps, anc, tb, ts, fg, stride, _ = l1_inputs(B, C, hw, seed)
    H, W = hw
    feats, a0 = [], 0
    for s in STRIDES:
        h, w = int(H // s), int(W // s)
        rows = torch.cat((pd, ps), -1)[:, a0 : a0 + h * w]
        feats.append(rows.transpose(1, 2).reshape(B, 4 + C, h, w).contiguous().to(device))
        a0 += h * w
    return feats, *(t.to(device) for t in (anc, tb, ts, fg, stride))


def check_public_maps(name, device, spy_module, spy_attr, monkeypatch):
    """bbox_loss_maps of reg_max 1 maps under backend ``name``: routed to its maps kernel (the spy records
    the reg_max of each call) and equal to the reference on the cat-ed maps."""
    calls = []
    real = getattr(spy_module, spy_attr)

    def spy(*a, **k):
        calls.append(a[5])
        return real(*a, **k)

    monkeypatch.setattr(spy_module, spy_attr, spy)
    hw = (64.0, 96.0)
    feats, anc, tb, ts, fg, stride = l1_maps(2, 5, hw, 14, device)
    fs = [f.detach().clone().requires_grad_() for f in feats]
    with backend(name):
        out = bbox_loss_maps(fs, anc, tb, ts, fg, 1, strides=STRIDES)
    grads = torch.autograd.grad((out * torch.tensor([0.7, 1.3, -0.4], device=device)).sum(), fs)
    assert calls == [1], "reg_max 1 maps did not reach the maps kernel"
    rs = [f.detach().clone().requires_grad_() for f in feats]
    pd, ps = maps_to_rows(rs, 1)
    want = bbox_loss_ref(pd, ps, anc, tb, ts, fg, stride, hw)
    rgrads = torch.autograd.grad((want * torch.tensor([0.7, 1.3, -0.4], device=device)).sum(), rs)
    torch.testing.assert_close(out.detach(), want.detach(), rtol=1e-5, atol=0)
    for a, b in zip(grads, rgrads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_public_maps_route_to_the_cuda_kernel(monkeypatch):
    from yolofast.ops import _library

    check_public_maps("cuda", "cuda", _library, "bbox_loss_maps", monkeypatch)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_opcheck_and_graph_capture():
    *six, stride, hw = [a.cuda() if torch.is_tensor(a) else a for a in l1_inputs(2, 5, (64.0, 64.0), 15)]
    op = torch.ops.yolofast.bbox_loss.l1
    six[0].requires_grad_()
    torch.library.opcheck(op.default, (*six, stride, *hw))
    six[0] = six[0].detach()
    eager = op(*six, stride, *hw)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(*six, stride, *hw)  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = op(*six, stride, *hw)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, eager):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- Triton (interpreter or GPU)
try:
    from yolofast.kernels import _common
    from yolofast.kernels.bbox_loss import bbox_loss as triton_bbox_loss
except ImportError as e:
    NO_TRITON = f"triton is not importable: {e}"
else:
    NO_TRITON = ""


def _dev(args):
    return [a.to(TRITON_DEV) if isinstance(a, torch.Tensor) else a for a in args]


class TestTritonL1:
    """The Triton bbox_loss for reg_max 1 (kernels/bbox_loss.py) against the reference."""

    pytestmark = needs_triton(NO_TRITON)

    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_reference(self, case):
        got = check(triton_bbox_loss, _dev(CASES[case]))
        if case == "no_positives":
            assert got[0][0] == 0 and got[0][2] == 0 and torch.count_nonzero(got[1]) == 0

    def test_float64_tight(self):
        check(triton_bbox_loss, _dev(l1_inputs(2, 5, (64.0, 96.0), 7, fg_frac=0.6, dtype=torch.float64)),
              rtol=1e-11)

    def test_every_output_element_is_written(self, monkeypatch):
        monkeypatch.setattr(_common, "POISON", True)  # outputs start as NaN: an unwritten one would show
        *six, stride, hw = _dev(l1_inputs(2, 9, (64.0, 64.0), 11))
        out = torch.ops.yolofast.bbox_loss_l1_triton(*six, stride, *hw)
        for t in out:
            assert torch.isfinite(t).all()
        torch.testing.assert_close(out[0], bbox_loss_ref(*six, stride, hw), rtol=1e-5, atol=0)

    def test_public_op_dispatches_to_triton(self):
        args = _dev(l1_inputs(2, 5, (64.0, 64.0), 12))
        with backend("triton"):
            a = public_bbox_loss(*args[:6], stride_tensor=args[6], img_hw=args[7])
        torch.testing.assert_close(a, bbox_loss_ref(*args), rtol=1e-5, atol=0)

    def test_public_maps_route_to_the_triton_kernel(self, monkeypatch):
        from yolofast.kernels import _bbox_loss_maps

        check_public_maps("triton", TRITON_DEV, _bbox_loss_maps, "bbox_loss_maps", monkeypatch)

    def test_opcheck(self):
        # fake-tensor and AOT checks trace compiled Triton kernels only (a GPU), as test_bbox_loss.py's
        utils = ("test_schema", "test_autograd_registration") + (
            () if TRITON_DEV == "cpu" else ("test_faketensor", "test_aot_dispatch_dynamic"))
        *six, stride, hw = _dev(l1_inputs(1, 3, (64.0, 64.0), 16))
        six[0].requires_grad_()
        six[1].requires_grad_()
        torch.library.opcheck(torch.ops.yolofast.bbox_loss_l1_triton.default, (*six, stride, *hw),
                              test_utils=utils)

    @pytest.mark.skipif(TRITON_DEV == "cpu", reason="torch.compile traces Triton kernels only when compiled")
    def test_torch_compile_fullgraph_matches_eager(self):
        args = _dev(l1_inputs(2, 5, (64.0, 96.0), 17))
        eager = losses_and_grads(triton_bbox_loss, args)
        compiled = torch.compile(lambda *a: triton_bbox_loss(*a), fullgraph=True)
        got = losses_and_grads(compiled, args)
        for a, b in zip(got, eager):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)

    def test_shape_errors_name_the_argument(self):
        pd, ps, anc, tb, ts, fg, stride, hw = _dev(l1_inputs(1, 3, (64.0, 64.0), 13))
        with pytest.raises(ValueError, match="stride_tensor"):
            triton_bbox_loss(pd, ps, anc, tb, ts, fg, stride[:-1], hw)
        with pytest.raises(ValueError, match="img_hw"):
            triton_bbox_loss(pd, ps, anc, tb, ts, fg, stride)
