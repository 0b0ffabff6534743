import contextlib
import io

import numpy as np
import pytest
import torch

from yolofast.val.metrics import IOU_THRESHOLDS, ap_per_class, box_iou_np, coco_ap, match_predictions


def test_box_iou_np():
    a = np.array([[0, 0, 10, 10], [0, 0, 0, 0]])
    b = np.array([[5, 0, 15, 10], [20, 20, 30, 30]])
    np.testing.assert_allclose(box_iou_np(a, b), [[50 / 150, 0], [0, 0]])


def test_match_greedy_by_confidence_like_coco():
    gt = np.array([[0, 0, 10, 10]])
    pred = np.array(
        [
            [0, 0, 10, 8.2],  # conf 0.9, IoU 0.82
            [0, 0, 10, 9.6],  # conf 0.8, IoU 0.96
            [0, 0, 10, 10],  # conf 0.95, perfect box but class 1 -> never a TP
        ]
    )
    tp = match_predictions(pred, [0.9, 0.8, 0.95], [0, 0, 1], gt, [0])
    # The higher-confidence detection takes the GT wherever its IoU reaches the threshold (0.50..0.80);
    # above that the GT is free and the better-overlapping, lower-confidence one takes it (0.85..0.95).
    # (Matching greedily by IoU, as Ultralytics does, would give the GT to row 1 at every threshold.)
    expected = np.zeros((3, 10), bool)
    expected[0, :7] = True
    expected[1, 7:] = True
    np.testing.assert_array_equal(tp, expected)


def test_match_each_gt_once_and_best_free_gt():
    gt = np.array([[0, 0, 10, 10], [0, 0, 10, 9]])
    pred = np.array([[0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 10]])
    # Detection 0 takes GT 0 (IoU 1); detection 1 takes the free GT 1 (IoU 0.9, so TP up to 0.90);
    # detection 2 finds both GTs taken -> FP everywhere.
    tp = match_predictions(torch.tensor(pred), torch.tensor([0.9, 0.8, 0.7]), [2, 2, 2], gt, [2, 2])
    assert tp[0].all()
    np.testing.assert_array_equal(tp[1], IOU_THRESHOLDS <= 0.9 + 1e-9)
    assert not tp[2].any()
    assert match_predictions(pred, [1, 1, 1], [0, 0, 0], np.zeros((0, 4)), []).shape == (3, 10)


def test_ap_hand_worked():
    # One class, 2 GT; detections by conf: TP, FP, TP at every threshold.
    # precision 1, 1/2, 2/3; recall 1/2, 1/2, 1; envelope 1, 2/3, 2/3.
    # 101 recall points: 0.00..0.50 (51 points) read precision 1, 0.51..1.00 (50 points) read 2/3
    # -> AP = (51 + 50 * 2/3) / 101 = 253/303.
    tp = np.array([[True] * 10, [False] * 10, [True] * 10])
    # ... except that the last TP fails IoU >= 0.75: there recall never exceeds 1/2 and AP = 51/101.
    tp[2, 5:] = False
    res = ap_per_class(tp, [0.9, 0.8, 0.7], [0, 0, 0], [0, 0])
    np.testing.assert_allclose(res.all_ap[0, :5], 253 / 303)
    np.testing.assert_allclose(res.all_ap[0, 5:], 51 / 101)
    np.testing.assert_allclose(res.map50, 253 / 303)
    np.testing.assert_allclose(res.map, (5 * 253 / 303 + 5 * 51 / 101) / 10)
    np.testing.assert_array_equal(res.classes, [0])
    np.testing.assert_array_equal(res.nt, [2])


def test_ap_classes_without_gt_or_without_detections():
    # class 0: perfect (AP 1); class 1: GT but no detection (AP 0); class 2: detections but no GT (ignored)
    tp = np.array([[True] * 10, [False] * 10])
    res = ap_per_class(tp, [0.9, 0.8], [0, 2], [0, 1])
    np.testing.assert_array_equal(res.classes, [0, 1])
    np.testing.assert_allclose(res.ap, [1.0, 0.0])
    assert res.map == pytest.approx(0.5)
    assert res.p[1] == 0 and res.r[1] == 0
    empty = ap_per_class(np.zeros((0, 10), bool), [], [], [])
    assert empty.map == 0.0 and empty.mp == 0.0 and empty.results_dict()["fitness"] == 0.0


def test_pr_at_best_mean_f1():
    # 2 GT; TP at conf 0.9 and 0.8, FP at 0.7. F1 peaks at conf ~0.8 (P 1, R 1); a report at the lowest
    # conf would give P 2/3, at the highest R 1/2. Smoothing the F1 curve (101 of 1000 points) may move the
    # pick a little, so P is allowed 0.9..1.
    tp = np.array([[True], [True], [False]])
    res = ap_per_class(tp, [0.9, 0.8, 0.7], [0, 0, 0], [0, 0])
    assert 0.9 <= res.mp <= 1.0
    assert res.mr == pytest.approx(1.0, abs=0.05)
    assert 0.7 <= res.conf_thr <= 0.85
    perfect = ap_per_class(np.ones((4, 10), bool), [0.9, 0.8, 0.7, 0.6], [0, 1, 0, 1], [0, 1, 0, 1])
    assert perfect.mp == pytest.approx(1.0) and perfect.mr == pytest.approx(1.0) and perfect.map == 1.0


def test_coco_ap_never_reached_recall_counts_zero():
    ap = coco_ap(np.array([0.2, 0.4]), np.array([1.0, 1.0]))
    np.testing.assert_allclose(ap, [41 / 101])  # recall points 0.00..0.40


# ---------------------------------------------------------------------------------- pycocotools agreement


def random_scene(rng, n_img=24, nc=5, w=640, h=480):
    """GT and jittered/false predictions; boxes as COCO xywh in float64."""
    gts, dets = [], []
    for i in range(n_img):
        n_gt = rng.integers(0, 9) if i % 6 else 0  # every 6th image has no GT
        for _ in range(n_gt):
            bw, bh = rng.uniform(8, 200), rng.uniform(8, 200)
            x, y = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
            c = int(rng.integers(0, nc - 1))  # the last class never has GT
            gts.append((i, c, x, y, bw, bh))
            for _ in range(rng.integers(0, 3)):  # 0-2 detections per GT, IoU spread over ~0.3..1
                s = rng.uniform(0.0, 0.25)
                dx, dy = rng.normal(0, s * bw / 2), rng.normal(0, s * bh / 2)
                dw, dh = bw * np.exp(rng.normal(0, s)), bh * np.exp(rng.normal(0, s))
                dc = c if rng.random() > 0.1 else int(rng.integers(0, nc))
                dets.append((i, dc, x + dx, y + dy, dw, dh, rng.random()))
        for _ in range(rng.integers(0, 5)):  # background false positives
            bw, bh = rng.uniform(8, 150), rng.uniform(8, 150)
            dets.append(
                (
                    i,
                    int(rng.integers(0, nc)),
                    rng.uniform(0, w - bw),
                    rng.uniform(0, h - bh),
                    bw,
                    bh,
                    rng.random() * 0.5,
                )
            )
    return np.array(gts, dtype=np.float64).reshape(-1, 6), np.array(dets, dtype=np.float64).reshape(-1, 7)


def pycocotools_map(gts, dets, n_img, nc):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    ds = {
        "images": [{"id": i + 1, "width": 640, "height": 480} for i in range(n_img)],
        "categories": [{"id": c + 1, "name": str(c)} for c in range(nc)],
        "annotations": [
            {
                "id": k + 1,
                "image_id": int(g[0]) + 1,
                "category_id": int(g[1]) + 1,
                "bbox": g[2:6].tolist(),
                "area": float(g[4] * g[5]),
                "iscrowd": 0,
            }
            for k, g in enumerate(gts)
        ],
    }
    results = [
        {"image_id": int(d[0]) + 1, "category_id": int(d[1]) + 1, "bbox": d[2:6].tolist(), "score": d[6]}
        for d in dets
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = ds
        coco_gt.createIndex()
        coco_dt = coco_gt.loadRes(results)
        ev = COCOeval(coco_gt, coco_dt, "bbox")
        ev.params.areaRng, ev.params.areaRngLbl = [[0, 1e10]], ["all"]
        ev.params.maxDets = [10_000]  # no per-image cap (ours is max_det in NMS)
        ev.evaluate()
        ev.accumulate()
    prec = ev.eval["precision"][:, :, :, 0, 0]  # (T, R, K); -1 for classes without GT
    valid = prec[0, 0] > -1
    per_class = prec[:, :, valid].mean(1).T  # (k, T)
    return per_class, float(prec[:, :, valid].mean()), float(prec[0][:, valid].mean())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_agrees_with_pycocotools(seed):
    rng = np.random.default_rng(seed)
    n_img, nc = 24, 5
    gts, dets = random_scene(rng, n_img, nc)
    tps, confs, clss = [], [], []
    for i in range(n_img):
        g, d = gts[gts[:, 0] == i], dets[dets[:, 0] == i]
        gxyxy = np.concatenate((g[:, 2:4], g[:, 2:4] + g[:, 4:6]), 1)
        dxyxy = np.concatenate((d[:, 2:4], d[:, 2:4] + d[:, 4:6]), 1)
        tps.append(match_predictions(dxyxy, d[:, 6], d[:, 1], gxyxy, g[:, 1]))
        confs.append(d[:, 6])
        clss.append(d[:, 1])
    res = ap_per_class(np.concatenate(tps), np.concatenate(confs), np.concatenate(clss), gts[:, 1])
    ref_per_class, ref_map, ref_map50 = pycocotools_map(gts, dets, n_img, nc)

    assert 0.2 < ref_map < 0.9  # the scene is neither trivial nor hopeless
    tp_all = np.concatenate(tps)
    assert 0 < tp_all[:, -1].sum() < tp_all[:, 0].sum()  # thresholds really differ
    # Same convention as COCOeval, so agreement is to rounding, far inside the 0.002 budget
    np.testing.assert_allclose(res.all_ap, ref_per_class, atol=1e-9)
    assert res.map == pytest.approx(ref_map, abs=1e-9)
    assert res.map50 == pytest.approx(ref_map50, abs=1e-9)
