"""Triton ``ema_update``: in place ``ema = d*ema + (1 - d)*model`` over flat buffers (DESIGN §2.3).

One launch covers the whole flat buffer (read 2N, write N elements). The decay is read from a device tensor
inside the kernel, so the update needs no host sync and can be captured in a CUDA graph. Semantics are
``reference.ema_update_ref``: w = 1 - d formed in the decay's precision, rounded once to the compute dtype
(float32 for fp32/bf16/fp16 storage, float64 for float64), then torch.lerp's two-sided formula
``ema + w*(model - ema)`` for w < 0.5 and ``model - (1 - w)*(model - ema)`` otherwise, as one fma each
(what torch's vectorised CPU lerp and its CUDA lerp compute).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _common

# 4096 elements x (2 loads + 1 store) per program: long enough runs for full-bandwidth vector accesses;
# the interpreter runs programs one by one, so there a larger block means fewer Python-level iterations.
BLOCK = 16384 if _common.INTERPRET else 4096
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@triton.jit
def _ema_update_kernel(ema_ptr, model_ptr, decay_ptr, n, F64: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    d = tl.load(decay_ptr)
    w = 1.0 - d  # in the decay's own dtype, as the reference's ``1 - decay``
    if F64:
        w = w.to(tl.float64)
        e = tl.load(ema_ptr + offs, mask=mask, other=0.0).to(tl.float64)
        m = tl.load(model_ptr + offs, mask=mask, other=0.0).to(tl.float64)
    else:
        w = w.to(tl.float32)
        e = tl.load(ema_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(model_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    small = tl.abs(w) < 0.5
    coeff = tl.where(small, w, w - 1.0)
    base = tl.where(small, e, m)
    out = _common.fma(tl.zeros_like(e) + coeff, m - e, base)
    tl.store(ema_ptr + offs, _common.cast_to(out, ema_ptr.dtype.element_ty), mask=mask)


def _check(ema: Tensor, model: Tensor, decay: Tensor) -> None:
    if ema.shape != model.shape:
        raise ValueError(f"ema_update: ema {tuple(ema.shape)} and model {tuple(model.shape)} differ in shape")
    if ema.dtype not in _FLOAT_DTYPES or model.dtype != ema.dtype:
        raise TypeError(
            f"ema_update (Triton): ema and model must share one floating dtype, got {ema.dtype} and "
            f"{model.dtype}; cast the model buffer to the EMA's dtype"
        )
    if not (ema.is_contiguous() and model.is_contiguous()):
        raise ValueError("ema_update (Triton): ema and model must be contiguous flat buffers")
    if model.device != ema.device or decay.device != ema.device:
        raise ValueError(
            f"ema_update (Triton): ema ({ema.device}), model ({model.device}) and decay ({decay.device}) "
            "must be on one device"
        )
    if decay.numel() != 1 or not decay.dtype.is_floating_point:
        raise ValueError(
            f"ema_update (Triton): decay must be a 1-element floating tensor, got {decay.dtype} "
            f"{tuple(decay.shape)}"
        )


@torch.library.triton_op("yolofast::ema_update_triton", mutates_args={"ema"})
def _ema_update_op(ema: Tensor, model: Tensor, decay: Tensor) -> None:
    _check(ema, model, decay)
    n = ema.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, BLOCK),)
    _common.launch(_ema_update_kernel)[grid](
        ema, model, decay, n, F64=ema.dtype == torch.float64, BLOCK=BLOCK, num_warps=8
    )


def ema_update(ema: Tensor, model: Tensor, decay) -> None:
    """In place ``ema = decay*ema + (1 - decay)*model`` (``reference.ema_update_ref``).

    ema, model: flat contiguous (N,) tensors of one floating dtype on one device; decay: a float or a
    0-d/1-element tensor (moved to ema's device if it is elsewhere; keep it there to stay sync-free).
    """
    if not isinstance(decay, Tensor):
        decay = torch.tensor(float(decay), dtype=torch.float64, device=ema.device)
    elif decay.device != ema.device:
        decay = decay.to(ema.device, non_blocking=True)
    if decay.dtype not in (torch.float32, torch.float64):
        decay = decay.to(torch.float64)  # a bf16/fp16 decay: 1 - d is then formed in float64
    torch.ops.yolofast.ema_update_triton(ema, model, decay.reshape(()))
