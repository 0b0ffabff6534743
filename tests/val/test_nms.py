import pytest
import torch

from yolofast.boxes import xyxy2xywh
from yolofast.val.nms import non_max_suppression


def make_pred(boxes_xyxy, scores):
    """One image: boxes (A, 4) xyxy px, scores (A, nc) -> pred (1, 4+nc, A) as the model's eval output."""
    boxes = torch.tensor(boxes_xyxy, dtype=torch.float32)
    scores = torch.tensor(scores, dtype=torch.float32)
    return torch.cat((xyxy2xywh(boxes), scores), 1).T.unsqueeze(0)


def test_overlap_suppressed_within_class_kept_across_classes():
    boxes = [
        [0, 0, 100, 100],  # class 0, 0.9
        [5, 5, 105, 105],  # class 0, 0.8: IoU 0.82 with box 0 -> suppressed
        [0, 0, 100, 100],  # class 1, 0.7: same place, other class -> kept
        [300, 300, 400, 400],  # class 0, 0.6: no overlap -> kept
        [0, 0, 100, 60],  # class 0, 0.5: IoU 0.6 with box 0 < 0.7 -> kept
    ]
    scores = [[0.9, 0.1], [0.8, 0.05], [0.2, 0.7], [0.6, 0.0], [0.5, 0.0]]
    (det,) = non_max_suppression(make_pred(boxes, scores), conf=0.25, iou=0.7)
    assert det.shape == (4, 6)
    torch.testing.assert_close(det[:, 4], torch.tensor([0.9, 0.7, 0.6, 0.5]))
    torch.testing.assert_close(det[:, 5], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(det[1, :4], torch.tensor([0.0, 0.0, 100.0, 100.0]))
    torch.testing.assert_close(det[2, :4], torch.tensor([300.0, 300.0, 400.0, 400.0]))
    # A stricter iou threshold also removes the box with IoU 0.6
    (det,) = non_max_suppression(make_pred(boxes, scores), conf=0.25, iou=0.5)
    torch.testing.assert_close(det[:, 4], torch.tensor([0.9, 0.7, 0.6]))


def test_conf_filter_and_best_class():
    boxes = [[0, 0, 10, 10], [50, 50, 60, 60], [100, 100, 110, 110]]
    scores = [[0.3, 0.6], [0.2, 0.1], [0.25, 0.0]]
    (det,) = non_max_suppression(make_pred(boxes, scores), conf=0.25)
    # box 1 below conf; box 2 exactly at conf is rejected (strict >); box 0 gets its best class 1
    assert det.shape == (1, 6)
    torch.testing.assert_close(det[0], torch.tensor([0.0, 0.0, 10.0, 10.0, 0.6, 1.0]))


def test_multi_label():
    boxes = [[0, 0, 10, 10]]
    scores = [[0.3, 0.6, 0.1]]
    (det,) = non_max_suppression(make_pred(boxes, scores), conf=0.25, multi_label=True)
    assert det.shape == (2, 6)
    torch.testing.assert_close(det[:, 4:], torch.tensor([[0.6, 1.0], [0.3, 0.0]]))


def test_max_det_and_max_nms_keep_highest():
    n = 50
    boxes = [[20 * i, 0, 20 * i + 10, 10] for i in range(n)]  # disjoint
    conf = torch.rand(n)
    pred = make_pred(boxes, conf[:, None].tolist())
    (det,) = non_max_suppression(pred, conf=0.0, max_det=7)
    torch.testing.assert_close(det[:, 4], conf.sort(descending=True).values[:7])
    (det,) = non_max_suppression(pred, conf=0.0, max_nms=5)
    torch.testing.assert_close(det[:, 4], conf.sort(descending=True).values[:5])


def test_batch_empty_images_and_dtype():
    boxes = [[0, 0, 10, 10], [0, 0, 10, 10]]
    pred = torch.cat((make_pred(boxes, [[0.9], [0.8]]), make_pred(boxes, [[0.0], [0.0]])), 0)
    out = non_max_suppression(pred.double(), conf=0.001)
    assert [d.shape for d in out] == [(1, 6), (0, 6)]
    assert out[0].dtype == torch.float64 and out[1].dtype == torch.float64
    # A tuple (pred, extras) is accepted as some eval heads return one
    assert non_max_suppression((pred, None))[0].shape == (1, 6)


def test_class_offset_survives_fp16():
    # 79 * 7680 overflows fp16; two distant classes with the same box must both survive
    scores = torch.zeros(2, 80)
    scores[0, 0], scores[1, 79] = 0.9, 0.8
    pred = make_pred([[0, 0, 10, 10], [0, 0, 10, 10]], scores.tolist()).half()
    (det,) = non_max_suppression(pred, conf=0.25)
    assert det[:, 5].tolist() == [0.0, 79.0]


def test_bad_input_raises():
    with pytest.raises(ValueError, match="4\\+nc"):
        non_max_suppression(torch.zeros(2, 4, 10))
    with pytest.raises(ValueError, match="conf"):
        non_max_suppression(torch.zeros(1, 6, 10), conf=1.5)
