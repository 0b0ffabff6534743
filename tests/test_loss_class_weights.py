"""cls_pw: class-frequency weights on the class loss (DetectionLoss(class_weights=...))."""

import numpy as np
import pytest
import torch

from yolofast.engine.class_weights import class_weights
from yolofast.loss import DetectionLoss
from yolofast.ops import backend

NC, R = 3, 16
NO = 4 * R + NC


def _feats(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NO, 64 // s, 64 // s, generator=g).requires_grad_(True) for s in (8, 16, 32)]


def _batch():
    gt_cls = torch.zeros(2, 16, 1)
    gt_bboxes = torch.zeros(2, 16, 4)
    gt_mask = torch.zeros(2, 16, 1)
    gt_cls[0, :2, 0] = torch.tensor([0.0, 2.0])
    gt_bboxes[0, :2] = torch.tensor([[0.3, 0.4, 0.4, 0.5], [0.7, 0.7, 0.2, 0.3]])
    gt_mask[0, :2] = 1
    gt_cls[1, 0, 0] = 1.0
    gt_bboxes[1, 0] = torch.tensor([0.5, 0.5, 0.6, 0.6])
    gt_mask[1, 0] = 1
    return {"gt_cls": gt_cls, "gt_bboxes": gt_bboxes, "gt_mask": gt_mask}


def test_weights_follow_inverse_frequency_to_the_power():
    labels = [{"cls": np.array([[0]] * 8 + [[1]] * 2)}, {"cls": np.zeros((0, 1))}]
    w = class_weights(labels, 3, 1.0)
    # counts 8, 2, 0 -> 1/8, 1/2, mean(1/8, 1/2) for the unseen class; scaled to mean 1
    raw = np.array([1 / 8, 1 / 2, (1 / 8 + 1 / 2) / 2])
    assert np.allclose(w.numpy(), raw / raw.mean())
    w_half = class_weights(labels, 3, 0.5)
    raw = np.array([(1 / 8) ** 0.5, (1 / 2) ** 0.5])
    raw = np.append(raw, raw.mean())
    assert np.allclose(w_half.numpy(), raw / raw.mean())
    assert class_weights(labels, 3, 0.0) is None


@pytest.mark.parametrize("be", ["ref", "auto"])
def test_unit_weights_equal_the_fused_loss_and_its_gradients(be):
    with backend(be):
        f1, f2 = _feats(), _feats()
        t1, i1 = DetectionLoss(NC)(f1, _batch())
        t2, i2 = DetectionLoss(NC, class_weights=torch.ones(NC))(f2, _batch())
        t1.backward()
        t2.backward()
    assert torch.allclose(i1, i2, rtol=1e-5, atol=1e-6)
    for a, b in zip(f1, f2):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("be", ["ref", "auto"])
def test_weights_scale_each_class_bce(be):
    """Weights (w0, w1, w2): the class item equals 0.5 * sum_c w_c * BCE_c / S, computed here by hand from the
    unweighted loss run once per class with that class's weight 1 and the others 0."""
    w = torch.tensor([0.2, 1.3, 1.5])
    with backend(be):
        feats = _feats()
        _, items = DetectionLoss(NC, class_weights=w)(feats, _batch())
        per_class = [DetectionLoss(NC, class_weights=torch.eye(NC)[c])(_feats(), _batch())[1][1]
                     for c in range(NC)]
        _, plain = DetectionLoss(NC)(_feats(), _batch())
    assert torch.allclose(sum(per_class), plain[1], rtol=1e-5)  # the per-class parts add up to the fused term
    assert torch.allclose(items[1], sum(wc * pc for wc, pc in zip(w, per_class)), rtol=1e-5)
    assert torch.allclose(items[[0, 2]], plain[[0, 2]], rtol=1e-6)  # box and DFL terms untouched
    assert not torch.allclose(items[1], plain[1])
