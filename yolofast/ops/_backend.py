"""Which implementation of each hot op runs: ``select_backend(op, device)``.

Order of preference per device type (the first available wins under ``auto``):
  cuda: cuda, triton, ref      cpu: cpp, ref
``YOLOFAST_BACKEND`` forces one backend for every op and ``YOLOFAST_BACKEND_<OP>`` (e.g.
``YOLOFAST_BACKEND_TAL_ASSIGN=ref``) for one op; the ``backend(name)`` context manager does the same
in code and wins over the environment. A forced backend that is not available is an error that says
why; ``auto`` falls back silently and ``yolofast info`` reports the choice and the reason.

The public wrappers (``yolofast/ops/<op>.py``) dispatch with
``implementation(op, backend_name(op, device_type))(*args)``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Callable

import torch

OPS = ("tal_assign", "bbox_loss", "ema_update", "ns_orthogonalize")
BACKENDS = ("ref", "cpp", "cuda", "triton")
_PREFERENCE = {"cuda": ("cuda", "triton", "ref"), "cpu": ("cpp", "ref")}

_local = threading.local()


class BackendUnavailable(RuntimeError):
    """A backend was forced (env var or ``backend()``) but cannot run here."""


def _check_name(name: str, where: str) -> str:
    name = name.strip().lower()
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"{where}={name!r} is not a backend; choose one of auto, {', '.join(BACKENDS)}")
    return name


@contextlib.contextmanager
def backend(name: str):
    """Force ``name`` ("ref", "cpp", "cuda", "triton" or "auto") for every op inside the block."""
    name = _check_name(name, "backend")
    prev = getattr(_local, "forced", None)
    _local.forced = name
    try:
        yield
    finally:
        _local.forced = prev


def requested_backend(op: str) -> tuple[str, str]:
    """(name, where it was asked for); name is "auto" when nothing forces one."""
    forced = getattr(_local, "forced", None)
    if forced is not None:
        return forced, "yolofast.ops.backend()"
    for var in (f"YOLOFAST_BACKEND_{op.upper()}", "YOLOFAST_BACKEND"):
        val = os.environ.get(var)
        if val:
            return _check_name(val, var), var
    return "auto", "default"


def availability(op: str, name: str, device_type: str) -> tuple[bool, str]:
    """Whether backend ``name`` can run ``op`` on ``device_type``, with the reason."""
    if name == "ref":
        return True, "pure-PyTorch reference"
    if name in ("cpp", "cuda"):
        want = "cpu" if name == "cpp" else "cuda"
        if device_type != want:
            return False, f"the {name} kernels run on {want} tensors, got {device_type}"
        from yolofast.ops import _build

        ok, why = _build.extension_status(name)
        if not ok:
            return False, why
        key = "CPU" if name == "cpp" else "CUDA"
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"yolofast::{op}", key):
            detail = _build.missing_kernel_reason(op)
            return False, f"the {name} extension has no {op} kernel" + (f": {detail}" if detail else "")
        return True, f"{name} extension loaded"
    if name == "triton":
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return False, "Triton kernels need a CUDA device (or TRITON_INTERPRET=1 for testing)"
        try:
            from yolofast.kernels import triton_status
        except ImportError as e:
            return False, f"Triton kernels unavailable: {e}"
        return triton_status(op)
    raise ValueError(f"unknown backend {name!r}")


def select_backend(op: str, device: torch.device | str) -> str:
    """The backend that runs ``op`` for tensors on ``device``."""
    device_type = torch.device(device).type
    name, where = requested_backend(op)
    if name != "auto":
        ok, why = availability(op, name, device_type)
        if not ok:
            raise BackendUnavailable(f"{where} asks for backend {name!r} for {op}, but: {why}")
        return name
    for cand in _PREFERENCE.get(device_type, ("ref",)):
        if availability(op, cand, device_type)[0]:
            return cand
    return "ref"


@torch.compiler.assume_constant_result
def backend_name(op: str, device_type: str) -> str:
    """``select_backend(op, device_type)`` for the public wrappers.

    Under torch.compile this runs once at trace time and the choice is baked into the graph (the
    availability check takes a lock that dynamo cannot trace); in eager mode it runs on every call.
    """
    name = select_backend(op, device_type)
    implementation(op, name)  # imports its module here, outside the code that dynamo traces
    return name


def implementation(op: str, name: str) -> Callable:
    """The function that runs ``op`` on backend ``name`` (as returned by ``backend_name``), with the
    signature of ``reference.<op>_ref``: ``reference.<op>_ref`` (ref), ``_library.<op>`` (cpp, cuda) or
    ``yolofast.kernels.<op>.<op>`` (triton)."""
    if op not in OPS or name not in BACKENDS:
        raise ValueError(f"implementation: no op {op!r} on backend {name!r}; ops {OPS}, backends {BACKENDS}")
    if name == "ref":
        from yolofast.ops import reference

        return getattr(reference, f"{op}_ref")
    if name in ("cpp", "cuda"):
        from yolofast.ops import _library

        return getattr(_library, op)
    # Each Triton module imports triton, so only the chosen op's is imported. Dynamo cannot trace
    # importlib.import_module: under torch.compile backend_name (run outside the traced code) has imported
    # it, and the package attribute is read live.
    if not torch.compiler.is_compiling():
        importlib.import_module(f"yolofast.kernels.{op}")
    from yolofast import kernels

    return getattr(getattr(kernels, op), op)


def describe(device_type: str = "cpu") -> list[tuple[str, str, str]]:
    """(op, chosen backend, why) per op, for ``yolofast info``."""
    rows = []
    for op in OPS:
        try:
            chosen = select_backend(op, device_type)
            why = availability(op, chosen, device_type)[1]
            skipped = [
                f"{c}: {availability(op, c, device_type)[1]}"
                for c in _PREFERENCE.get(device_type, ())
                if c != chosen and _PREFERENCE[device_type].index(c) < _PREFERENCE[device_type].index(chosen)
            ]
            if skipped:
                why += " (skipped " + "; ".join(skipped) + ")"
        except BackendUnavailable as e:
            chosen, why = "error", str(e)
        rows.append((op, chosen, why))
    return rows
