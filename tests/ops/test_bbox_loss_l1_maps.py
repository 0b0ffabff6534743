"""bbox_loss_maps for reg_max 1 (YOLO26: CIoU + L1 + BCE, YOLO11_YOLO26.md §4.2) on the CUDA and Triton
backends, which read the head's maps in place: the CUDA op ``yolofast::bbox_loss_maps`` (csrc/cuda, on a GPU
or the CPU emulation) and the Triton op ``bbox_loss_maps_triton`` (kernels/_bbox_loss_maps.py, the
interpreter or a GPU), against reference.bbox_loss_ref on the maps cat into (B, A, .) rows: losses and every
map's gradient, on random scenes and edge cases (no foreground, all foreground, an empty image, odd map
sizes, one level, per-anchor targets, channels_last / channel-sliced / cropped maps, float64, bf16), and that
neither the forward nor the backward cats the maps."""

from __future__ import annotations

import pytest
import torch
from op_inputs import TRITON_DEV, needs_triton

from yolofast.boxes import make_anchors
from yolofast.ops import bbox_loss_maps, reference
from yolofast.ops._backend import backend, implementation
from yolofast.ops.bbox_loss import dense_target_scores, maps_to_rows

UPSTREAM = (0.7, 1.3, -0.4)
STRIDES = (8.0, 16.0, 32.0)


def scene(B, C, sizes, seed, fg_frac=0.3, dtype=torch.float32):
    """Random reg_max 1 maps (B, 4 + C, h, w) of the given sizes (level l has stride STRIDES[l]; the image is
    sizes[0] x 8), targets in grid units with some anchors outside their box and NaN background boxes.
    Returns a dict: feats, anc, stride (A, 1), tb, ts (B, A, C), score and label (B, A), fg, hw, l1_scale."""
    g = torch.Generator().manual_seed(seed)
    feats = []
    for h, w in sizes:
        dist = torch.rand(B, 4, h, w, generator=g) * 6 - 0.5  # raw distances, a few negative
        cls = torch.randn(B, C, h, w, generator=g) * 2.0 - 3.0
        feats.append(torch.cat((dist, cls), 1).to(dtype))
    strides = STRIDES[: len(sizes)]
    anc, stride = make_anchors(feats, strides)
    A = anc.shape[0]
    centre = anc + (torch.rand(B, A, 2, generator=g) - 0.5) * 4
    wh = torch.rand(B, A, 2, generator=g) * 8 + 0.1
    tb = torch.cat((centre - wh / 2, centre + wh / 2), -1)
    fg = torch.rand(B, A, generator=g) < fg_frac
    tb = torch.where(fg[..., None], tb, torch.full_like(tb, float("nan")))  # never read
    label = torch.randint(0, C, (B, A), generator=g)
    score = torch.rand(B, A, generator=g) * fg
    ts = torch.zeros(B, A, C).scatter_(-1, label[..., None], score[..., None])
    hw = (sizes[0][0] * 8.0, sizes[0][1] * 8.0)
    return {"feats": feats, "anc": anc.to(dtype), "stride": stride.to(dtype), "tb": tb.to(dtype),
            "ts": ts.to(dtype), "score": score.to(dtype), "label": label, "fg": fg, "hw": hw,
            "l1_scale": (*strides, *hw)}


def _cases():
    yield "random", scene(2, 7, [(8, 12), (4, 6), (2, 3)], 0)
    yield "odd_sizes", scene(3, 5, [(7, 5), (4, 3), (2, 1)], 1, fg_frac=0.5)
    yield "one_level", scene(2, 3, [(5, 9)], 2, fg_frac=0.4)
    yield "many_classes", scene(1, 80, [(6, 4), (3, 2), (2, 1)], 3, fg_frac=0.2)
    yield "no_foreground", scene(2, 4, [(6, 6), (3, 3), (2, 2)], 4, fg_frac=0.0)
    yield "all_foreground", scene(1, 3, [(4, 4), (2, 2), (1, 1)], 5, fg_frac=1.0)
    empty = scene(2, 6, [(6, 8), (3, 4), (2, 2)], 6, fg_frac=0.5)
    for k in ("fg", "ts", "score"):
        empty[k][0] = 0  # image 0 has no GT: no foreground, no targets
    yield "empty_image", empty


CASES = dict(_cases())


def test_cases_exercise_what_they_claim():
    for name in ("random", "odd_sizes", "all_foreground"):
        sc = CASES[name]
        t = torch.cat((sc["anc"] - sc["tb"][..., :2], sc["tb"][..., 2:] - sc["anc"]), -1)
        assert bool((t[sc["fg"]] < 0).any()), name  # negative target distances
    assert not CASES["no_foreground"]["fg"].any() and CASES["all_foreground"]["fg"].all()
    assert not CASES["empty_image"]["fg"][0].any() and CASES["empty_image"]["fg"][1].any()


def run_ref(sc, feats=None):
    fs = [f.detach().clone().requires_grad_() for f in (feats or sc["feats"])]
    pd, ps = maps_to_rows(fs, 1)
    out = reference.bbox_loss_ref(pd, ps, sc["anc"], sc["tb"], sc["ts"], sc["fg"], sc["stride"], sc["hw"])
    up = torch.tensor(UPSTREAM, dtype=out.dtype)
    return out.detach(), torch.autograd.grad((out * up).sum(), fs)


def run(fn, sc, device, per_anchor=False, feats=None, prepare=None):
    """fn(feats, anc, tb, ts, fg, labels, l1_scale) -> losses; its losses and map gradients on device (back
    on the CPU). prepare(feats) makes the maps fn gets (a layout) from leaves of the scene's maps."""
    leaves = [f.detach().clone().to(device).requires_grad_() for f in (feats or sc["feats"])]
    fs = prepare(leaves) if prepare else leaves
    ts, lab = (sc["score"], sc["label"]) if per_anchor else (sc["ts"], None)
    to = (lambda t: None if t is None else t.to(device))  # noqa: E731
    out = fn(fs, to(sc["anc"]), to(sc["tb"]), to(ts), to(sc["fg"]), to(lab), sc["l1_scale"])
    up = torch.tensor(UPSTREAM, dtype=out.dtype, device=out.device)
    grads = torch.autograd.grad((out * up).sum(), leaves)
    return out.detach().cpu(), [g.cpu() for g in grads]


def assert_close_to_ref(got, want, rtol=1e-5):
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=0)
    for a, b in zip(got[1], want[1]):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()) + 1e-30)


LAYOUTS = {
    "channels_last": lambda fs: [f.to(memory_format=torch.channels_last) for f in fs],
    # a channel slice of a larger map: pixels contiguous, read in place with its strides
    "channel_slice": lambda fs: [torch.cat((f[:, :2] * 0, f), 1)[:, 2:] for f in fs],
    # a crop: rows not contiguous, copied once
    "crop": lambda fs: [torch.nn.functional.pad(f, (1, 2, 0, 1))[:, :, :-1, 1:-2] for f in fs],
}


class Backend:
    """Shared tests of one backend's maps op (a subclass sets ``fn``, ``device``, ``tight``)."""

    device = "cpu"
    tight = 1e-12

    def fn(self, feats, anc, tb, ts, fg, lab, l1_scale):
        raise NotImplementedError

    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_reference(self, case):
        sc = CASES[case]
        got = run(self.fn, sc, self.device)
        assert_close_to_ref(got, run_ref(sc))
        if case == "no_foreground":
            assert got[0][0] == 0 and got[0][2] == 0
            assert all(torch.count_nonzero(g[:, :4]) == 0 for g in got[1])

    @pytest.mark.parametrize("case", ["random", "odd_sizes", "empty_image"])
    def test_per_anchor_targets(self, case):
        sc = CASES[case]
        assert_close_to_ref(run(self.fn, sc, self.device, per_anchor=True), run_ref(sc))

    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_strided_maps(self, layout):
        sc = CASES["odd_sizes"]
        assert_close_to_ref(run(self.fn, sc, self.device, prepare=LAYOUTS[layout]), run_ref(sc))

    def test_float64_tight(self):
        sc = scene(2, 5, [(6, 5), (3, 3), (2, 2)], 7, fg_frac=0.6, dtype=torch.float64)
        assert_close_to_ref(run(self.fn, sc, self.device), run_ref(sc), rtol=self.tight)

    def test_bf16_maps_compute_in_float32(self):
        sc = CASES["random"]
        bf = [f.bfloat16() for f in sc["feats"]]
        got = run(self.fn, sc, self.device, feats=bf)
        want = run_ref(sc, feats=bf)
        assert got[0].dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in got[1])
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)

    def test_no_cat_in_forward_or_backward(self, monkeypatch):
        sc = CASES["random"]
        leaves = [f.detach().clone().to(self.device).requires_grad_() for f in sc["feats"]]
        args = [sc[k].to(self.device) for k in ("anc", "tb", "ts", "fg")]
        real = torch.cat
        calls = []

        def spy(*a, **k):
            calls.append(tuple(t.shape for t in a[0]))
            return real(*a, **k)

        monkeypatch.setattr(torch, "cat", spy)
        out = self.fn(leaves, *args, None, sc["l1_scale"])
        torch.autograd.grad(out.sum(), leaves)
        monkeypatch.setattr(torch, "cat", real)
        assert calls == [], f"torch.cat called on {calls}"


# --------------------------------------------------------------------- CUDA (a GPU or the CPU emulation)
class _EmuMaps(torch.autograd.Function):
    """Autograd of the emulated op: _bbox_loss_grad.maps_backward's rule (no weights on CUDA)."""

    @staticmethod
    def forward(ctx, anc, tb, ts, fg, lab, l1_scale, *feats):
        ops = torch.ops.yolofast_cuda_emu
        losses, gcls, rows, index, inv_s = ops.bbox_loss_maps(
            list(feats), anc, tb, ts, fg, 1, True, lab, None, l1_scale)
        ctx.save_for_backward(inv_s, rows, index, *gcls)
        ctx.dtypes = [f.dtype for f in feats]
        return losses

    @staticmethod
    def backward(ctx, g):
        inv_s, rows, index, *gcls = ctx.saved_tensors
        c = g.to(inv_s.dtype) * inv_s
        grads = torch.ops.yolofast_cuda_emu._bbox_loss_maps_scale(gcls, rows, index, c, 1)
        return (None,) * 6 + tuple(gr.to(dt) for gr, dt in zip(grads, ctx.dtypes))


class TestCuda(Backend):
    """yolofast::bbox_loss_maps's CUDA kernel (reg_max 1) and its backward _bbox_loss_maps_scale."""

    @pytest.fixture(autouse=True)
    def _impl(self, impl):
        if impl.name == "cpp":
            pytest.skip("the C++ maps kernel: test_bbox_loss_l1.py")
        self.impl = impl
        self.device = impl.device

    def fn(self, feats, anc, tb, ts, fg, lab, l1_scale):
        scale = torch.tensor(l1_scale, dtype=torch.float64)
        if self.impl.name == "emu":
            return _EmuMaps.apply(anc, tb, ts, fg, lab, scale, *feats)
        return torch.ops.yolofast.bbox_loss_maps(feats, anc, tb, ts, fg, 1, True, lab, None, scale)[0]

    def test_static_rows_and_every_output_written(self, monkeypatch):
        sc = CASES["odd_sizes"]
        ops = self.impl.ops
        fs = [f.to(self.device) for f in sc["feats"]]
        args = [sc[k].to(self.device) for k in ("anc", "tb", "ts", "fg")]
        scale = torch.tensor(sc["l1_scale"], dtype=torch.float64)
        clean = ops.bbox_loss_maps(fs, *args, 1, True, None, None, scale)
        monkeypatch.setenv("YOLOFAST_POISON_OUTPUTS", "1")
        poisoned = ops.bbox_loss_maps(fs, *args, 1, True, None, None, scale)
        B, A = sc["fg"].shape
        assert poisoned[2].shape == (B * A, 2, 4) and torch.equal(poisoned[3].cpu(), torch.arange(B * A))
        flat = lambda o: [o[0], *o[1], *o[2:]]  # noqa: E731
        for a, b in zip(flat(clean), flat(poisoned)):
            assert torch.isfinite(b).all() and torch.equal(a, b)  # bitwise: no float atomics
        c = torch.tensor([0.3, -1.1, 2.0], device=self.device)
        g1 = ops._bbox_loss_maps_scale(clean[1], clean[2], clean[3], c, 1)
        # the same rows compacted to the foreground: the scatter path gives the same gradients
        keep = sc["fg"].reshape(-1).to(self.device)
        g2 = ops._bbox_loss_maps_scale(clean[1], clean[2][keep], clean[3][keep], c, 1)
        for a, b in zip(g1, g2):
            assert torch.isfinite(b).all() and torch.equal(a, b)

    def test_bad_inputs_raise_clear_errors(self):
        sc = CASES["random"]
        ops = self.impl.ops
        fs = [f.to(self.device) for f in sc["feats"]]
        args = [sc[k].to(self.device) for k in ("anc", "tb", "ts", "fg")]
        scale = torch.tensor(sc["l1_scale"], dtype=torch.float64)
        with pytest.raises(RuntimeError, match="l1_scale"):
            ops.bbox_loss_maps(fs, *args, 1, True, None, None, scale[:-1])
        with pytest.raises(RuntimeError, match="reg_max 1"):
            ops.bbox_loss_maps(fs, *args, 2, True, None, None, scale)
        with pytest.raises(RuntimeError, match="weights"):
            ops.bbox_loss_maps(fs, *args, 1, True, None, torch.ones(3), scale)
        with pytest.raises(RuntimeError, match="anchor_points"):
            ops.bbox_loss_maps(fs, args[0][:-1], *args[1:], 1, True, None, None, scale)


def test_cuda_maps_form_is_chosen_for_reg_max_1_only():
    from yolofast.ops import _composed, _library

    assert implementation("bbox_loss.maps", "cuda", 1) is _library.bbox_loss_maps
    dfl = implementation("bbox_loss.maps", "cuda", 16)
    assert dfl.func is _composed.bbox_loss_maps  # DFL maps: one cat per map, then the (B, A, .) kernel


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_public_maps_route_to_the_cuda_maps_kernel_and_capture():
    sc = CASES["random"]
    got = run(lambda fs, anc, tb, ts, fg, lab, _: _public("cuda", fs, anc, tb, ts, fg, lab), sc, "cuda",
              per_anchor=True)
    assert_close_to_ref(got, run_ref(sc))
    fs = [f.cuda() for f in sc["feats"]]
    args = [sc[k].cuda() for k in ("anc", "tb", "ts", "fg")]
    scale = torch.tensor(sc["l1_scale"], dtype=torch.float64)
    op = torch.ops.yolofast.bbox_loss_maps
    eager = op(fs, *args, 1, False, None, None, scale)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(fs, *args, 1, False, None, None, scale)  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = op(fs, *args, 1, False, None, None, scale)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and all(torch.equal(a, b) for a, b in zip(out[1], eager[1]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["cuda", "triton"])
def test_gpu_torch_compile_fullgraph_matches_eager(name):
    """The traced forms (static rows on CUDA, the Triton op's fake) give the eager values."""
    sc = CASES["odd_sizes"]

    def fn(fs, anc, tb, ts, fg, lab, _):
        return bbox_loss_maps(fs, anc, tb, ts, fg, 1, target_labels=lab, strides=STRIDES)

    torch._dynamo.reset()
    with backend(name):  # outside the traced code, as tests/ops/test_compile.py does
        eager = run(fn, sc, "cuda", per_anchor=True)
        got = run(torch.compile(fn, fullgraph=True), sc, "cuda", per_anchor=True)
    torch.testing.assert_close(got[0], eager[0], rtol=1e-6, atol=0)
    for a, b in zip(got[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def _public(name, fs, anc, tb, ts, fg, lab):
    with backend(name):
        return bbox_loss_maps(fs, anc, tb, ts, fg, 1, target_labels=lab, strides=STRIDES[: len(fs)])


# ---------------------------------------------------------------------------- Triton (interpreter or GPU)
try:
    from yolofast.kernels import _bbox_loss_maps, _common
except ImportError as e:
    NO_TRITON = f"triton is not importable: {e}"
else:
    NO_TRITON = ""


class TestTriton(Backend):
    """bbox_loss_maps_triton (kernels/_bbox_loss_maps.py)."""

    pytestmark = needs_triton(NO_TRITON)
    device = TRITON_DEV
    tight = 1e-11

    def fn(self, feats, anc, tb, ts, fg, lab, l1_scale):
        return _bbox_loss_maps.bbox_loss_maps(feats, anc, tb, ts, fg, 1, lab, l1_scale=l1_scale)

    def test_every_output_element_is_written(self, monkeypatch):
        monkeypatch.setattr(_common, "POISON", True)  # outputs start as NaN: an unwritten one would show
        sc = CASES["odd_sizes"]
        fs = [f.to(TRITON_DEV) for f in sc["feats"]]
        args = [sc[k].to(TRITON_DEV) for k in ("anc", "tb", "ts", "fg")]
        losses, grads, inv_s = torch.ops.yolofast.bbox_loss_maps_triton(fs, *args, None, list(sc["l1_scale"]))
        assert torch.isfinite(losses).all() and torch.isfinite(inv_s)
        assert all(torch.isfinite(g).all() for g in grads)

    def test_public_maps_route_to_the_maps_kernel(self, monkeypatch):
        calls = []
        real = _bbox_loss_maps.bbox_loss_maps
        spy = lambda *a, **k: calls.append(1) or real(*a, **k)  # noqa: E731
        monkeypatch.setattr(_bbox_loss_maps, "bbox_loss_maps", spy)
        sc = CASES["random"]
        got = run(lambda fs, anc, tb, ts, fg, lab, _: _public("triton", fs, anc, tb, ts, fg, lab), sc,
                  TRITON_DEV, per_anchor=True)
        assert calls, "reg_max 1 maps did not reach the Triton maps kernel"
        assert_close_to_ref(got, run_ref(sc))

    def test_shape_errors_name_the_argument(self):
        sc = CASES["random"]
        fs = [f.to(TRITON_DEV) for f in sc["feats"]]
        anc, tb, ts, fg = (sc[k].to(TRITON_DEV) for k in ("anc", "tb", "ts", "fg"))
        with pytest.raises(ValueError, match="l1_scale"):
            _bbox_loss_maps.bbox_loss_maps(fs, anc, tb, ts, fg, 1, l1_scale=sc["l1_scale"][:-1])
        with pytest.raises(ValueError, match="target_labels"):
            _bbox_loss_maps.bbox_loss_maps(fs, anc, tb, sc["score"], fg, 1, l1_scale=sc["l1_scale"])
        with pytest.raises(ValueError, match="anchor_points"):
            _bbox_loss_maps.bbox_loss_maps(fs, anc[:-1], tb, ts, fg, 1, l1_scale=sc["l1_scale"])
        with pytest.raises(ValueError, match="reg_max 1"):
            _bbox_loss_maps.bbox_loss_maps(fs, anc, tb, ts, fg, 16, l1_scale=sc["l1_scale"])

    def test_yolo26_criterion_equals_the_reference_path(self, monkeypatch):
        """The trainer's call (E2EDetectionLoss: per-anchor targets, weights) on the Triton backend."""
        from yolofast.loss import E2EDetectionLoss

        fgs = []
        real = _bbox_loss_maps.bbox_loss_maps
        spy = lambda *a, **k: fgs.append(int(a[4].sum())) or real(*a, **k)  # noqa: E731
        monkeypatch.setattr(_bbox_loss_maps, "bbox_loss_maps", spy)

        batch = {"batch_idx": torch.tensor([0.0, 0.0, 1.0]), "cls": torch.tensor([[0.0], [2.0], [1.0]]),
                 "bboxes": torch.tensor([[0.3, 0.4, 0.4, 0.5], [0.7, 0.7, 0.2, 0.3], [0.5, 0.5, 0.06, 0.05]])}
        out = []
        for be in ("triton", "ref"):
            g = torch.Generator().manual_seed(9)
            preds = {br: [(torch.rand(2, 7, h, w, generator=g) * 3).to(TRITON_DEV).requires_grad_()
                          for h, w in ((8, 12), (4, 6), (2, 3))] for br in ("one2many", "one2one")}
            with backend(be):
                total, items = E2EDetectionLoss(3, epochs=4)(preds, batch)
            total.backward()
            grads = [f.grad.cpu() for br in preds.values() for f in br]
            out.append((total.detach().cpu(), items.cpu(), grads))
        assert len(fgs) == 2 and min(fgs) > 0  # both branches, each with foreground anchors
        torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-5, atol=0)
        torch.testing.assert_close(out[0][1], out[1][1], rtol=1e-5, atol=0)
        for a, b in zip(out[0][2], out[1][2]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))

    def test_opcheck(self):
        # fake-tensor and AOT checks trace compiled Triton kernels only (a GPU), as test_bbox_loss.py's
        utils = ("test_schema", "test_autograd_registration") + (
            () if TRITON_DEV == "cpu" else ("test_faketensor", "test_aot_dispatch_dynamic"))
        sc = scene(1, 3, [(4, 4), (2, 2)], 8)
        fs = [f.to(TRITON_DEV).requires_grad_() for f in sc["feats"]]
        args = [sc[k].to(TRITON_DEV) for k in ("anc", "tb", "ts", "fg")]
        torch.library.opcheck(torch.ops.yolofast.bbox_loss_maps_triton.default,
                              (fs, *args, None, list(sc["l1_scale"])), test_utils=utils)


def test_dense_and_per_anchor_scenes_agree():
    """The scene's per-anchor targets are its dense ones (what the per-anchor tests rely on)."""
    sc = CASES["random"]
    assert torch.equal(dense_target_scores(sc["score"], sc["label"], sc["ts"].shape[-1]), sc["ts"])
