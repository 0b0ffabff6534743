"""The fused C++ ema_update (csrc/cpu/ema_update_kernel.cpp) against reference.ema_update_ref / torch.lerp."""

from __future__ import annotations

import pytest
import torch

from yolofast.ops import reference
from yolofast.ops._backend import backend

# Not multiples of the 16-float vector width, below and across the 64 Ki parallel grain.
SIZES = (1, 15, 17, 1000, (1 << 16) + 7, 300_001)


def _pair(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ema = torch.randn(n, generator=g).to(dtype)
    model = (ema.float() + torch.randn(n, generator=g) * 0.1).to(dtype)
    return ema, model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("decay", [0.9999, 0.3, 0.5, 0.0])
def test_matches_lerp(lib, dtype, n, decay):
    """Bitwise equal to torch.lerp (weight 1 - d) except, at most, 1 ulp where torch's scalar tail loop
    rounds a*b + c twice instead of once (fma)."""
    ema, model = _pair(n, dtype, n)
    want = ema.clone()
    reference.ema_update_ref(want, model, decay)
    if dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(want, ema.float().lerp(model.float(), 1 - decay).to(dtype))
    ptr = ema.data_ptr()
    model_before = model.clone()
    lib.ema_update(ema, model, decay)
    assert ema.data_ptr() == ptr and torch.equal(model, model_before)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(ema, want, rtol=ulp, atol=ulp * 1e-3)
    if n >= 64:  # the vectorised body is bitwise torch's
        assert (ema != want).float().mean() < 0.01


@pytest.mark.parametrize("decay_dtype", [torch.float32, torch.float64])
def test_tensor_decay(lib, decay_dtype):
    ema, model = _pair(10_001, torch.float32, 3)
    d = torch.tensor(0.999, dtype=decay_dtype)
    want = ema.clone()
    reference.ema_update_ref(want, model, d)
    lib.ema_update(ema, model, d)
    torch.testing.assert_close(ema, want, rtol=torch.finfo(torch.float32).eps, atol=0)


def test_mixed_dtypes_read_model_at_compute_precision(lib):
    ema = torch.randn(5003, dtype=torch.bfloat16)
    model = torch.randn(5003, dtype=torch.float32)
    want = ema.clone()
    reference.ema_update_ref(want, model, 0.7)
    lib.ema_update(ema, model, 0.7)
    torch.testing.assert_close(ema, want, rtol=torch.finfo(torch.bfloat16).eps, atol=0)


def test_public_wrapper_and_errors(lib):
    ema, model = _pair(100, torch.float32, 1)
    want = ema.clone()
    reference.ema_update_ref(want, model, 0.9)
    with backend("cpp"):
        from yolofast.ops import ema_update

        ema_update(ema, model, 0.9)
    torch.testing.assert_close(ema, want, rtol=torch.finfo(torch.float32).eps, atol=0)
    with pytest.raises(RuntimeError, match="differ in shape"):
        lib.ema_update(ema, model[:50], 0.9)
    with pytest.raises(RuntimeError, match="contiguous"):
        lib.ema_update(torch.zeros(200)[::2], model, 0.9)
    with pytest.raises(RuntimeError, match="floating point"):
        lib.ema_update(torch.zeros(100, dtype=torch.int64), model, 0.9)


def test_opcheck(lib):
    ema, model = _pair(1000, torch.float32, 2)
    torch.library.opcheck(torch.ops.yolofast.ema_update.default, (ema, model, torch.tensor(0.99)))
