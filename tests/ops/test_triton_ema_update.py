"""Triton ema_update vs reference.ema_update_ref (interpreter on CPU, the real kernel on a GPU)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from yolofast.kernels import _common, triton_status  # noqa: E402
from yolofast.kernels.ema_update import BLOCK, ema_update  # noqa: E402
from yolofast.ops import backend  # noqa: E402
from yolofast.ops import ema_update as public_ema_update  # noqa: E402
from yolofast.ops.reference import ema_update_ref  # noqa: E402

pytestmark = pytest.mark.triton
DEV = "cpu" if _common.INTERPRET else "cuda"
if DEV == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)


def _pair(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ema = torch.randn(n, generator=g).to(dtype).to(DEV)
    model = (torch.randn(n, generator=g) * 3).to(dtype).to(DEV)
    return ema, model


def test_status_reports_available():
    ok, why = triton_status("ema_update")
    assert ok, why
    assert triton_status("nope")[0] is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "decay",
    [0.9999, 0.3, torch.tensor(0.7), torch.tensor(0.993, dtype=torch.float64)],
    ids=["float-near-1", "float-below-half", "f32-tensor", "f64-tensor"],
)
def test_matches_reference_bitwise(dtype, decay):
    # N not a multiple of BLOCK: the masked tail must be updated and nothing past it touched
    n = BLOCK + 37
    ema, model = _pair(n, dtype, seed=1)
    expected = ema.clone()
    ema_update_ref(expected, model, decay.to(DEV) if isinstance(decay, torch.Tensor) else decay)
    before = ema.clone()
    ema_update(ema, model, decay)
    assert ema.dtype == dtype and ema.shape == (n,)
    assert torch.equal(ema, expected), (ema.double() - expected.double()).abs().max()
    assert not torch.equal(ema, before)


def test_float64_within_one_ulp():
    # the interpreter's tl.fma rounds twice in float64 (no wider type to emulate it), so 1 ulp is allowed
    ema, model = _pair(1000, torch.float64, seed=2)
    expected = ema.clone()
    ema_update_ref(expected, model, 0.99)
    ema_update(ema, model, 0.99)
    torch.testing.assert_close(ema, expected, rtol=3e-16, atol=3e-16)


def test_extreme_decays_and_empty():
    ema, model = _pair(100, torch.float32, seed=3)
    e0 = ema.clone()
    ema_update(ema, model, 1.0)  # d = 1 keeps the EMA
    assert torch.equal(ema, e0)
    ema_update(ema, model, 0.0)  # d = 0 copies the model
    assert torch.equal(ema, model)
    empty = torch.empty(0, device=DEV)
    ema_update(empty, empty.clone(), 0.5)


def test_public_op_dispatches_to_triton():
    ema, model = _pair(5000, torch.float32, seed=4)
    expected = ema.clone()
    decay = torch.tensor(0.9, device=DEV)
    ema_update_ref(expected, model, decay)
    with backend("triton"):
        public_ema_update(ema, model, decay)
    assert torch.equal(ema, expected)


def test_bad_arguments_are_refused():
    ema, model = _pair(10, torch.float32, seed=5)
    with pytest.raises(ValueError, match="shape"):
        ema_update(ema, model[:5], 0.5)
    with pytest.raises(TypeError, match="dtype"):
        ema_update(ema, model.double(), 0.5)


def test_opcheck():
    # the fake-tensor and AOT checks need compiled (CUDA) kernels: wrap_triton cannot trace the interpreter
    utils = ("test_schema", "test_autograd_registration") + (
        () if DEV == "cpu" else ("test_faketensor", "test_aot_dispatch_dynamic")
    )
    ema, model = _pair(1000, torch.float32, seed=6)
    decay = torch.tensor(0.9, dtype=torch.float64, device=DEV)
    torch.library.opcheck(torch.ops.yolofast.ema_update_triton.default, (ema, model, decay), test_utils=utils)


@pytest.mark.skipif(DEV == "cpu", reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_reads_the_decay_on_the_device():
    ema, model = _pair(10_000, torch.float32, seed=7)
    decay = torch.tensor(0.5, dtype=torch.float64, device=DEV)
    ema_update(ema, model, decay)  # compile + warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ema_update(ema, model, decay)
    for d in (0.9, 0.99):
        decay.fill_(d)
        expected = ema.clone()
        ema_update_ref(expected, model, decay)
        graph.replay()
        assert torch.equal(ema, expected)
