"""The MuSGD benchmark (presets ``musgd-yolo26n``/``musgd-yolo26s``): one optimizer step over a real model's
parameters, with fixed seeded gradients.

Variants: yolofast's backends of ``ns_orthogonalize`` ("ref": matrix by matrix; the fused op: "cpp" on the
CPU, "cuda" and "triton" on a GPU, preset ``gpu-musgd-yolo26n``);
baselines ``ultralytics`` (Ultralytics' own MuSGD over the same groups, only where ``ultralytics`` is
importable: an optional import for this comparison, never on a training path) and ``bmm_floor`` (the
Newton–Schulz matmuls of the step alone, as plain batched ``torch.bmm`` calls over the same shapes and
dtype: the irreducible cost the fused step is measured against). ``count_dispatches`` counts the ATen
ops a step dispatches (a CPU proxy for GPU kernel launches).
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["bmm_floor", "count_dispatches", "musgd_case", "musgd_setup"]


def musgd_setup(model_name: str, seed: int = 0, device: str = "cpu", optimizer_cls=None, ns_dtype=None):
    """(optimizer, params): MuSGD's 8 groups of ``model_name`` (lr 0.01, momentum 0.937, decay 5e-4), every
    trainable parameter given a seeded random gradient of a typical size (1e-3 per entry)."""
    from yolofast.engine import optim
    from yolofast.nn import build_model

    model = build_model(model_name, nc=80).to(device)
    groups = optim.musgd_groups(model, 0.01, 0.937, 5e-4)
    g = torch.Generator().manual_seed(seed)
    params = [p for gr in groups for p in gr["params"]]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(device)
    if optimizer_cls is None:
        from yolofast.optim import MuSGD

        opt = MuSGD(groups, lr=0.01, momentum=0.937, nesterov=True, muon=0.2, sgd=1.0, ns_dtype=ns_dtype)
    else:
        opt = optimizer_cls(groups, muon=0.2, sgd=1.0)
    return opt, params


def _ns_shapes(params) -> collections.Counter:
    return collections.Counter((p.shape[0], p[0].numel()) for p in params if p.ndim in (2, 4))


def bmm_floor(opt, dtype=torch.bfloat16):
    """A callable that runs the step's Newton–Schulz matmuls alone: per distinct Muon shape (count G,
    oriented m <= n) 5 x [(G,m,n)@(G,n,m), (G,m,m)@(G,m,m), (G,m,m)@(G,m,n)] as plain torch.bmm on
    preallocated inputs of ``dtype``."""
    params = [p for gr in opt.param_groups if gr.get("use_muon") for p in gr["params"]]
    dev = params[0].device
    work = []
    for (r, c), count in _ns_shapes(params).items():
        m, n = min(r, c), max(r, c)
        x = torch.randn(count, m, n, device=dev).to(dtype) * 0.03
        work.append((x, x.transpose(1, 2).contiguous(), torch.randn(count, m, m, device=dev).to(dtype) * 0.1))
    def run():
        for x, xt, a in work:
            for _ in range(5):
                torch.bmm(x, xt)
                torch.bmm(a, a)
                torch.bmm(a, x)
    return run


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_dispatches(step) -> collections.Counter:
    """The ATen (and yolofast) ops one call of ``step`` dispatches from Python, by name: what a
    TorchDispatchMode sees (calls made inside a C++ op are that op's own and not counted)."""
    mode = _Count()
    with mode:
        step()
    return mode.ops


def _ultralytics_variant(model_name: str, seed: int, device: str):
    from yolofast.bench.case_types import Variant

    try:
        from ultralytics.optim import MuSGD as UltralyticsMuSGD  # optional: the comparison only
    except ImportError as e:
        return Variant("ultralytics", None, f"ultralytics not importable ({e})", baseline=True)
    opt, _ = musgd_setup(model_name, seed, device, optimizer_cls=UltralyticsMuSGD)
    return Variant("ultralytics", opt.step, "Ultralytics' MuSGD over the same groups and gradients",
                   baseline=True)


def musgd_case(p, device: str, seed: int, backend_variants):
    """The bench Case of a ``musgd`` preset (see the module docstring)."""
    from yolofast.bench.case_types import Case, Variant

    def make_step():
        opt, _ = musgd_setup(p.model, seed, device)
        return opt.step

    variants = backend_variants("musgd_step", device, make_step, ("ref", "cpp") if device == "cpu" else
                                ("ref", "cuda", "triton"))
    opt, params = musgd_setup(p.model, seed, device)
    shapes = _ns_shapes([q for gr in opt.param_groups if gr["use_muon"] for q in gr["params"]])
    variants += [_ultralytics_variant(p.model, seed, device),
                 Variant("bmm_floor", bmm_floor(opt), f"the NS matmuls alone: {15 * len(shapes)} torch.bmm "
                         f"calls over {len(shapes)} shapes, bf16", baseline=True)]
    n = sum(shapes.values())
    return Case(p, "musgd_step", device, variants,
                what=f"one MuSGD step of {p.model}: {n} Muon matrices of {len(shapes)} shapes + SGD")
