"""CUDA-graph capture of the whole train step (yolofast/engine/cudagraph.py): replay == eager to 1e-5."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from tiny_models import tiny

from yolofast.engine.cudagraph import (
    ShapeMismatch,
    capture_train_step,
    graph_blockers,
    has_state,
    optimizer_kwargs,
    pad_gt,
)
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


def _eager_step(model, crit, opt, ema, batch) -> float:
    loss, _ = crit(model(batch["img"]), batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
    opt.step()
    opt.zero_grad()
    ema.update(model)
    return loss.item()


def _replay_equals_eager(dev):
    """After one eager step (the optimizer needs its state before capture), the captured step (capture on
    batch 1; its warm-up steps are undone) gives the eager losses and EMA over batches 1, 2, then an lr
    change, an eager step on a short batch in between (the graph gets its gradient tensors back, zeroed)
    and batch 3; a batch of another shape is refused."""
    torch.manual_seed(0)
    base = build_model(TINY, nc=3).to(dev).train()
    runs = []
    for graph in (False, True):
        model = copy.deepcopy(base)
        lr = torch.tensor(0.01, device=dev)  # a tensor: a float lr would be frozen into the graph
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True,
                              **optimizer_kwargs("sgd"))
        ema, crit = ModelEMA(model), DetectionLoss(3)
        _eager_step(model, crit, opt, ema, _batch(0, dev))
        step = None
        if graph:
            fresh = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, **optimizer_kwargs("sgd"))
            assert capture_train_step(model, crit, fresh, ema, _batch(1, dev)) is None  # no state yet
            step = capture_train_step(model, crit, opt, ema, _batch(1, dev))
            assert step is not None
            with pytest.raises(ShapeMismatch):
                step(_batch(4, dev, B=2))
        losses = []
        for s in (1, 2, "lr", "short", 3):
            if s == "lr":
                lr.fill_(0.004)
            elif s == "short":
                losses.append(_eager_step(model, crit, opt, ema, _batch(5, dev, B=2)))
            elif graph:
                losses.append(step(_batch(s, dev))[0].item())
            else:
                losses.append(_eager_step(model, crit, opt, ema, _batch(s, dev)))
        runs.append((losses, torch.cat([p.detach().flatten() for p in ema.ema.parameters()])))
    torch.testing.assert_close(torch.tensor(runs[1][0]), torch.tensor(runs[0][0]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=1e-5, atol=1e-6)
    return step


@pytest.mark.cuda
def test_replay_equals_eager():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _replay_equals_eager(torch.device("cuda"))


def test_replay_equals_eager_emulated(emulated_graphs):
    """The same on the CPU emulator: capture, warm-up undo and replay logic without a GPU."""
    step = _replay_equals_eager(torch.device("cpu"))
    assert step.graph.replays == 3 and len(step.graph.calls) > 100


def test_pad_gt_and_blockers():
    b = _batch(0, "cpu", B=2, M=16)
    wide = pad_gt(b, 48)
    assert wide["gt_bboxes"].shape == (2, 48, 4) and wide["gt_mask"][:, 16:].sum() == 0
    assert torch.equal(wide["gt_cls"][:, :16], b["gt_cls"]) and pad_gt(b, 16) is b and pad_gt(b, 8) is None
    why = graph_blockers("cpu", compile_enabled=True, distributed=True, accumulate=4, scaler_enabled=True)
    assert len(why) == 5 and "nbs <= batch" in why[3]
    assert graph_blockers("cuda", False, False, 1, False) == []
    assert optimizer_kwargs("sgd") == {"fused": True} and optimizer_kwargs("AdamW") == {"capturable": True}
    w = torch.nn.Parameter(torch.ones(3))
    for opt in (torch.optim.SGD([w], lr=0.1, momentum=0.9), torch.optim.AdamW([w], lr=0.1)):
        assert not has_state(opt)
        w.grad = torch.ones(3)
        opt.step()
        assert has_state(opt)
    assert has_state(torch.optim.SGD([w], lr=0.1))  # plain SGD keeps no state at all


def test_trainer_cuda_graph_on_cpu_warns_and_trains_eagerly(tmp_path):
    from yolofast import Trainer
    from yolofast.data import make_shapes

    data = make_shapes(root=tmp_path, n_train=4, n_val=2, imgsz=64)
    with pytest.warns(UserWarning, match="cuda_graph=True but not a CUDA run"):
        t = Trainer(model=TINY, data=data, imgsz=64, batch=2, nbs=2, epochs=1, workers=0, verbose=False,
                    plots=False, cuda_graph=True, project=tmp_path)
        t.train()
    assert t.graph is None and torch.isfinite(t.tloss).all()
    torch.use_deterministic_algorithms(False)


def _trainer_graph_run_equals_eager_run(tmp_path, device, model=TINY, **kw):
    """Two epochs of the real trainer, eager vs cuda_graph=True (same seed, same data): the per-epoch losses,
    the pre-clip gradient norms (mean and max, which the replayed steps hand out of the graph) and the final
    EMA (weights and BN statistics) agree, and the graph really replayed (captured at the first step after
    the warmup)."""
    from yolofast import Trainer
    from yolofast.data import make_shapes

    data = make_shapes(root=tmp_path, n_train=16, n_val=4, imgsz=128)
    out, norms = [], []
    for graph in (False, True):
        t = Trainer(model=model, data=data, imgsz=128, batch=4, nbs=4, epochs=2, workers=0, verbose=False,
                    plots=False, val=False, lr0=0.002, warmup_epochs=0.5, device=device, cuda_graph=graph,
                    project=tmp_path, name=f"g{int(graph)}", **kw)
        losses, grads = [], []
        t.add_callback("on_train_epoch_end", lambda tr, losses=losses: losses.append(tr.tloss.clone()))
        t.add_callback("on_train_epoch_end", lambda tr, grads=grads: grads.append(
            [tr.grad_norm.read()[k] for k in ("grad/norm_mean", "grad/norm_max", "grad/clip_frac")]))
        t.train()
        if graph:  # 8 steps, warmup nw = 2: eager 0..2, capture at 3, replays 3..7
            assert t.graph is not None and t.graph.off is None and t.graph.replays == 5 and t.graph.eager == 0
        # the EMA's whole float state: BN running statistics too (train-mode losses do not see them)
        ema = [v.flatten() for v in t.ema.ema.state_dict().values() if v.is_floating_point()]
        out.append((torch.stack(losses), torch.cat(ema).cpu()))
        norms.append(torch.tensor(grads, dtype=torch.float64))
    torch.use_deterministic_algorithms(False)
    assert torch.isfinite(norms[1]).all() and (norms[1][:, 0] > 0).all()
    torch.testing.assert_close(norms[1], norms[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-4, atol=1e-5)
    return t


@pytest.mark.cuda
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_trainer_graph_run_equals_eager_run(tmp_path, optimizer):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _trainer_graph_run_equals_eager_run(tmp_path, 0, optimizer=optimizer)


@pytest.mark.parametrize("amp", [False, True])
def test_trainer_graph_run_equals_eager_run_emulated(tmp_path, emulated_graphs, amp):
    """The same on the CPU emulator, in fp32 and in the CPU's default bf16 autocast. SGD only: a capturable
    Adam keeps its state on CUDA devices only."""
    t = _trainer_graph_run_equals_eager_run(tmp_path, "cpu", optimizer="SGD", amp=amp)
    assert t.optimizer.defaults.get("fused") and torch.is_tensor(t.optimizer.param_groups[0]["lr"])


def test_trainer_graph_non_finite_loss_emulated(tmp_path, emulated_graphs):
    """A non-finite loss in a replayed step (its update is already applied): the trainer restores the
    epoch's last good state, turns the graph off and finishes the run eagerly with finite weights."""
    from yolofast import Trainer
    from yolofast.data import make_shapes

    data = make_shapes(root=tmp_path, n_train=8, n_val=2, imgsz=64)
    t = Trainer(model=TINY, data=data, imgsz=64, batch=2, nbs=2, epochs=2, workers=0, verbose=False,
                plots=False, val=False, optimizer="SGD", warmup_epochs=0.0, mosaic=0.0, cuda_graph=True,
                device="cpu", project=tmp_path)
    prep, seen = t.preprocess_batch, {"n": 0}

    def poisoned(batch):  # batch 6 (epoch 2, step 2) gets a NaN pixel: its replayed loss is NaN
        out = prep(batch)
        if seen["n"] == 5:
            out["img"][0, 0, 0, 0] = float("nan")
        seen["n"] += 1
        return out

    start = {}
    t.add_callback("on_train_epoch_start", lambda tr: start.setdefault(tr.epoch, copy.deepcopy(
        {k: v.clone() for k, v in tr.model.state_dict().items()})))
    t.preprocess_batch = poisoned
    with pytest.warns(UserWarning, match="non-finite loss"):
        t.train()
    g = t.graph
    assert g.off == "non-finite loss" and g.replays == 5 and g.step is None  # steps 1..5 (5: the NaN)
    assert t.nonfinite.skipped == 1 and t.nonfinite.restores == 0  # the restore is not counted
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    assert all(torch.isfinite(p).all() for p in t.ema.ema.parameters())
    state = t.model.state_dict()  # the two eager steps after the restore trained:
    assert any(not torch.equal(v, start[1][k]) for k, v in state.items() if v.is_floating_point())


def test_step_is_capture_safe_on_cpu():
    """What a CUDA graph cannot hold, checked on the CPU: after one warm step, a whole step (forward, loss,
    backward, clipping, EMA) makes no tensor from host data (lift_fresh: a host->device copy on CUDA),
    reads no value to the host (.item()) and has no data-dependent shape (nonzero)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = build_model(TINY, nc=3).train()
    ema, crit, batch = ModelEMA(model), DetectionLoss(3), _batch(0, "cpu", B=2)

    def step():
        loss, _ = crit(model(batch["img"]), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0, foreach=True)
        ema.update(model)
        model.zero_grad(set_to_none=False)

    step()  # warm: caches, EMA buffers
    with Record() as rec:
        step()
    assert any(op.startswith("yolofast.") for op in rec.ops), "the fused ops did not run"
    forbidden = ("lift_fresh", "_local_scalar_dense", "nonzero", "item")
    bad = {op for op in rec.ops if op.split(".")[1] in forbidden}
    assert not bad, bad


def test_bench_train_step_graph_variant_emulated(emulated_graphs):
    """benchmarks/bench_train_step.py's graph_bf16_cl (gpu_check.sh times it on the H200) captures and
    replays: its optimizer has state before capture and a tensor lr, and each call is one replay."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train_step.py"
    spec = importlib.util.spec_from_file_location("yolofast_bench_train_step", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    step = mod.make_step("graph_bf16_cl", imgsz=64, batch=2, nc=3, device=torch.device("cpu"))
    losses = [float(step()) for _ in range(3)]
    assert step.graphed.graph.replays == 3 and all(math.isfinite(v) for v in losses)
    assert losses[0] != losses[2]  # the weights moved between replays


def test_trainer_graph_resume_equals_uninterrupted_emulated(tmp_path, emulated_graphs, resume_after_crash):
    """A graphed run stopped after epoch 1 and resumed (its checkpoint holds the graph's tensor lr) ends
    where the uninterrupted graphed run ends; the resumed run captures again and replays."""
    from yolofast import Trainer
    from yolofast.data import make_shapes
    from yolofast.engine.checkpoint import load_checkpoint

    data = make_shapes(root=tmp_path, n_train=8, n_val=2, imgsz=64)
    recipe = dict(model=TINY, data=data, imgsz=64, batch=2, nbs=2, epochs=2, workers=0, verbose=False,
                  plots=False, val=False, optimizer="SGD", warmup_epochs=0.5, cuda_graph=True, device="cpu",
                  project=tmp_path)
    full = Trainer(name="full", **recipe)
    full.train()
    r = resume_after_crash(recipe)
    r.train()
    assert full.graph.replays == 5 and r.graph.replays == 4 and r.graph.off is None  # nw = 2
    a, b = (load_checkpoint(tmp_path / f"{n}/weights/last.pt") for n in ("full", "cut"))
    for part in ("model", "ema"):
        sa, sb = a[part].state_dict(), b[part].state_dict()
        for k in sa:
            torch.testing.assert_close(sb[k], sa[k], rtol=0, atol=1e-6, msg=f"{part} {k}")


@pytest.mark.parametrize("family", ["yolo11", "yolo26"])
def test_trainer_graph_run_equals_eager_run_emulated_families(tmp_path, emulated_graphs, family):
    """YOLO11 and YOLO26 under the graph: YOLO26's head output is a dict of branches and its branch weights
    change after epoch 0, so its graph is captured again then."""
    t = _trainer_graph_run_equals_eager_run(tmp_path, "cpu", model=tiny(family), optimizer="SGD")
    assert t.graph is not None and t.graph.replays > 0
    if family == "yolo26":  # its branch weights change after epoch 0: the graph is captured again
        assert t.graph.captures == 2 and t.graph.key == t.criterion.weights
