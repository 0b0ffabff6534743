"""torch.compile of the train step (yolofast/engine/compile.py): no graph breaks, eager numbers, and the
trainer's compile=... path. Tests use backend "aot_eager" (Dynamo + AOTAutograd, the same graphs inductor
gets): inductor's C++ codegen of yolov8 takes minutes on a 2-core CPU; bench_train_step.py measures it."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import tiny

from yolofast.data import make_shapes
from yolofast.engine.compile import ScaledLoss, compile_mode, train_step_modules
from yolofast.engine.trainer import Trainer
from yolofast.loss import DetectionLoss
from yolofast.nn import YOLOV8, build_model

TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.use_deterministic_algorithms(False)


def _batch(B=2, nc=3, M=16, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    img = torch.rand(B, 3, 64, 64, generator=g)
    xy, wh = torch.rand(B, M, 2, generator=g) * 0.5 + 0.25, torch.rand(B, M, 2, generator=g) * 0.3 + 0.1
    boxes = torch.cat([xy, wh], -1)
    mask = (torch.arange(M)[None, :, None] < n).float().expand(B, M, 1).contiguous()
    return img, {"gt_cls": torch.randint(0, nc, (B, M, 1), generator=g).float(), "gt_bboxes": boxes,
                 "gt_mask": mask}


def _step(model, loss_fn, img, batch):
    model.zero_grad(set_to_none=True)
    total, items = loss_fn([f.float() for f in model(img)], batch)
    total.backward()
    return total.detach(), items, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_compiled_step_fullgraph_equals_eager():
    torch.manual_seed(0)
    model = build_model(TINY, nc=3).train()
    crit = DetectionLoss(3)
    img, batch = _batch()
    ref = _step(model, crit, img, batch)
    # fullgraph=True on both (no DDP here): a graph break anywhere in the model or the loss raises.
    cmodel, closs = train_step_modules(model, crit, torch.device("cpu"), compile="aot_eager")
    got = _step(cmodel, closs, img, batch)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    assert len(got[2]) == len(ref[2]) > 0
    for a, b in zip(got[2], ref[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # A second batch with the same padded shapes reuses the graphs (GT bucketed to 16: no recompile).
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    _step(cmodel, closs, *_batch(seed=1, n=9))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


def test_scaled_loss_and_compile_values():
    crit = DetectionLoss(3)
    feats = [torch.randn(2, 67, 64 // s, 64 // s) for s in (8, 16, 32)]
    _, batch = _batch()
    t1, i1 = crit(feats, batch)
    t2, i2 = ScaledLoss(crit, 2)(feats, batch)
    torch.testing.assert_close(t2, 2 * t1)
    torch.testing.assert_close(i2, i1)  # logged items are never scaled
    assert compile_mode(False) == (False, None, None) and compile_mode(True) == (True, None, None)
    assert compile_mode("reduce-overhead") == (True, "reduce-overhead", None)
    assert compile_mode("aot_eager") == (True, None, "aot_eager")
    with pytest.raises(ValueError, match="compile='fast'"):
        compile_mode("fast")


def test_trainer_compile_epoch_validates_uncompiled_ema(tmp_path):
    data = str(make_shapes(root=tmp_path / "d", n_train=8, n_val=4, imgsz=64))
    t = Trainer(model=TINY, data=data, epochs=1, imgsz=64, batch=4, workers=0, verbose=False, plots=False,
                project=tmp_path, name="c", compile="aot_eager")
    m = t.train()
    assert hasattr(t.train_model, "_orig_mod") and t.train_loss is not t.criterion  # compiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # model + loss graphs were built
    assert not hasattr(t.ema.ema, "_orig_mod") and t.validator.loss is t.criterion  # validation: eager
    assert "metrics/mAP50-95(B)" in m and (tmp_path / "c" / "weights" / "last.pt").exists()


@pytest.mark.parametrize("family", ["yolo11", "yolo26"])
def test_compiled_step_fullgraph_equals_eager_families(family):
    """fullgraph=True: a graph break anywhere in the model or the family's criterion raises."""
    from yolofast.engine.compile import train_step_modules
    from yolofast.loss import criterion_for, fp32_preds
    from yolofast.nn import build_model

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(tiny(family), nc=3).train()
    crit = criterion_for(model)
    img, batch = _batch()

    def step(m, loss_fn):
        m.zero_grad(set_to_none=True)
        total, items = loss_fn(fp32_preds(m(img)), batch)
        total.backward()
        return total.detach(), items, [p.grad.clone() for p in m.parameters() if p.grad is not None]

    ref = step(model, crit)
    got = step(*train_step_modules(model, crit, torch.device("cpu"), compile="aot_eager"))
    torch._dynamo.reset()
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    assert len(got[2]) == len(ref[2]) > 0
    for a, b in zip(got[2], ref[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
