"""bbox_loss's maps variant (csrc/cpu/bbox_loss_kernel.cpp bbox_loss_maps) against the reference path: the
maps cat into (B, A, .) and reference.bbox_loss_ref. head_decode: test_head_decode.py."""

from __future__ import annotations

import platform

import pytest
import torch
from op_inputs import UPSTREAM, make_maps

from yolofast.ops import reference
from yolofast.ops._backend import backend
from yolofast.ops.bbox_loss import maps_to_rows


def run_maps(lib, feats, rest, reg_max=16):
    fs = [f.detach().clone().requires_grad_() for f in feats]
    out = lib.bbox_loss_maps(fs, *rest, reg_max)
    grads = torch.autograd.grad((out * torch.tensor(UPSTREAM, dtype=out.dtype)).sum(), fs)
    return out.detach(), grads


def run_ref(feats, rest, reg_max=16):
    fs = [f.detach().clone().requires_grad_() for f in feats]
    pd, ps = maps_to_rows(fs, reg_max)
    out = reference.bbox_loss_ref(pd, ps, *rest)
    grads = torch.autograd.grad((out * torch.tensor(UPSTREAM, dtype=out.dtype)).sum(), fs)
    return out.detach(), grads


def assert_close_to_ref(got, want, rtol=1e-5):
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=0)
    for a, b in zip(got[1], want[1]):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()) + 1e-30)


@pytest.mark.parametrize("seed", range(3))
def test_matches_reference_640(lib, seed):
    feats, *rest = make_maps(2, 80, [(80, 80), (40, 40), (20, 20)], seed)
    assert_close_to_ref(run_maps(lib, feats, rest), run_ref(feats, rest))


@pytest.mark.parametrize("seed", range(12))
def test_matches_reference_random_shapes(lib, seed):
    """Odd H/W, 1 to 3 levels, any nc and reg_max: rows that are not whole vectors, tails everywhere."""
    g = torch.Generator().manual_seed(500 + seed)
    rnd = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    sizes = [(rnd(1, 23), rnd(1, 23)) for _ in range(rnd(1, 4))]
    reg_max, C, B = rnd(2, 20), rnd(1, 40), rnd(1, 3)
    feats, *rest = make_maps(B, C, sizes, seed, reg_max=reg_max, fg_frac=float(torch.rand(1, generator=g)))
    assert_close_to_ref(run_maps(lib, feats, rest, reg_max), run_ref(feats, rest, reg_max))


def test_no_positives(lib):
    feats, anc, tb, ts, fg = make_maps(2, 10, [(9, 7), (5, 4)], 3, fg_frac=0.0)
    ts.zero_()
    got = run_maps(lib, feats, (anc, tb, ts, fg))
    assert got[0][0] == 0 and got[0][2] == 0
    assert_close_to_ref(got, run_ref(feats, (anc, tb, ts, fg)))


def test_fp64_gradcheck(lib):
    feats, anc, tb, ts, fg = make_maps(1, 3, [(3, 5), (2, 1)], 11, reg_max=4, fg_frac=0.6)
    feats = [f.double().requires_grad_() for f in feats]
    rest = (anc.double(), tb.double(), ts.double(), fg)

    def f(*fs):
        return lib.bbox_loss_maps(list(fs), *rest, 4)[1:]  # class + DFL terms: smooth in the logits

    assert torch.autograd.gradcheck(f, tuple(feats), eps=1e-6, atol=1e-8, rtol=1e-6)
    assert_close_to_ref(run_maps(lib, feats, rest, 4), run_ref(feats, rest, 4), rtol=1e-12)


def test_strided_maps(lib):
    """channels_last maps and maps cut out of a larger tensor read the same as contiguous ones."""
    feats, *rest = make_maps(2, 12, [(10, 9), (5, 5)], 5)
    want = run_ref(feats, rest)
    cl = [f.to(memory_format=torch.channels_last) for f in feats]
    assert not cl[0].is_contiguous()
    assert_close_to_ref(run_maps(lib, cl, rest), want)
    big = [torch.randn(f.shape[0] + 1, f.shape[1] + 3, f.shape[2] + 2, f.shape[3] + 4) for f in feats]
    for b, f in zip(big, feats):
        b[1:, 2:-1, 1:-1, 3:-1] = f
    crops = [b[1:, 2:-1, 1:-1, 3:-1] for b in big]
    assert not crops[0].is_contiguous()
    assert_close_to_ref(run_maps(lib, crops, rest), want)
    rows = [b[1:, 2:-1, 1:-1, :] for b in big]  # full rows: read in place, channel and batch strides odd
    rows = [r[..., 3:-1] if r.shape[-1] != f.shape[-1] else r for r, f in zip(rows, feats)]
    assert_close_to_ref(run_maps(lib, rows, rest), want)


def test_bf16_maps_no_worse_than_reference(lib):
    feats, *rest = make_maps(2, 20, [(16, 16), (8, 8)], 9, fg_frac=0.2)
    low = [f.to(torch.bfloat16) for f in feats]
    exact = run_ref([f.double() for f in low], [r.double() if r.is_floating_point() else r for r in rest])
    got, ref = run_maps(lib, low, rest), run_ref(low, rest)
    assert got[0].dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in got[1])
    err = lambda x: max(float((a.double() - b).abs().max()) for a, b in zip(x, exact[1]))  # noqa: E731
    loss_err = lambda x: float((x[0].double() - exact[0]).abs().max())  # noqa: E731
    assert loss_err(got) <= 2 * loss_err(ref) + 1e-7
    assert err(got[1]) <= 2 * err(ref[1]) + 1e-7


def test_every_output_element_written(lib, monkeypatch):
    """Outputs are filled with NaN before the kernels run (YOLOFAST_POISON_OUTPUTS): none may survive."""
    feats, *rest = make_maps(2, 9, [(7, 11), (3, 5)], 2, reg_max=5, fg_frac=0.3)
    monkeypatch.setenv("YOLOFAST_POISON_OUTPUTS", "1")
    out = torch.ops.yolofast.bbox_loss_maps(feats, *rest, 5)
    dec = torch.ops.yolofast.head_decode(feats, [8.0, 16.0], 5)
    c = torch.tensor([0.7, 1.3, -0.4])
    grads = torch.ops.yolofast._bbox_loss_maps_scale(out[1], out[2], out[3], c, 5)
    monkeypatch.delenv("YOLOFAST_POISON_OUTPUTS")
    for g, f in zip(grads, feats):
        assert g.shape == f.shape and torch.isfinite(g).all()
    assert out[2].shape[0] == out[3].shape[0] == int(rest[3].sum()) > 0  # one compact row per fg anchor
    for t in (out[0], *out[1], out[2], out[3], out[4], *dec):
        assert torch.isfinite(t).all()
    assert (out[3] >= 0).all() and (out[3].diff() > 0).all()


def test_deterministic_and_thread_count_independent(lib):
    feats, *rest = make_maps(3, 80, [(40, 40), (20, 20), (10, 10)], 1)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        a = torch.ops.yolofast.bbox_loss_maps(feats, *rest, 16)
        da = torch.ops.yolofast.head_decode(feats, [8.0, 16.0, 32.0], 16)
        b = torch.ops.yolofast.bbox_loss_maps(feats, *rest, 16)
        torch.set_num_threads(1)
        c = torch.ops.yolofast.bbox_loss_maps(feats, *rest, 16)
        dc = torch.ops.yolofast.head_decode(feats, [8.0, 16.0, 32.0], 16)
    finally:
        torch.set_num_threads(prev)
    flat = lambda o: [o[0], *o[1], o[2], o[3], o[4]]  # noqa: E731
    for x, y, z in zip(flat(a), flat(b), flat(c)):
        assert torch.equal(x, y) and torch.equal(x, z)
    for x, z in zip(da, dc):
        assert torch.equal(x, z)


def test_old_layout_matches_maps_layout(lib):
    """bbox_loss on (B, A, .) rows and bbox_loss_maps on the maps are the same loss to fp32 rounding."""
    feats, *rest = make_maps(2, 30, [(12, 12), (6, 6)], 4, fg_frac=0.3)
    pd, ps = maps_to_rows(feats)
    want = lib.bbox_loss(pd, ps, *rest)
    torch.testing.assert_close(lib.bbox_loss_maps(feats, *rest, 16), want, rtol=1e-5, atol=0)


def test_public_wrapper_backends_agree(lib):
    from yolofast.ops import bbox_loss_maps

    feats, *rest = make_maps(1, 6, [(8, 8), (4, 4)], 8, fg_frac=0.3)
    with backend("cpp"):
        got = bbox_loss_maps(feats, *rest)
    with backend("ref"):
        want = bbox_loss_maps(feats, *rest)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_bad_inputs_raise_clear_errors(lib):
    feats, anc, tb, ts, fg = make_maps(1, 3, [(4, 4), (2, 2)], 0)
    with pytest.raises(RuntimeError, match="target_scores"):
        lib.bbox_loss_maps(feats, anc, tb, ts[..., :2], fg, 16)
    with pytest.raises(RuntimeError, match=r"feats\[1\]"):
        lib.bbox_loss_maps([feats[0], feats[1][:, :-1]], anc, tb, ts, fg, 16)
    with pytest.raises(RuntimeError, match="anchor_points"):
        lib.bbox_loss_maps(feats, anc[:5], tb, ts, fg, 16)
    with pytest.raises(RuntimeError, match="strides"):
        torch.ops.yolofast.head_decode(feats, [8.0], 16)


def test_opcheck(lib):
    feats, anc, tb, ts, fg = make_maps(2, 5, [(4, 5), (2, 3)], 6, reg_max=8, fg_frac=0.4)
    torch.library.opcheck(torch.ops.yolofast.head_decode.default, (feats, [8.0, 16.0], 8))
    torch.library.opcheck(torch.ops.yolofast.bbox_loss_maps.default, (feats, anc, tb, ts, fg, 8))
    feats = [f.requires_grad_() for f in feats]
    torch.library.opcheck(torch.ops.yolofast.bbox_loss_maps.default, (feats, anc, tb, ts, fg, 8))


def test_compiled_maps_loss_fullgraph(lib):
    feats, *rest = make_maps(2, 5, [(8, 8), (4, 4)], 12, fg_frac=0.3)

    def f(fs):
        return (lib.bbox_loss_maps(fs, *rest, 16) * torch.tensor(UPSTREAM)).sum()

    fs = [x.clone().requires_grad_() for x in feats]
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(fs)
    grads = torch.autograd.grad(out, fs)
    want = run_ref(feats, rest)
    torch.testing.assert_close(out, (want[0] * torch.tensor(UPSTREAM)).sum(), rtol=1e-5, atol=0)
    for a, b in zip(grads, want[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_kernels_are_built_with_simd(lib):
    """The loss-path kernels use at::vec's AVX2/AVX-512/NEON code, not its generic scalar fallback."""
    bits = lib.bbox_vec_bits()
    if platform.machine() in ("aarch64", "arm64"):
        assert bits == 128
    elif platform.machine() in ("x86_64", "AMD64"):
        flags = _cpu_flags()
        if not {"avx2", "fma"} <= flags:
            pytest.skip("CPU without AVX2 + FMA: the generic fallback is expected")
        assert bits in (256, 512)
        if bits == 512:  # only when the CPU has all four AVX-512 subsets
            assert {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags


def test_static_layout_equals_compact(lib):
    """compact=False (what torch.compile and graph capture get: one row per anchor, a static shape) gives
    the compact layout's losses, rows and map gradients."""
    feats, anc, tb, ts, fg = make_maps(2, 9, [(7, 11), (3, 5)], 4, reg_max=5, fg_frac=0.3)
    a = torch.ops.yolofast.bbox_loss_maps(feats, anc, tb, ts, fg, 5)
    b = torch.ops.yolofast.bbox_loss_maps(feats, anc, tb, ts, fg, 5, False)
    assert b[2].shape == (fg.numel(), 2, 20) and torch.equal(b[3], torch.arange(fg.numel()))
    assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    assert torch.equal(b[2][a[3]], a[2]) and not b[2][~fg.reshape(-1)].any()
    c = torch.tensor([0.7, 1.3, -0.4])
    ga = torch.ops.yolofast._bbox_loss_maps_scale(a[1], a[2], a[3], c, 5)
    gb = torch.ops.yolofast._bbox_loss_maps_scale(b[1], b[2], b[3], c, 5)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))
    torch.library.opcheck(torch.ops.yolofast.bbox_loss_maps.default, (feats, anc, tb, ts, fg, 5, False))


def per_anchor(ts):
    """(score (B, A), label (B, A)) of one-hot (B, A, C) targets: the row's one non-zero and its class."""
    return ts.sum(-1), ts.argmax(-1)


def test_per_anchor_targets_are_the_dense_ones(lib):
    """(B, A) scores with their labels give the losses and gradients of the (B, A, C) one-hot targets."""
    feats, anc, tb, ts, fg = make_maps(2, 7, [(9, 13), (5, 7), (3, 4)], 21, fg_frac=0.3)
    score, label = per_anchor(ts)
    dense = run_maps(lib, feats, (anc, tb, ts, fg))
    fs = [f.detach().clone().requires_grad_() for f in feats]
    out = lib.bbox_loss_maps(fs, anc, tb, score, fg, 16, label)
    grads = torch.autograd.grad((out * torch.tensor(UPSTREAM)).sum(), fs)
    torch.testing.assert_close(out.detach(), dense[0], rtol=1e-6, atol=0)
    for a, b in zip(grads, dense[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7 * float(b.abs().max()))
    with backend("ref"):
        from yolofast.ops import bbox_loss_maps

        ref = bbox_loss_maps(feats, anc, tb, score, fg, 16, label)
    torch.testing.assert_close(ref, dense[0], rtol=1e-5, atol=0)
    with pytest.raises(RuntimeError, match="target_labels"):
        torch.ops.yolofast.bbox_loss_maps(feats, anc, tb, score, fg, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_final_gradients_in_forward(lib, dtype):
    """Given the weights of its three losses, bbox_loss_maps writes the final map gradients in the forward
    pass: when backward brings exactly those weights they are handed on as they are, and equal the general
    path's gradients; any other incoming gradient (one branch, a scaled loss) is rescaled to the same
    values; a second backward after the hand-off is refused (the gradients may have been accumulated into)."""
    feats, anc, tb, ts, fg = make_maps(2, 9, [(12, 11), (6, 6), (3, 3)], 22, fg_frac=0.2, dtype=dtype)
    score, label = per_anchor(ts.to(dtype))
    rest = (anc.to(dtype), tb.to(dtype), score, fg, label)
    w = torch.tensor([7.5 * 2, 0.5 * 2, 1.5 * 2], dtype=dtype)

    def run(weights, upstream):
        fs = [f.detach().clone().requires_grad_() for f in feats]
        losses = lib.bbox_loss_maps(fs, *rest[:4], 16, rest[4], weights)
        return losses.detach(), torch.autograd.grad(losses, fs, grad_outputs=upstream)

    for upstream in (w, w * 2, torch.tensor([0.0, 1.0, 0.0]), torch.tensor([float("nan"), 1.0, 1.0])):
        upstream = upstream.to(dtype)
        want = run(None, upstream)
        got = run(w, upstream)
        assert torch.equal(got[0], want[0])
        for a, b in zip(got[1], want[1]):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7 * float(b.nan_to_num().abs().max()),
                                       equal_nan=True)
    # The rescaled path leaves the prepared gradients as they were: then the hand-off, then no more.
    fs = [f.detach().clone().requires_grad_() for f in feats]
    losses = lib.bbox_loss_maps(fs, *rest[:4], 16, rest[4], w)
    half = torch.autograd.grad(losses, fs, grad_outputs=w / 2, retain_graph=True)
    full = torch.autograd.grad(losses, fs, grad_outputs=w, retain_graph=True)
    for h, f in zip(half, full):
        torch.testing.assert_close(h * 2, f, rtol=1e-6, atol=1e-7 * float(f.abs().max()))
    with pytest.raises(RuntimeError, match="second backward"):
        torch.autograd.grad(losses, fs, grad_outputs=w)


def test_final_gradients_every_element_written_and_opcheck(lib, monkeypatch):
    feats, anc, tb, ts, fg = make_maps(2, 9, [(7, 11), (3, 5)], 2, reg_max=5, fg_frac=0.3, strides=(8, 16))
    score, label = per_anchor(ts)
    w = torch.tensor([15.0, 1.0, 3.0])
    monkeypatch.setenv("YOLOFAST_POISON_OUTPUTS", "1")
    out = torch.ops.yolofast.bbox_loss_maps(feats, anc, tb, score, fg, 5, True, label, w)
    monkeypatch.delenv("YOLOFAST_POISON_OUTPUTS")
    for g, f in zip(out[1], feats):
        assert g.shape == f.shape and torch.isfinite(g).all()
    clean = torch.ops.yolofast.bbox_loss_maps(feats, anc, tb, score, fg, 5, True, label, w)
    for a, b in zip(out[1], clean[1]):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="weights"):
        torch.ops.yolofast.bbox_loss_maps(feats, anc, tb, ts, fg, 5, True, None, w)  # dense targets
    for bad in (0.0, float("inf")):
        with pytest.raises(RuntimeError, match="finite and non-zero"):
            bad_w = torch.tensor([1.0, bad, 1.0])
            torch.ops.yolofast.bbox_loss_maps(feats, anc, tb, score, fg, 5, True, label, bad_w)
    for grad in (False, True):
        fs = [f.clone().requires_grad_(grad) for f in feats]
        args = (fs, anc, tb, score, fg, 5, False, label, w)
        torch.library.opcheck(torch.ops.yolofast.bbox_loss_maps.default, args)
