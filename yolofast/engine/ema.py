"""Exponential moving average of the model weights, kept in flat buffers for a one-launch update."""

from __future__ import annotations

import copy

import torch
from torch import nn

from yolofast.ops import ema_update


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module under DDP/DataParallel (``.module``) and torch.compile (``._orig_mod``) wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def _state_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters then buffers, by name, each tensor once (tied weights appear under their first name)."""
    return list(module.named_parameters()) + list(module.named_buffers())


class _FlatGroup:
    """All floating state tensors of one dtype: the EMA's live as views of ``ema_flat``."""

    def __init__(self, names: list[str], tensors: list[torch.Tensor]):
        self.names = names
        numel = sum(t.numel() for t in tensors)
        ref = tensors[0]
        self.ema_flat = torch.empty(numel, dtype=ref.dtype, device=ref.device)
        self.model_flat = torch.empty_like(self.ema_flat)
        self.views = []
        offset = 0
        for t in tensors:
            view = self.ema_flat[offset : offset + t.numel()].view(t.shape)
            view.copy_(t.detach())
            self.views.append(view)
            offset += t.numel()


class ModelEMA:
    """EMA of a model's floating-point state (parameters and float buffers such as BN running stats).

    ``ema = d*ema + (1 - d)*model`` with ``d = decay * (1 - exp(-updates / tau))`` per ``update``
    (DESIGN §2.3); integer buffers (BN num_batches_tracked) are copied. The EMA model (``.ema``, eval
    mode, no grad) keeps its floating tensors as views of one flat contiguous buffer per dtype (normally
    exactly one, in the model's dtype), so one ``yolofast.ops.ema_update`` call covers everything.
    ``updates`` and ``d`` stay on the device (no host sync per step); reading ``.updates`` syncs once.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, tau: float = 2000, updates: int = 0):
        model = unwrap_model(model)
        self.ema = copy.deepcopy(model).eval()
        for p in self.ema.parameters():
            p.requires_grad_(False)
            p.grad = None
        self.decay, self.tau = float(decay), float(tau)

        named = _state_tensors(self.ema)
        floats = [(n, t) for n, t in named if t.is_floating_point()]
        self._int_names = [n for n, t in named if not t.is_floating_point()]
        self._int_tensors = [t for _, t in named if not t.is_floating_point()]
        by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for n, t in floats:
            by_dtype.setdefault(t.dtype, []).append((n, t))
        self._groups = [_FlatGroup([n for n, _ in g], [t for _, t in g]) for g in by_dtype.values()]
        self._rebind_to_views(floats)

        device = floats[0][1].device if floats else torch.device("cpu")
        # float64 keeps d exact to ~1e-16 for any step count; MPS has no float64.
        self._ddtype = torch.float32 if device.type == "mps" else torch.float64
        self._updates = torch.tensor(int(updates), dtype=torch.int64, device=device)

    def _rebind_to_views(self, floats: list[tuple[str, torch.Tensor]]) -> None:
        """Make every EMA parameter/buffer (incl. aliases of the same tensor) a view of its flat buffer."""
        old_of = dict(floats)
        new_of = {id(old_of[name]): view for g in self._groups for name, view in zip(g.names, g.views)}
        for mod in self.ema.modules():
            for p in mod._parameters.values():
                if p is not None and id(p) in new_of:
                    p.data = new_of[id(p)]
            for key, b in mod._buffers.items():
                if b is not None and id(b) in new_of:
                    mod._buffers[key] = new_of[id(b)]

    @property
    def updates(self) -> int:
        return int(self._updates)

    @updates.setter
    def updates(self, value: int) -> None:
        self._updates.fill_(int(value))

    def decay_tensor(self) -> torch.Tensor:
        """d for the current update count, a 0-d tensor on the EMA's device."""
        return self.decay * (1 - torch.exp(-self._updates.to(self._ddtype) / self.tau))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One EMA step towards ``model`` (same architecture; may be DDP/compile-wrapped)."""
        model = unwrap_model(model)
        state = dict(_state_tensors(model))
        self._updates += 1
        d = self.decay_tensor()
        for g in self._groups:
            try:
                src = [state[n].detach().reshape(-1) for n in g.names]
            except KeyError as e:
                raise ValueError(
                    f"ModelEMA.update: the model has no tensor {e}; pass a model of the EMA's architecture"
                ) from None
            torch.cat(src, out=g.model_flat)
            ema_update(g.ema_flat, g.model_flat, d)
        for n, t in zip(self._int_names, self._int_tensors):
            t.copy_(state[n])

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        # Module.load_state_dict copies in place, so the flat-buffer views stay intact.
        self.ema.load_state_dict(state["ema"])
        self.updates = int(state["updates"])
