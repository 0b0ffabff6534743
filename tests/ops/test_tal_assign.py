"""tal_assign: the C++ sparse assigner (csrc/cpu/tal_assign_kernel.cpp), and the CUDA one (csrc/cuda, on a GPU
or the CPU emulation: the ``impl`` fixture) against reference.tal_assign_ref. The Triton kernel:
test_triton_tal_assign.py. Scenes and tolerances: op_inputs.py.

Integer outputs (labels, fg_mask, target_gt_idx) must be exactly equal and the boxes too (they are gathers);
scores to rtol 1e-6 (+ atol 1e-10). The kernel takes atan from at::atan and pow from the SLEEF function
that ATen's pow uses, so its overlaps and aligns are normally bit-identical; the reference itself computes
the last few elements of each ATen pow call with libm (an ulp apart, amplified up to 6x by overlap^6; worst
seen 3.2e-7 relative). Were the SLEEF lookup to fail on some platform, libm's pow would put ~1e-6 relative
differences on some scores, and tiny scores (< 1e-7) whose CIoU is a near-cancelling difference more.
Every output element is compared, so an element the kernel forgot to write fails.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cuda_emulation import Impl, gpu
from op_inputs import (
    ALPHA,
    ASSIGN_SCORE_TOL,
    BETA,
    EPS,
    NAMES,
    TOPK,
    TRITON_DEV,
    anchors_px,
    needs_triton,
    random_scene,
    small_assign_inputs,
)

from yolofast.ops import reference
from yolofast.ops import tal_assign as public_tal_assign
from yolofast.ops._backend import backend
from yolofast.ops.reference import tal_assign_ref


def _load_op():
    from yolofast.ops import _build

    ok, why = _build.extension_status("cpp")
    if not ok:
        pytest.skip(f"C++ extension unavailable: {why}")
    if not torch._C._dispatch_has_kernel_for_dispatch_key("yolofast::tal_assign", "CPU"):
        pytest.skip("the C++ extension has no CPU tal_assign kernel")
    return torch.ops.yolofast.tal_assign


@pytest.fixture(scope="module")
def op():
    return _load_op()


def run_both(op, args, topk=TOPK, alpha=ALPHA, beta=BETA, eps=EPS):
    ref = tal_assign_ref(*args, topk=topk, alpha=alpha, beta=beta, eps=eps)
    out = op(*args, topk, alpha, beta, eps)
    return ref, out


def assert_same(ref, out, score_rtol=ASSIGN_SCORE_TOL["cpp"][0], score_atol=ASSIGN_SCORE_TOL["cpp"][1]):
    for name, r, o in zip(NAMES, ref, out):
        assert o.dtype == r.dtype, f"{name}: dtype {o.dtype} != reference {r.dtype}"
        assert o.shape == r.shape, f"{name}: shape {tuple(o.shape)} != reference {tuple(r.shape)}"
        if name == "target_scores":
            torch.testing.assert_close(
                o, r, rtol=score_rtol, atol=score_atol, msg=lambda m, n=name: f"{n}: {m}"
            )
        else:
            diff = (o != r) if not o.is_floating_point() else ~((o == r) | (o.isnan() & r.isnan()))
            assert not diff.any(), (
                f"{name}: {int(diff.sum())} elements differ, first at {diff.nonzero()[:5].tolist()}"
            )


def check(op, args, **kw):
    ref, out = run_both(op, args, **kw)
    assert_same(ref, out)
    return ref, out


# ------------------------------------------------------------------------------------------------ random
@pytest.mark.parametrize("seed", range(30))
def test_random_scenes_match_reference(op, seed):
    M = (1, 8, 40, 120, 300)[seed % 5]
    ref, out = check(op, random_scene(seed, B=2, M=M, pad=seed % 3 != 0))
    if M >= 40:  # the scenes must exercise the assigner, not just background
        assert ref[3].sum() > 10 * (M // 40)


@pytest.mark.parametrize("seed", range(3))
def test_fp64_inputs(op, seed):
    args = random_scene(100 + seed, B=2, M=(5, 60, 200)[seed], dtype=torch.float64)
    ref, out = check(op, args)
    assert out[2].dtype == torch.float64 and out[1].dtype == torch.float64


def test_mixed_dtypes_follow_reference(op):
    """bf16 scores with fp32 boxes: computed in fp32, target_scores back in bf16; fp64 boxes with fp32
    scores: computed in fp64, target_scores fp32, target_bboxes fp64."""
    scores, pd, anc, labels, gt, mask = random_scene(7, B=2, M=60)
    ref, out = run_both(op, (scores.bfloat16(), pd, anc, labels, gt, mask))
    assert_same(ref, out, score_rtol=1e-2, score_atol=1e-6)  # one bf16 ulp if fp32 ulps straddle a rounding
    check(op, (scores, pd, anc, labels.long(), gt.double(), mask.bool()))


def test_non_default_hyperparameters(op):
    args = random_scene(11, B=2, M=80)
    for topk, alpha, beta in ((13, 1.0, 2.0), (1, 0.5, 6.0), (10, 0.25, 3.5), (10, 0.5, 0.0), (0, 0.5, 6.0)):
        check(op, args, topk=topk, alpha=alpha, beta=beta)


def test_same_result_on_any_thread_count(op):
    args = random_scene(12, B=3, M=200)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(*args, TOPK, ALPHA, BETA, EPS)
    finally:
        torch.set_num_threads(n)
    many = op(*args, TOPK, ALPHA, BETA, EPS)
    for name, a, b in zip(NAMES, one, many):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------------------------ constructed
def _one_image(gt_boxes, labels, pd_box=None, imgsz=640, C=4, score=0.5, dtype=torch.float32):
    """One image, anchors of a 640 px pyramid, every prediction the same box (or per-anchor boxes)."""
    anc = anchors_px(imgsz, dtype)
    A = anc.shape[0]
    gt = torch.tensor(gt_boxes, dtype=dtype)[None]
    M = gt.shape[1]
    lab = torch.tensor(labels, dtype=dtype).view(1, M, 1)
    mask = torch.ones(1, M, 1, dtype=dtype)
    if pd_box is None:
        pd_box = gt[0, 0]
    pd = torch.as_tensor(pd_box, dtype=dtype).expand(1, A, 4).clone()
    scores = torch.full((1, A, C), score, dtype=dtype)
    return scores, pd, anc, lab, gt, mask


def test_topk_ties_go_to_lower_anchor_index(op):
    # Every candidate has the same prediction and score: all aligns tie, so the k picks are the k
    # candidates with the lowest anchor index (row-major in the stride-8 level first).
    args = _one_image([[200.0, 200.0, 300.0, 260.0]], [1], pd_box=[205.0, 202.0, 298.0, 262.0])
    ref, out = check(op, args)
    anc = args[2]
    inside = (anc[:, 0] > 200) & (anc[:, 0] < 300) & (anc[:, 1] > 200) & (anc[:, 1] < 260)
    expected = inside.nonzero().squeeze(1)[:TOPK]
    assert out[3][0].nonzero().squeeze(1).tolist() == expected.tolist()


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("topk", (1, 3, 10, 40))
def test_topk_filling_inside_a_candidate_row(op, dtype, topk):
    """The kernel prepares a whole row of candidates (one SIMD vector) against the top-k as it stood before
    the row, then pushes them in anchor order: with a small k the top-k fills in the first lanes of a row
    and later lanes, which one-at-a-time bounds would have skipped, must still be rejected, ties included.
    One big GT, every prediction a jittered copy of it (high overlaps that all compete), a few exact copies
    (tied aligns) and random scores."""
    g = torch.Generator().manual_seed(11 + topk)
    box = [100.0, 120.0, 500.0, 420.0]
    scores, pd, anc, lab, gt, mask = _one_image([box], [2], dtype=dtype)
    A = anc.shape[0]
    pd = torch.tensor(box, dtype=dtype).expand(A, 4) + (torch.rand(A, 4, generator=g, dtype=dtype) - 0.5) * 40
    exact = torch.rand(A, generator=g) < 0.1
    pd = torch.where(exact[:, None], torch.tensor(box, dtype=dtype).expand(A, 4), pd)
    scores = torch.rand(1, A, 4, generator=g, dtype=dtype) * 0.9 + 0.05
    scores[0, exact] = 0.5
    ref, out = check(op, (scores, pd[None], anc, lab, gt, mask), topk=topk)
    assert int(out[3].sum()) == topk


def test_every_pow_variant_agrees_lane_for_lane(op):
    """The kernel raises a row of overlaps to beta with one call of a SLEEF vector pow (pow_many) and must
    get what one value at a time gives. It probes every variant this CPU can run (also the 8-lane AVX2 ones
    on an AVX-512 CPU, which it would not pick there) and says so under YOLOFAST_TAL_DEBUG: in a fresh
    process, since the probe runs once per process."""
    here = str(Path(__file__).parent)
    code = (
        f"import sys, torch; sys.path.insert(0, {here!r})\n"
        "import test_tal_assign as t\n"
        "op = t._load_op()\n"
        "for dt in (torch.float32, torch.float64):\n"
        "    t.check(op, t.random_scene(3, B=1, M=20, dtype=dt))\n"
    )
    env = {**os.environ, "YOLOFAST_TAL_DEBUG": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [s for s in res.stderr.splitlines() if "candidate" in s]
    if not lines:
        pytest.skip("no SLEEF variant on this platform: pow comes from libm, one value at a time")
    assert all("pow_many differs from pow in 0/" in s for s in lines), "\n".join(lines)
    assert {"float32", "float64"} <= {s.split("(")[1].split(")")[0] for s in lines}


def test_identical_gts_tie_to_lowest_index(op):
    box = [300.0, 100.0, 380.0, 150.0]
    other = [20.0, 500.0, 90.0, 600.0]
    args = _one_image([other, box, box, box], [0, 1, 2, 3], pd_box=[302.0, 101.0, 377.0, 152.0])
    ref, out = check(op, args)
    fg, idx = out[3][0], out[4][0]
    assert fg.sum() == TOPK  # the three copies pick the same anchors; all conflicts, all to GT 1
    assert set(idx[fg].tolist()) == {1}


def test_conflict_goes_to_best_overlap_even_if_it_did_not_select(op):
    # GT 0 (label 0) and GT 1 (label 1) overlap. Anchor predictions are GT 1's box, but class 0 scores
    # high and class 1 scores low; GT 2 (label 0) has GT 0's box, so GT 0 and 2 select the same anchors.
    # Conflicts resolve by overlap: GT 1 fits the predictions best although it selected other anchors.
    gts = [[100.0, 100.0, 260.0, 260.0], [120.0, 120.0, 250.0, 250.0], [100.0, 100.0, 260.0, 260.0]]
    scores, pd, anc, lab, gt, mask = _one_image(gts, [0, 1, 0], pd_box=gts[1])
    g = torch.Generator().manual_seed(0)
    scores = scores * (0.5 + torch.rand(scores.shape, generator=g))  # break the ties of test above
    scores[..., 1] *= 0.01
    ref, out = check(op, (scores, pd, anc, lab, gt, mask))
    assert (out[4][0][out[3][0]] == 1).any()


def _f32_step(v: float, steps: int) -> float:
    """v moved by `steps` float32 ulps (negative: down)."""
    t = torch.tensor(v, dtype=torch.float32)
    target = torch.tensor(math.inf if steps > 0 else -math.inf)
    for _ in range(abs(steps)):
        t = torch.nextafter(t, target)
    return t.item()


def test_anchor_exactly_on_box_edges(op):
    # Stride-8 centres are 4, 12, 20, ...; an edge ON a centre excludes it (strict inequality), an edge one
    # float32 ulp outside includes it, one ulp inside excludes it.
    gts = [
        [100.0, 100.0, 164.0, 132.0],  # all four sides on centres
        [_f32_step(4.0, -1), _f32_step(4.0, -1), _f32_step(20.0, 1), _f32_step(20.0, 1)],
        [_f32_step(4.0, 1), _f32_step(300.0, 1), _f32_step(36.0, -1), 340.0],
        [600.0, 600.0, 636.0, 636.0],  # bottom-right corner, centres 604..628
    ]
    scores, pd, anc, lab, gt, mask = _one_image(gts, [0, 1, 2, 3])
    pd = torch.cat((anc - 10, anc + 10), -1)[None]  # boxes around their anchors: CIoU > 0 near each GT
    ref, out = check(op, (scores, pd, anc, lab, gt, mask), topk=100)
    ax, ay = anc[:, 0], anc[:, 1]
    fg, idx = out[3][0], out[4][0]
    # GT 0's positives lie strictly inside it, none on its edges
    in0 = (ax > 100) & (ax < 164) & (ay > 100) & (ay < 132)
    fg0 = fg & (idx == 0)
    assert not (fg0 & ~in0).any() and (fg0 & in0).any()
    # GT 1 (edges one ulp outside the centres 4 and 20) owns the stride-8 anchor at (4, 4)
    assert fg[0] and idx[0] == 1


def test_small_boxes_are_widened_and_may_have_fewer_than_k_candidates(op):
    gts = [[50.0, 50.0, 52.0, 53.0], [300.0, 300.0, 315.99, 316.0], [400.0, 40.0, 416.0, 41.0]]
    scores, pd, anc, lab, gt, mask = _one_image(gts, [0, 1, 2])
    pd = torch.cat((anc - 6, anc + 6), -1)[None]
    ref, out = check(op, (scores, pd, anc, lab, gt, mask))
    counts = torch.bincount(out[4][0][out[3][0]], minlength=3)
    assert (counts > 0).all() and (counts < TOPK).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_candidate_rows_of_every_width(op, dtype):
    """The kernel computes the CIoU bounds of a candidate row a SIMD vector at a time (4, 8 or 16 lanes, 2-8
    for float64): rows of 1..40 stride-8 anchors end on every lane of a partial vector. Per-anchor
    predictions near each GT (so overlaps are > 0 and compete), some inverted (x2 < x1) and some NaN at
    row ends, and top-k 100 so that every candidate's value is used."""
    g = torch.Generator().manual_seed(7)
    # GT j spans j + 1 stride-8 centres in x and 2 in y (edges 3 px off the centres), shifted along x.
    gts = []
    for j, w in enumerate(range(1, 41)):
        x1, y1 = 24.0 * (j % 8) + 1.0, 16.0 * j + 2.0
        gts.append([x1, y1, x1 + 8.0 * w, y1 + 16.0])
    labels = [j % 4 for j in range(len(gts))]
    scores, pd, anc, lab, gt, mask = _one_image(gts, labels, dtype=dtype)
    A = anc.shape[0]
    jitter = (torch.rand(A, 4, generator=g, dtype=dtype) - 0.5) * 12
    pd = torch.cat((anc - 9, anc + 9), -1) + jitter
    inverted = torch.rand(A, generator=g) < 0.05
    pd = torch.where(inverted[:, None], pd[:, [2, 3, 0, 1]], pd)
    row_end = (anc[:, 0] - 4) % 64 == 56  # x = 60, 124, ...: the last lane of many rows
    nan = row_end & (torch.rand(A, generator=g) < 0.3)
    pd = torch.where(nan[:, None], torch.full_like(pd, float("nan")), pd)
    scores = torch.rand(1, A, 4, generator=g, dtype=dtype) * 0.9 + 0.05
    ref, out = check(op, (scores, pd[None], anc, lab, gt, mask), topk=100)
    assert out[3].sum() > 200  # many positives: the comparison covered real picks


def test_no_gt_slots(op):
    scores, pd, anc, labels, gt, mask = random_scene(3, B=2, M=4)
    ref, out = check(op, (scores, pd, anc, labels[:, :0], gt[:, :0], mask[:, :0]))
    assert (out[0] == scores.shape[-1]).all() and not out[3].any()


def test_all_padding(op):
    scores, pd, anc, labels, gt, mask = random_scene(4, B=2, M=6)
    labels[0, 0], labels[1, 0] = 3.0, -1.0  # padding labels still become the background label, clamped >= 0
    ref, out = check(op, (scores, pd, anc, labels, gt, torch.zeros_like(mask)))
    assert not out[3].any() and (out[0][0] == 3).all() and (out[0][1] == 0).all()


def test_out_of_range_labels_follow_reference(op):
    scores, pd, anc, labels, gt, mask = random_scene(5, B=2, M=30, pad=False)
    labels[0, :3, 0] = torch.tensor([-1.0, 80.0, 200.0])
    check(op, (scores, pd, anc, labels, gt, mask))


@pytest.mark.parametrize(
    "kind", ["random_points", "perturbed_grid", "single_level", "levels_reversed", "few_anchors"]
)
def test_arbitrary_anchors(op, kind):
    """Anchors that are not make_anchors' grid: the kernel's grid inference must notice (or describe them
    exactly) and still give the reference's answer."""
    scores, pd, anc, labels, gt, mask = random_scene(21, B=2, M=40)
    g = torch.Generator().manual_seed(1)
    if kind == "random_points":
        anc = torch.rand(anc.shape, generator=g) * 640
    elif kind == "perturbed_grid":
        anc = anc.clone()
        anc[1234, 0] = torch.nextafter(anc[1234, 0], torch.tensor(1e9))
        anc[5000, 1] -= 3.0
    elif kind == "levels_reversed":  # still grids (stride 32 first): ties must follow the anchor index
        order = torch.cat((torch.arange(8000, 8400), torch.arange(6400, 8000), torch.arange(0, 6400)))
        anc, scores, pd = anc[order], scores[:, order], pd[:, order]
    elif kind == "single_level":
        anc = anchors_px(640)[:6400].flip(0)  # descending: no row is increasing
        scores, pd = scores[:, :6400], pd[:, :6400]
    else:
        idx = torch.randperm(anc.shape[0], generator=g)[:7]
        anc, scores, pd = anc[idx], scores[:, idx], pd[:, idx]
    check(op, (scores, pd, anc, labels, gt, mask))
    if kind == "few_anchors":
        check(op, (scores, pd, anc, labels, gt, mask), topk=30)  # topk > A


def test_non_finite_boxes_follow_reference(op):
    """NaN/inf predictions (a diverged model) and a NaN GT: NaN aligns rank first in the reference's sort and
    take top-k slots without becoming positives; the kernel must reproduce that, not crash."""
    scores, pd, anc, labels, gt, mask = random_scene(16, B=2, M=40, pad=False)
    g = torch.Generator().manual_seed(2)
    bad = torch.rand(pd.shape[:2], generator=g) < 0.05
    pd = torch.where(bad[..., None], torch.tensor([float("nan"), 0.0, 10.0, 10.0]), pd)
    inf = torch.rand(pd.shape[:2], generator=g) < 0.02
    pd = torch.where(inf[..., None], torch.tensor([-float("inf"), 0.0, float("inf"), 30.0]), pd)
    gt[0, 3] = float("nan")
    check(op, (scores, pd, anc, labels, gt, mask))


def test_outputs_are_written_everywhere(op):
    """Freed NaN-filled blocks of the outputs' sizes are likely to be handed back by malloc: any output
    element the kernel does not write keeps the poison and fails the comparison."""
    args = random_scene(9, B=2, M=50)
    B, A, C = args[0].shape
    for _ in range(2):
        poison = [
            torch.full((B, A, C), float("nan")),
            torch.full((B, A, 4), float("nan")),
            torch.full((B, A), -7, dtype=torch.long),
            torch.full((B, A), -7, dtype=torch.long),
        ]
        del poison
    check(op, args)


def test_public_wrapper_uses_cpp_backend(op):
    from yolofast import ops

    args = random_scene(13, B=2, M=30)
    with ops.backend("cpp"):
        out = ops.tal_assign(*args)
    direct = op(*args, TOPK, ALPHA, BETA, EPS)
    for name, a, b in zip(NAMES, out, direct):
        assert torch.equal(a, b), name


def test_bad_shapes_raise_clear_errors(op):
    scores, pd, anc, labels, gt, mask = random_scene(14, B=2, M=5)
    with pytest.raises(RuntimeError, match="tal_assign: anc_points"):
        op(scores, pd, anc[:-1], labels, gt, mask, TOPK, ALPHA, BETA, EPS)
    with pytest.raises(RuntimeError, match="tal_assign: pd_bboxes"):
        op(scores, pd[..., :3], anc, labels, gt, mask, TOPK, ALPHA, BETA, EPS)
    with pytest.raises(RuntimeError, match="tal_assign: mask_gt"):
        op(scores, pd, anc, labels, gt, mask[:, :4], TOPK, ALPHA, BETA, EPS)
    with pytest.raises(RuntimeError, match="tal_assign: topk"):
        op(scores, pd, anc, labels, gt, mask, -1, ALPHA, BETA, EPS)


def test_opcheck(op):
    scores, pd, anc, labels, gt, mask = random_scene(15, B=2, imgsz=128, M=6, C=3)
    torch.library.opcheck(
        torch.ops.yolofast.tal_assign.default, (scores, pd, anc, labels, gt, mask, TOPK, ALPHA, BETA, EPS)
    )


@pytest.mark.slow
def test_dense_scene_matches_reference(op):
    """B=2, 640 px, 1,000 GT per image (the reference needs ~2 GB here)."""
    args = random_scene(31, B=2, M=1000, pad=False, min_side=4.0, max_side=96.0)
    ref, out = check(op, args)
    assert ref[3].sum() > 1000


def test_reference_module_is_the_spec():
    # Guards the assumptions the kernel's comments cite (small-side widening to 16 px).
    assert reference.SMALL_GT_SIDE == 16.0


# ------------------------------------------------------------------- tal_assign.maps: logits from the maps
def logit_maps(seed, scene, reg_max=4, strides=(8, 16, 32), imgsz=640, dtype=torch.float32):
    """Class logits (B, A, C) of the scene's shape as head maps (B, 4*reg_max + C, H, W), level by level
    (box channels random: the assigner does not read them), and the logits themselves."""
    B, A, C = scene[0].shape
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, A, C, generator=g, dtype=torch.float64) * 3 - 2).to(dtype)
    maps, a0 = [], 0
    for s in strides:
        h = w = imgsz // s
        cls = logits[:, a0:a0 + h * w].transpose(1, 2).reshape(B, C, h, w)
        box = torch.randn(B, 4 * reg_max, h, w, generator=g, dtype=torch.float64).to(dtype)
        maps.append(torch.cat((box, cls), 1))
        a0 += h * w
    assert a0 == A
    return maps, logits


@pytest.mark.parametrize("seed", range(8))
def test_maps_logits_match_reference_on_sigmoid(op, seed):
    """The overload that reads the class logits from the maps gives the reference's outputs on their
    sigmoid: integers and boxes exact, scores to the usual tolerance."""
    dtype = torch.float64 if seed == 7 else torch.float32
    scene = random_scene(200 + seed, B=2, M=(3, 20, 60, 150)[seed % 4], pad=seed % 2 == 0, dtype=dtype)
    maps, logits = logit_maps(seed, scene, dtype=dtype)
    _, pd, anc, labels, gt, mask = scene
    ref = tal_assign_ref(logits.sigmoid(), pd, anc, labels, gt, mask, topk=TOPK, alpha=ALPHA, beta=BETA,
                         eps=EPS)
    out = torch.ops.yolofast.tal_assign.maps(maps, 4, pd, anc, labels, gt, mask, TOPK, ALPHA, BETA, EPS)
    assert_same(ref, out)
    assert ref[3].sum() > 0


def test_maps_logits_edge_cases(op):
    """Saturated and infinite logits, strided (channels_last) maps, no GT slot, thread-count independence,
    and the public wrapper on both backends (NaN logits: test_non_unit_scores_follow_reference)."""
    from yolofast import ops

    scene = random_scene(300, B=2, M=40, pad=False)
    maps, logits = logit_maps(3, scene)
    _, pd, anc, labels, gt, mask = scene
    g = torch.Generator().manual_seed(4)
    pick = torch.rand(logits.shape, generator=g)
    logits = torch.where(pick > 0.97, torch.tensor(90.0), logits)
    logits = torch.where((pick > 0.5) & (pick < 0.52), torch.tensor(-float("inf")), logits)
    maps, a0 = [m.clone() for m in maps], 0
    for m in maps:
        hw = m.shape[2] * m.shape[3]
        m[:, 16:] = logits[:, a0:a0 + hw].transpose(1, 2).reshape(m[:, 16:].shape)
        a0 += hw
    args = (pd, anc, labels, gt, mask)
    ref = tal_assign_ref(logits.sigmoid(), *args, topk=TOPK, alpha=ALPHA, beta=BETA, eps=EPS)
    cl = [m.to(memory_format=torch.channels_last) for m in maps]
    out = torch.ops.yolofast.tal_assign.maps(cl, 4, *args, TOPK, ALPHA, BETA, EPS)
    assert_same(ref, out)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.yolofast.tal_assign.maps(maps, 4, *args, TOPK, ALPHA, BETA, EPS)
    finally:
        torch.set_num_threads(n)
    for name, a, b in zip(NAMES, one, out):
        assert torch.equal(a, b), name
    for name in ("cpp", "ref"):
        with ops.backend(name):
            assert_same(ref, ops.tal_assign_maps(maps, *args, reg_max=4))
    empty = torch.ops.yolofast.tal_assign.maps(maps, 4, pd, anc, labels[:, :0], gt[:, :0], mask[:, :0], TOPK,
                                               ALPHA, BETA, EPS)
    assert_same(tal_assign_ref(logits.sigmoid(), pd, anc, labels[:, :0], gt[:, :0], mask[:, :0]), empty)


@pytest.mark.parametrize("kind", ["nan_logits", "probs_out_of_unit_range"])
def test_non_unit_scores_follow_reference(op, kind):
    """A NaN score gives a NaN align even at overlap 0, which the reference's sort ranks above every number
    (it holds a top-k slot, never positive): the kernel skips a candidate without computing its score only
    when the raw value proves it in [0, 1]. NaN logits on the maps; NaN, negative, > 1 and infinite
    probabilities on tal_assign."""
    scene = random_scene(301, B=2, M=40, pad=False)
    maps, logits = logit_maps(5, scene)
    _, pd, anc, labels, gt, mask = scene
    g = torch.Generator().manual_seed(6)
    pick = torch.rand(logits.shape, generator=g)
    if kind == "nan_logits":
        logits = torch.where(pick < 0.1, torch.tensor(float("nan")), logits)
        maps, a0 = [m.clone() for m in maps], 0
        for m in maps:
            hw = m.shape[2] * m.shape[3]
            m[:, 16:] = logits[:, a0:a0 + hw].transpose(1, 2).reshape(m[:, 16:].shape)
            a0 += hw
        ref = tal_assign_ref(logits.sigmoid(), pd, anc, labels, gt, mask, topk=TOPK, alpha=ALPHA, beta=BETA,
                             eps=EPS)
        out = torch.ops.yolofast.tal_assign.maps(maps, 4, pd, anc, labels, gt, mask, TOPK, ALPHA, BETA, EPS)
    else:
        probs = logits.sigmoid()
        for lo, hi, v in ((0.0, 0.03, float("nan")), (0.03, 0.06, -0.25), (0.06, 0.09, 1.5),
                          (0.09, 0.1, float("inf"))):
            probs = torch.where((pick >= lo) & (pick < hi), torch.tensor(v), probs)
        ref = tal_assign_ref(probs, pd, anc, labels, gt, mask, topk=TOPK, alpha=ALPHA, beta=BETA, eps=EPS)
        out = torch.ops.yolofast.tal_assign(probs, pd, anc, labels, gt, mask, TOPK, ALPHA, BETA, EPS)
        # An infinite score that wins its anchor makes its GT's scores inf / inf = NaN, in both.
        torch.testing.assert_close(out[2], ref[2], rtol=1e-6, atol=1e-10, equal_nan=True)
        ref, out = ref[:2] + (ref[2].nan_to_num(),) + ref[3:], out[:2] + (out[2].nan_to_num(),) + out[3:]
    assert_same(ref, out)
    assert ref[3].sum() > 0


def test_maps_opcheck_and_errors(op):
    scene = random_scene(15, B=2, imgsz=128, M=6, C=3)
    maps, _ = logit_maps(1, scene, reg_max=2, imgsz=128)
    _, pd, anc, labels, gt, mask = scene
    torch.library.opcheck(torch.ops.yolofast.tal_assign.maps,
                          (maps, 2, pd, anc, labels, gt, mask, TOPK, ALPHA, BETA, EPS))
    with pytest.raises(RuntimeError, match="tal_assign: pd_bboxes"):
        torch.ops.yolofast.tal_assign.maps(maps[:2], 2, pd, anc, labels, gt, mask, TOPK, ALPHA, BETA, EPS)


@pytest.mark.parametrize("seed", range(4))
def test_maps_per_anchor_scores_are_the_dense_rows(op, seed):
    """dense_scores=False: (B, A) scores, each the one non-zero of the dense (B, A, C) row, at class
    min(target_labels, C - 1); every other output identical. Also with no GT slot, for both backends."""
    from yolofast import ops
    from yolofast.ops.bbox_loss import dense_target_scores

    dtype = torch.float64 if seed == 3 else torch.float32
    scene = random_scene(500 + seed, B=2, M=(3, 20, 60, 150)[seed], pad=seed % 2 == 0, dtype=dtype)
    maps, _ = logit_maps(seed, scene, dtype=dtype)
    _, pd, anc, labels, gt, mask = scene
    C = scene[0].shape[2]
    args = (pd, anc, labels, gt, mask, TOPK, ALPHA, BETA, EPS)
    dense = torch.ops.yolofast.tal_assign.maps(maps, 4, *args)
    sparse = torch.ops.yolofast.tal_assign.maps(maps, 4, *args, False)
    assert sparse[2].shape == dense[2].shape[:2] and sparse[2].dtype == dense[2].dtype
    assert torch.equal(sparse[2], dense[2].sum(-1))
    assert torch.equal(dense_target_scores(sparse[2], sparse[0], C), dense[2])
    assert (sparse[2][~sparse[3]] == 0).all() and sparse[3].sum() > 0
    for a, b in zip(dense[:2] + dense[3:], sparse[:2] + sparse[3:]):
        assert torch.equal(a, b)
    for name in ("cpp", "ref"):
        with ops.backend(name):
            got = ops.tal_assign_maps(maps, *args[:5], reg_max=4, dense_scores=False)
        for a, b in zip(got[:2] + got[3:], sparse[:2] + sparse[3:]):
            assert torch.equal(a, b), name
        torch.testing.assert_close(got[2], sparse[2], rtol=1e-6, atol=1e-12)
    empty = torch.ops.yolofast.tal_assign.maps(maps, 4, pd, anc, labels[:, :0], gt[:, :0], mask[:, :0], TOPK,
                                               ALPHA, BETA, EPS, False)
    assert empty[2].shape == dense[2].shape[:2] and not empty[2].any()
    torch.library.opcheck(torch.ops.yolofast.tal_assign.maps, (maps, 4, *args, False))


# ---------------------------------------- the same checks on the CUDA kernels (a GPU, or the CPU emulation)
# ------------------------------------------------------------------------------------------- tal_assign
def _tal_check(impl, args, score_rtol=None, score_atol=None, **kw):
    """Integer outputs and boxes exactly; scores to rounding. On a GPU the kernel's float math is torch's
    own (same CUDA atan/pow): 1e-6. The emulation calls glibc's powf/atanf where the CPU reference uses
    SLEEF/MKL: an ulp of overlap, raised to the 6th power, moves a score by up to ~2e-6 relative."""
    args = impl.to(args)
    score_rtol = score_rtol or ASSIGN_SCORE_TOL[impl.name][0]
    score_atol = score_atol or ASSIGN_SCORE_TOL[impl.name][1]
    hp = {"topk": TOPK, "alpha": ALPHA, "beta": BETA, "eps": EPS, **kw}
    ref = tal_assign_ref(*args, **hp)
    out = impl.tal(args, **hp)
    for name, r, o in zip(NAMES, ref, out):
        assert o.dtype == r.dtype, f"{name}: dtype {o.dtype} != reference {r.dtype}"
        assert o.shape == r.shape and o.device == r.device, f"{name}: {o.shape} {o.device} vs {r.shape}"
        if name == "target_scores":
            msg = lambda m, n=name: f"{n}: {m}"  # noqa: E731
            torch.testing.assert_close(o, r, rtol=score_rtol, atol=score_atol, msg=msg)
        else:
            diff = (o != r) if not o.is_floating_point() else ~((o == r) | (o.isnan() & r.isnan()))
            assert not diff.any(), f"{name}: {int(diff.sum())} differ, first at {diff.nonzero()[:5].tolist()}"
    return ref, out


def _kernel_one_image(gt_boxes, labels, pd_box, C=4, score=0.5):
    anc = anchors_px(640)
    A = anc.shape[0]
    gt = torch.tensor(gt_boxes, dtype=torch.float32)[None]
    M = gt.shape[1]
    lab = torch.tensor(labels, dtype=torch.float32).view(1, M, 1)
    pd = torch.as_tensor(pd_box, dtype=torch.float32).expand(1, A, 4).clone()
    return torch.full((1, A, C), score), pd, anc, lab, gt, torch.ones(1, M, 1)


@pytest.mark.parametrize("seed", range(10))
def test_tal_random_scenes(impl, seed):
    M = (1, 8, 40, 120, 300)[seed % 5]
    ref, _ = _tal_check(impl, random_scene(seed, B=2, M=M, pad=seed % 3 != 0))
    if M >= 40:  # the scenes must exercise the assigner, not only background
        assert int(ref[3].sum()) > 10 * (M // 40)


def test_tal_float64_takes_the_two_pass_conflict_resolution(impl):
    for seed, M in ((100, 5), (101, 60)):
        _, out = _tal_check(impl, random_scene(seed, B=2, M=M, dtype=torch.float64))
        assert out[2].dtype == torch.float64


def test_tal_mixed_dtypes(impl):
    scores, pd, anc, labels, gt, mask = random_scene(7, B=2, M=60)
    _tal_check(impl, (scores.bfloat16(), pd, anc, labels, gt, mask), score_rtol=1e-2, score_atol=1e-6)
    _tal_check(impl, (scores, pd, anc, labels.long(), gt.double(), mask.bool()))


@pytest.mark.parametrize(
    "topk,alpha,beta",
    [(13, 1.0, 2.0), (1, 0.5, 6.0), (10, 0.25, 3.5), (10, 0.5, 0.0), (0, 0.5, 6.0), (100, 0.5, 6.0)],
)
def test_tal_hyperparameters(impl, topk, alpha, beta):
    _tal_check(impl, random_scene(11, B=2, M=80), topk=topk, alpha=alpha, beta=beta)


def test_tal_topk_ties_go_to_the_lower_anchor_index(impl):
    args = _kernel_one_image([[200.0, 200.0, 300.0, 260.0]], [1], [205.0, 202.0, 298.0, 262.0])
    _, out = _tal_check(impl, args)
    anc = args[2]
    inside = (anc[:, 0] > 200) & (anc[:, 0] < 300) & (anc[:, 1] > 200) & (anc[:, 1] < 260)
    assert out[3][0].cpu().nonzero().squeeze(1).tolist() == inside.nonzero().squeeze(1)[:TOPK].tolist()


def test_tal_identical_gts_tie_to_the_lowest_index(impl):
    box, other = [300.0, 100.0, 380.0, 150.0], [20.0, 500.0, 90.0, 600.0]
    scene = _kernel_one_image([other, box, box, box], [0, 1, 2, 3], [302.0, 101.0, 377.0, 152.0])
    _, out = _tal_check(impl, scene)
    fg, idx = out[3][0].cpu(), out[4][0].cpu()
    assert int(fg.sum()) == TOPK and set(idx[fg].tolist()) == {1}


def test_tal_conflict_goes_to_the_best_overlap_even_if_it_did_not_select(impl):
    gts = [[100.0, 100.0, 260.0, 260.0], [120.0, 120.0, 250.0, 250.0], [100.0, 100.0, 260.0, 260.0]]
    scores, pd, anc, lab, gt, mask = _kernel_one_image(gts, [0, 1, 0], gts[1])
    scores = scores * (0.5 + torch.rand(scores.shape, generator=torch.Generator().manual_seed(0)))
    scores[..., 1] *= 0.01
    _, out = _tal_check(impl, (scores, pd, anc, lab, gt, mask))
    assert (out[4][0][out[3][0]] == 1).any()


def test_tal_anchors_on_box_edges_and_small_boxes(impl):
    def step(v, n):  # v moved by n float32 ulps
        t = torch.tensor(v, dtype=torch.float32)
        for _ in range(abs(n)):
            t = torch.nextafter(t, torch.tensor(math.inf if n > 0 else -math.inf))
        return t.item()

    gts = [
        [100.0, 100.0, 164.0, 132.0],  # all four sides on stride-8 centres: excluded (strict inequality)
        [step(4.0, -1), step(4.0, -1), step(20.0, 1), step(20.0, 1)],  # one ulp outside: included
        [step(4.0, 1), step(300.0, 1), step(36.0, -1), 340.0],  # one ulp inside: excluded
        [600.0, 600.0, 636.0, 636.0],  # the bottom-right corner
        [50.0, 50.0, 52.0, 53.0],  # 2 x 3 px: widened to 16 px
        [400.0, 40.0, 416.0, 41.0],
    ]
    scores, pd, anc, lab, gt, mask = _kernel_one_image(gts, [0, 1, 2, 3, 0, 1], gts[0])
    pd = torch.cat((anc - 10, anc + 10), -1)[None]
    _, out = _tal_check(impl, (scores, pd, anc, lab, gt, mask), topk=100)
    assert bool(out[3][0, 0]) and int(out[4][0, 0]) == 1


def test_tal_no_gt_slots_and_all_padding(impl):
    scores, pd, anc, labels, gt, mask = random_scene(3, B=2, M=6)
    _, out = _tal_check(impl, (scores, pd, anc, labels[:, :0], gt[:, :0], mask[:, :0]))
    assert (out[0] == scores.shape[-1]).all() and not out[3].any()
    labels[0, 0], labels[1, 0] = 3.0, -1.0
    _, out = _tal_check(impl, (scores, pd, anc, labels, gt, torch.zeros_like(mask)))
    assert not out[3].any()


def test_tal_out_of_range_labels(impl):
    scores, pd, anc, labels, gt, mask = random_scene(5, B=2, M=30, pad=False)
    labels[0, :3, 0] = torch.tensor([-1.0, 80.0, 200.0])
    _tal_check(impl, (scores, pd, anc, labels, gt, mask))


@pytest.mark.parametrize(
    "kind", ["random_points", "perturbed_grid", "single_level", "levels_reversed", "few"]
)
def test_tal_anchors_that_are_not_make_anchors_grid(impl, kind):
    """The device-side grid inference must notice (full scan) or describe them exactly."""
    scores, pd, anc, labels, gt, mask = random_scene(21, B=2, M=40)
    g = torch.Generator().manual_seed(1)
    if kind == "random_points":
        anc = torch.rand(anc.shape, generator=g) * 640
    elif kind == "perturbed_grid":
        anc = anc.clone()
        anc[1234, 0] = torch.nextafter(anc[1234, 0], torch.tensor(1e9))
        anc[5000, 1] -= 3.0
    elif kind == "levels_reversed":  # still grids, stride 32 first
        order = torch.cat((torch.arange(8000, 8400), torch.arange(6400, 8000), torch.arange(0, 6400)))
        anc, scores, pd = anc[order], scores[:, order], pd[:, order]
    elif kind == "single_level":
        anc = anchors_px(640)[:6400].flip(0)
        scores, pd = scores[:, :6400], pd[:, :6400]
    else:
        idx = torch.randperm(anc.shape[0], generator=g)[:7]
        anc, scores, pd = anc[idx], scores[:, idx], pd[:, idx]
    _tal_check(impl, (scores, pd, anc, labels, gt, mask))
    if kind == "few":
        _tal_check(impl, (scores, pd, anc, labels, gt, mask), topk=30)  # topk > A


def test_tal_nan_predictions_hold_topk_slots_but_are_never_positive(impl):
    scores, pd, anc, labels, gt, mask = random_scene(20, B=1, M=8, pad=False)
    g = torch.Generator().manual_seed(1)
    A = scores.shape[1]
    scores[0, torch.rand(A, generator=g) < 0.1] = float("nan")
    pd[0, torch.rand(A, generator=g) < 0.05, 2] = float("nan")
    _tal_check(impl, (scores, pd, anc, labels, gt, mask))


def test_tal_every_output_element_is_written_and_runs_repeat(impl, monkeypatch):
    args = impl.to(random_scene(9, B=2, M=50))
    clean = impl.tal(args)
    monkeypatch.setenv("YOLOFAST_POISON_OUTPUTS", "1")
    poisoned = impl.tal(args)
    for name, a, b in zip(NAMES, clean, poisoned):
        assert torch.equal(a, b), name  # also: two runs give identical results


def test_tal_bad_arguments_raise_clear_errors(impl):
    scores, pd, anc, labels, gt, mask = impl.to(random_scene(14, B=2, M=5))
    with pytest.raises(RuntimeError, match="tal_assign: anc_points"):
        impl.tal((scores, pd, anc[:-1], labels, gt, mask))
    with pytest.raises(RuntimeError, match="tal_assign: mask_gt"):
        impl.tal((scores, pd, anc, labels, gt, mask[:, :4]))
    with pytest.raises(RuntimeError, match="tal_assign: topk"):
        impl.tal((scores, pd, anc, labels, gt, mask), topk=-1)
    if impl.name != "cpp":  # the CUDA kernel keeps each GT's top-k on chip; the C++ one has no such limit
        with pytest.raises(RuntimeError, match="topk must be <= 1024"):
            impl.tal((scores, pd, anc, labels, gt, mask), topk=5000)


@gpu
@pytest.mark.cuda
def test_gpu_dense_scene_and_memory(cuda_ops):
    """B=2, 640 px, 1,000 GT per image: identical to the reference, in a fraction of its memory."""
    args = tuple(a.cuda() for a in random_scene(31, B=2, M=1000, pad=False, min_side=4.0, max_side=96.0))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = cuda_ops.tal_assign(*args, TOPK, ALPHA, BETA, EPS)
    torch.cuda.synchronize()
    ours = torch.cuda.max_memory_allocated() - base
    del out
    torch.cuda.reset_peak_memory_stats()
    ref, _ = _tal_check(Impl("gpu", "cuda", cuda_ops), args)
    theirs = torch.cuda.max_memory_allocated() - base
    assert int(ref[3].sum()) > 1000
    assert ours * 20 < theirs, (ours, theirs)


# ------------------------------------------------------------------------------------ the Triton kernel
# On the CPU through Triton's interpreter, the compiled kernel on a GPU (op_inputs.needs_triton).
try:
    from yolofast.kernels import _common, triton_status
    from yolofast.kernels.tal_assign import tal_assign as triton_tal_assign
except ImportError as e:
    NO_TRITON = f"triton is not importable: {e}"
else:
    NO_TRITON = ""
NEEDS_TRITON = needs_triton(NO_TRITON)


def triton_check(inputs, min_fg=1, **kw):
    inputs = [t.to(TRITON_DEV) for t in inputs]
    out = triton_tal_assign(*inputs, **kw)
    ref = tal_assign_ref(*inputs, **kw)
    labels, boxes, scores, fg, idx = out
    r_labels, r_boxes, r_scores, r_fg, r_idx = ref
    assert fg.dtype == torch.bool and labels.dtype == idx.dtype == torch.int64
    assert boxes.dtype == r_boxes.dtype and scores.dtype == r_scores.dtype
    assert torch.equal(fg, r_fg), f"fg differs at {torch.nonzero(fg != r_fg)[:10].tolist()}"
    assert torch.equal(idx, r_idx), f"target_gt_idx differs at {torch.nonzero(idx != r_idx)[:10].tolist()}"
    assert torch.equal(labels, r_labels)
    assert torch.equal(boxes, r_boxes)
    # the float path differs only in atan/pow rounding (an ulp or so of align, see kernels/_common.py)
    torch.testing.assert_close(scores, r_scores, rtol=1e-5, atol=1e-6)
    assert int(r_fg.sum()) >= min_fg
    return out


# the fake-tensor and AOT checks trace the kernels through torch.library.wrap_triton, which needs real
# (compiled) Triton kernels: on the interpreter only the eager checks apply
TRITON_OPCHECK_UTILS = ("test_schema", "test_autograd_registration") + (
    () if TRITON_DEV == "cpu" else ("test_faketensor", "test_aot_dispatch_dynamic")
)


class TestTriton:
    """The Triton tal_assign (kernels/tal_assign.py): integer outputs exactly, scores to float rounding."""

    pytestmark = NEEDS_TRITON

    def test_status_reports_available(self):
        ok, why = triton_status("tal_assign")
        assert ok, why

    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_matches_reference(self, seed):
        triton_check(small_assign_inputs(seed), min_fg=50)

    def test_matches_reference_640px(self):
        # A = 8400 anchors: large GTs span several tiles per level, so the top-k merges across tiles
        triton_check(small_assign_inputs(3, B=1, img=640, M=16, pad=2, C=8), min_fg=50)

    def test_float64_uses_the_two_pass_conflict_resolution(self):
        triton_check(small_assign_inputs(4, dtype=torch.float64), min_fg=50)

    def test_bf16_scores_give_bf16_targets(self):
        inputs = small_assign_inputs(5)
        inputs[0] = inputs[0].bfloat16()
        out = triton_check(inputs, min_fg=50)
        assert out[2].dtype == torch.bfloat16

    def test_conflicts_go_to_the_best_overlap_then_the_lowest_gt(self):
        # GT 1 is GT 0 shifted by a pixel, GT 2 an exact copy of GT 0: the same anchors are picked by several
        # GTs; exact duplicates tie on overlap and must go to the lower index
        inputs = small_assign_inputs(6, B=1, M=6, pad=1)
        gt = inputs[4]
        gt[0, 0] = torch.tensor([40.0, 40.0, 100.0, 90.0])
        gt[0, 1] = gt[0, 0] + 1.0
        gt[0, 2] = gt[0, 0]
        out = triton_check(inputs, min_fg=10)
        assert (out[4][out[3]] == 2).sum() == 0  # the duplicate never wins against GT 0

    def test_topk_ties_go_to_the_lower_anchor_index(self):
        # every anchor predicts the same box with the same score: all candidates of a GT tie on align
        inputs = small_assign_inputs(7, B=1, M=4, pad=0)
        A = inputs[0].shape[1]
        inputs[1] = torch.tensor([30.0, 30.0, 110.0, 100.0]).expand(1, A, 4).clone()
        inputs[0] = torch.full_like(inputs[0], 0.6)
        inputs[4][0] = torch.tensor(
            [
                [20.0, 20.0, 100.0, 90.0],
                [40.0, 30.0, 120.0, 110.0],
                [10.0, 50.0, 90.0, 130.0],
                [60.0, 60.0, 140.0, 140.0],
            ]
        )
        out = triton_check(inputs, min_fg=10)
        fg_idx = torch.nonzero(out[3][0] & (out[4][0] == 3)).flatten().tolist()
        assert len(fg_idx) == 10 and fg_idx == sorted(fg_idx)

    @pytest.mark.parametrize("topk", [1, 3, 13])
    def test_other_topk(self, topk):
        triton_check(small_assign_inputs(8, B=1), topk=topk)

    def test_other_alpha_beta(self):
        # non-shortcut exponents take the general pow path
        triton_check(small_assign_inputs(9, B=1), alpha=1.3, beta=4.5)

    def test_no_gt_slots(self):
        inputs = small_assign_inputs(10, M=0, pad=0)
        out = triton_check(inputs, min_fg=0)
        assert (out[0] == inputs[0].shape[-1]).all()

    def test_only_padding_and_out_of_image_gts(self):
        inputs = small_assign_inputs(11, M=4, pad=2)
        inputs[4][:, :2] = torch.tensor([500.0, 500.0, 600.0, 650.0])  # real GTs containing no anchor
        out = triton_check(inputs, min_fg=0)
        assert not out[3].any()
        inputs = small_assign_inputs(12, M=4, pad=4)  # padding only
        assert not triton_check(inputs, min_fg=0)[3].any()

    def test_tiny_and_border_gts(self):
        inputs = small_assign_inputs(13, B=1, M=5, pad=0)
        inputs[4][0] = torch.tensor(
            [
                [10.0, 10.0, 12.0, 13.0],
                [0.0, 0.0, 3.0, 3.0],
                [150.0, 20.0, 160.0, 24.0],
                [0.0, 0.0, 160.0, 160.0],
                [64.0, 64.0, 64.0, 64.0],
            ]
        )
        triton_check(inputs)

    def test_anchors_that_are_not_a_grid_take_the_full_scan(self):
        # shuffled anchors: the grid check fails and every GT scans all anchors; results must not change
        inputs = small_assign_inputs(14)
        perm = torch.randperm(inputs[2].shape[0], generator=torch.Generator().manual_seed(0))
        inputs[2] = inputs[2][perm]
        triton_check(inputs, min_fg=20)

    def test_nan_predictions_take_topk_slots_but_are_never_positive(self):
        # torch.sort puts NaN first, so NaN-align anchors use up top-k slots; a NaN overlap wins a conflict
        inputs = small_assign_inputs(20, B=1, M=8, pad=0)
        g = torch.Generator().manual_seed(1)
        A = inputs[0].shape[1]
        inputs[0][0, torch.rand(A, generator=g) < 0.1] = float("nan")
        inputs[1][0, torch.rand(A, generator=g) < 0.05, 2] = float("nan")
        triton_check(inputs, min_fg=10)

    def test_every_output_element_is_written(self, monkeypatch):
        monkeypatch.setattr(_common, "POISON", True)  # outputs start as NaN / -987654 / True
        triton_check(small_assign_inputs(15), min_fg=50)

    def test_public_op_dispatches_to_triton(self):
        inputs = [t.to(TRITON_DEV) for t in small_assign_inputs(16, B=1)]
        with backend("triton"):
            out = public_tal_assign(*inputs)
        for a, b in zip(out, triton_tal_assign(*inputs)):
            assert torch.equal(a, b)

    def test_shape_errors_name_the_argument(self):
        inputs = small_assign_inputs(17, B=1)
        with pytest.raises(ValueError, match="mask_gt"):
            triton_tal_assign(*inputs[:5], inputs[5][:, :-1])
        with pytest.raises(ValueError, match="exponent"):
            triton_tal_assign(*inputs, beta=-1.0)

    def test_opcheck(self):
        inputs = [t.to(TRITON_DEV) for t in small_assign_inputs(18, B=2, img=64, M=4, pad=1)]
        torch.library.opcheck(
            torch.ops.yolofast.tal_assign_triton.default,
            (*inputs, 10, 0.5, 6.0, 1e-9),
            test_utils=TRITON_OPCHECK_UTILS,
        )

    @pytest.mark.skipif(
        TRITON_DEV == "cpu", reason="torch.compile traces Triton kernels only when they are compiled (CUDA)"
    )
    def test_torch_compile_fullgraph_matches_eager(self):
        inputs = [t.to(TRITON_DEV) for t in small_assign_inputs(19)]
        compiled = torch.compile(triton_tal_assign, fullgraph=True)
        for a, b in zip(compiled(*inputs), triton_tal_assign(*inputs)):
            assert torch.equal(a, b)
