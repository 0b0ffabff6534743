"""YOLO26's second top-k (``topk2``, spec YOLO11_YOLO26.md §4.3) in every assigner backend that runs here
against ``reference.tal_assign_ref(..., topk2=...)``: integer outputs and boxes exactly, scores to rounding.

Backends: the C++ kernel (cpp), the Triton kernel under TRITON_INTERPRET=1 (triton) and the CUDA kernel
compiled for the CPU emulation (emu, marked slow). Scenes: random ones from test_tal_assign (jittered copies
of the GTs make GTs compete, so anchors are won by overlap), YOLO26's one-to-one setting (topk 7, topk2 1),
topk2 > 1, and hand-made cases (a GT whose positives include an anchor it won by overlap, ties, empty
images, topk2 == topk, which is off).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

# Scene generators shared by every op's tests (tests/ops is on sys.path under pytest).
from op_inputs import NAMES, anchors_px, random_scene

from yolofast.ops.reference import tal_assign_ref

TOPK, ALPHA, BETA, EPS = 7, 0.5, 6.0, 1e-9


def _cpp():
    from yolofast.ops import _build

    ok, why = _build.extension_status("cpp")
    if not ok:
        pytest.skip(f"C++ extension unavailable: {why}")
    import yolofast.ops._library  # noqa: F401 - the schemas

    return lambda args, topk, topk2: torch.ops.yolofast.tal_assign(*args, topk, ALPHA, BETA, EPS, topk2)


def _triton():
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device")
    pytest.importorskip("triton")
    from yolofast.kernels.tal_assign import tal_assign

    def call(args, topk, topk2):
        return tal_assign(*args, topk, ALPHA, BETA, EPS, topk2=topk2)

    call.device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    return call



def _emu():
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler for the CUDA emulation")
    from cuda_emulation import build_emulation

    import yolofast.ops._library  # noqa: F401 - yolofast's own schemas first

    torch.ops.load_library(build_emulation())
    op = torch.ops.yolofast_cuda_emu.tal_assign
    return lambda args, topk, topk2: op(*args, topk, ALPHA, BETA, EPS, topk2)


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import yolofast.ops._library  # noqa: F401 - the schemas (and the CUDA kernels, when built)

    def call(args, topk, topk2):
        return torch.ops.yolofast.tal_assign(*args, topk, ALPHA, BETA, EPS, topk2)

    call.device = "cuda"  # the reference runs there too: the same CUDA atan/pow as the kernel
    return call


@pytest.fixture(
    scope="module",
    params=[
        "cpp",
        pytest.param("triton", marks=pytest.mark.triton),
        pytest.param("emu", marks=pytest.mark.slow),
        pytest.param("gpu", marks=pytest.mark.cuda),
    ],
)
def run(request):
    return {"cpp": _cpp, "triton": _triton, "emu": _emu, "gpu": _gpu}[request.param]()


def check(run, args, topk=TOPK, topk2=1, score_rtol=1e-5, score_atol=1e-7):
    """The kernel's outputs against the reference's on the kernel's device; returns the reference's."""
    args = tuple(a.to(getattr(run, "device", "cpu")) for a in args)
    ref = tal_assign_ref(*args, topk=topk, alpha=ALPHA, beta=BETA, eps=EPS, topk2=topk2)
    out = run(args, topk, topk2)
    for name, r, o in zip(NAMES, ref, out):
        assert o.dtype == r.dtype and o.shape == r.shape, (
            f"{name}: {o.dtype} {o.shape} vs {r.dtype} {r.shape}"
        )
        if name == "target_scores":
            torch.testing.assert_close(
                o, r, rtol=score_rtol, atol=score_atol, msg=lambda m, n=name: f"{n}: {m}"
            )
        else:
            diff = o != r
            assert not diff.any(), f"{name}: {int(diff.sum())} differ, first at {diff.nonzero()[:5].tolist()}"
    return ref


def _small(seed, M, B=2, imgsz=160, **kw):
    """random_scene at 160 px (A = 525): small enough for the Triton interpreter and the emulation."""
    return random_scene(seed, B=B, imgsz=imgsz, M=M, C=12, **kw)


@pytest.mark.parametrize("seed", range(6))
def test_one_to_one_random_scenes(run, seed):
    """topk 7 then topk2 1: every GT ends with at most one positive."""
    M = (1, 6, 20, 40)[seed % 4]
    ref = check(run, _small(seed, M, pad=seed % 2 == 0))
    fg, idx = ref[3], ref[4]
    for b in range(fg.shape[0]):
        per_gt = torch.bincount(idx[b][fg[b]], minlength=M)
        assert int(per_gt.max()) <= 1
    if M >= 20:
        assert int(fg.sum()) >= 5  # the scenes exercise the assigner, not only background


@pytest.mark.parametrize("topk2", [2, 3, 12])
def test_topk2_above_one_and_above_topk(run, topk2):
    """topk2 > 1 keeps several positives per GT; topk2 > topk still trims a GT that won extra anchors by
    overlap beyond its own picks."""
    check(run, _small(40 + topk2, 40), topk2=topk2)


def test_topk2_equal_to_topk_is_off(run):
    args = tuple(a.to(getattr(run, "device", "cpu")) for a in _small(50, 30))
    off = tal_assign_ref(*args, topk=TOPK, alpha=ALPHA, beta=BETA, eps=EPS)
    out = run(args, TOPK, TOPK)
    for name, r, o in zip(NAMES, off, out):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_topk2_changes_the_assignment(run):
    """Not a no-op: on a busy scene the second top-k removes positives that top-k alone keeps."""
    args = _small(51, 40)
    plain = tal_assign_ref(*args, topk=TOPK, alpha=ALPHA, beta=BETA, eps=EPS)
    ref = check(run, args)
    assert int(ref[3].sum()) < int(plain[3].sum())


def test_anchor_won_by_overlap_counts_for_its_winner():
    """Two GTs, the second one nested in the first: anchors selected by both go to the best-overlap GT;
    topk2 then ranks the winner's positives, its own and those it won, together."""
    anc = anchors_px(160)
    A = anc.shape[0]
    gt = torch.tensor([[[20.0, 20.0, 120.0, 120.0], [40.0, 40.0, 100.0, 100.0]]])
    # predictions: anchors near the centre predict the inner box (high overlap with GT 1), others the outer
    near = ((anc - 70).abs() < 20).all(-1)
    pd = torch.where(near[None, :, None], gt[:, 1:2], gt[:, 0:1]).expand(1, A, 4).clone()
    pd += torch.linspace(0, 1, A)[None, :, None]  # distinct overlaps: no ties
    scores = torch.full((1, A, 2), 0.5)
    labels = torch.tensor([[[0.0], [1.0]]])
    mask = torch.ones(1, 2, 1)
    args = (scores, pd, anc, labels, gt, mask)
    ref = tal_assign_ref(*args, topk=TOPK, alpha=ALPHA, beta=BETA, eps=EPS, topk2=1)
    for name in ("cpp",):
        out = _cpp()(args, TOPK, 1)
        for n, r, o in zip(NAMES, ref, out):
            torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-7, msg=lambda m, n=n, b=name: f"{b} {n}: {m}")
    assert int(ref[3].sum()) == 2  # one positive per GT


def test_ties_empty_images_and_padding(run):
    """Identical predictions give equal aligns (ties); an image without real GTs; padding rows."""
    scores, pd, anc, labels, gt, mask = _small(60, 10, B=3)
    pd[:, 100:140] = pd[:, 100:101]  # 40 anchors with one box: equal overlaps with every GT
    scores[:, 100:140] = scores[:, 100:101]
    mask[1] = 0  # image 1: padding only
    check(run, (scores, pd, anc, labels, gt, mask))


def test_no_gt_slots(run):
    scores, pd, anc, labels, gt, mask = _small(61, 4)
    check(run, (scores, pd, anc, labels[:, :0], gt[:, :0], mask[:, :0]))


def test_float64(run):
    args = _small(62, 20, dtype=torch.float64)
    check(run, args, score_rtol=1e-9, score_atol=1e-12)


def test_negative_topk2_is_refused(run):
    with pytest.raises((RuntimeError, ValueError), match="topk2"):
        run(tuple(a.to(getattr(run, "device", "cpu")) for a in _small(63, 3)), TOPK, -1)


def test_maps_variant_with_topk2():
    """tal_assign.maps (C++: scores = sigmoid of the head's class logits, read in place) with topk2 against
    the reference on the same sigmoid scores."""
    _cpp()
    from yolofast.ops import tal_assign_maps

    scores, pd, anc, labels, gt, mask = _small(64, 20)
    B, C = scores.shape[0], scores.shape[2]
    logits = torch.logit(scores.double()).float()
    sizes = [(160 // s) ** 2 for s in (8, 16, 32)]
    feats, a0 = [], 0
    for s, n in zip((8, 16, 32), sizes):
        h = 160 // s
        cls = logits[:, a0 : a0 + n].transpose(1, 2).reshape(B, C, h, h)
        feats.append(torch.cat((torch.zeros(B, 4 * 16, h, h), cls), 1))
        a0 += n
    sig = torch.cat([f[:, 64:].flatten(2) for f in feats], 2).transpose(1, 2).sigmoid()
    ref = tal_assign_ref(sig, pd, anc, labels, gt, mask, topk=TOPK, alpha=ALPHA, beta=BETA, eps=EPS, topk2=1)
    out = tal_assign_maps(feats, pd, anc, labels, gt, mask, TOPK, ALPHA, BETA, EPS, reg_max=16, topk2=1)
    for n, r, o in zip(NAMES, ref, out):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
