"""The inputs every op's tests share, and their tolerance tables (imported by tests/ops/test_*.py).

Scenes for the assigner (``random_scene``: 640 px pyramids, GTs of every size, padded slots), (B, A, .)
loss inputs (``make_inputs``) and the head's per-level maps (``make_maps``), built from seeded generators so
that every backend (C++, Triton interpreter, CUDA emulator, a GPU) is checked on the same tensors.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from yolofast.boxes import make_anchors
from yolofast.ops.reference import tal_assign_ref

REG_MAX = 16


def anchors_640(dtype=torch.float32):
    feats = [torch.empty(1, 1, 640 // s, 640 // s, dtype=dtype) for s in (8, 16, 32)]
    anc, _ = make_anchors(feats, (8, 16, 32))
    return anc  # (8400, 2) grid units of each level


def make_inputs(B, A, C, seed, fg_frac=0.06, reg_max=REG_MAX, anc=None, dtype=torch.float32):
    """Random but realistic inputs: logits of a trained-ish head, GT boxes around their anchors (grid units,
    some sides beyond the DFL clamp, some anchors outside their box), assigner-like one-class soft targets."""
    g = torch.Generator().manual_seed(seed)
    if anc is None:
        anc = (torch.rand(A, 2, generator=g) * 40).floor() + 0.5
    pred_dist = torch.randn(B, A, 4 * reg_max, generator=g) * 2.5
    pred_scores = torch.randn(B, A, C, generator=g) * 2.0 - 3.0
    centre = anc + (torch.rand(B, A, 2, generator=g) - 0.5) * 3
    wh = torch.rand(B, A, 2, generator=g) * (reg_max * 2.2) + 0.05
    target_bboxes = torch.cat((centre - wh / 2, centre + wh / 2), -1)
    fg = torch.rand(B, A, generator=g) < fg_frac
    label = torch.randint(0, C, (B, A), generator=g)
    score = torch.rand(B, A, generator=g) * fg
    target_scores = torch.zeros(B, A, C).scatter_(-1, label[..., None], score[..., None])
    cast = [t.to(dtype) for t in (pred_dist, pred_scores, anc, target_bboxes, target_scores)]
    return (*cast, fg)


def losses_and_grads(fn, args, upstream=(0.7, 1.3, -0.4)):
    pd = args[0].detach().clone().requires_grad_()
    ps = args[1].detach().clone().requires_grad_()
    out = fn(pd, ps, *args[2:])
    (out * torch.tensor(upstream, dtype=out.dtype, device=out.device)).sum().backward()
    return out.detach(), pd.grad, ps.grad


def assert_matches(got, want, rtol=1e-5):
    """Losses to rtol; gradients elementwise to rtol, with an absolute floor of rtol x the largest entry
    (most gradient entries are ~0 and a relative test of those is meaningless)."""
    (l1, gd1, gs1), (l2, gd2, gs2) = got, want
    torch.testing.assert_close(l1, l2, rtol=rtol, atol=0)
    for a, b in ((gd1, gd2), (gs1, gs2)):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()) + 1e-30)


def dfl_edge_inputs() -> tuple:
    """One image, 12 foreground anchors whose target distances sit exactly on bins (wl = 1, wr = 0), at 0,
    at/after reg_max - 1 (clamped to 14.99), negative (anchor outside its box) and far beyond."""
    dists = torch.tensor([0.0, 1.0, 7.0, 14.0, 14.99, 15.0, 16.0, 40.0, -3.0, 0.5, 13.999, 2.25])
    n = len(dists)
    anc = torch.stack((torch.arange(n) + 0.5, torch.full((n,), 20.5)), -1)
    ltrb = torch.stack((dists, dists.roll(1), dists.roll(2), dists.roll(3)), -1)
    tb = torch.cat((anc - ltrb[:, :2], anc + ltrb[:, 2:]), -1)[None]
    pd, ps, _, _, ts, _ = make_inputs(1, n, 5, 3, fg_frac=1.0)
    ts[..., 0] = torch.linspace(0.1, 1.0, n)
    return pd, ps, anc, tb, ts, torch.ones(1, n, dtype=torch.bool)


TOPK, ALPHA, BETA, EPS = 10, 0.5, 6.0, 1e-9


NAMES = ("target_labels", "target_bboxes", "target_scores", "fg_mask", "target_gt_idx")


def anchors_px(imgsz: int, dtype=torch.float32) -> torch.Tensor:
    feats = [torch.empty(1, 1, imgsz // s, imgsz // s, dtype=dtype) for s in (8, 16, 32)]
    pts, stride = make_anchors(feats, (8, 16, 32))
    return pts * stride


def random_scene(
    seed, B=2, imgsz=640, M=50, C=80, pad=True, dtype=torch.float32, min_side=1.0, max_side=None
):
    """GTs of every size (1 px .. 0.9 * imgsz, log-uniform; tiny ones get widened), centres up to 20 px
    past the border; predictions: half are jittered copies of a GT of the image (so CIoU > 0 and GTs
    compete), half are random boxes around their anchor. mask_gt pads each image to M with garbage rows."""
    g = torch.Generator().manual_seed(seed)
    anc = anchors_px(imgsz, dtype)
    A = anc.shape[0]

    def U(*s):
        return torch.rand(*s, generator=g, dtype=dtype)

    max_side = max_side or imgsz * 0.9
    centre = U(B, M, 2) * (imgsz + 40) - 20
    wh = torch.exp(U(B, M, 2) * (math.log(max_side) - math.log(min_side)) + math.log(min_side))
    gt = torch.cat((centre - wh / 2, centre + wh / 2), -1)
    labels = torch.randint(0, C, (B, M, 1), generator=g).to(dtype)
    if pad:
        n_real = torch.randint(0, M + 1, (B,), generator=g)
        mask = (torch.arange(M)[None] < n_real[:, None]).to(dtype)[..., None]
        # padding rows hold garbage that must be ignored
        gt = torch.where(mask.bool(), gt, U(B, M, 4) * imgsz)
        labels = torch.where(mask.bool(), labels, torch.full_like(labels, -1))
    else:
        mask = torch.ones(B, M, 1, dtype=dtype)
    pick = torch.randint(0, M, (B, A), generator=g)
    base = gt.gather(1, pick[..., None].expand(B, A, 4))
    size = (base[..., 2:] - base[..., :2]).repeat(1, 1, 2)
    jittered = base + (U(B, A, 4) - 0.5) * 0.4 * size
    own_wh = torch.exp(U(B, A, 2) * 5 + 1.0)
    own_c = anc[None] + (U(B, A, 2) - 0.5) * 16
    own = torch.cat((own_c - own_wh / 2, own_c + own_wh / 2), -1)
    pd = torch.where(U(B, A, 1) < 0.5, jittered, own)
    pd = torch.cat((torch.minimum(pd[..., :2], pd[..., 2:]), torch.maximum(pd[..., :2], pd[..., 2:])), -1)
    scores = torch.sigmoid(torch.randn(B, A, C, generator=g, dtype=dtype) * 2 - 2)
    return scores, pd, anc, labels, gt, mask


F64 = torch.float64


def t64(x):
    return torch.tensor(x, dtype=F64)


def close(got, expected, rel=1e-7, abs=1e-12):
    torch.testing.assert_close(got.to(F64), t64(expected), rtol=rel, atol=abs)


def assign(scores, pd, anc, labels, gts, mask=None, **kw):
    """tal_assign_ref on one image (B = 1), inputs as nested lists, in float64."""
    scores, pd, anc, gts = t64([scores]), t64([pd]), t64(anc), t64([gts]).reshape(1, -1, 4)
    labels = t64([labels]).reshape(1, -1, 1)
    mask = torch.ones_like(labels) if mask is None else t64([mask]).reshape(1, -1, 1)
    return tal_assign_ref(scores, pd, anc, labels, gts, mask, **kw)


def ciou_py(a, b, alpha=None, eps=1e-7):
    """Scalar CIoU with an optional frozen alpha (used to check alpha is a constant in the gradient)."""
    w1, h1, w2, h2 = a[2] - a[0], a[3] - a[1] + eps, b[2] - b[0], b[3] - b[1] + eps
    inter = max(min(a[2], b[2]) - max(a[0], b[0]), 0) * max(min(a[3], b[3]) - max(a[1], b[1]), 0)
    iou = inter / (w1 * h1 + w2 * h2 - inter + eps)
    c2 = (max(a[2], b[2]) - min(a[0], b[0])) ** 2 + (max(a[3], b[3]) - min(a[1], b[1])) ** 2 + eps
    rho2 = ((b[0] + b[2] - a[0] - a[2]) ** 2 + (b[1] + b[3] - a[1] - a[3]) ** 2) / 4
    v = 4 / math.pi**2 * (math.atan(w2 / h2) - math.atan(w1 / h1)) ** 2
    if alpha is None:
        alpha = v / (v - iou + 1 + eps)
    return iou - (rho2 / c2 + v * alpha), alpha


def small_scene(B, A, C, M):
    side = int(math.isqrt(A))
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    anc = (torch.stack((xs, ys), -1).reshape(-1, 2).to(F64) + 0.5) * 8  # an 8 px grid
    size = side * 8
    ctr = torch.rand(B, M, 2, dtype=F64) * size
    wh = torch.rand(B, M, 2, dtype=F64) * size / 2 + 1  # some under 16 px
    gts = torch.cat((ctr - wh / 2, ctr + wh / 2), -1)
    jitter = torch.randn(B, anc.shape[0], 4, dtype=F64) * 6
    pd = torch.cat((anc - 12, anc + 12), -1) + jitter
    pd = torch.cat((pd[..., :2], torch.maximum(pd[..., 2:], pd[..., :2] + 1)), -1)
    scores = torch.rand(B, anc.shape[0], C, dtype=F64)
    labels = torch.randint(0, C, (B, M, 1)).to(F64)
    mask = (torch.rand(B, M, 1) < 0.8).to(F64)
    return scores, pd, anc, labels, gts, mask


UPSTREAM = (0.7, 1.3, -0.4)


def make_maps(B, C, sizes, seed, reg_max=16, fg_frac=0.1, dtype=torch.float32, strides=(8, 16, 32)):
    """Random head maps (B, 4R+C, H, W) and the targets of their anchors (grid units), fg anchors with one
    soft class target each, some target sides beyond the DFL clamp and some anchors outside their box."""
    g = torch.Generator().manual_seed(seed)
    feats = []
    for h, w in sizes:
        dist = torch.randn(B, 4 * reg_max, h, w, generator=g) * 2.5
        cls = torch.randn(B, C, h, w, generator=g) * 2.0 - 3.0
        feats.append(torch.cat((dist, cls), 1).to(dtype))
    anc, stride = make_anchors(feats, strides[: len(sizes)])
    anc = anc.float()
    A = anc.shape[0]
    centre = anc + (torch.rand(B, A, 2, generator=g) - 0.5) * 3
    wh = torch.rand(B, A, 2, generator=g) * (reg_max * 2.2) + 0.05
    tb = torch.cat((centre - wh / 2, centre + wh / 2), -1)
    fg = torch.rand(B, A, generator=g) < fg_frac
    label = torch.randint(0, C, (B, A), generator=g)
    score = torch.rand(B, A, generator=g) * fg
    ts = torch.zeros(B, A, C).scatter_(-1, label[..., None], score[..., None])
    return feats, anc, tb, ts, fg

def ema_pair(n, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    ema = torch.randn(n, generator=g).to(dtype)
    model = (ema.float() + torch.randn(n, generator=g) * 0.1).to(dtype)
    return ema.to(device), model.to(device)


def small_loss_inputs(seed, B=2, img=160, C=20, fg_frac=0.3, dtype=torch.float32, device="cpu", R=16):
    """Random logits; targets in grid units near each anchor (A = 525 anchors at 160 px): small enough for
    Triton's interpreter. A list (tests replace single inputs)."""
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
    return [t.to(device) for t in cast] + [fg.to(device)]


def small_assign_inputs(seed, B=2, img=160, C=20, M=12, pad=3, dtype=torch.float32):
    """Random GTs (a few padding rows), predicted boxes around the anchors, random scores (A = 525 at 160)."""
    g = torch.Generator().manual_seed(seed)
    anc = anchors_px(img)
    A = anc.shape[0]
    ctr = torch.rand(B, M, 2, generator=g) * img
    wh = torch.rand(B, M, 2, generator=g) ** 2 * img * 0.6 + 2  # many sides < 16 px: widened
    gt = torch.cat((ctr - wh / 2, ctr + wh / 2), -1)
    mask = torch.ones(B, M, 1)
    mask[:, M - pad :] = 0
    labels = torch.randint(0, C, (B, M, 1), generator=g).float()
    pwh = torch.rand(B, A, 2, generator=g) * img * 0.4 + 4
    pc = anc + torch.randn(B, A, 2, generator=g) * 8
    pd = torch.cat((pc - pwh / 2, pc + pwh / 2), -1)
    scores = torch.rand(B, A, C, generator=g)
    return [scores.to(dtype), pd.to(dtype), anc.to(dtype), labels, gt.to(dtype), mask]


# --------------------------------------------------------------------------------------- tolerance tables
# tal_assign: integer outputs and boxes are compared exactly on every backend; target_scores to
# (rtol, atol). The C++ kernel's overlaps and aligns are bit-identical to the reference's; on a GPU the
# kernel's float math is torch's own (same CUDA atan/pow); the CUDA emulation calls glibc's powf/atanf where
# the CPU reference uses SLEEF/MKL: an ulp of overlap, raised to the 6th power, moves a score by up to ~2e-6.
ASSIGN_SCORE_TOL = {"cpp": (1e-6, 1e-10), "gpu": (1e-6, 1e-10), "emu": (1e-5, 1e-7)}
# bbox_loss: losses to rtol, gradients elementwise to rtol with an absolute floor of rtol x the largest entry.
LOSS_RTOL = {"cpp": 1e-5, "gpu": 1e-5, "emu": 1e-5, "float64": 1e-12}


# ------------------------------------------------------------------------------------ Triton kernels
# On the CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before any import),
# the compiled kernel on a GPU; without triton these tests skip and the others run.
TRITON_DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def needs_triton(no_triton: str) -> list:
    """The marks of a Triton kernel test; ``no_triton``: why the module's kernel import failed, or ""."""
    return [
        pytest.mark.triton,
        pytest.mark.skipif(bool(no_triton), reason=no_triton or "triton present"),
        pytest.mark.skipif(TRITON_DEV == "cuda" and not torch.cuda.is_available(),
                           reason="Triton kernels need TRITON_INTERPRET=1 or a CUDA device"),
    ]
