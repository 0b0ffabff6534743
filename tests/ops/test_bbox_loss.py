"""bbox_loss: the fused C++ loss (csrc/cpu/bbox_loss_kernel.cpp) and the CUDA one (csrc/cuda, on a GPU or the
CPU emulation: the ``impl`` fixture) against reference.bbox_loss_ref. Maps variant: test_bbox_loss_maps.py;
the Triton kernel: test_triton_bbox_loss.py. Inputs and tolerances: op_inputs.py."""

from __future__ import annotations

import pytest
import torch
from op_inputs import (
    REG_MAX,
    TRITON_DEV,
    anchors_640,
    assert_matches,
    dfl_edge_inputs,
    losses_and_grads,
    make_inputs,
    needs_triton,
    small_loss_inputs,
)

from yolofast.boxes import make_anchors
from yolofast.ops import bbox_loss as public_bbox_loss
from yolofast.ops import reference
from yolofast.ops._backend import backend
from yolofast.ops.reference import bbox_loss_ref


@pytest.mark.parametrize("seed", range(3))
def test_matches_reference_640(lib, seed):
    args = make_inputs(2, 8400, 80, seed, anc=anchors_640())
    assert args[5].sum() > 500
    assert_matches(losses_and_grads(lib.bbox_loss, args), losses_and_grads(reference.bbox_loss_ref, args))


@pytest.mark.parametrize("seed", range(20))
def test_matches_reference_random_shapes(lib, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    B, A, C = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 4), (1, 300), (1, 100)))
    reg_max = int(torch.randint(4, 20, (1,), generator=g))
    args = make_inputs(B, A, C, seed, fg_frac=float(torch.rand(1, generator=g)), reg_max=reg_max)
    assert_matches(losses_and_grads(lib.bbox_loss, args), losses_and_grads(reference.bbox_loss_ref, args))


@pytest.mark.parametrize("case", ["no_fg", "all_fg"])
def test_fg_extremes(lib, case):
    args = list(make_inputs(2, 500, 20, 7, fg_frac=0.0 if case == "no_fg" else 1.0))
    if case == "no_fg":
        args[4].zero_()  # no positives -> no targets: S = max(0, 1) = 1, box = dfl = 0
    got = losses_and_grads(lib.bbox_loss, args)
    assert_matches(got, losses_and_grads(reference.bbox_loss_ref, args))
    if case == "no_fg":
        assert got[0][0] == 0 and got[0][2] == 0 and torch.all(got[1] == 0)


def test_class_logits_across_the_exp_range(lib):
    """The class loss's softplus and sigmoid of logits from -110 to 110: through the end of exp(-|x|)'s
    float range (|x| ~ 86-104, where it is denormal or 0 and the fused exp stops at exp(-86)), around 0
    (+-0, +-1e-3) and across the exp's range-reduction steps; with and without a target on each logit."""
    pd, ps, anc, tb, ts, fg = make_inputs(2, 96, 37, 5, fg_frac=0.5)
    edges = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 0.3465, -0.3466, 20.0, -20.0, 85.9, -86.0, -86.1, 87.4,
                          -87.4, 88.7, -88.8, 103.9, -104.0, 110.0, -110.0])
    vals = torch.cat((edges, torch.linspace(-110, 110, ps.numel() - len(edges))))
    ps = vals[torch.randperm(vals.numel(), generator=torch.Generator().manual_seed(0))].view_as(ps)
    on = torch.rand(ts.shape, generator=torch.Generator().manual_seed(1)) < 0.3
    ts = torch.where(on, 0.7, 0.0) * fg[..., None]
    args = (pd, ps, anc, tb, ts, fg)
    got, want = losses_and_grads(lib.bbox_loss, args), losses_and_grads(reference.bbox_loss_ref, args)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[2]).all()
    assert_matches(got, want)
    # Without a target a logit's gradient is its sigmoid (times c1 / S): each to 1e-5 relative, down to
    # the denormals (|x| > 86, where the fused exp keeps exp(-86) and the reference goes to 0).
    torch.testing.assert_close(got[2][ts == 0], want[2][ts == 0], rtol=1e-5, atol=1e-35)


def test_dfl_targets_on_bin_edges_and_beyond_clamp(lib):
    args = dfl_edge_inputs()
    assert_matches(losses_and_grads(lib.bbox_loss, args), losses_and_grads(reference.bbox_loss_ref, args))


def test_degenerate_targets(lib):
    """Zero-width/height/size target boxes (h = eps), and predictions saturated on one bin."""
    pd, ps, anc, tb, ts, _ = make_inputs(1, 64, 4, 11, fg_frac=1.0)
    tb[0, :16, 2] = tb[0, :16, 0]  # zero width
    tb[0, 16:32, 3] = tb[0, 16:32, 1]  # zero height
    tb[0, 32:48, 2:] = tb[0, 32:48, :2]  # a point
    pd[0, 48:, :] = 0
    pd[0, 48:, ::REG_MAX] = 60.0  # softmax saturated on bin 0: a zero-size predicted box
    ts[..., 1] = 0.8
    fg = torch.ones(1, 64, dtype=torch.bool)
    args = (pd, ps, anc, tb, ts, fg)
    got = losses_and_grads(lib.bbox_loss, args)
    assert all(torch.isfinite(t).all() for t in got)
    assert_matches(got, losses_and_grads(reference.bbox_loss_ref, args))


def test_every_output_element_written(lib, monkeypatch):
    """Outputs are filled with NaN before the kernel runs (YOLOFAST_POISON_OUTPUTS): none may survive."""
    monkeypatch.setenv("YOLOFAST_POISON_OUTPUTS", "1")
    args = make_inputs(3, 777, 13, 5, fg_frac=0.3)
    outs = torch.ops.yolofast.bbox_loss(*args)
    assert all(torch.isfinite(t).all() for t in outs)
    monkeypatch.delenv("YOLOFAST_POISON_OUTPUTS")
    clean = torch.ops.yolofast.bbox_loss(*args)
    for a, b in zip(outs, clean):
        assert torch.equal(a, b)


def test_fp64_gradcheck(lib):
    """gradcheck of L_cls and L_dfl (exact derivatives); L_box's gradient holds CIoU's alpha constant by
    design, so finite differences cannot check it: the fp64 comparison with autograd below does."""
    pd, ps, anc, tb, ts, fg = make_inputs(2, 5, 3, 2, fg_frac=0.7, reg_max=6, dtype=torch.float64)
    pd.requires_grad_()
    ps.requires_grad_()

    def cls_dfl(pd, ps):
        return lib.bbox_loss(pd, ps, anc, tb, ts, fg)[1:]

    assert torch.autograd.gradcheck(cls_dfl, (pd, ps), eps=1e-6, atol=1e-8, rtol=1e-6)
    args = (pd, ps, anc, tb, ts, fg)
    want = losses_and_grads(reference.bbox_loss_ref, args)
    assert_matches(losses_and_grads(lib.bbox_loss, args), want, rtol=1e-12)


def test_low_precision_inputs_no_worse_than_reference(lib):
    """bf16/fp16 logits: error against the fp64 reference on the unrounded inputs <= 2x the reference's."""
    args = make_inputs(2, 2000, 80, 9, fg_frac=0.1)
    wide = [a.double() if a.is_floating_point() else a for a in args]
    exact = losses_and_grads(reference.bbox_loss_ref, wide)
    for dt in (torch.bfloat16, torch.float16):
        low = [a.to(dt) if i < 2 else a for i, a in enumerate(args)]
        got = losses_and_grads(lib.bbox_loss, low)
        ref = losses_and_grads(reference.bbox_loss_ref, low)
        assert got[0].dtype == torch.float32 and got[1].dtype == dt and got[2].dtype == dt
        for k in range(3):
            err_k = (got[k].double() - exact[k]).abs().max()
            err_r = (ref[k].double() - exact[k]).abs().max()
            assert err_k <= 2 * err_r + 1e-7, (dt, k, float(err_k), float(err_r))


def test_autocast_runs_in_fp32(lib):
    args = make_inputs(1, 300, 10, 4, fg_frac=0.2)
    pd = args[0].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = pd.to(torch.bfloat16) * 1.0  # a bf16 activation, as the head would give
        out = lib.bbox_loss(x, args[1], *args[2:])
    assert out.dtype == torch.float32
    out.sum().backward()
    assert pd.grad is not None and torch.isfinite(pd.grad).all()


def test_deterministic_and_thread_count_independent(lib):
    args = make_inputs(2, 3000, 80, 1, fg_frac=0.1)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        a = torch.ops.yolofast.bbox_loss(*args)
        b = torch.ops.yolofast.bbox_loss(*args)
        torch.set_num_threads(1)
        c = torch.ops.yolofast.bbox_loss(*args)
    finally:
        torch.set_num_threads(prev)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y) and torch.equal(x, z)


def test_public_wrapper_uses_kernel(lib):
    args = make_inputs(1, 200, 6, 8, fg_frac=0.3)
    with backend("cpp"):
        from yolofast.ops import bbox_loss

        got = bbox_loss(*args)
    torch.testing.assert_close(got, reference.bbox_loss_ref(*args), rtol=1e-5, atol=0)


def test_bad_shapes_raise_clear_errors(lib):
    pd, ps, anc, tb, ts, fg = make_inputs(1, 10, 3, 0)
    with pytest.raises(RuntimeError, match="target_scores"):
        lib.bbox_loss(pd, ps, anc, tb, ts[..., :2], fg)
    with pytest.raises(RuntimeError, match="anchor_points"):
        lib.bbox_loss(pd, ps, anc[:5], tb, ts, fg)
    with pytest.raises(RuntimeError, match="pred_dist"):
        lib.bbox_loss(pd[..., :-1], ps, anc, tb, ts, fg)


def test_opcheck(lib):
    pd, ps, anc, tb, ts, fg = make_inputs(2, 40, 5, 6, fg_frac=0.4, reg_max=8)
    torch.library.opcheck(torch.ops.yolofast.bbox_loss.default, (pd, ps, anc, tb, ts, fg))
    pd.requires_grad_()
    ps.requires_grad_()
    torch.library.opcheck(torch.ops.yolofast.bbox_loss.default, (pd, ps, anc, tb, ts, fg))


def test_tal_assign_opcheck(lib):
    if not torch._C._dispatch_has_kernel_for_dispatch_key("yolofast::tal_assign", "CPU"):
        pytest.skip("csrc/cpu/tal_assign_kernel.cpp is not part of this build yet")
    g = torch.Generator().manual_seed(0)
    B, M, C = 2, 6, 5
    feats = [torch.empty(1, 1, 64 // s, 64 // s) for s in (8, 16, 32)]
    anc, stride = make_anchors(feats, (8, 16, 32))
    anc_px = anc * stride
    A = anc.shape[0]
    xy = torch.rand(B, M, 2, generator=g) * 48
    wh = torch.rand(B, M, 2, generator=g) * 30 + 2
    gt_bboxes = torch.cat((xy, xy + wh), -1)
    gt_labels = torch.randint(0, C, (B, M, 1), generator=g).float()
    mask_gt = (torch.rand(B, M, 1, generator=g) < 0.8).float()
    pd_scores = torch.rand(B, A, C, generator=g)
    c = anc_px + torch.randn(B, A, 2, generator=g) * 4
    pwh = torch.rand(B, A, 2, generator=g) * 30 + 2
    pd_bboxes = torch.cat((c - pwh / 2, c + pwh / 2), -1)
    args = (pd_scores, pd_bboxes, anc_px, gt_labels, gt_bboxes, mask_gt, 10, 0.5, 6.0, 1e-9)
    torch.library.opcheck(torch.ops.yolofast.tal_assign.default, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_path_is_the_dense_op(lib, dtype):
    """bbox_loss.rows (the CPU path of lib.bbox_loss) gives the dense op's losses and class gradient bit for
    bit, and its foreground rows are the dense op's box/DFL rows, in both layouts: compact (one row per
    foreground anchor, ascending index) and static (one row per anchor, zero off the foreground)."""
    args = make_inputs(3, 203, 7, 12, fg_frac=0.3, dtype=dtype)  # 203 anchors: vector tails, 7 row blocks
    fg = args[5]
    losses, gb, gd, gs, inv_s = torch.ops.yolofast.bbox_loss(*args)
    for compact in (True, False):
        r_losses, r_gs, rows, index, r_inv = torch.ops.yolofast.bbox_loss.rows(*args, compact)
        assert torch.equal(r_losses, losses) and torch.equal(r_gs, gs) and torch.equal(r_inv, inv_s)
        want_index = fg.flatten().nonzero().squeeze(1) if compact else torch.arange(fg.numel())
        assert torch.equal(index, want_index)
        assert torch.equal(rows[:, 0], gb.flatten(0, 1)[want_index])
        assert torch.equal(rows[:, 1], gd.flatten(0, 1)[want_index])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_backward_matches_the_formula(lib, dtype):
    """yolofast::_bbox_loss_rows_scale = gd_box*c0 + gd_dfl*c2 (from the foreground rows, 0 elsewhere) and
    gs*c1; a non-finite incoming grad reaches the background rows too, as the dense product's does."""
    args = make_inputs(2, 5000, 7, 11, fg_frac=0.3, dtype=dtype)  # 10000 anchors: several 2048-anchor chunks
    _, gb, gd, gs, _ = torch.ops.yolofast.bbox_loss(*args)
    for compact in (True, False):
        _, r_gs, rows, index, _ = torch.ops.yolofast.bbox_loss.rows(*args, compact)
        for c in ([0.7, 1.3, -0.4], [float("nan"), 1.0, 1.0]):
            c = torch.tensor(c, dtype=dtype)
            got_dist, got_scores = torch.ops.yolofast._bbox_loss_rows_scale(r_gs, rows, index, c)
            want = (gb * c[0]).addcmul_(gd, c[2])
            torch.testing.assert_close(got_dist, want, rtol=1e-6, atol=0, equal_nan=True)
            torch.testing.assert_close(got_scores, gs * c[1], rtol=0, atol=0)
    c = torch.tensor([0.7, 1.3, -0.4], dtype=dtype)
    torch.library.opcheck(torch.ops.yolofast._bbox_loss_rows_scale.default, (r_gs, rows, index, c))


def test_rows_every_output_element_written(lib, monkeypatch):
    """NaN-poisoned outputs (YOLOFAST_POISON_OUTPUTS) of bbox_loss.rows and its backward: none survives."""
    args = make_inputs(3, 777, 13, 5, fg_frac=0.3)
    monkeypatch.setenv("YOLOFAST_POISON_OUTPUTS", "1")
    out = torch.ops.yolofast.bbox_loss.rows(*args)
    grads = torch.ops.yolofast._bbox_loss_rows_scale(out[1], out[2], out[3], torch.tensor([0.7, 1.3, -0.4]))
    monkeypatch.delenv("YOLOFAST_POISON_OUTPUTS")
    assert out[2].shape[0] == out[3].shape[0] == int(args[5].sum()) > 0
    for t in (*out, *grads):
        assert torch.isfinite(t).all()


def test_rows_deterministic_and_thread_count_independent(lib):
    args = make_inputs(2, 3000, 80, 1, fg_frac=0.1)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        a = losses_and_grads(lib.bbox_loss, args)
        torch.set_num_threads(1)
        b = losses_and_grads(lib.bbox_loss, args)
    finally:
        torch.set_num_threads(prev)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_rows_opcheck(lib):
    pd, ps, anc, tb, ts, fg = make_inputs(2, 40, 5, 6, fg_frac=0.4, reg_max=8)
    for grad in (False, True):
        pd.requires_grad_(grad)
        ps.requires_grad_(grad)
        for compact in (True, False):
            torch.library.opcheck(torch.ops.yolofast.bbox_loss.rows, (pd, ps, anc, tb, ts, fg, compact))


# ---------------------------------------- the same checks on the CUDA kernels (a GPU, or the CPU emulation)
# -------------------------------------------------------------------------------------------- bbox_loss
def _loss_check(impl, args, rtol=1e-5):
    """Losses to rtol; gradients elementwise to rtol with an absolute floor of rtol x the largest entry."""
    args = impl.to(args)
    got = losses_and_grads(impl.loss, args)
    want = losses_and_grads(bbox_loss_ref, args)
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=0)
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()) + 1e-30)
    return got


@pytest.mark.parametrize("seed", range(4))
def test_loss_random_shapes(impl, seed):
    B, A, C, R = [(2, 300, 80, 16), (1, 777, 13, 16), (3, 100, 1, 7), (2, 200, 20, 33)][seed]
    _loss_check(impl, make_inputs(B, A, C, seed, fg_frac=0.2, reg_max=R))


def test_loss_realistic_640(impl):
    if impl.name == "emu":
        args = make_inputs(1, 1500, 80, 3, anc=anchors_640()[:1500])  # the emulation is slow
    else:
        args = make_inputs(4, 8400, 80, 3, anc=anchors_640())
    _loss_check(impl, args)


@pytest.mark.parametrize("case", ["no_fg", "all_fg"])
def test_loss_foreground_extremes(impl, case):
    pd, ps, anc, tb, ts, fg = make_inputs(2, 150, 7, 4, fg_frac=0.5)
    fg = torch.zeros_like(fg) if case == "no_fg" else torch.ones_like(fg)
    ts = ts * fg[..., None] if case == "no_fg" else ts
    _loss_check(impl, (pd, ps, anc, tb, ts, fg))


def test_loss_dfl_targets_on_bin_edges_and_degenerate_boxes(impl):
    pd, ps, anc, tb, ts, fg = dfl_edge_inputs()
    tb[0, :3, 2] = tb[0, :3, 0]  # zero width
    tb[0, 3:5, 2:] = tb[0, 3:5, :2]  # a point
    pd[0, 6:8] = 0
    pd[0, 6:8, ::16] = 60.0  # softmax saturated on bin 0
    _loss_check(impl, (pd, ps, anc, tb, ts, fg))


def test_loss_background_boxes_are_never_read(impl):
    pd, ps, anc, tb, ts, fg = make_inputs(2, 120, 6, 5, fg_frac=0.3)
    ts = ts * fg[..., None]
    tb = torch.where(fg[..., None], tb, torch.full_like(tb, float("nan")))
    got = _loss_check(impl, (pd, ps, anc, tb, ts, fg))
    assert all(torch.isfinite(t).all() for t in got)


def test_loss_float64_tight(impl):
    _loss_check(impl, make_inputs(2, 50, 3, 2, fg_frac=0.7, reg_max=6, dtype=torch.float64), rtol=1e-12)


def test_loss_low_precision_inputs_compute_in_float32(impl):
    pd, ps, anc, tb, ts, fg = make_inputs(2, 200, 10, 9, fg_frac=0.1)
    for dt in (torch.bfloat16, torch.float16):
        args = impl.to((pd.to(dt), ps.to(dt), anc, tb, ts, fg))
        got = losses_and_grads(impl.loss, args)
        want = losses_and_grads(bbox_loss_ref, args)
        assert got[0].dtype == torch.float32 and got[1].dtype == dt and got[2].dtype == dt
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)


def test_loss_every_output_written_and_deterministic(impl, monkeypatch):
    args = impl.to(make_inputs(3, 333, 13, 5, fg_frac=0.3))
    raw = impl.ops.bbox_loss
    clean = raw(*args)
    monkeypatch.setenv("YOLOFAST_POISON_OUTPUTS", "1")
    poisoned = raw(*args)
    for a, b in zip(clean, poisoned):
        assert torch.isfinite(b).all() and torch.equal(a, b)  # bitwise: no float atomics anywhere


def test_loss_bad_shapes_raise_clear_errors(impl):
    pd, ps, anc, tb, ts, fg = impl.to(make_inputs(1, 20, 3, 6))
    with pytest.raises(RuntimeError, match="anchor_points"):
        impl.ops.bbox_loss(pd, ps, anc[:-1], tb, ts, fg)
    with pytest.raises(RuntimeError, match="reg_max"):
        impl.ops.bbox_loss(pd[..., :4], ps, anc, tb, ts, fg)


# ------------------------------------------------------------------------------------ the Triton kernel
# On the CPU through Triton's interpreter, the compiled kernel on a GPU (op_inputs.needs_triton).
try:
    from yolofast.kernels import _common, triton_status
    from yolofast.kernels.bbox_loss import bbox_loss as triton_bbox_loss
except ImportError as e:
    NO_TRITON = f"triton is not importable: {e}"
else:
    NO_TRITON = ""
NEEDS_TRITON = needs_triton(NO_TRITON)


def triton_loss_inputs(seed, **kw):
    return small_loss_inputs(seed, device=TRITON_DEV, **kw)


# distinct weights per loss term, so a gradient routed to the wrong term shows
TRITON_GAINS = torch.tensor([7.5, 0.5, 1.5])


def triton_run_both(inputs, gains=TRITON_GAINS):
    """(value, grad_dist, grad_scores) of the Triton op and of the reference, for sum(gains * losses)."""
    results = []
    for fn in (triton_bbox_loss, bbox_loss_ref):
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


# the fake-tensor and AOT checks trace the kernels through torch.library.wrap_triton, which needs real
# (compiled) Triton kernels: on the interpreter only the eager checks apply
TRITON_OPCHECK_UTILS = ("test_schema", "test_autograd_registration") + (
    () if TRITON_DEV == "cpu" else ("test_faketensor", "test_aot_dispatch_dynamic")
)


class TestTriton:
    """The Triton bbox_loss (kernels/bbox_loss.py) against the reference: values, gradients, edge cases."""

    pytestmark = NEEDS_TRITON

    def test_status_reports_available(self):
        ok, why = triton_status("bbox_loss")
        assert ok, why

    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_matches_reference_float32(self, seed):
        (out, gd, gs), (ref, rd, rs) = triton_run_both(triton_loss_inputs(seed))
        assert out.dtype == torch.float32 and out.shape == (3,)
        assert (ref[0] > 0) and (ref[2] > 0)  # the inputs exercise the box and DFL terms
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
        assert_grads_close((gd, gs), (rd, rs), rel=1e-5)

    def test_matches_reference_float64_tightly(self):
        (out, gd, gs), (ref, rd, rs) = triton_run_both(triton_loss_inputs(3, dtype=torch.float64))
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)
        assert_grads_close((gd, gs), (rd, rs), rel=1e-11)

    def test_dfl_targets_on_bin_edges(self):
        # targets at whole-bin distances (wl = 1, wr = 0), at 0 and past the last bin (clamped to 14.99)
        inputs = triton_loss_inputs(4, fg_frac=1.0)
        anc = inputs[2]
        dists = torch.tensor([0.0, 3.0, 14.0, 15.0, 20.0, 7.0, 1.0, 2.0], device=TRITON_DEV)
        B, A = inputs[5].shape
        d = dists[torch.arange(B * A * 4, device=TRITON_DEV) % len(dists)].view(B, A, 4)
        inputs[3] = torch.cat((anc - d[..., :2], anc + d[..., 2:]), -1)
        (out, gd, gs), (ref, rd, rs) = triton_run_both(inputs)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
        assert_grads_close((gd, gs), (rd, rs), rel=1e-5)

    def test_no_foreground(self):
        inputs = triton_loss_inputs(5, fg_frac=0.0)
        assert inputs[4].sum() == 0  # S = max(0, 1) = 1
        (out, gd, gs), (ref, rd, rs) = triton_run_both(inputs)
        assert out[0] == 0 and out[2] == 0 and out[1] > 0
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
        assert torch.count_nonzero(gd) == 0
        assert_grads_close((gs,), (rs,), rel=1e-5)

    def test_background_boxes_are_never_read(self):
        inputs = triton_loss_inputs(6)
        fg = inputs[5]
        inputs[3] = torch.where(fg[..., None], inputs[3], float("nan"))
        (out, gd, gs), (ref, rd, rs) = triton_run_both(inputs)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
        assert_grads_close((gd, gs), (rd, rs), rel=1e-5)

    def test_low_precision_inputs_compute_in_float32(self):
        inputs = triton_loss_inputs(7, dtype=torch.bfloat16)
        inputs[5] = inputs[5].clone()
        (out, gd, gs), (ref, rd, rs) = triton_run_both(inputs)
        assert out.dtype == torch.float32 and gd.dtype == torch.bfloat16 and gs.dtype == torch.bfloat16
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
        assert_grads_close((gd, gs), (rd, rs), rel=1e-2)  # the gradients are rounded to bf16 at the end

    def test_every_output_element_is_written(self, monkeypatch):
        monkeypatch.setattr(_common, "POISON", True)  # outputs start as NaN: an unwritten element would show
        inputs = triton_loss_inputs(8)
        losses, gd_box, gd_dfl, gs, inv_s = torch.ops.yolofast.bbox_loss_triton(*inputs)
        for t in (losses, gd_box, gd_dfl, gs, inv_s):
            assert torch.isfinite(t).all()
        ref = bbox_loss_ref(*inputs)
        torch.testing.assert_close(losses, ref, rtol=1e-5, atol=0)
        torch.testing.assert_close(inv_s, 1 / inputs[4].sum().clamp(min=1), rtol=1e-6, atol=0)

    def test_public_op_dispatches_to_triton_and_is_deterministic(self):
        inputs = triton_loss_inputs(9)
        with backend("triton"):
            a = public_bbox_loss(*inputs)
            b = public_bbox_loss(*inputs)
        assert torch.equal(a, b)
        torch.testing.assert_close(a, bbox_loss_ref(*inputs), rtol=1e-5, atol=0)

    def test_shape_errors_name_the_argument(self):
        inputs = triton_loss_inputs(10)
        with pytest.raises(ValueError, match="target_scores"):
            triton_bbox_loss(*inputs[:4], inputs[4][:, :-1], inputs[5])

    def test_opcheck(self):
        inputs = triton_loss_inputs(11, B=1, img=64, C=3)
        inputs[0].requires_grad_()
        inputs[1].requires_grad_()
        torch.library.opcheck(
            torch.ops.yolofast.bbox_loss_triton.default, tuple(inputs), test_utils=TRITON_OPCHECK_UTILS
        )

    @pytest.mark.skipif(
        TRITON_DEV == "cpu", reason="torch.compile traces Triton kernels only when they are compiled (CUDA)"
    )
    def test_torch_compile_fullgraph_matches_eager(self):
        inputs = triton_loss_inputs(12)

        def loss_and_grads(pd, ps, *rest):
            pd, ps = pd.detach().requires_grad_(), ps.detach().requires_grad_()
            out = triton_bbox_loss(pd, ps, *rest)
            (out * TRITON_GAINS.to(out)).sum().backward()
            return out.detach(), pd.grad, ps.grad

        eager = loss_and_grads(*inputs)
        compiled = torch.compile(lambda *a: triton_bbox_loss(*a), fullgraph=True)
        pd, ps = inputs[0].detach().requires_grad_(), inputs[1].detach().requires_grad_()
        out = compiled(pd, ps, *inputs[2:])
        (out * TRITON_GAINS.to(out)).sum().backward()
        torch.testing.assert_close(out.detach(), eager[0], rtol=1e-6, atol=0)
        torch.testing.assert_close(pd.grad, eager[1], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(ps.grad, eager[2], rtol=1e-6, atol=1e-9)
