"""Triton kernels of the hot ops, installed as ``yolofast.kernels``.

One module per op (``tal_assign``, ``bbox_loss``, ``ema_update``, ``ns_orthogonalize``), each with a public
function of the same name, signature and outputs as its reference in ``yolofast.ops.reference`` (for
``ns_orthogonalize``: the fused op's list form, ``(mats, steps, eps, fp32)``), backed by a
``torch.library.triton_op`` (``yolofast::<op>_triton``) so that torch.compile sees the kernels on CUDA.
With ``TRITON_INTERPRET=1`` set *before* these modules are imported they also run on CPU tensors (slowly;
that is how the tests check them without a GPU). Importing this package does not import Triton:
``triton_status(op)`` says whether an op's kernel can be used, and why not.
"""

from __future__ import annotations

import importlib
import os

OPS = ("tal_assign", "bbox_loss", "ema_update", "ns_orthogonalize")
MIN_TRITON = (3, 0)  # checked on 3.6 (the GPU machine's) and 3.8


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def triton_status(op: str) -> tuple[bool, str]:
    """(True, description) when ``yolofast.kernels.<op>`` imports and can launch, else (False, reason)."""
    if op not in OPS:
        return False, f"no Triton kernel for op {op!r}; the Triton kernels are {', '.join(OPS)}"
    try:
        import triton
    except Exception as e:  # ImportError, or a broken install raising anything at import
        return (
            False,
            f"triton is not importable ({type(e).__name__}: {e}); install it with `pip install triton`",
        )
    if _version_tuple(triton.__version__) < MIN_TRITON:
        want = ".".join(map(str, MIN_TRITON))
        return False, f"triton {triton.__version__} is too old for yolofast's kernels (need >= {want})"
    try:
        importlib.import_module(f"{__name__}.{op}")
    except Exception as e:
        return False, f"yolofast/kernels/{op}.py failed to import: {type(e).__name__}: {e}"
    from . import _common

    now = os.environ.get("TRITON_INTERPRET") == "1"
    if now != _common.INTERPRET:
        return False, (
            f"TRITON_INTERPRET is {'1' if now else 'unset'} now but was "
            f"{'1' if _common.INTERPRET else 'unset'} when yolofast.kernels was imported; "
            "set it before the first import"
        )
    mode = "interpreter (TRITON_INTERPRET=1)" if _common.INTERPRET else "compiled"
    return True, f"Triton {triton.__version__} kernel, {mode}"
