"""The MuSGD benchmark: its case (fused, reference, baselines) and the dispatch goal (<= 60 ops a step)."""

import torch

from yolofast.bench.cases import build_cases
from yolofast.bench.musgd import count_dispatches, musgd_setup
from yolofast.ops import backend


def test_musgd_case_variants_run():
    (case,) = build_cases("musgd-yolo26n", "cpu")
    names = [v.name for v in case.variants]
    assert names[:2] == ["ref", "cpp"] and {"ultralytics", "bmm_floor"} <= set(names)
    assert "126 Muon matrices of 41 shapes" in case.what
    for v in case.variants:
        if v.available and v.name in ("cpp", "bmm_floor"):
            v.fn()


def test_a_musgd_step_dispatches_at_most_60_ops():
    """Counted from Python by a TorchDispatchMode (the fused op's internal matmuls are its own): the
    per-tensor work is multi-tensor (_foreach_*) and the Newton-Schulz one op, whatever the model."""
    opt, params = musgd_setup("yolo26n")
    with backend("cpp"):
        opt.step()
        before = [p.detach().clone() for p in params]
        ops = count_dispatches(opt.step)
    assert sum(ops.values()) <= 60, ops
    assert ops["yolofast.ns_orthogonalize"] == 1
    assert all(not torch.equal(a, p) for a, p in zip(before[-5:], params[-5:]))  # it did step
