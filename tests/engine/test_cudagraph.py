"""CUDA-graph capture of the whole train step (yolofast/engine/cudagraph.py): replay == eager to 1e-5."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from yolofast.engine.cudagraph import ShapeMismatch, capture_train_step
from yolofast.engine.ema import ModelEMA
from yolofast.loss import DetectionLoss
from yolofast.nn import YOLOV8, build_model

TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)


def test_refuses_without_cuda_or_float_lr(caplog):
    model = build_model(TINY, nc=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = {"img": torch.zeros(1, 3, 64, 64), "gt_cls": torch.zeros(1, 16, 1),
             "gt_bboxes": torch.zeros(1, 16, 4), "gt_mask": torch.zeros(1, 16, 1)}
    with caplog.at_level(logging.WARNING, logger="yolofast"):
        assert capture_train_step(model, DetectionLoss(3), opt, None, batch) is None
    assert "cuda_graph" in caplog.text


def _batch(seed, dev, B=4, M=16, n=6):
    g = torch.Generator().manual_seed(seed)
    xy, wh = torch.rand(B, M, 2, generator=g) * 0.5 + 0.25, torch.rand(B, M, 2, generator=g) * 0.3 + 0.1
    b = {"img": torch.rand(B, 3, 128, 128, generator=g),
         "gt_cls": torch.randint(0, 3, (B, M, 1), generator=g).float(), "gt_bboxes": torch.cat([xy, wh], -1),
         "gt_mask": (torch.arange(M)[None, :, None] < n).float().expand(B, M, 1)}
    return {k: v.to(dev).contiguous() for k, v in b.items()}


@pytest.mark.cuda
def test_replay_equals_eager():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    base = build_model(TINY, nc=3).to(dev).train()
    runs = []
    for graph in (False, True):
        model = copy.deepcopy(base)
        lr = torch.tensor(0.01, device=dev)  # a tensor: a float lr would be frozen into the graph
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)
        ema, crit = ModelEMA(model), DetectionLoss(3)
        losses = []
        if graph:
            step = capture_train_step(model, crit, opt, ema, _batch(0, dev))  # 3 warm-up steps on batch 0
            assert step is not None
            for s in (1, 2):
                losses.append(step(_batch(s, dev))[0].item())
            with pytest.raises(ShapeMismatch):
                step(_batch(3, dev, B=2))
        else:
            for s in (0, 0, 0, 1, 2):
                loss, _ = crit(model(_batch(s, dev)["img"]), _batch(s, dev))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
                opt.step()
                opt.zero_grad()
                ema.update(model)
                losses.append(loss.item())
            losses = losses[3:]
        runs.append((losses, torch.cat([p.detach().flatten() for p in ema.ema.parameters()])))
    torch.testing.assert_close(torch.tensor(runs[1][0]), torch.tensor(runs[0][0]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=1e-5, atol=1e-6)
