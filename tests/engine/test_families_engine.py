"""CUDA-graph capture (on the CPU emulator), torch.compile and AutoBatch's profiling step for YOLO11 and
YOLO26, the families whose heads differ from v8's: YOLO26's end-to-end loss, with its per-epoch weights,
replays the same numbers as the eager step (the graph is captured again when the weights change), and
compiles without a graph break."""

from __future__ import annotations

import pytest
import torch
from test_cudagraph import _trainer_graph_run_equals_eager_run
from test_train_families import _tiny


@pytest.mark.parametrize("family", ["yolo11", "yolo26"])
def test_trainer_graph_run_equals_eager_run_emulated(tmp_path, emulated_graphs, family):
    t = _trainer_graph_run_equals_eager_run(tmp_path, "cpu", model=_tiny(family), optimizer="SGD")
    assert t.graph is not None and t.graph.replays > 0
    if family == "yolo26":  # its branch weights change after epoch 0: the graph is captured again
        assert t.graph.captures == 2 and t.graph.key == t.criterion.weights


@pytest.mark.parametrize("family", ["yolo11", "yolo26"])
def test_compiled_step_fullgraph_equals_eager(family):
    """fullgraph=True: a graph break anywhere in the model or the family's criterion raises."""
    from test_compile_train import _batch

    from yolofast.engine.compile import train_step_modules
    from yolofast.loss import criterion_for, fp32_preds
    from yolofast.nn import build_model

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(_tiny(family), nc=3).train()
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


@pytest.mark.parametrize("family", ["yolo11", "yolo26"])
def test_autobatch_step_takes_the_family_head_output(family):
    """AutoBatch's profiling step (forward, fp32 loss, backward) with the family's criterion: YOLO26's head
    output is a dict of branches, not a list of maps."""
    from yolofast.engine.autobatch import _train_step
    from yolofast.loss import criterion_for
    from yolofast.nn import build_model

    model = build_model(_tiny(family), nc=3).train()
    _train_step(model, criterion_for(model), 64, 2, 4, torch.device("cpu"))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
