"""Exponential moving average of the model weights: one fused ``ema_update`` call per optimizer step."""

from __future__ import annotations

import copy
import operator
import weakref
from itertools import chain

import torch
from torch import nn

from yolofast.engine.distributed import unwrap_model
from yolofast.ops import ema_update
from yolofast.ops._backend import requested_backend
from yolofast.ops.ema_update import ema_plan


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


def _locate(module: nn.Module, names: list[str]) -> list[tuple[dict, str]]:
    """(the owning module's ``_parameters`` or ``_buffers`` dict, key) per state name: reading ``d[key]`` on
    every update costs ~0.1 us, where ``named_parameters()`` + ``named_buffers()`` of yolov8s (355 tensors)
    costs ~1-5 ms, as long as the whole EMA update of its 11.2 M floats. A tensor later reassigned to a
    module attribute is still found (it replaces the dict entry)."""
    out = []
    for name in names:
        mod_name, _, key = name.rpartition(".")
        try:
            sub = module.get_submodule(mod_name) if mod_name else module
        except AttributeError:
            sub = None
        slot = None if sub is None else sub._parameters if key in sub._parameters else sub._buffers
        if slot is None or slot.get(key) is None:
            raise ValueError(f"ModelEMA.update: the model has no tensor '{name}'; pass a model of the EMA's "
                             "architecture")
        out.append((slot, key))
    return out


class _Plan:
    """A compiled ``yolofast::EmaPlan`` (CPU, C++ backend) and what it was built from: the model (weakly),
    the ``_parameters``/``_buffers`` dicts its tensors came from with every value they held, and
    (decay, tau)."""

    def __init__(self, model: nn.Module, locs: list[tuple[dict, str]], settings: tuple[float, float], op):
        self.model = weakref.ref(model)
        self.dicts = list({id(slot): slot for slot, _ in locs}.values())  # yolov8s: 178 dicts, 413 values
        self.values = list(chain.from_iterable(map(dict.values, self.dicts)))
        self.settings, self.step = settings, op.step

    def current(self, model: nn.Module, settings: tuple[float, float]) -> bool:
        """Still this model, these settings, and every dict still holding the very objects it held (a
        reassigned parameter or buffer replaces its dict entry). Iterating the dicts' values touches less
        memory than looking the 355 slots up by key: in situ, after the sweep has evicted the caches, 1.5 %
        of the update instead of 3.9 % on the AMD EPYC Zen 4."""
        if self.model() is not model or self.settings != settings:
            return False
        now = list(chain.from_iterable(map(dict.values, self.dicts)))
        return len(now) == len(self.values) and all(map(operator.is_, now, self.values))


class ModelEMA:
    """EMA of a model's floating-point state (parameters and float buffers such as BN running stats).

    ``ema = d*ema + (1 - d)*model`` with ``d = decay * (1 - exp(-updates / tau))`` per ``update``
    (DESIGN §2.3); integer buffers (BN num_batches_tracked) are copied. ``.ema`` is the EMA model (eval
    mode, no grad). ``updates`` and ``d`` stay on the device (no host sync per step; reading ``.updates``
    syncs once), so the update can be captured in a CUDA graph.

    Two layouts, one kernel call per update either way:
    - CPU (default there): the EMA's tensors keep the model's layout (channels_last included) and the C++
      multi-tensor kernel reads the model's own tensors in place, in one sweep over both threads: read 2N,
      write N, nothing else. With the C++ backend the whole step (counter, decay, sweep) is one call of a
      plan built at the first update (``_Plan``; rebuilt when the model or one of its tensors is replaced).
    - other devices (``flat=True``): the EMA's floating tensors are views of one flat buffer per dtype and the
      model is gathered into a second one (``torch.cat``) for the one-launch CUDA/Triton kernels.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, tau: float = 2000, updates: int = 0,
                 flat: bool | None = None):
        model = unwrap_model(model, student=True)
        self.ema = copy.deepcopy(model).eval()
        for p in self.ema.parameters():
            p.requires_grad_(False)
            p.grad = None
        self.decay, self.tau = float(decay), float(tau)

        named = _state_tensors(self.ema)
        floats = [(n, t) for n, t in named if t.is_floating_point()]
        device = floats[0][1].device if floats else torch.device("cpu")
        self.flat = device.type != "cpu" if flat is None else bool(flat)
        self._names = [n for n, _ in named]
        self._tensors = [t for _, t in named]
        self._source: tuple[weakref.ref, list[tuple[dict, str]]] | None = None
        self._plan: _Plan | None = None
        self._int_names = [n for n, t in named if not t.is_floating_point()]
        self._int_tensors = [t for _, t in named if not t.is_floating_point()]
        self._groups: list[_FlatGroup] = []
        if self.flat:
            by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
            for n, t in floats:
                by_dtype.setdefault(t.dtype, []).append((n, t))
            self._groups = [_FlatGroup([n for n, _ in g], [t for _, t in g]) for g in by_dtype.values()]
            self._rebind_to_views(floats)

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

    def _model_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """The model's state tensors in the EMA's order (located once per model object)."""
        if self._source is None or self._source[0]() is not model:
            self._source = (weakref.ref(model), _locate(model, self._names))
        return [slot[key] for slot, key in self._source[1]]

    def _plan_step(self, model: nn.Module) -> bool:
        """The update as one ``EmaPlan.step`` call; False where the op path runs instead: flat buffers, a
        backend other than C++, or a TorchDispatchMode (the CUDA-graph emulator, fake tensors) that must
        see the update as ops, which it cannot see inside a torch.classes call. Per step only what may
        change is checked (a forced backend, the model, its slots); the backend's availability only when
        a plan is built (the loaded extension stays)."""
        if self.flat or torch._C._len_torch_dispatch_stack() or requested_backend("ema_update")[0] not in (
                "auto", "cpp"):
            return False
        model, settings, plan = unwrap_model(model, student=True), (self.decay, self.tau), self._plan
        if plan is None or not plan.current(model, settings):
            compiled = ema_plan(self._tensors, self._model_tensors(model), *settings)
            if compiled is None:  # ema_update runs on a backend without the plan (not C++)
                return False
            self._plan = plan = _Plan(model, self._source[1], settings, compiled)
        plan.step(self._updates)
        return True

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One EMA step towards ``model`` (same architecture; may be DDP/compile-wrapped, or a distillation
        step whose student is followed)."""
        if self._plan_step(model):
            return
        model = unwrap_model(model, student=True)
        src = self._model_tensors(model)
        self._updates += 1
        d = self.decay_tensor()
        if not self.flat:
            ema_update(self._tensors, src, d)
            return
        state = dict(zip(self._names, src))
        for g in self._groups:
            torch.cat([state[n].detach().reshape(-1) for n in g.names], out=g.model_flat)
            ema_update(g.ema_flat, g.model_flat, d)
        for n, t in zip(self._int_names, self._int_tensors):
            t.copy_(state[n])

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        # Module.load_state_dict copies in place, so the flat-buffer views (flat layout) stay intact.
        self.ema.load_state_dict(state["ema"])
        self.updates = int(state["updates"])
