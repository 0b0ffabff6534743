"""Helpers shared by the Triton kernels: interpreter detection, output allocation, exact-ish math.

Math that Triton lacks or that the interpreter cannot run:
- ``atan``: on a GPU libdevice's (the same ``atanf`` torch's CUDA kernel calls); in the interpreter
  (no libdevice there) a float64 range reduction + series whose error (~1e-16) is far below one float32 ulp,
  so after rounding it almost always equals the correctly rounded value.
- ``pow`` by a constant: torch's exact shortcuts (sqrt for 0.5, x*x for 2, x*x*x for 3) and otherwise
  libdevice (GPU) or a float64 evaluation rounded once (interpreter).
- float32 ``div``/``sqrt`` use the IEEE-rounded forms (``div_rn``, ``sqrt_rn``): Triton's default float32
  ``/`` is the 2-ulp ``div.full``, and the assigner's integer outputs hinge on exact ties.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

# Decided once, when this module is imported: triton.jit picks the interpreter from the same variable.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

try:  # the interpreter cannot call external (libdevice) functions, so it is never used there
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - very old or exotic Triton builds
    libdevice = None
USE_LIBDEVICE = (not INTERPRET) and libdevice is not None

# Set by tests: every output buffer is then filled with garbage first, so an element a kernel forgets to
# write shows up as NaN / an impossible integer instead of a plausible zero.
POISON = False


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs (poisoned when ``POISON`` is set, see above)."""
    if not POISON:
        return torch.empty(shape, dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -987654, dtype=dtype, device=device)


def launch(kernel):
    """The launcher of ``kernel`` inside a ``torch.library.triton_op`` body (visible to torch.compile)."""
    wrap = getattr(torch.library, "wrap_triton", None)
    if wrap is None:
        return kernel
    if INTERPRET:
        try:
            return wrap(kernel)
        except RuntimeError:
            # torch 2.11 (the GPU machine's) refuses the interpreter's InterpretedFunction; 2.14 takes it.
            # The interpreter runs eagerly on the CPU, where a direct launch is the same computation.
            return kernel
    return wrap(kernel)


# See exact_opts; also what the ahead-of-time compile test builds the exact kernels with.
EXACT = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


def exact_opts() -> dict:
    """Launch options for kernels whose float results must match torch's op-by-op rounding: no fusing of
    a*b + c into one fma, and no flushing of denormals to zero. Triton's default enable_reflect_ftz makes
    libdevice and plain fp32 arithmetic flush (42 .ftz instructions in the assigner's scan for sm_90, 2
    without it), so an overlap of ~3e-7 gives overlap**6 = 0 where torch gives 7e-40 > 0, and the anchor
    drops out of the top-k. Only for a plain eager launch: the interpreter has no such options, and the
    torch.compile wrapper does not forward them (traced launches then keep Triton's defaults)."""
    if INTERPRET:
        return {}
    try:
        from torch._library.triton import is_wrap_triton_enabled
    except ImportError:  # pragma: no cover - older torch
        return {}
    return {} if is_wrap_triton_enabled() else dict(EXACT)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64 (as the reference does), float32 otherwise (bf16/fp16 upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def pow_kind(e: float) -> tuple[int, float | int]:
    """(KIND, E) for ``pow_c``: how ``x ** e`` is evaluated, mirroring torch's pow(tensor, scalar)
    shortcuts; E is an int for the square-and-multiply kind."""
    e = float(e)
    if not math.isfinite(e) or e < 0:
        raise ValueError(f"exponent {e} is not supported by the Triton kernels (use a finite value >= 0)")
    for kind, special in enumerate((0.0, 1.0, 0.5, 2.0, 3.0)):
        if e == special:
            return kind, e
    if e == int(e) and e < 128:
        return 5, int(e)
    return 6, e


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


_PI_2 = tl.constexpr(math.pi / 2)
INF = tl.constexpr(float("inf"))
_INTERPRET = tl.constexpr(INTERPRET)


@triton.jit
def cast_to(x, TY: tl.constexpr):
    """x.to(TY) rounding to nearest even: the interpreter truncates float32 -> bfloat16 (and its rtne
    mode does not carry into the exponent), so there the rounding is done on the bits first."""
    if _INTERPRET and TY == tl.bfloat16:  # noqa: SIM300 (constexpr on the left unwraps it)
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        xr = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
        r = xr.to(tl.bfloat16)
    else:
        r = x.to(TY)
    return r


@triton.jit
def fma(a, b, c):
    """a*b + c rounded once; the interpreter's tl.fma rounds twice, so there float32 goes via float64
    (the float64 product of two float32 values is exact; the sum's double rounding is ~2^-29 rare)."""
    if _INTERPRET and c.dtype == tl.float32:
        r = (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
    else:
        r = tl.fma(a, b, c)
    return r


@triton.jit
def div(x, y, F64: tl.constexpr):
    """IEEE-rounded x / y (float32 ``/`` is approximate on NVIDIA GPUs; float64 ``/`` is exact already)."""
    if F64:
        r = x / y
    else:
        r = tl.math.div_rn(x, y)
    return r


@triton.jit
def sqrt(x, F64: tl.constexpr):
    if F64:
        r = tl.sqrt(x)
    else:
        r = tl.sqrt_rn(x)
    return r


@triton.jit
def atan(x, USE_LIB: tl.constexpr):
    """atan in x's dtype (float32 or float64)."""
    if USE_LIB:
        r = libdevice.atan(x)
    else:
        # |x| > 1 -> pi/2 - atan(1/|x|); two half-angle steps atan(u) = 2 atan(u / (1 + sqrt(1 + u^2)))
        # bring |u| under tan(pi/16) = 0.199, where 12 terms of the Taylor series leave an error < 1e-18.
        # (One function on purpose: every jit-helper call costs the interpreter ~1 ms.)
        t = tl.abs(x.to(tl.float64))
        big = t > 1.0
        u = tl.where(big, 1.0 / tl.maximum(t, 1.0), t)
        u = u / (1.0 + tl.sqrt(1.0 + u * u))
        u = u / (1.0 + tl.sqrt(1.0 + u * u))
        z = u * u
        p = -1.0 / 23.0
        p = p * z + 1.0 / 21.0
        p = p * z - 1.0 / 19.0
        p = p * z + 1.0 / 17.0
        p = p * z - 1.0 / 15.0
        p = p * z + 1.0 / 13.0
        p = p * z - 1.0 / 11.0
        p = p * z + 1.0 / 9.0
        p = p * z - 1.0 / 7.0
        p = p * z + 1.0 / 5.0
        p = p * z - 1.0 / 3.0
        p = p * z + 1.0
        rd = 4.0 * (u * p)
        rd = tl.where(big, _PI_2 - rd, rd)
        r = tl.where(x < 0, -rd, rd).to(x.dtype)
    return r


@triton.jit
def pow_c(x, E: tl.constexpr, KIND: tl.constexpr, USE_LIB: tl.constexpr, F64: tl.constexpr):
    """x ** E for a constant E >= 0, KIND = pow_kind(E)."""
    if KIND == 0:
        r = tl.full(x.shape, 1.0, x.dtype)
    elif KIND == 1:
        r = x
    elif KIND == 2:
        r = tl.sqrt(x) if F64 else tl.sqrt_rn(x)
    elif KIND == 3:
        r = x * x
    elif KIND == 4:
        r = x * x * x
    elif USE_LIB:
        r = libdevice.pow(x, tl.full(x.shape, E, x.dtype))
    else:
        xd = x.to(tl.float64)
        if KIND == 5:
            # square-and-multiply in float64: x^6 of a float32 x has 2 roundings at 1e-16, then one to float32
            rd = tl.full(xd.shape, 1.0, tl.float64)
            b = xd
            for i in tl.static_range(7):
                if (E >> i) & 1:
                    rd = rd * b
                b = b * b
        else:
            rd = tl.exp(E * tl.log(tl.where(xd > 0, xd, 1.0)))
            # x == 0 -> 0; x < 0 or NaN -> NaN via sqrt (no NaN constant; no warning on other lanes)
            rd = tl.where(xd > 0, rd, tl.where(xd == 0, 0.0, tl.sqrt(tl.where(xd > 0, 0.0, xd))))
        r = rd.to(x.dtype)
    return r
