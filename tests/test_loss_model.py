"""``model.loss(batch, preds=None)``: Ultralytics' return convention for every family, on the golden state
dicts and batch (YOLO11_YOLO26.md Appendix B): the model's own train-mode forward, then its criterion."""

from pathlib import Path

import pytest
import torch

from yolofast.loss import DetectionLoss, E2EDetectionLoss, criterion_for
from yolofast.nn.model import build_model

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "data" / "ultralytics" / "golden"
REL = 1e-5


def _golden(name):
    path = GOLDEN / f"{name}_nc5_seed0.pt"
    if not path.exists():
        pytest.skip(f"golden file not found at {path}")
    from yolofast.io.reader import load_pickle

    return load_pickle(path)


def _model(name, g):
    model = build_model(f"{name}.yaml", nc=5)
    model.load_state_dict(g["state_dict"], strict=True)
    return model


def _batch(g):
    return {"img": g["x"], "batch_idx": g["batch_batch_idx"], "cls": g["batch_cls"],
            "bboxes": g["batch_bboxes"]}


def _rel(got, exp):
    return ((got.double() - exp.double()).abs() / exp.double().abs()).max().item()


def test_yolo11_model_loss_matches_the_golden():
    g = _golden("yolo11n")
    model = _model("yolo11n", g).train()
    vec, items = model.loss(_batch(g))
    assert isinstance(model.criterion, DetectionLoss) and model.criterion.names[2] == "dfl_loss"
    assert vec.shape == (3,) and vec.requires_grad and not items.requires_grad
    assert _rel(vec, g["loss_vec"]) <= REL and _rel(items, g["loss_items"]) <= REL
    vec.sum().backward()
    trained = [p for n, p in model.named_parameters() if p.requires_grad and ".dfl." not in n]
    assert all(p.grad is not None for p in trained)


def test_yolo26_model_loss_matches_the_golden_at_epochs_0_and_5():
    g = _golden("yolo26n")
    model = _model("yolo26n", g).train()
    model.args = {"epochs": 10}  # the golden run's recipe; criterion_for reads it as Ultralytics does
    vec, items = model.loss(_batch(g))
    assert isinstance(model.criterion, E2EDetectionLoss) and model.criterion.names[2] == "l1_loss"
    assert _rel(vec, g["loss_vec_epoch0"]) <= REL and _rel(items, g["loss_items_epoch0"]) <= REL
    # epoch 5 of 10 on the same head outputs (preds given: the forward is not rerun)
    preds = _model("yolo26n", g).train()(g["x"])
    model.criterion.set_epoch(5, 10)
    vec5, items5 = model.loss(_batch(g), preds)
    assert _rel(vec5, g["loss_vec_epoch5"]) <= REL and _rel(items5, g["loss_items_epoch0"]) <= REL


def test_yolo26_one_to_one_loss_trains_its_own_branches_only():
    g = _golden("yolo26n")
    model = _model("yolo26n", g).train()
    model.criterion = E2EDetectionLoss(5, epochs=10)
    preds = model(g["x"])
    o2o_total, _ = model.criterion.one2one(preds["one2one"], _batch(g))
    o2o_total.backward()
    got = {n for n, p in model.named_parameters() if p.grad is not None}
    assert got and all(".one2one_cv" in n for n in got)


def test_model_loss_in_eval_mode_uses_the_raw_maps():
    g = _golden("yolo26n")
    model = _model("yolo26n", g).eval()
    with torch.no_grad():
        vec, items = model.loss(_batch(g))
    assert vec.shape == items.shape == (3,) and torch.isfinite(vec).all() and (items > 0).all()


def test_criterion_for_reads_the_family_and_the_recipe():
    m8 = build_model("yolov8n.yaml", nc=3)
    assert type(criterion_for(m8)) is DetectionLoss
    m8.args = type("Args", (), {"box": 5.0, "cls": 1.0, "dfl": 2.0})()
    assert criterion_for(m8).gains == (5.0, 1.0, 2.0) and criterion_for(m8, box=1.0).gains[0] == 1.0
    m26 = build_model("yolo26n.yaml", nc=3)
    crit = criterion_for(m26, epochs=7)
    assert type(crit) is E2EDetectionLoss and crit.epochs == 7 and crit.reg_max == 1
    assert crit.one2one.topk == 7 and crit.one2one.topk2 == 1 and crit.one2many.topk2 is None
