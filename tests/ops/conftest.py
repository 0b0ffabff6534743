import os
import shutil

import pytest
import torch
from cuda_emulation import HAS_GPU, Impl, build_emulation

from yolofast.ops import _build


@pytest.fixture(scope="module")
def lib():
    """``yolofast.ops._library`` (the compiled ops), or skip when the C++ extension did not build."""
    ok, why = _build.extension_status("cpp")
    if not ok:
        pytest.skip(f"C++ extension unavailable ({why}); tests/ops/test_build.py reports the failure")
    from yolofast.ops import _library

    return _library


@pytest.fixture(
    scope="module",
    params=["cpp", pytest.param("gpu", marks=pytest.mark.cuda), pytest.param("emu", marks=pytest.mark.slow)],
)
def impl(request):
    """One backend's kernels through their raw ops (``Impl``): "cpp" the C++ extension, "gpu" the CUDA one on
    a GPU, "emu" the CUDA sources on the CPU emulation; the per-op tests that take it run on each."""
    if request.param == "cpp":
        ok, why = _build.extension_status("cpp")
        if not ok:
            pytest.skip(f"C++ extension unavailable ({why}); tests/ops/test_build.py reports the failure")
        return Impl("cpp", "cpu", torch.ops.yolofast)
    if request.param == "gpu":
        if not HAS_GPU:
            pytest.skip("no CUDA device")
        ok, why = _build.extension_status("cuda")
        assert ok, f"a GPU is visible but the CUDA extension is not available: {why}"
        return Impl("gpu", "cuda", torch.ops.yolofast)
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler for the CUDA emulation")
    import yolofast.ops._schemas  # noqa: F401 - yolofast's own schemas first (same names, other namespace)

    torch.ops.load_library(build_emulation())
    return Impl("emu", "cpu", torch.ops.yolofast_cuda_emu)


@pytest.fixture(scope="module")
def cuda_ops():
    ok, why = _build.extension_status("cuda")
    assert ok, f"a GPU is visible but the CUDA extension is not available: {why}"
    return torch.ops.yolofast
