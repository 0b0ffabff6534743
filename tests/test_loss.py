import math

import pytest
import torch

from yolofast.loss import DetectionLoss
from yolofast.ops import backend
from yolofast.ops.reference import bbox_decode, bbox_loss_ref, tal_assign_ref

NC, R = 3, 16
NO = 4 * R + NC


@pytest.fixture(autouse=True, params=["ref", "auto"])
def op_backend(request):
    """Every test runs on the reference and on whatever backend is chosen automatically (the kernels)."""
    with backend(request.param):
        yield request.param


def make_feats(b=2, h=64, w=64, requires_grad=True):
    feats = [torch.randn(b, NO, h // s, w // s) for s in (8, 16, 32)]
    return [f.requires_grad_(requires_grad) for f in feats]


def make_batch(b=2):
    # image 0: two objects, image 1: one, padded to M = 16 as the collate does
    gt_cls = torch.zeros(b, 16, 1)
    gt_bboxes = torch.zeros(b, 16, 4)
    gt_mask = torch.zeros(b, 16, 1)
    gt_cls[0, :2, 0] = torch.tensor([0.0, 2.0])
    gt_bboxes[0, :2] = torch.tensor([[0.3, 0.4, 0.4, 0.5], [0.7, 0.7, 0.2, 0.3]])
    gt_mask[0, :2] = 1
    if b > 1:
        gt_cls[1, 0, 0] = 1.0
        gt_bboxes[1, 0] = torch.tensor([0.5, 0.5, 0.6, 0.6])
        gt_mask[1, 0] = 1
    return {"gt_cls": gt_cls, "gt_bboxes": gt_bboxes, "gt_mask": gt_mask}


def test_shapes_total_and_items():
    loss_fn = DetectionLoss(NC)
    total, items = loss_fn(make_feats(), make_batch())
    assert total.shape == () and total.dtype == torch.float32
    assert items.shape == (3,) and items.dtype == torch.float32 and not items.requires_grad
    assert total.item() == pytest.approx(items.sum().item() * 2, rel=1e-6)
    assert (items > 0).all()


def test_backward_gives_finite_grads():
    feats = make_feats()
    total, _ = DetectionLoss(NC)(feats, make_batch())
    total.backward()
    for f in feats:
        assert f.grad is not None and torch.isfinite(f.grad).all()
    # box channels get gradient only from foreground anchors, class channels from every anchor
    assert feats[0].grad[:, : 4 * R].abs().sum() > 0
    assert (feats[2].grad[:, 4 * R :] != 0).all()


def test_empty_batch_has_only_class_loss():
    feats = make_feats()
    batch = make_batch()
    batch["gt_mask"].zero_()
    total, items = DetectionLoss(NC)(feats, batch)
    assert items[0].item() == 0 and items[2].item() == 0
    # every target is 0, S = 1: L_cls = 0.5 * sum softplus(logits)
    logits = torch.cat([f.detach()[:, 4 * R :].flatten(2) for f in feats], 2)
    expected = 0.5 * torch.nn.functional.softplus(logits).sum()
    assert items[1].item() == pytest.approx(expected.item(), rel=1e-5)
    total.backward()
    assert all(f.grad[:, : 4 * R].abs().sum() == 0 for f in feats)


def test_flat_targets_are_padded_like_the_collate():
    feats = make_feats(requires_grad=False)
    padded = make_batch()
    flat = {
        "batch_idx": torch.tensor([0.0, 0.0, 1.0]),
        "cls": torch.tensor([[0.0], [2.0], [1.0]]),
        "bboxes": torch.tensor([[0.3, 0.4, 0.4, 0.5], [0.7, 0.7, 0.2, 0.3], [0.5, 0.5, 0.6, 0.6]]),
    }
    loss_fn = DetectionLoss(NC)
    torch.testing.assert_close(loss_fn(feats, flat)[1], loss_fn(feats, padded)[1])
    with pytest.raises(KeyError, match="gt_cls"):
        loss_fn(feats, {"img": None})


def test_pixel_conversion_on_a_non_square_image():
    # 64 x 96 image (h x w): normalized xywh (0.5, 0.25, 0.5, 0.25) -> cx 48, cy 16, w 48, h 16 px
    torch.manual_seed(3)
    feats = make_feats(b=1, h=64, w=96, requires_grad=False)
    batch = {
        "gt_cls": torch.tensor([[[1.0]]]),
        "gt_bboxes": torch.tensor([[[0.5, 0.25, 0.5, 0.25]]]),
        "gt_mask": torch.ones(1, 1, 1),
    }
    _, items = DetectionLoss(NC)(feats, batch)

    # the same pipeline spelled out with the pixel box written by hand
    pred = torch.cat([f.flatten(2) for f in feats], 2).transpose(1, 2)
    pd, ps = pred[..., : 4 * R], pred[..., 4 * R :]
    pts, strides = [], []
    for s in (8, 16, 32):
        ys, xs = torch.meshgrid(torch.arange(64 // s) + 0.5, torch.arange(96 // s) + 0.5, indexing="ij")
        pts.append(torch.stack((xs, ys), -1).reshape(-1, 2))
        strides.append(torch.full((pts[-1].shape[0], 1), float(s)))
    anc, st = torch.cat(pts), torch.cat(strides)
    _, tb, ts, fg, _ = tal_assign_ref(
        ps.sigmoid(),
        bbox_decode(pd, anc) * st,
        anc * st,
        batch["gt_cls"],
        torch.tensor([[[24.0, 8, 72, 24]]]),
        batch["gt_mask"],
    )
    assert fg.any()
    expected = bbox_loss_ref(pd, ps, anc, tb / st, ts, fg) * torch.tensor([7.5, 0.5, 1.5])
    torch.testing.assert_close(items, expected)


def test_autocast_still_computes_in_fp32():
    feats = make_feats(requires_grad=False)
    loss_fn = DetectionLoss(NC)
    ref_total, ref_items = loss_fn(feats, make_batch())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, items = loss_fn([f.to(torch.bfloat16) for f in feats], make_batch())
    assert total.dtype == torch.float32 and items.dtype == torch.float32
    torch.testing.assert_close(items, ref_items, rtol=0.05, atol=0.05)  # bf16 rounding of the inputs only


def test_wrong_channel_count_is_explained():
    with pytest.raises(ValueError, match="nc"):
        DetectionLoss(80)(make_feats(), make_batch())


def test_loss_decreases_when_fitting_the_maps():
    torch.manual_seed(0)
    feats = [torch.nn.Parameter(f.detach() * 0.1) for f in make_feats(b=1)]
    batch = make_batch(b=1)
    loss_fn = DetectionLoss(NC)
    opt = torch.optim.Adam(feats, lr=0.05)
    first = None
    for _ in range(30):
        total, items = loss_fn(feats, batch)
        first = items.clone() if first is None else first
        opt.zero_grad()
        total.backward()
        opt.step()
    assert math.isfinite(total.item())
    # the box term may rise while the assigner hands out larger target scores (weights); the sum falls
    assert items.sum() < 0.5 * first.sum(), (first, items)
    assert items[2] < first[2]


def test_cached_anchors_follow_the_feature_size():
    # One loss object reused across image sizes (multi-scale / val) must not reuse the anchors of the
    # previous size: compare against a fresh object, values and gradients.
    loss_fn = DetectionLoss(NC)
    loss_fn(make_feats(h=64, w=64), make_batch())
    feats = make_feats(h=96, w=64)
    total, items = loss_fn(feats, make_batch())
    total.backward()
    fresh = [f.detach().clone().requires_grad_(True) for f in feats]
    f_total, f_items = DetectionLoss(NC)(fresh, make_batch())
    f_total.backward()
    torch.testing.assert_close(items, f_items, rtol=0, atol=0)
    for f, g in zip(feats, fresh):
        torch.testing.assert_close(f.grad, g.grad, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["gt", "no_gt", "odd_maps", "bf16", "zero_cls_gain", "scaled_total"])
def test_kernel_path_equals_reference_path(op_backend, case):
    """The default path (maps read in place on the CPU, the final map gradients written in the loss's forward
    pass) gives the reference path's loss and map gradients; also when a gain is 0 (no final gradients
    then) and when the total is scaled before backward (the prepared gradients are rescaled)."""
    if op_backend == "ref":
        pytest.skip("compares the automatic backend with the reference")
    h, w = (72, 40) if case == "odd_maps" else (64, 64)  # odd: 9x5, 4x2, 2x1 cells, rows not whole vectors
    feats = make_feats(2, h, w, requires_grad=False)
    if case == "bf16":
        feats = [f.to(torch.bfloat16) for f in feats]
    batch = make_batch(2)
    if case == "no_gt":
        batch = {k: v[:, :0] for k, v in batch.items()}
    crit = DetectionLoss(NC, cls=0.0) if case == "zero_cls_gain" else DetectionLoss(NC)
    out = []
    for name in ("auto", "ref"):
        fs = [f.detach().clone().requires_grad_() for f in feats]
        with backend(name):
            total, items = crit(fs, batch)
        (total * 0.25 if case == "scaled_total" else total).backward()
        out.append((total.detach(), items, [f.grad for f in fs]))
    (t1, i1, g1), (t2, i2, g2) = out
    torch.testing.assert_close(t1, t2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(i1, i2, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g2):
        assert a.dtype == b.dtype == feats[0].dtype and a.shape == b.shape
        tol = 2e-2 if case == "bf16" else 1e-5
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * float(b.abs().max()) + 1e-12)


def test_stages_are_the_call_and_the_reference_assignment():
    """``stages`` (what the doctor reads) is the computation ``__call__`` returns, and its assigner outputs
    are the reference assigner's on the sigmoid scores and decoded boxes of the same maps."""
    from yolofast.boxes import make_anchors
    from yolofast.ops.bbox_loss import maps_to_rows

    crit = DetectionLoss(NC)
    feats, batch = make_feats(), make_batch()
    st = crit.stages(feats, batch)
    total, items = crit(feats, batch)
    torch.testing.assert_close(st.items.detach(), items, rtol=0, atol=0)
    torch.testing.assert_close(total, st.items.sum() * 2, rtol=0, atol=0)
    assert st.items.requires_grad and st.img_wh == (64.0, 64.0)
    pd, ps = maps_to_rows([f.detach() for f in feats], R)
    anc, stride = make_anchors(feats, (8, 16, 32), 0.5)
    pd_bboxes = bbox_decode(pd, anc) * stride
    torch.testing.assert_close(st.pd_bboxes, pd_bboxes, rtol=1e-6, atol=1e-4)
    ref = tal_assign_ref(ps.sigmoid(), st.pd_bboxes, st.anc_px, st.gt_cls, st.gt_xyxy, st.gt_mask)
    assert torch.equal(st.fg_mask, ref[3]) and torch.equal(st.target_gt_idx, ref[4])
    torch.testing.assert_close(st.target_scores, ref[2], rtol=1e-6, atol=1e-10)
    assert st.fg_mask.sum() > 0
