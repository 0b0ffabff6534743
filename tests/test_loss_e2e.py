"""The YOLO11 and YOLO26 criteria (YOLO11_YOLO26.md §4) against the loss vectors Ultralytics 8.4.190 computed
on a fixed batch (golden/, Appendix B), fed with its own train-mode head outputs; the E2E weights table of
§4.4; and the E2E criterion's structure (branches, epoch counter, gradients) on random maps."""

from pathlib import Path

import pytest
import torch

from yolofast.loss import DetectionLoss, E2EDetectionLoss, e2e_weights, head_maps, loss_names
from yolofast.ops import backend

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "data" / "ultralytics" / "golden"
LEVELS = [(20, 20), (10, 10), (5, 5)]  # 160 px at strides 8, 16, 32: 525 anchors
REL = 1e-5


def _golden(name):
    path = GOLDEN / f"{name}_nc5_seed0.pt"
    if not path.exists():
        pytest.skip(f"golden file not found at {path}")
    from yolofast.io.reader import load_pickle

    return load_pickle(path)


def _maps(boxes, scores):
    """Ultralytics' (B, 4R, A) / (B, nc, A) train outputs as our per-level maps (the feats give the sizes)."""
    feats = [torch.empty(1, 1, h, w) for h, w in LEVELS]
    return head_maps({"boxes": boxes, "scores": scores, "feats": feats})


def _batch(g):
    return {"batch_idx": g["batch_batch_idx"], "cls": g["batch_cls"], "bboxes": g["batch_bboxes"]}


def _rel(got, exp):
    return ((got.double() - exp.double()).abs() / exp.double().abs()).max().item()


@pytest.fixture(params=["ref", "auto"])
def op_backend(request):
    with backend(request.param):
        yield request.param


# ------------------------------------------------------------------------------------------------- golden


def test_yolo11_criterion_is_v8_and_matches_the_golden(op_backend):
    g = _golden("yolo11n")
    crit = DetectionLoss(5)
    assert crit.names == ("box_loss", "cls_loss", "dfl_loss")
    vec, items = crit.vector(_maps(g["train_boxes"], g["train_scores"]), _batch(g))
    assert _rel(vec, g["loss_vec"]) <= REL and _rel(items, g["loss_items"]) <= REL
    total, items2 = crit(_maps(g["train_boxes"], g["train_scores"]), _batch(g))
    assert torch.equal(items2, items)
    assert total.item() == pytest.approx(g["loss_vec"].sum().item(), rel=REL)


def _e2e_preds(g, requires_grad=False):
    return {br: [m.requires_grad_(requires_grad)
                 for m in _maps(g[f"train_{br}_boxes"], g[f"train_{br}_scores"])]
            for br in ("one2many", "one2one")}


@pytest.mark.parametrize("epoch", [0, 5])
def test_yolo26_criterion_matches_the_golden(op_backend, epoch):
    g = _golden("yolo26n")
    crit = E2EDetectionLoss(5, reg_max=1, epochs=10)  # the golden run's args: epochs 10
    assert crit.names == ("box_loss", "cls_loss", "l1_loss")
    crit.set_epoch(epoch)
    vec, items = crit.vector(_e2e_preds(g), _batch(g))
    assert _rel(vec, g[f"loss_vec_epoch{epoch}"]) <= REL, (vec, g[f"loss_vec_epoch{epoch}"])
    if epoch == 0:
        assert _rel(items, g["loss_items_epoch0"]) <= REL, (items, g["loss_items_epoch0"])
    else:
        assert crit.weights == tuple(g["o2m_o2o_epoch5"].tolist())  # float64, exactly
    # items are the one-to-one branch alone, whatever the epoch's weights
    crit.set_epoch(9)
    assert torch.equal(crit.vector(_e2e_preds(g), _batch(g))[1], items)


def test_yolo26_one_to_one_assignment_on_the_golden_batch():
    """topk2 = 1: each of the 5 GTs ends with at most one positive anchor in the one-to-one branch, while
    the one-to-many branch gives them several (the golden file has no assigner outputs to compare)."""
    g = _golden("yolo26n")
    crit = E2EDetectionLoss(5, reg_max=1, epochs=10)
    preds = _e2e_preds(g)
    o2o = crit.one2one.stages(preds["one2one"], _batch(g))
    o2m = crit.one2many.stages(preds["one2many"], _batch(g))
    per_gt = [(o2o.fg_mask[b] & (o2o.target_gt_idx[b] == i)).sum().item() for b, i in [(0, 0), (0, 1), (0, 2),
                                                                                      (1, 0), (1, 1)]]
    assert max(per_gt) == 1 and o2o.fg_mask.sum().item() == sum(per_gt)
    assert o2m.fg_mask.sum() > o2o.fg_mask.sum()


# ---------------------------------------------------------------------------------------------- schedule

# YOLO11_YOLO26.md §4.4, measured on Ultralytics 8.4.190 (6 decimals): {E: {e: (w_o2m, w_o2o)}}
TABLE = {
    100: {0: (0.8, 0.2), 1: (0.792929, 0.207071), 2: (0.785859, 0.214141), 10: (0.729293, 0.270707),
          50: (0.446465, 0.553535), 89: (0.170707, 0.829293), 98: (0.107071, 0.892929), 99: (0.1, 0.9)},
    300: {0: (0.8, 0.2), 1: (0.797659, 0.202341), 2: (0.795318, 0.204682), 10: (0.776589, 0.223411),
          150: (0.448829, 0.551171), 289: (0.123411, 0.876589), 298: (0.102341, 0.897659), 299: (0.1, 0.9)},
    2: {0: (0.8, 0.2), 1: (0.1, 0.9)},
    1: {0: (0.8, 0.2)},
}


def test_e2e_weights_table():
    for E, row in TABLE.items():
        for e, (o2m, o2o) in row.items():
            w = e2e_weights(e, E)
            assert w == pytest.approx((o2m, o2o), abs=5e-7), (E, e, w)
            assert isinstance(w[0], float) and isinstance(w[1], float)
    # bit parity of the Python floats: epoch 0 is exactly 0.8 (so w_o2o = 1 - 0.8), and past the end the
    # one-to-many weight stays 0.1
    assert e2e_weights(0, 100) == (0.8, 0.19999999999999996)
    assert e2e_weights(150, 100) == e2e_weights(99, 100) == (0.1, 0.9)


def test_set_epoch_drives_the_weights_and_resume_agrees():
    crit = E2EDetectionLoss(3, epochs=100)
    assert crit.epoch == 0 and crit.weights == e2e_weights(0, 100)
    for e in range(1, 12):  # what the trainer does after each epoch's last batch
        crit.set_epoch(e, 100)
    resumed = E2EDetectionLoss(3, epochs=100)
    resumed.set_epoch(11, 100)  # resume with start_epoch 11
    assert crit.weights == resumed.weights == e2e_weights(11, 100)
    crit.set_epoch(11, 300)  # time= runs re-estimate E: the schedule follows
    assert crit.weights == e2e_weights(11, 300)
    with pytest.raises(ValueError, match="negative"):
        crit.set_epoch(-1)
    DetectionLoss(3).set_epoch(5, 10)  # the v8/YOLO11 loss accepts the same call and has no schedule


# -------------------------------------------------------------------------------- structure on random maps

NC = 3


def _rand_preds(b=2, h=64, w=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {br: [torch.randn(b, 4 + NC, h // s, w // s, generator=gen).requires_grad_() for s in (8, 16, 32)]
            for br in ("one2many", "one2one")}


def _rand_batch():
    return {"batch_idx": torch.tensor([0.0, 0.0, 1.0]), "cls": torch.tensor([[0.0], [2.0], [1.0]]),
            "bboxes": torch.tensor([[0.3, 0.4, 0.4, 0.5], [0.7, 0.7, 0.2, 0.3], [0.5, 0.5, 0.06, 0.05]])}


def test_total_is_the_weighted_sum_of_the_branches_and_gradients_follow(op_backend):
    preds = _rand_preds()
    crit = E2EDetectionLoss(NC, epochs=10)
    crit.set_epoch(3)
    w_o2m, w_o2o = crit.weights
    total, items = crit(preds, _rand_batch())
    total.backward()
    # each branch alone, as a plain DetectionLoss with the branch's assigner settings
    alone = {}
    for br, kw in (("one2many", {"topk": 10}), ("one2one", {"topk": 7, "topk2": 1})):
        fs = [f.detach().clone().requires_grad_() for f in preds[br]]
        t, v = DetectionLoss(NC, reg_max=1, **kw)(fs, _rand_batch())
        t.backward()
        alone[br] = (t, v, [f.grad for f in fs])
    assert torch.equal(items, alone["one2one"][1]) and not items.requires_grad
    exp = w_o2m * alone["one2many"][0] + w_o2o * alone["one2one"][0]
    assert total.item() == pytest.approx(exp.item(), rel=1e-6)
    for br, w in (("one2many", w_o2m), ("one2one", w_o2o)):
        for f, g in zip(preds[br], alone[br][2]):
            torch.testing.assert_close(f.grad, g * w, rtol=1e-5, atol=1e-8)


def test_empty_images_give_only_the_class_term(op_backend):
    preds = _rand_preds()
    empty = {"batch_idx": torch.zeros(0), "cls": torch.zeros(0, 1), "bboxes": torch.zeros(0, 4)}
    total, items = E2EDetectionLoss(NC)(preds, empty)
    assert items[0] == 0 and items[2] == 0 and items[1] > 0
    total.backward()
    assert all(f.grad[:, :4].abs().sum() == 0 for br in preds.values() for f in br)


def test_auto_backend_equals_the_reference_path():
    out = []
    for be in ("auto", "ref"):
        preds = _rand_preds(h=96, w=64, seed=1)
        with backend(be):
            total, items = E2EDetectionLoss(NC, epochs=4)(preds, _rand_batch())
        total.backward()
        out.append((total.detach(), items, [f.grad for br in preds.values() for f in br]))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out[0][1], out[1][1], rtol=1e-6, atol=1e-7)
    for a, b in zip(out[0][2], out[1][2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_bad_inputs_are_explained():
    crit = E2EDetectionLoss(NC)
    with pytest.raises(KeyError, match="one2many"):
        crit(_rand_preds()["one2many"], _rand_batch())
    with pytest.raises(KeyError, match="feats"):
        head_maps({"boxes": torch.zeros(1, 4, 5), "scores": torch.zeros(1, 3, 5)})
    with pytest.raises(ValueError, match="add up"):
        head_maps({"boxes": torch.zeros(1, 4, 5), "scores": torch.zeros(1, 3, 5),
                   "feats": [torch.zeros(1, 1, 2, 2)]})
    assert loss_names(1)[2] == "l1_loss" and loss_names(16)[2] == "dfl_loss"


def test_head_maps_layout():
    # anchors level by level, row-major inside a level: anchor a of level 1 (4 x 2) is pixel (a // 2, a % 2)
    boxes = torch.arange(2 * 4 * 40, dtype=torch.float32).view(2, 4, 40)
    scores = -torch.arange(2 * 3 * 40, dtype=torch.float32).view(2, 3, 40)
    feats = [torch.empty(1, 1, 4, 8), torch.empty(1, 1, 4, 2)]
    maps = head_maps({"boxes": boxes, "scores": scores, "feats": feats})
    assert [tuple(m.shape) for m in maps] == [(2, 7, 4, 8), (2, 7, 4, 2)]
    assert torch.equal(maps[1][1, :4, 3, 1], boxes[1, :, 32 + 7])
    assert torch.equal(maps[0][0, 4:, 2, 5], scores[0, :, 21])


def test_class_weights_reach_both_branches():
    """cls_pw (YOLO11_YOLO26.md §4.5) weighs the class loss of both branches: unit weights change nothing,
    other weights change only the class terms."""
    plain_total, plain = E2EDetectionLoss(NC)(_rand_preds(), _rand_batch())
    unit_total, unit = E2EDetectionLoss(NC, class_weights=torch.ones(NC))(_rand_preds(), _rand_batch())
    torch.testing.assert_close(unit, plain, rtol=1e-5, atol=1e-7)
    crit = E2EDetectionLoss(NC, class_weights=torch.tensor([0.2, 1.3, 1.5]))
    _, weighted = crit(_rand_preds(), _rand_batch())
    assert torch.equal(weighted[[0, 2]], plain[[0, 2]]) and not torch.allclose(weighted[1], plain[1])
    assert crit.one2many.class_weights is not None and crit.one2one.class_weights is not None


def test_autocast_bf16_computes_in_fp32():
    """Under AMP the head gives bf16 maps; the criterion upcasts them and computes in fp32: the same values
    as the fp32 computation on the bf16-rounded maps."""
    preds = {br: [f.detach().to(torch.bfloat16) for f in fs] for br, fs in _rand_preds().items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, items = E2EDetectionLoss(NC)(preds, _rand_batch())
    up = {br: [f.float() for f in fs] for br, fs in preds.items()}
    ref_total, ref_items = E2EDetectionLoss(NC)(up, _rand_batch())
    assert total.dtype == items.dtype == torch.float32
    torch.testing.assert_close(items, ref_items, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=1e-7)
