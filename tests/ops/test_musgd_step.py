"""The fused MuSGD step (the C++ CPU op ``ns_orthogonalize.musgd``: momentum, Newton–Schulz and SGD part in
one call) against MuSGD's multi-tensor path (``_momentum_look`` + ``ns_orthogonalize`` + ``_foreach_*``), bit
for bit over 3 steps: Muon and plain groups, decay on and off, Nesterov or not, bf16 and fp32 NS, NCHW and
channels_last weights, σ != 1 (2-D weights taller than wide), 1 and 2 threads; and the fallback where a
tensor does not fit the op (a transposed weight, a tensor lr).

    python -m pytest -q tests/ops/test_musgd_step.py
"""

from __future__ import annotations

import pytest
import torch

from yolofast.bench.musgd import count_dispatches
from yolofast.optim import MuSGD

# Muon shapes: conv weights (one repeated, a depthwise one), 2-D weights wide, tall (σ = sqrt(5)), a row and
# a column, and one of 55 K values, so that a pass (66 K values) is cut between 2 threads mid-row; plain:
# biases and BN weights.
MUON = [(16, 3, 3, 3), (32, 16, 3, 3), (32, 16, 3, 3), (8, 1, 3, 3), (8, 40), (40, 8), (1, 16), (16, 1),
        (24, 8, 1, 1), (96, 64, 3, 3)]
PLAIN = [(16,), (32,), (7,), (1,)]


def _params(channels_last: bool, transposed: bool = False) -> tuple[list, list]:
    g = torch.Generator().manual_seed(0)
    muon = [torch.randn(s, generator=g) * 0.1 for s in MUON]
    if channels_last:
        muon = [p.contiguous(memory_format=torch.channels_last) if p.dim() == 4 else p for p in muon]
    if transposed:  # a (40, 8) weight stored as the transpose of a (8, 40) one: not rows of memory
        muon[5] = (torch.randn(8, 40, generator=g) * 0.1).t()
    plain = [torch.randn(s, generator=g) * 0.1 for s in PLAIN]
    return [torch.nn.Parameter(p) for p in muon], [torch.nn.Parameter(p) for p in plain]


def _run(fused: bool, channels_last=False, fp32=False, nesterov=True, transposed=False, tensor_lr=False):
    muon, plain = _params(channels_last, transposed)
    lr = (lambda v: torch.tensor(v)) if tensor_lr else (lambda v: v)
    groups = [{"params": muon[:4], "use_muon": True, "lr": lr(0.03), "weight_decay": 5e-4},
              {"params": muon[4:], "use_muon": True, "lr": lr(0.01), "weight_decay": 0.0},
              {"params": plain[:2], "lr": lr(0.01), "weight_decay": 5e-4},
              {"params": plain[2:], "lr": lr(0.03), "weight_decay": 0.0}]
    opt = MuSGD(groups, lr=0.01, momentum=0.937, nesterov=nesterov, muon=0.2, sgd=1.0,
                ns_dtype=torch.float32 if fp32 else torch.bfloat16)
    if not fused:
        opt._fused_step = lambda work: False
    g = torch.Generator().manual_seed(1)
    taken = []
    for _ in range(3):
        for p in muon + plain:
            p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=g) * 1e-2)
        taken.append(count_dispatches(opt.step))
    state = [v for p in muon + plain for v in opt.state[p].values()]
    return [p.detach() for p in muon + plain] + state, taken


def _assert_equal(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"tensor {i} {tuple(x.shape)}: max diff {float((x - y).abs().max())}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("channels_last,fp32,nesterov", [(False, False, True), (True, False, True),
                                                         (False, True, True), (True, True, False)])
def test_fused_step_equals_the_multi_tensor_step(lib, threads, channels_last, fp32, nesterov):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want, _ = _run(False, channels_last, fp32, nesterov)
        lib.threads_seen()
        got, taken = _run(True, channels_last, fp32, nesterov)
        assert lib.threads_seen() == threads
    finally:
        torch.set_num_threads(before)
    _assert_equal(got, want)
    for ops in taken:  # the fused op ran: one call, no multi-tensor op
        assert ops["yolofast.ns_orthogonalize"] == 1 and not any(k.startswith("aten._foreach") for k in ops)


@pytest.mark.parametrize("case", ["transposed", "tensor_lr"])
def test_fallback_to_the_multi_tensor_step(lib, case):
    kw = {case: True}
    want, _ = _run(False, **kw)
    got, taken = _run(True, **kw)
    _assert_equal(got, want)
    for ops in taken:
        assert any(k.startswith("aten._foreach") for k in ops)
