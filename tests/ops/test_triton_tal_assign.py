"""Triton tal_assign vs reference.tal_assign_ref: integer outputs exactly, scores to float rounding."""

import pytest
import torch

triton = pytest.importorskip("triton")

from yolofast.boxes import make_anchors  # noqa: E402
from yolofast.kernels import _common, triton_status  # noqa: E402
from yolofast.kernels.tal_assign import tal_assign  # noqa: E402
from yolofast.ops import backend  # noqa: E402
from yolofast.ops import tal_assign as public_tal_assign  # noqa: E402
from yolofast.ops.reference import tal_assign_ref  # noqa: E402

pytestmark = pytest.mark.triton
DEV = "cpu" if _common.INTERPRET else "cuda"
if DEV == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)


def anchors(img):
    feats = [torch.zeros(1, 1, img // s, img // s) for s in (8, 16, 32)]
    anc, stride = make_anchors(feats, [8, 16, 32])
    return anc * stride  # pixels


def make_inputs(seed, B=2, img=160, C=20, M=12, pad=3, dtype=torch.float32):
    """Random GTs (a few padding rows), predicted boxes around the anchors, random scores (A = 525 at 160)."""
    g = torch.Generator().manual_seed(seed)
    anc = anchors(img)
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


def check(inputs, min_fg=1, **kw):
    inputs = [t.to(DEV) for t in inputs]
    out = tal_assign(*inputs, **kw)
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


def test_status_reports_available():
    ok, why = triton_status("tal_assign")
    assert ok, why


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference(seed):
    check(make_inputs(seed), min_fg=50)


def test_matches_reference_640px():
    # A = 8400 anchors: large GTs span several tiles per level, so the top-k merges across tiles
    check(make_inputs(3, B=1, img=640, M=16, pad=2, C=8), min_fg=50)


def test_float64_uses_the_two_pass_conflict_resolution():
    check(make_inputs(4, dtype=torch.float64), min_fg=50)


def test_bf16_scores_give_bf16_targets():
    inputs = make_inputs(5)
    inputs[0] = inputs[0].bfloat16()
    out = check(inputs, min_fg=50)
    assert out[2].dtype == torch.bfloat16


def test_conflicts_go_to_the_best_overlap_then_the_lowest_gt():
    # GT 1 is GT 0 shifted by a pixel, GT 2 an exact copy of GT 0: the same anchors are picked by several
    # GTs; exact duplicates tie on overlap and must go to the lower index
    inputs = make_inputs(6, B=1, M=6, pad=1)
    gt = inputs[4]
    gt[0, 0] = torch.tensor([40.0, 40.0, 100.0, 90.0])
    gt[0, 1] = gt[0, 0] + 1.0
    gt[0, 2] = gt[0, 0]
    out = check(inputs, min_fg=10)
    assert (out[4][out[3]] == 2).sum() == 0  # the duplicate never wins against GT 0


def test_topk_ties_go_to_the_lower_anchor_index():
    # every anchor predicts the same box with the same score: all candidates of a GT tie on align
    inputs = make_inputs(7, B=1, M=4, pad=0)
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
    out = check(inputs, min_fg=10)
    fg_idx = torch.nonzero(out[3][0] & (out[4][0] == 3)).flatten().tolist()
    assert len(fg_idx) == 10 and fg_idx == sorted(fg_idx)


@pytest.mark.parametrize("topk", [1, 3, 13])
def test_other_topk(topk):
    check(make_inputs(8, B=1), topk=topk)


def test_other_alpha_beta():
    # non-shortcut exponents take the general pow path
    check(make_inputs(9, B=1), alpha=1.3, beta=4.5)


def test_no_gt_slots():
    inputs = make_inputs(10, M=0, pad=0)
    out = check(inputs, min_fg=0)
    assert (out[0] == inputs[0].shape[-1]).all()


def test_only_padding_and_out_of_image_gts():
    inputs = make_inputs(11, M=4, pad=2)
    inputs[4][:, :2] = torch.tensor([500.0, 500.0, 600.0, 650.0])  # real GTs containing no anchor
    out = check(inputs, min_fg=0)
    assert not out[3].any()
    inputs = make_inputs(12, M=4, pad=4)  # padding only
    assert not check(inputs, min_fg=0)[3].any()


def test_tiny_and_border_gts():
    inputs = make_inputs(13, B=1, M=5, pad=0)
    inputs[4][0] = torch.tensor(
        [
            [10.0, 10.0, 12.0, 13.0],
            [0.0, 0.0, 3.0, 3.0],
            [150.0, 20.0, 160.0, 24.0],
            [0.0, 0.0, 160.0, 160.0],
            [64.0, 64.0, 64.0, 64.0],
        ]
    )
    check(inputs)


def test_anchors_that_are_not_a_grid_take_the_full_scan():
    # shuffled anchors: the grid check fails and every GT scans all anchors; results must not change
    inputs = make_inputs(14)
    perm = torch.randperm(inputs[2].shape[0], generator=torch.Generator().manual_seed(0))
    inputs[2] = inputs[2][perm]
    check(inputs, min_fg=20)


def test_nan_predictions_take_topk_slots_but_are_never_positive():
    # torch.sort puts NaN first, so NaN-align anchors use up top-k slots; a NaN overlap wins a conflict
    inputs = make_inputs(20, B=1, M=8, pad=0)
    g = torch.Generator().manual_seed(1)
    A = inputs[0].shape[1]
    inputs[0][0, torch.rand(A, generator=g) < 0.1] = float("nan")
    inputs[1][0, torch.rand(A, generator=g) < 0.05, 2] = float("nan")
    check(inputs, min_fg=10)


def test_every_output_element_is_written(monkeypatch):
    monkeypatch.setattr(_common, "POISON", True)  # outputs start as NaN / -987654 / True
    check(make_inputs(15), min_fg=50)


def test_public_op_dispatches_to_triton():
    inputs = [t.to(DEV) for t in make_inputs(16, B=1)]
    with backend("triton"):
        out = public_tal_assign(*inputs)
    for a, b in zip(out, tal_assign(*inputs)):
        assert torch.equal(a, b)


def test_shape_errors_name_the_argument():
    inputs = make_inputs(17, B=1)
    with pytest.raises(ValueError, match="mask_gt"):
        tal_assign(*inputs[:5], inputs[5][:, :-1])
    with pytest.raises(ValueError, match="exponent"):
        tal_assign(*inputs, beta=-1.0)


# the fake-tensor and AOT checks trace the kernels through torch.library.wrap_triton, which needs real
# (compiled) Triton kernels: on the interpreter only the eager checks apply
OPCHECK_UTILS = ("test_schema", "test_autograd_registration") + (
    () if DEV == "cpu" else ("test_faketensor", "test_aot_dispatch_dynamic")
)


def test_opcheck():
    inputs = [t.to(DEV) for t in make_inputs(18, B=2, img=64, M=4, pad=1)]
    torch.library.opcheck(
        torch.ops.yolofast.tal_assign_triton.default, (*inputs, 10, 0.5, 6.0, 1e-9), test_utils=OPCHECK_UTILS
    )


@pytest.mark.skipif(
    DEV == "cpu", reason="torch.compile traces Triton kernels only when they are compiled (CUDA)"
)
def test_torch_compile_fullgraph_matches_eager():
    inputs = [t.to(DEV) for t in make_inputs(19)]
    compiled = torch.compile(tal_assign, fullgraph=True)
    for a, b in zip(compiled(*inputs), tal_assign(*inputs)):
        assert torch.equal(a, b)
