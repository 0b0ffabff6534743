"""The validation pictures (yolofast/val/plots.py) hold the validator's numbers: the PR curve's area per
class is the reported AP50, the F1 curve's peak is the confidence P and R are read at, the confusion
matrix's diagonal counts the true positives at its thresholds; known answers on small synthetic sets;
every file written with a plot folder, none without, and a failing picture is one warning, not an error."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from yolofast.boxes import xyxy2xywh
from yolofast.val import Validator, ap_per_class, match_predictions
from yolofast.val import plots as vp
from yolofast.val.metrics import CONVENTIONS, REC_THRESHOLDS, pr_area

H, W, NC = 64, 96, 3
NAMES = {0: "cat", 1: "dog", 2: "bird"}
VAL_FILES = {"confusion_matrix.png", "confusion_matrix_normalized.png", "BoxPR_curve.png", "BoxF1_curve.png",
             "BoxP_curve.png", "BoxR_curve.png", "val_batch0_labels.jpg", "val_batch0_pred.jpg",
             "val_batch1_labels.jpg", "val_batch1_pred.jpg", "val_batch2_labels.jpg", "val_batch2_pred.jpg"}


def random_set(seed, n_img=30, convention="coco"):
    """Per image: GT (m, 4) xyxy + classes, and detections near them (jittered, some with another class,
    some spurious), conf uniform. Returns the per-image lists and the validator's concatenated stats."""
    rng = np.random.default_rng(seed)
    images, tp, conf, pcls, tcls = [], [], [], [], []
    for _ in range(n_img):
        m = int(rng.integers(0, 6))
        xy = rng.uniform(0, 60, (m, 2))
        gt = np.concatenate([xy, xy + rng.uniform(8, 30, (m, 2))], 1)
        gc = rng.integers(0, NC, m)
        k = int(rng.integers(0, 9))
        src = rng.integers(0, max(m, 1), k)
        det = np.zeros((k, 6))
        if m:
            det[:, :4] = gt[src] + rng.normal(0, 3, (k, 4))
            det[:, 5] = np.where(rng.random(k) < 0.7, gc[src], rng.integers(0, NC, k))
        else:
            det[:, :2] = rng.uniform(0, 60, (k, 2))
            det[:, 2:4] = det[:, :2] + 15
            det[:, 5] = rng.integers(0, NC, k)
        det[:, 4] = rng.uniform(0.01, 1, k)
        images.append((det, gt, gc))
        tp.append(match_predictions(det[:, :4], det[:, 4], det[:, 5], gt, gc, convention=convention))
        conf.append(det[:, 4])
        pcls.append(det[:, 5])
        tcls.append(gc)
    stats = [np.concatenate(x) for x in (tp, conf, pcls, tcls)]
    return images, stats


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_pr_curve_area_is_the_reported_ap50_and_f1_peak_is_the_reported_conf(convention):
    _, (tp, conf, pcls, tcls) = random_set(0, convention=convention)
    r = ap_per_class(tp, conf, pcls, tcls, convention=convention)
    assert r.pr_curve.shape == (len(r.classes), len(REC_THRESHOLDS))
    assert 0 < r.map50 < 1
    np.testing.assert_allclose(pr_area(r.pr_curve, convention), r.ap50, rtol=0, atol=1e-12)
    assert pr_area(r.pr_curve.mean(0), convention) == pytest.approx(r.map50, abs=1e-12)  # the bold mean
    i = int(r.f1_mean().argmax())
    assert r.px[i] == r.conf_thr
    np.testing.assert_array_equal(r.p_curve[:, i], r.p)
    np.testing.assert_array_equal(r.r_curve[:, i], r.r)


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_confusion_matrix_diagonal_is_the_true_positives_at_its_thresholds(convention):
    images, _ = random_set(1, n_img=60, convention=convention)
    cm = vp.ConfusionMatrix(NC, conf=0.25, iou=0.45, convention=convention)
    tp_per_class, n_gt = np.zeros(NC, int), np.zeros(NC, int)
    n_det = np.zeros(NC, int)
    for det, gt, gc in images:
        cm.process(det, gt, gc)
        keep = det[:, 4] >= 0.25
        d = det[keep]
        tp = match_predictions(d[:, :4], d[:, 4], d[:, 5], gt, gc, iouv=[0.45], convention=convention)[:, 0]
        np.add.at(tp_per_class, d[tp, 5].astype(int), 1)
        np.add.at(n_gt, gc, 1)
        np.add.at(n_det, d[:, 5].astype(int), 1)
    assert tp_per_class.sum() > 10
    np.testing.assert_array_equal(cm.true_positives(), tp_per_class)
    np.testing.assert_array_equal(cm.matrix[:NC].sum(1), n_det)  # every detection counted once (its row)
    np.testing.assert_array_equal(cm.matrix[:, :NC].sum(0), n_gt)  # every GT once (its column)
    assert cm.matrix[NC, NC] == 0
    assert cm.matrix[:NC, :NC].sum() > np.trace(cm.matrix)  # some confusions off the diagonal


def test_perfect_predictions_identity_matrix_and_ap_one():
    rng = np.random.default_rng(2)
    cm = vp.ConfusionMatrix(NC)
    tp, conf, pcls, tcls = [], [], [], []
    for _ in range(10):
        xy = rng.uniform(0, 200, (4, 2))
        gt = np.concatenate([xy, xy + 20], 1)
        gt[:, 0] += np.arange(4) * 300  # apart: no two boxes overlap
        gt[:, 2] += np.arange(4) * 300
        gc = rng.integers(0, NC, 4)
        det = np.concatenate([gt, rng.uniform(0.5, 1, (4, 1)), gc[:, None]], 1)
        cm.process(det, gt, gc)
        tp.append(match_predictions(det[:, :4], det[:, 4], det[:, 5], gt, gc))
        conf.append(det[:, 4])
        pcls.append(gc)
        tcls.append(gc)
    counts = np.bincount(np.concatenate(tcls), minlength=NC)
    np.testing.assert_array_equal(cm.matrix, np.diag([*counts, 0]))
    r = ap_per_class(np.concatenate(tp), np.concatenate(conf), np.concatenate(pcls), np.concatenate(tcls))
    np.testing.assert_allclose(r.ap50, 1.0)
    np.testing.assert_allclose(r.pr_curve, 1.0)  # precision 1 at every recall


def test_one_class_always_taken_for_another_is_that_cell():
    cm = vp.ConfusionMatrix(NC)
    gt = np.array([[0, 0, 20, 20], [50, 50, 80, 90], [100, 0, 130, 30.0]])
    gc = np.array([0, 1, 2])
    det = np.array([[0, 0, 20, 20, 0.9, 1],  # the cat is called a dog
                    [50, 50, 80, 90, 0.8, 1],  # right
                    [100, 0, 130, 30, 0.1, 2],  # right but under conf 0.25: the bird is missed
                    [200, 200, 220, 220, 0.7, 0]])  # a cat where there is nothing
    for _ in range(5):
        cm.process(det, gt, gc)
    want = np.zeros((NC + 1, NC + 1), int)
    want[1, 0] = want[1, 1] = 5  # rows predicted, columns true
    want[NC, 2] = 5  # background row: GT found by nothing
    want[0, NC] = 5  # background column: detection of nothing
    np.testing.assert_array_equal(cm.matrix, want)


# ------------------------------------------------------------------------------------------ validator
class FakeModel(nn.Module):
    def __init__(self, preds):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.preds, self.calls = preds, 0

    def forward_feats(self, img):
        return [img[:, :1] + self.w]

    def decode(self, feats):
        self.calls += 1
        return self.preds[self.calls - 1]


def scene(n_batches=4):
    """Each batch: 2 images; a cat and a dog, found (the dog as a cat in the second image)."""
    batches, preds = [], []
    a, b = (10, 8, 40, 30), (50, 20, 90, 60)
    for _ in range(n_batches):
        t = torch.tensor([(0, 0, *a), (0, 1, *b), (1, 1, *b)], dtype=torch.float32)
        batches.append({"img": torch.randint(0, 256, (2, 3, H, W), dtype=torch.uint8), "batch_idx": t[:, 0],
                        "cls": t[:, 1:2], "bboxes": xyxy2xywh(t[:, 2:6]) / torch.tensor([W, H, W, H]),
                        "im_file": ["a.jpg", "b.jpg"], "ori_shape": [(H, W)] * 2})
        p = torch.zeros(2, 4 + NC, 8)
        for img, box, cls, conf in ((0, a, 0, 0.9), (0, b, 1, 0.8), (1, b, 0, 0.6)):
            p[img, :4, cls] = xyxy2xywh(torch.tensor(box, dtype=torch.float32))
            p[img, 4 + cls, cls] = conf
        preds.append(p)
    return batches, preds


def test_validator_writes_every_picture_with_a_plot_dir_and_none_without(tmp_path):
    batches, preds = scene()
    v = Validator(batches, NAMES, progress=False, plot_dir=tmp_path / "val")
    out = v(FakeModel(preds))
    assert set(v.plot_files) == VAL_FILES
    assert {p.name for p in (tmp_path / "val").iterdir()} == VAL_FILES
    assert all(p.stat().st_size > 1000 for p in v.plot_files.values())
    # the same validation without a folder: same numbers, nothing written
    v2 = Validator(batches, NAMES, progress=False)
    assert v2(FakeModel(preds)) == out and v2.plot_files == {}
    assert len(list(tmp_path.rglob("*"))) == 1 + len(VAL_FILES)


def test_validator_confusion_matrix_counts_the_scene(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(vp, "plot_confusion_matrix", lambda cm, names, path, norm: seen.append(cm.matrix))
    batches, preds = scene(n_batches=2)
    Validator(batches, NAMES, progress=False, plot_dir=tmp_path)(FakeModel(preds))
    want = np.zeros((NC + 1, NC + 1), int)
    want[0, 0] = want[1, 1] = want[0, 1] = 2  # per batch: cat right, dog right, dog called a cat
    np.testing.assert_array_equal(seen[0], want)


def test_a_failing_picture_is_one_warning_and_the_validation_goes_on(tmp_path, monkeypatch, caplog):
    def boom(*a, **k):
        raise RuntimeError("no ink")

    monkeypatch.setattr(vp, "plot_pr_curve", boom)
    batches, preds = scene()
    with caplog.at_level(logging.WARNING, logger="yolofast"):
        out = Validator(batches, NAMES, progress=False, plot_dir=tmp_path)(FakeModel(preds))
    assert out["metrics/mAP50(B)"] > 0
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "yolofast" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "BoxPR_curve.png" in warnings[0] and "no ink" in warnings[0]
    assert "BoxF1_curve.png" in {p.name for p in tmp_path.iterdir()}  # the others are still written
    # an error while collecting (confusion matrix / batch images) also stays one line
    monkeypatch.setattr(vp, "batch_boxes", boom)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="yolofast"):
        Validator(batches, NAMES, progress=False, plot_dir=tmp_path / "b")(FakeModel(scene()[1]))
    assert sum("no ink" in r.getMessage() for r in caplog.records) == 2  # collecting once, PR curve once


def test_eighty_classes_render(tmp_path):
    """COCO-sized class lists: grey per-class lines without 80 legend entries, no cell numbers."""
    names = {i: f"class_{i}" for i in range(80)}
    rng = np.random.default_rng(3)
    n = 400
    tcls = rng.integers(0, 80, n)
    r = ap_per_class(rng.random((n, 10)) < 0.5, rng.random(n), tcls, tcls)
    files = vp.plot_curves(r, names, tmp_path)
    assert set(files) == {"BoxPR_curve.png", "BoxF1_curve.png", "BoxP_curve.png", "BoxR_curve.png"}
    cm = vp.ConfusionMatrix(80)
    cm.matrix[:] = rng.integers(0, 3, cm.matrix.shape)
    assert vp.plot_confusion_matrix(cm, names, tmp_path / "cm.png", True).stat().st_size > 10_000
    boxes = rng.uniform(0.05, 0.5, (n, 4))
    assert vp.plot_labels(tcls, boxes, names, tmp_path / "labels.jpg").stat().st_size > 10_000
