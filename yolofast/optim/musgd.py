"""MuSGD: Nesterov SGD plus, for the groups flagged ``use_muon``, Muon's orthogonalised momentum
(YOLO11_YOLO26.md §5.3). The constructor and the state names are Ultralytics' (``momentum_buffer``,
``momentum_buffer_SGD``), so its checkpoints' optimizer state loads here and code written against
``ultralytics.optim.MuSGD`` runs with one import changed.

Per group, for the parameters that have a gradient (μ = momentum, η = lr, λ = weight_decay):
- a non-Muon group is Nesterov SGD with L2 decay: ``g' = g + λp; V ← μV + g'; p ← p − η(g' + μV)``
  (plain momentum ``p ← p − ηV`` with nesterov=False);
- a Muon group first takes ``M ← μM + (1 − μ)g``, ``U = μM + (1 − μ)g`` (``U = M`` without Nesterov), then
  ``p ← p − η·muon·σ·NS5(mat(U))``, then the SGD step above on the updated p with its own buffer V and
  lr ``η·sgd``: weight decay enters through the SGD part only.

On the CPU (C++ backend) the whole step is one call of the op ``ns_orthogonalize.musgd``: momentum, the
Newton–Schulz products of every shape group and the SGD part in two parallel passes over memory, equal to
the multi-tensor path bit for bit. That path runs elsewhere (GPU backends, the reference, a tensor lr, a
tensor the op does not take): the Newton–Schulz work of all Muon matrices is one call of
``yolofast.ops.ns_orthogonalize`` (grouped by shape, batched, no padding) and the rest multi-tensor
``torch._foreach_*`` ops, so a step dispatches a few dozen ops whatever the model. Nothing reads a value
back to the host: with a tensor lr on the device the step can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from yolofast.ops._backend import backend_name, compiled_form
from yolofast.ops.ns_orthogonalize import ns_orthogonalize

__all__ = ["MuSGD", "default_ns_dtype", "muon_sigma"]


def default_ns_dtype() -> torch.dtype:
    """bfloat16 (the reference), unless ``YOLOFAST_MUON_DTYPE=fp32`` asks for float32 or the CPU has no
    native bf16 arithmetic (AVX512-BF16 or AMX; ``=bf16`` forces bfloat16 there too). A CUDA run always
    has bf16. Read once per optimizer: a resumed run on the same machine makes the same choice."""
    env = os.environ.get("YOLOFAST_MUON_DTYPE", "").strip().lower()
    if env in ("fp32", "float32"):
        return torch.float32
    if env in ("bf16", "bfloat16"):
        return torch.bfloat16
    if env:
        raise ValueError(f"YOLOFAST_MUON_DTYPE={env!r}: choose bf16 or fp32")
    return torch.bfloat16 if torch.cuda.is_available() or _native_bf16() else torch.float32


def _native_bf16() -> bool:
    """The CPU flags (Linux /proc/cpuinfo) list avx512_bf16 or amx_bf16; True where they cannot be read
    (the reference dtype is the safe default)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return True
    if not flags:
        return True
    words = set(flags.split())
    return "avx512_bf16" in words or "amx_bf16" in words


def muon_sigma(shape) -> float:
    """σ = sqrt(max(1, d[-2] / d[-1])) over the last two dims of the parameter's own shape: kh/kw for a conv
    weight (1 for square kernels), rows/cols for a 2-D weight."""
    return math.sqrt(max(1.0, shape[-2] / shape[-1]))


class MuSGD(torch.optim.Optimizer):
    """SGD with Nesterov momentum + Muon for the groups with ``use_muon=True`` (see the module docstring).

    params: parameters or groups (dicts with ``params`` and any of the keyword names below); lr, momentum,
    weight_decay, nesterov, use_muon: group defaults; muon, sgd: the weights of the Muon and the SGD
    update inside a Muon group (Ultralytics' trainer uses muon=0.2, sgd=1.0). ``ns_dtype`` (a yolofast
    addition): the Newton–Schulz compute dtype, torch.bfloat16 (the reference) or torch.float32 (for CPUs
    without native bf16, where bf16 matmuls are emulated; within bf16 rounding of the reference, see
    ``yolofast.ops.ns_orthogonalize``); None: ``default_ns_dtype()``.
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, use_muon: bool = False, muon: float = 0.5, sgd: float = 0.5,
                 ns_dtype: torch.dtype | None = None):
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "nesterov": nesterov,
                    "use_muon": use_muon}
        super().__init__(params, defaults)
        self.muon, self.sgd = muon, sgd
        self.ns_dtype = default_ns_dtype() if ns_dtype is None else ns_dtype
        if self.ns_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"MuSGD: ns_dtype must be torch.bfloat16 or torch.float32, got {ns_dtype}")

    def __getstate__(self):  # torch's keeps only defaults/state/groups: copies would lose the mix
        return {**super().__getstate__(), "muon": self.muon, "sgd": self.sgd, "ns_dtype": self.ns_dtype}

    def __setstate__(self, state):
        # load_state_dict() comes through here too, with groups and state only: keep this optimizer's mix.
        state = dict(state)
        self.muon = state.pop("muon", getattr(self, "muon", 0.5))
        self.sgd = state.pop("sgd", getattr(self, "sgd", 0.5))
        self.ns_dtype = state.pop("ns_dtype", getattr(self, "ns_dtype", torch.bfloat16))
        super().__setstate__(state)
        for g in self.param_groups:  # groups written by other code may lack the flag
            g.setdefault("use_muon", False)

    def _buffers(self, group: dict, params: list[Tensor]) -> tuple[list[Tensor], list[Tensor] | None]:
        for p in params:
            st = self.state[p]
            if not st:
                st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["use_muon"]:
                    st["momentum_buffer_SGD"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        first = [self.state[p]["momentum_buffer"] for p in params]
        second = [self.state[p]["momentum_buffer_SGD"] for p in params] if group["use_muon"] else None
        return first, second

    @torch.no_grad()
    def step(self, closure=None):
        """One step over every group; returns the closure's loss (if given)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                work.append((group, params, [p.grad for p in params], *self._buffers(group, params)))
        if work and self._fused_step(work):
            return loss
        # Every Muon matrix of every group in one Newton–Schulz call: shapes shared across groups (the x3
        # class branches repeat the box branches' shapes) batch together. Groups are disjoint, so the
        # order of their updates does not change any value.
        muon = [w for w in work if w[0]["use_muon"]]
        if muon:
            looks = [_momentum_look(w[2], w[3], w[0]["momentum"], w[0]["nesterov"]) for w in muon]
            flat = ns_orthogonalize([u for lk in looks for u in lk], fp32=self.ns_dtype == torch.float32)
            start = 0
            for (group, params, grads, _, _), lk in zip(muon, looks):
                out = flat[start:start + len(lk)]
                start += len(lk)
                for o, g in zip(out, grads):
                    if (sig := muon_sigma(g.shape)) != 1.0:  # never for YOLO: every conv kernel is square
                        o.mul_(sig)
                _add_scaled(params, out, group["lr"], self.muon)
        for group, params, grads, first, second in work:
            lr, mu, nesterov, decay = group["lr"], group["momentum"], group["nesterov"], group["weight_decay"]
            if group["use_muon"]:
                _sgd(params, grads, second, lr, mu, decay, nesterov, self.sgd)
            else:
                _sgd(params, grads, first, lr, mu, decay, nesterov, 1.0)
        return loss

    def _fused_step(self, work) -> bool:
        """The whole step as one compiled call where the backend has one (the C++ CPU op
        ``ns_orthogonalize.musgd``: momentum, Newton–Schulz and SGD part in two parallel passes over memory,
        equal to the multi-tensor path below bit for bit); False where it has none (GPU backends, the
        reference), where an lr is a tensor (CUDA-graph steps) or where a tensor does not fit it."""
        dev = work[0][1][0].device.type
        fn = compiled_form("ns_orthogonalize.musgd", backend_name("ns_orthogonalize", dev))
        if fn is None or any(torch.is_tensor(w[0]["lr"]) for w in work):
            return False
        tensors = [[p for w in work for p in w[i]] for i in (1, 2, 3)]
        second = [p for w in work if w[0]["use_muon"] for p in w[4]]
        hyper = ([w[0][k] for w in work] for k in ("lr", "momentum", "weight_decay", "nesterov", "use_muon"))
        return fn(*tensors, second, [len(w[1]) for w in work], *hyper, self.muon, self.sgd, 5, 1e-7,
                  self.ns_dtype == torch.float32)


def _add_scaled(params: list[Tensor], updates: list[Tensor], lr, weight: float) -> None:
    """p ← p − lr·weight·u; a tensor lr (CUDA graphs) is read on the device, never on the host."""
    if torch.is_tensor(lr):
        torch._foreach_add_(params, torch._foreach_mul(updates, lr), alpha=-weight)
    else:
        torch._foreach_add_(params, updates, alpha=-(lr * weight))


def _momentum_look(grads, bufs, mu: float, nesterov: bool) -> list[Tensor]:
    """M ← μM + (1 − μ)g in place; returns U = μM + (1 − μ)g (Nesterov) or M."""
    torch._foreach_mul_(bufs, mu)
    torch._foreach_add_(bufs, grads, alpha=1 - mu)
    if not nesterov:
        return list(bufs)
    look = torch._foreach_mul(bufs, mu)
    torch._foreach_add_(look, grads, alpha=1 - mu)
    return look


def _sgd(params, grads, bufs, lr, mu: float, decay: float, nesterov: bool, weight: float) -> None:
    """Nesterov SGD with L2 decay on p (already Muon-updated in a Muon group), lr scaled by ``weight``."""
    if decay != 0:
        grads = torch._foreach_add(grads, params, alpha=decay)
    torch._foreach_mul_(bufs, mu)
    torch._foreach_add_(bufs, grads)
    step = torch._foreach_add(grads, bufs, alpha=mu) if nesterov else bufs
    _add_scaled(params, step, lr, weight)
