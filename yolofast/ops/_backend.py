"""Which implementation of each hot op runs: ``select_backend(op, device)``, ``implementation(op, name)``.

Order of preference per device type (the first available wins under ``auto``):
  cuda: cuda, triton, ref      cpu: cpp, ref
``YOLOFAST_BACKEND`` forces one backend for every op and ``YOLOFAST_BACKEND_<OP>`` (e.g.
``YOLOFAST_BACKEND_TAL_ASSIGN=ref``) for one op; the ``backend(name)`` context manager does the same
in code and wins over the environment. A forced backend that is not available is an error that says
why; ``auto`` falls back silently and ``yolofast info`` reports the choice and the reason.

An op's variants (``tal_assign.maps``, ``bbox_loss.maps``, ``ema_update.multi``, ``head_decode.boxes``) run
on their op's backend: ``implementation`` returns the backend's own form where it has one (``_library``'s
compiled callables) and otherwise the form composed of torch ops and the base op (``_composed.py``).
The public wrappers (``yolofast/ops/<op>.py``) dispatch with
``implementation(op_or_variant, backend_name(op, device_type))(*args)``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading
from collections.abc import Callable

import torch

OPS = ("tal_assign", "bbox_loss", "ema_update", "head_decode", "ns_orthogonalize")
VARIANTS = {  # variant -> its op
    "tal_assign.maps": "tal_assign",
    "bbox_loss.maps": "bbox_loss",
    "ema_update.multi": "ema_update",
    "head_decode.boxes": "head_decode",
}
BACKENDS = ("ref", "cpp", "cuda", "triton")
_PREFERENCE = {"cuda": ("cuda", "triton", "ref"), "cpu": ("cpp", "ref")}
# (op or variant, backend) -> its callable in _library, where the compiled extension has that form. On the
# CPU bbox_loss keeps the box/DFL gradients of the foreground anchors only (bbox_loss.rows).
_COMPILED = {
    ("tal_assign", "cpp"): "tal_assign",
    ("tal_assign", "cuda"): "tal_assign",
    ("tal_assign.maps", "cpp"): "tal_assign_maps",
    ("bbox_loss", "cpp"): "bbox_loss_rows",
    ("bbox_loss", "cuda"): "bbox_loss",
    ("bbox_loss.maps", "cpp"): "bbox_loss_maps",
    ("bbox_loss.maps", "cuda"): "bbox_loss_maps",
    ("ema_update", "cpp"): "ema_update",
    ("ema_update", "cuda"): "ema_update",
    ("ema_update.multi", "cpp"): "ema_update_multi",
    ("head_decode", "cpp"): "head_decode",
    ("head_decode.boxes", "cpp"): "head_decode_boxes",
    ("ns_orthogonalize", "cpp"): "ns_orthogonalize",
    ("ns_orthogonalize", "cuda"): "ns_orthogonalize",
    # the data pipeline's fused HSV augmentation; its reference is OpenCV (yolofast.data.augment), which picks
    # between the two with availability() and requested_backend(): not one of OPS
    ("hsv_augment", "cpp"): "hsv_augment",
}
# Compiled-only forms: no reference or composed form exists, so a backend without one answers None and the
# caller runs the op instead (ema_update.plan: ModelEMA's whole step as one call of a torch.classes object).
# ns_orthogonalize.musgd: a whole MuSGD step (momentum, Newton–Schulz, SGD part) in one C++ call (CPU).
_COMPILED_ONLY = {
    ("ema_update.plan", "cpp"): "ema_plan",
    ("ns_orthogonalize.musgd", "cpp"): "ns_orthogonalize_musgd",
}
# Compiled forms that decode the head's maps with DFL bins only (reg_max >= 2; a reg_max 1 head would get the
# composed form on the same backend): none now. The C++ head_decode, tal_assign.maps and bbox_loss.maps read
# reg_max 1 maps (YOLO26: raw distances) in place too (bbox_loss.maps then takes the L1 geometry as l1_scale).
_DFL_ONLY: frozenset = frozenset()
# (form, backend) whose own form reads reg_max 1 maps only (YOLO26: raw distances, the L1 term): a DFL head's
# maps get the composed form on the same backend. CUDA: _library.bbox_loss_maps (yolofast::bbox_loss_maps's
# CUDA kernel); Triton: the module below (yolofast/kernels/_bbox_loss_maps.py).
_REG_MAX1_ONLY = frozenset({("bbox_loss.maps", "cuda"), ("bbox_loss.maps", "triton")})
# form -> (module of yolofast.kernels, its callable): Triton forms of a variant, reg_max 1 only (above).
_TRITON_FORMS = {"bbox_loss.maps": ("_bbox_loss_maps", "bbox_loss_maps")}
# Ops with a reference in reference.py (<op>_ref) and a Triton kernel (yolofast.kernels.<op>); head_decode
# has neither: off the CPU kernel it is torch ops (_composed.head_decode) on every backend.
_REFERENCE_OPS = ("tal_assign", "bbox_loss", "ema_update", "ns_orthogonalize")

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
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}")
    if name == "ref":
        return True, "pure-PyTorch reference"
    ok, why = _device_fits(name, device_type)
    if not ok:
        return False, why
    if op not in _REFERENCE_OPS and (op, name) not in _COMPILED:
        return True, f"torch ops (yolofast has no {name} kernel of {op})"
    if name in ("cpp", "cuda"):
        from yolofast.ops import _build

        ok, why = _build.extension_status(name)
        if not ok:
            return False, why
        key = "CPU" if name == "cpp" else "CUDA"
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"yolofast::{op}", key):
            detail = _build.missing_kernel_reason(op)
            return False, f"the {name} extension has no {op} kernel" + (f": {detail}" if detail else "")
        return True, f"{name} extension loaded"
    try:
        from yolofast.kernels import triton_status
    except ImportError as e:
        return False, f"Triton kernels unavailable: {e}"
    return triton_status(op)


def _device_fits(name: str, device_type: str) -> tuple[bool, str]:
    if name == "triton":
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return False, "Triton kernels need a CUDA device (or TRITON_INTERPRET=1 for testing)"
        return True, ""
    want = "cpu" if name == "cpp" else "cuda"
    if device_type != want:
        return False, f"the {name} kernels run on {want} tensors, got {device_type}"
    return True, ""


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
    for form in (op, *(v for v, base in VARIANTS.items() if base == op)):
        implementation(form, name)  # imports its module here, outside the code that dynamo traces
        if (form, name) in _REG_MAX1_ONLY:
            implementation(form, name, 1)
    return name


def implementation(op: str, name: str, reg_max: int | None = None) -> Callable:
    """The function that runs ``op`` (an op or a variant) on backend ``name`` (as ``backend_name`` of the
    op returns it), with the signature of ``reference.<op>_ref`` (ops) or of the public variant's
    wrapper: ``_library``'s compiled callable (cpp, cuda), ``reference.<op>_ref`` (ref),
    ``yolofast.kernels.<op>.<op>`` (triton), or else ``_composed``'s form over the op on that backend.
    ``reg_max``: the head's bins per side, for the forms that read the maps (``_DFL_ONLY``: >= 2,
    ``_REG_MAX1_ONLY``: 1; otherwise the composed form)."""
    base = VARIANTS.get(op, op)
    if base not in OPS or name not in BACKENDS:
        raise ValueError(f"implementation: no op {op!r} on backend {name!r}; ops {OPS} and their variants "
                         f"{tuple(VARIANTS)}, backends {BACKENDS}")
    compiled = _COMPILED.get((op, name))
    if compiled is not None and op in _DFL_ONLY and reg_max is not None and int(reg_max) < 2:
        compiled = None
    reg_max1 = reg_max is not None and int(reg_max) == 1
    if (op, name) in _REG_MAX1_ONLY and not reg_max1:
        compiled = None
    if compiled is not None:
        from yolofast.ops import _library

        return getattr(_library, compiled)
    if name == "triton" and op in _TRITON_FORMS and reg_max1:
        module, attr = _TRITON_FORMS[op]
        if not torch.compiler.is_compiling():  # as for the ops below: backend_name imported it already
            importlib.import_module(f"yolofast.kernels.{module}")
        from yolofast import kernels

        return getattr(getattr(kernels, module), attr)
    from yolofast.ops import _composed

    if base not in _REFERENCE_OPS:
        return getattr(_composed, op.replace(".", "_"))
    if op != base:
        fn = getattr(_composed, op.replace(".", "_"))
        first = implementation(base, name)
        return functools.partial(fn, first, name) if base == "ema_update" else functools.partial(fn, first)
    if name == "ref":
        from yolofast.ops import reference

        return getattr(reference, f"{op}_ref")
    # Each Triton module imports triton, so only the chosen op's is imported. Dynamo cannot trace
    # importlib.import_module: under torch.compile backend_name (run outside the traced code) has imported
    # it, and the package attribute is read live.
    if not torch.compiler.is_compiling():
        importlib.import_module(f"yolofast.kernels.{op}")
    from yolofast import kernels

    return getattr(getattr(kernels, op), op)


def compiled_form(form: str, name: str) -> Callable | None:
    """The compiled-only ``form`` (``ema_update.plan``) of backend ``name`` (as ``backend_name`` of its op
    returns it), or None where that backend has none: the caller then runs the op itself."""
    attr = _COMPILED_ONLY.get((form, name))
    if attr is None:
        return None
    from yolofast.ops import _library

    return getattr(_library, attr)


def simd_lanes() -> int:
    """Floats per SIMD vector in the loaded C++ build (16 AVX-512, 8 AVX2, 4 NEON), for ``yolofast info``;
    0 when the C++ extension is not loaded."""
    from yolofast.ops import _build, _library

    return _library.simd_lanes() if _build.extension_status("cpp")[0] else 0


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
