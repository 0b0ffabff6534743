"""ema_update: the fused C++ EMA (csrc/cpu/ema_update_kernel.cpp) and the CUDA one (csrc/cuda, on a GPU or the
CPU emulation: the ``impl`` fixture) against reference.ema_update_ref / torch.lerp. The Triton kernel:
test_triton_ema_update.py."""

from __future__ import annotations

import pytest
import torch
from op_inputs import TRITON_DEV, ema_pair, needs_triton

from yolofast.ops import ema_update as public_ema_update
from yolofast.ops import reference
from yolofast.ops._backend import backend
from yolofast.ops.reference import ema_update_ref

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


def _storage_order(t):
    return t.permute(0, 2, 3, 1).flatten() if t.dim() == 4 else t.flatten()  # 4-d ones are channels_last


def _state_lists(seed, dtype=torch.float32):
    """Tensors like a model's state: odd sizes, a channels_last conv weight, a 0-d and an empty tensor,
    integer counters."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 3, 3, 3), (16,), (), (0,), (300_001,), (7, 5), ((1 << 16) + 3,), (64, 32, 3, 3)]
    ema, model = [], []
    for s in shapes:
        e = torch.randn(s, generator=g).to(dtype)
        m = (e.float() + 0.1 * torch.randn(s, generator=g)).to(dtype)
        if len(s) == 4:
            e, m = e.to(memory_format=torch.channels_last), m.to(memory_format=torch.channels_last)
        ema.append(e)
        model.append(m)
    ema.append(torch.tensor(3))
    model.append(torch.tensor(7))
    return ema, model


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decay", [0.9999, 0.3])
def test_multi_tensor_equals_the_flat_kernel(lib, dtype, decay, threads):
    """ema_update.multi over the tensors where they lie == the flat kernel over their concatenation, bit for
    bit, at 1 and 2 threads; layouts kept, integers copied, the model untouched."""
    ema, model = _state_lists(5, dtype)
    floats = [i for i, t in enumerate(ema) if t.is_floating_point()]
    flat_e = torch.cat([_storage_order(ema[i]) for i in floats])
    flat_m = torch.cat([_storage_order(model[i]) for i in floats])
    lib.ema_update(flat_e, flat_m, decay)
    strides = [t.stride() for t in ema]
    model_before = [t.clone() for t in model]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.ops.yolofast.ema_update.multi(ema, model, torch.tensor(decay, dtype=torch.float64))
    finally:
        torch.set_num_threads(prev)
    got = torch.cat([_storage_order(ema[i]) for i in floats])
    assert torch.equal(got, flat_e)
    assert [t.stride() for t in ema] == strides
    assert ema[-1].item() == 7
    assert all(torch.equal(a, b) for a, b in zip(model, model_before))


def test_multi_tensor_reads_other_layouts_and_dtypes(lib):
    """A model tensor in another layout or dtype than the EMA's gives what the reference gives."""
    g = torch.Generator().manual_seed(1)
    ema = [torch.randn(8, 4, 3, 3, generator=g), torch.randn(999, generator=g).bfloat16()]
    model = [torch.randn(8, 4, 3, 3, generator=g).to(memory_format=torch.channels_last),
             torch.randn(999, generator=g)]
    want = [t.clone() for t in ema]
    for w, m in zip(want, model):
        reference.ema_update_ref(w.view(-1), m.reshape(-1), 0.8)
    torch.ops.yolofast.ema_update.multi(ema, model, torch.tensor(0.8, dtype=torch.float64))
    torch.testing.assert_close(ema[0], want[0], rtol=torch.finfo(torch.float32).eps, atol=0)
    torch.testing.assert_close(ema[1], want[1], rtol=torch.finfo(torch.bfloat16).eps, atol=0)


def test_multi_tensor_public_wrapper_and_errors(lib):
    from yolofast.ops import ema_update

    for name in ("ref", "cpp"):
        ema, model = _state_lists(2)
        want = [t.clone() for t in ema]
        for w, m in zip(want, model):
            if w.is_floating_point():
                reference.ema_update_ref(w, m, 0.9)
            else:
                w.copy_(m)
        with backend(name):
            ema_update(ema, model, 0.9)
        for a, b in zip(ema, want):
            torch.testing.assert_close(a, b, rtol=torch.finfo(torch.float32).eps, atol=0, msg=name)
    d = torch.tensor(0.9, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="model tensors"):
        torch.ops.yolofast.ema_update.multi([torch.zeros(3)], [], d)
    with pytest.raises(RuntimeError, match="differ in shape"):
        torch.ops.yolofast.ema_update.multi([torch.zeros(3)], [torch.zeros(4)], d)
    with pytest.raises(RuntimeError, match="not dense"):
        torch.ops.yolofast.ema_update.multi([torch.zeros(8)[::2]], [torch.zeros(4)], d)
    torch.library.opcheck(torch.ops.yolofast.ema_update.multi, (*_state_lists(3), d))


@pytest.mark.parametrize("threads", [1, 2])
def test_plan_step_is_the_counter_the_decay_then_the_multi_kernel(lib, threads):
    """EmaPlan.step (ModelEMA's CPU step): updates += 1, d = decay*(1 - exp(-updates/tau)) in float64 in
    the order of ModelEMA.decay_tensor(), then ema_update.multi with that d, bit for bit over several
    steps; integers copied, a model tensor in another layout than the EMA's read right."""
    ema, model = _state_lists(4)
    model[0] = model[0].contiguous()  # the EMA's is channels_last: read through a copy laid out like it
    want = [t.clone() for t in ema]
    updates = torch.tensor(1000, dtype=torch.int64)
    plan = lib.ema_plan(ema, model, 0.9999, 2000.0)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in (1001, 1002, 1003):
            plan.step(updates)
            assert updates.item() == step
            d = 0.9999 * (1 - torch.exp(-torch.tensor(step, dtype=torch.float64) / 2000.0))
            torch.ops.yolofast.ema_update.multi(want, model, d)
            for i, (a, b) in enumerate(zip(ema, want)):
                assert torch.equal(a, b), (step, i)
    finally:
        torch.set_num_threads(prev)
    assert ema[-1].item() == 7 and ema[0].is_contiguous(memory_format=torch.channels_last)


def test_plan_follows_replaced_data_and_reports_bad_arguments(lib):
    """The plan holds the model's tensor objects: one whose .data is replaced (Module.to does that) is read
    from its new memory. A bad counter or a mismatched pair is an error that says what to pass."""
    ema = [torch.zeros(4)]
    p = torch.nn.Parameter(torch.zeros(4))
    plan = lib.ema_plan(ema, [p], 0.5, 1e-9)  # d = 0.5 from the first step
    p.data = torch.full((4,), 2.0)
    plan.step(torch.tensor(0))
    assert torch.equal(ema[0], torch.full((4,), 1.0))
    with pytest.raises(RuntimeError, match="int64 CPU tensor"):
        plan.step(torch.tensor(0.0))
    p.data = torch.zeros(5)
    with pytest.raises(RuntimeError, match="differ in shape"):
        plan.step(torch.tensor(0))
    with pytest.raises(RuntimeError, match="model tensors"):
        lib.ema_plan([torch.zeros(3)], [], 0.5, 1.0)


# ---------------------------------------- the same checks on the CUDA kernels (a GPU, or the CPU emulation)
# ------------------------------------------------------------------------------------------- ema_update

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_ema_matches_reference(impl, dtype):
    for n in (1, 15, 17, 1000, 4099):
        for decay in (0.9999, 0.3, 0.5, 0.0):
            for decay_dtype in (torch.float32, torch.float64):
                ema, model = ema_pair(n, dtype, n, impl.device)
                d = torch.tensor(decay, dtype=decay_dtype, device=impl.device)
                want = ema.clone()
                ema_update_ref(want, model, d)
                before = model.clone()
                impl.ops.ema_update(ema, model, d)
                assert torch.equal(model, before)
                ulp = torch.finfo(dtype).eps  # torch's own lerp may round a*b + c twice in a tail loop
                torch.testing.assert_close(ema, want, rtol=ulp, atol=ulp * 1e-3)
                assert (ema != want).float().mean() < 0.01


def test_ema_decay_sources_views_and_mixed_dtypes(impl):
    dev = impl.device
    ema, model = ema_pair(1001, torch.float32, 1, dev)
    for d in (
        torch.tensor(0.7),
        torch.tensor(0.7, dtype=torch.float64, device=dev),
        torch.tensor(0.7, dtype=torch.bfloat16, device=dev),
    ):
        e, want = ema.clone(), ema.clone()
        impl.ops.ema_update(e, model, d)
        ema_update_ref(want, model, d.to(dev))
        torch.testing.assert_close(e, want, rtol=1.2e-7, atol=0)
    base = torch.zeros(1002, device=dev)
    view = base[1:]  # 4 bytes off the 16-byte alignment: the element-wise path
    view.copy_(ema)
    want = ema.clone()
    d = torch.tensor(0.9, device=dev)
    impl.ops.ema_update(view, model, d)
    ema_update_ref(want, model, d)
    torch.testing.assert_close(view, want, rtol=1.2e-7, atol=0)
    assert base[0] == 0
    low, full = ema.bfloat16(), model.clone()  # a float32 model into a bf16 EMA
    want = low.clone()
    impl.ops.ema_update(low, full, torch.tensor(0.6, dtype=torch.float64, device=dev))
    ema_update_ref(want, full, torch.tensor(0.6, dtype=torch.float64, device=dev))
    assert torch.equal(low, want)


def test_ema_bad_arguments(impl):
    ema, model = ema_pair(10, torch.float32, 2, impl.device)
    with pytest.raises(RuntimeError, match="differ in shape"):
        impl.ops.ema_update(ema, model[:5], torch.tensor(0.5))
    with pytest.raises(RuntimeError, match="contiguous"):
        impl.ops.ema_update(ema.view(2, 5).t(), model.view(2, 5).t(), torch.tensor(0.5))
    with pytest.raises(RuntimeError, match="one value"):
        impl.ops.ema_update(ema, model, torch.tensor([0.5, 0.5]))


# ------------------------------------------------------------------------------------ the Triton kernel
# On the CPU through Triton's interpreter, the compiled kernel on a GPU (op_inputs.needs_triton).
try:
    from yolofast.kernels import triton_status
    from yolofast.kernels.ema_update import BLOCK as TRITON_EMA_BLOCK
    from yolofast.kernels.ema_update import ema_update as triton_ema_update
except ImportError as e:
    NO_TRITON = f"triton is not importable: {e}"
else:
    NO_TRITON = ""
NEEDS_TRITON = needs_triton(NO_TRITON)


def triton_pair(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ema = torch.randn(n, generator=g).to(dtype).to(TRITON_DEV)
    model = (torch.randn(n, generator=g) * 3).to(dtype).to(TRITON_DEV)
    return ema, model


class TestTriton:
    """The Triton ema_update (kernels/ema_update.py) against reference.ema_update_ref."""

    pytestmark = NEEDS_TRITON

    def test_status_reports_available(self):
        ok, why = triton_status("ema_update")
        assert ok, why
        assert triton_status("nope")[0] is False

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize(
        "decay",
        [0.9999, 0.3, torch.tensor(0.7), torch.tensor(0.993, dtype=torch.float64)],
        ids=["float-near-1", "float-below-half", "f32-tensor", "f64-tensor"],
    )
    def test_matches_reference_bitwise(self, dtype, decay):
        # N not a multiple of BLOCK: the masked tail must be updated and nothing past it touched
        n = TRITON_EMA_BLOCK + 37
        ema, model = triton_pair(n, dtype, seed=1)
        expected = ema.clone()
        ema_update_ref(expected, model, decay.to(TRITON_DEV) if isinstance(decay, torch.Tensor) else decay)
        before = ema.clone()
        triton_ema_update(ema, model, decay)
        assert ema.dtype == dtype and ema.shape == (n,)
        assert torch.equal(ema, expected), (ema.double() - expected.double()).abs().max()
        assert not torch.equal(ema, before)

    def test_float64_within_one_ulp(self):
        # the interpreter's tl.fma rounds twice in float64 (no wider type to emulate it), so 1 ulp is allowed
        ema, model = triton_pair(1000, torch.float64, seed=2)
        expected = ema.clone()
        ema_update_ref(expected, model, 0.99)
        triton_ema_update(ema, model, 0.99)
        torch.testing.assert_close(ema, expected, rtol=3e-16, atol=3e-16)

    def test_extreme_decays_and_empty(self):
        ema, model = triton_pair(100, torch.float32, seed=3)
        e0 = ema.clone()
        triton_ema_update(ema, model, 1.0)  # d = 1 keeps the EMA
        assert torch.equal(ema, e0)
        triton_ema_update(ema, model, 0.0)  # d = 0 copies the model
        assert torch.equal(ema, model)
        empty = torch.empty(0, device=TRITON_DEV)
        triton_ema_update(empty, empty.clone(), 0.5)

    def test_public_op_dispatches_to_triton(self):
        ema, model = triton_pair(5000, torch.float32, seed=4)
        expected = ema.clone()
        decay = torch.tensor(0.9, device=TRITON_DEV)
        ema_update_ref(expected, model, decay)
        with backend("triton"):
            public_ema_update(ema, model, decay)
        assert torch.equal(ema, expected)

    def test_bad_arguments_are_refused(self):
        ema, model = triton_pair(10, torch.float32, seed=5)
        with pytest.raises(ValueError, match="shape"):
            triton_ema_update(ema, model[:5], 0.5)
        with pytest.raises(TypeError, match="dtype"):
            triton_ema_update(ema, model.double(), 0.5)

    def test_opcheck(self):
        # the fake-tensor and AOT checks need compiled (CUDA) kernels: wrap_triton cannot trace the
        # interpreter
        utils = ("test_schema", "test_autograd_registration") + (
            () if TRITON_DEV == "cpu" else ("test_faketensor", "test_aot_dispatch_dynamic")
        )
        ema, model = triton_pair(1000, torch.float32, seed=6)
        decay = torch.tensor(0.9, dtype=torch.float64, device=TRITON_DEV)
        op = torch.ops.yolofast.ema_update_triton.default
        torch.library.opcheck(op, (ema, model, decay), test_utils=utils)

    @pytest.mark.skipif(TRITON_DEV == "cpu", reason="CUDA graphs need a GPU")
    def test_cuda_graph_capture_reads_the_decay_on_the_device(self):
        ema, model = triton_pair(10_000, torch.float32, seed=7)
        decay = torch.tensor(0.5, dtype=torch.float64, device=TRITON_DEV)
        triton_ema_update(ema, model, decay)  # compile + warm up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            triton_ema_update(ema, model, decay)
        for d in (0.9, 0.99):
            decay.fill_(d)
            expected = ema.clone()
            ema_update_ref(expected, model, decay)
            graph.replay()
            assert torch.equal(ema, expected)
