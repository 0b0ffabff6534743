"""bbox_loss_maps for reg_max 1 (YOLO26: raw distances, CIoU + L1 + BCE, YOLO11_YOLO26.md §4.2) in the C++
kernel against reference.bbox_loss_ref(..., stride_tensor, img_hw) on the maps cat into (B, A, .): the three
losses and every map's gradient, with dense and per-anchor targets, with and without final gradients
(weights), negative targets (anchors outside their enlarged box) and garbage background boxes."""

from __future__ import annotations

import pytest
import torch

from yolofast.boxes import make_anchors
from yolofast.ops import backend, bbox_loss_maps, reference
from yolofast.ops.bbox_loss import maps_to_rows

UPSTREAM = (0.7, 1.3, -0.4)
STRIDES = (8.0, 16.0, 32.0)


def make_l1_maps(B, C, hw, seed, fg_frac=0.2, dtype=torch.float32):
    """Random reg_max 1 maps (B, 4 + C, H/s, W/s) of an H x W batch image, targets in grid units with some
    anchors outside their box (negative target distances) and NaN boxes on the background."""
    g = torch.Generator().manual_seed(seed)
    H, W = hw
    feats = []
    for s in STRIDES:
        h, w = int(H // s), int(W // s)
        dist = torch.rand(B, 4, h, w, generator=g) * 6  # raw distances, grid units
        cls = torch.randn(B, C, h, w, generator=g) * 2.0 - 3.0
        feats.append(torch.cat((dist, cls), 1).to(dtype))
    anc, stride = make_anchors(feats, STRIDES)
    A = anc.shape[0]
    centre = anc + (torch.rand(B, A, 2, generator=g) - 0.5) * 4  # up to 2 cells off: outside small boxes
    wh = torch.rand(B, A, 2, generator=g) * 8 + 0.1
    tb = torch.cat((centre - wh / 2, centre + wh / 2), -1)
    fg = torch.rand(B, A, generator=g) < fg_frac
    tb = torch.where(fg[..., None], tb, torch.full_like(tb, float("nan")))  # never read
    label = torch.randint(0, C, (B, A), generator=g)
    score = torch.rand(B, A, generator=g) * fg
    ts = torch.zeros(B, A, C).scatter_(-1, label[..., None], score[..., None])
    return feats, anc, stride, tb, ts, fg, label


def _grads(out, fs):
    return torch.autograd.grad((out * torch.tensor(UPSTREAM, dtype=out.dtype)).sum(), fs)


def run_ref(feats, anc, stride, tb, ts, fg, hw):
    fs = [f.detach().clone().requires_grad_() for f in feats]
    pd, ps = maps_to_rows(fs, 1)
    out = reference.bbox_loss_ref(pd, ps, anc, tb, ts, fg, stride, hw)
    return out.detach(), _grads(out, fs)


def run_cpp(feats, anc, tb, ts, fg, label=None, weights=None):
    fs = [f.detach().clone().requires_grad_() for f in feats]
    with backend("cpp"):
        out = bbox_loss_maps(fs, anc, tb, ts, fg, 1, target_labels=label, weights=weights, strides=STRIDES)
    return out.detach(), _grads(out, fs)


def assert_close(got, want, rtol=1e-5):
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=0)
    for a, b in zip(got[1], want[1]):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()) + 1e-30)


@pytest.fixture(scope="module", autouse=True)
def _cpp(lib):
    return lib


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("hw", [(64.0, 64.0), (96.0, 160.0)])
def test_matches_reference(seed, hw):
    feats, anc, stride, tb, ts, fg, _ = make_l1_maps(2, 7, hw, seed)
    assert int(fg.sum()) > 10
    assert_close(run_cpp(feats, anc, tb, ts, fg), run_ref(feats, anc, stride, tb, ts, fg, hw))


def test_negative_target_distances_are_not_clamped():
    feats, anc, stride, tb, ts, fg, _ = make_l1_maps(1, 3, (64.0, 64.0), 7, fg_frac=0.5)
    t = torch.cat((anc - tb[..., :2], tb[..., 2:] - anc), -1)
    assert bool((t[fg] < 0).any())  # the scene has anchors outside their box
    assert_close(run_cpp(feats, anc, tb, ts, fg), run_ref(feats, anc, stride, tb, ts, fg, (64.0, 64.0)))


def test_per_anchor_targets_and_final_gradients():
    """target_scores (B, A) with their labels, and weights (the forward writes the final map gradients)."""
    hw = (64.0, 96.0)
    feats, anc, stride, tb, ts, fg, label = make_l1_maps(2, 5, hw, 8)
    per_anchor = ts.sum(-1)
    want = run_ref(feats, anc, stride, tb, ts, fg, hw)
    assert_close(run_cpp(feats, anc, tb, per_anchor, fg, label=label), want)
    w = torch.tensor(UPSTREAM)
    assert_close(run_cpp(feats, anc, tb, per_anchor, fg, label=label, weights=w), want)


def test_no_foreground_and_float64():
    hw = (64.0, 64.0)
    feats, anc, stride, tb, ts, fg, _ = make_l1_maps(1, 4, hw, 9, fg_frac=0.0)
    assert_close(run_cpp(feats, anc, tb, ts, fg), run_ref(feats, anc, stride, tb, ts, fg, hw))
    feats, anc, stride, tb, ts, fg, _ = make_l1_maps(1, 4, hw, 10, dtype=torch.float64)
    got = run_cpp(feats, anc.double(), tb.double(), ts.double(), fg)
    want = run_ref(feats, anc.double(), stride.double(), tb.double(), ts.double(), fg, hw)
    assert_close(got, want, rtol=1e-9)


def test_reg_max_1_needs_the_strides(lib):
    feats, anc, _, tb, ts, fg, _ = make_l1_maps(1, 3, (64.0, 64.0), 11)
    with pytest.raises(ValueError, match="strides"), backend("cpp"):
        bbox_loss_maps(feats, anc, tb, ts, fg, 1)
    with pytest.raises(RuntimeError, match="l1_scale"):
        lib.bbox_loss_maps(feats, anc, tb, ts, fg, 1)
