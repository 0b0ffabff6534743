"""A CPU stand-in for torch.cuda's graph API, so that yolofast/engine/cudagraph.py and the trainer's graph
path run in CI, where there is no GPU (``emulated_graphs`` fixture in conftest.py).

What it keeps of a real CUDA graph:
- Capture runs the Python code once and records every ATen call it makes (a TorchDispatchMode, so the
  calls inside backward, the optimizer and the fused ops are recorded too). Replay re-runs the recorded
  calls in order on the same tensors and writes each result into the tensor the capture made. Python-side
  values (a float lr, a momentum, a branch taken) are frozen at capture, as on the GPU.
- Capture leaves every tensor that existed before it unchanged. A real capture launches no kernel. Here
  each such tensor is saved when a call first touches it and put back when the capture ends.
- A host read (.item(), nonzero) or a tensor made from host data (torch.tensor) inside the capture
  raises, as a real capture does.
What it does not model: streams, the graph's private memory pool, and kernel-level behaviour (CUDA
atomics, cuBLAS algorithms). tests/engine/test_cudagraph.py's cuda-marked tests check those on a GPU.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Calls that a capture refuses: they read device memory on the host or copy host memory in.
_HOST_OPS = ("_local_scalar_dense", "nonzero", "lift_fresh", "item")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


class _Capture(TorchDispatchMode):
    def __init__(self, graph: RecordedGraph):
        super().__init__()
        self.graph = graph
        self.made: set[int] = set()  # storages created inside the capture: the graph's own memory
        # (outside tensor, its value when a call first touched it). Every outside tensor a call touches is
        # saved, not only those its schema marks as written: native_batch_norm updates the running
        # statistics without saying so (and version counters do not move below the Python dispatch key).
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.saved_ids: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name in _HOST_OPS:
            raise RuntimeError(f"emulated CUDA graph: {func} is not allowed inside a capture (host sync or "
                               f"host-to-device copy)")
        inputs = _tensors((args, kwargs))
        for t in inputs:
            if t.numel() and _storage(t) not in self.made and id(t) not in self.saved_ids:
                self.saved.append((t, t.detach().clone()))
                self.saved_ids.add(id(t))
        out = func(*args, **kwargs)
        seen = {_storage(t) for t in inputs if t.numel()}
        self.made |= {_storage(t) for t in _tensors(out) if t.numel() and _storage(t) not in seen}
        self.graph.calls.append((func, args, kwargs, out))
        return out

    def undo(self) -> None:
        """Put back every outside tensor the capture's run changed. Oldest snapshot last: where views
        overlap, the view touched first holds the value from before the capture."""
        with torch.no_grad():
            for t, before in reversed(self.saved):
                expanded = any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))  # not writable
                if not expanded and not torch.equal(t, before):
                    t.copy_(before)


class RecordedGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: filled by ``EmulatedCuda.graph``, run by ``replay``."""

    def __init__(self):
        self.calls: list = []
        self.replays = 0

    @contextlib.contextmanager
    def capture(self):
        mode = _Capture(self)
        try:
            with mode:
                yield
        finally:  # a real capture launches nothing: undo what this one's run changed outside the graph
            mode.undo()

    @torch.no_grad()
    def replay(self) -> None:
        for func, args, kwargs, out in self.calls:
            new = func(*args, **kwargs)
            for old, fresh in zip(_tensors(out), _tensors(new)):
                if old.shape != fresh.shape:
                    raise RuntimeError(f"emulated CUDA graph: {func} made shape {tuple(fresh.shape)} on "
                                       f"replay, {tuple(old.shape)} at capture (a data-dependent shape)")
                if old.numel() and _storage(old) != _storage(fresh):  # same storage: in place, out=, a view
                    old.copy_(fresh)
        self.replays += 1


class _Stream:
    def wait_stream(self, other) -> None:
        pass


class EmulatedCuda:
    """The part of ``torch.cuda`` that yolofast/engine/cudagraph.py uses (``GRAPHS``), on the CPU."""

    CUDAGraph = RecordedGraph
    Stream = _Stream

    @staticmethod
    def graph(g: RecordedGraph, pool=None, stream=None, capture_error_mode: str = "global"):
        return g.capture()

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream() -> _Stream:
        return _Stream()

    @staticmethod
    def synchronize() -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def is_available() -> bool:
        return True
