import copy
import math

import pytest
import torch
from torch import nn

from yolofast.engine.ema import ModelEMA
from yolofast.ops import backend


@pytest.fixture(autouse=True, params=["ref", "auto"])
def op_backend(request):
    with backend(request.param):
        yield request.param


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.SiLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)
    )


def train_step(model, opt):
    model.train()
    loss = model(torch.randn(2, 3, 8, 8)).square().mean()  # also moves the BN running stats
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_matches_per_tensor_lerp_ema():
    model = small_model()
    ema = ModelEMA(model, decay=0.99, tau=3)  # small tau so d changes a lot over the first steps
    manual = copy.deepcopy(model).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 7):
        train_step(model, opt)
        ema.update(model)
        d = 0.99 * (1 - math.exp(-step / 3))
        with torch.no_grad():
            for e, m in zip(manual.state_dict().values(), model.state_dict().values()):
                if e.is_floating_point():
                    e.lerp_(m, 1 - d)
                else:
                    e.copy_(m)
        for name, e in ema.ema.state_dict().items():
            m = manual.state_dict()[name]
            assert e.dtype == m.dtype
            torch.testing.assert_close(e, m, rtol=0, atol=1e-7, msg=f"{name} at step {step}")
    assert ema.updates == 6
    # the integer buffer was copied, not averaged
    assert ema.ema[1].num_batches_tracked.item() == 6 == model[1].num_batches_tracked.item()
    # and the EMA really lags behind the model
    assert not torch.allclose(ema.ema[0].weight, model[0].weight)


def test_decay_formula():
    model = nn.Linear(2, 2, bias=False)
    nn.init.zeros_(model.weight)
    ema = ModelEMA(model, decay=0.9999, tau=2000, updates=99)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update(model)  # update 100: ema = d*0 + (1 - d)*1
    d = 0.9999 * (1 - math.exp(-100 / 2000))
    assert ema.ema.weight[0, 0].item() == pytest.approx(1 - d, rel=1e-6)
    assert ema.decay_tensor().item() == pytest.approx(d, rel=1e-12)
    assert ema.updates == 100


@pytest.mark.parametrize("flat", [False, True])
def test_ema_copy_is_frozen_eval_and_laid_out(flat):
    model = small_model().train().to(memory_format=torch.channels_last)
    ema = ModelEMA(model, flat=flat)
    assert ema.flat is flat and not ema.ema.training
    assert all(not p.requires_grad for p in ema.ema.parameters())
    assert all(p.requires_grad for p in model.parameters())  # the model itself is untouched
    floats = [t for t in list(ema.ema.parameters()) + list(ema.ema.buffers()) if t.is_floating_point()]
    if flat:  # one flat buffer: every floating tensor is a view into the same storage
        assert len({t.untyped_storage().data_ptr() for t in floats}) == 1
        assert sum(t.numel() for t in floats) == ema.ema[0].weight.untyped_storage().nbytes() // 4
    else:  # the CPU layout: the EMA's tensors keep the model's (channels_last), read in place
        w = ema.ema[0].weight
        assert w.stride() == model[0].weight.stride() != w.contiguous().stride()
    torch.testing.assert_close(ema.ema(torch.ones(1, 3, 8, 8)), model.eval()(torch.ones(1, 3, 8, 8)))


def test_cpu_update_reads_the_model_in_place_without_a_copy(monkeypatch):
    """The multi-tensor path is one op call over the model's own tensors: no torch.cat into a flat copy."""
    model = small_model()
    ema = ModelEMA(model, decay=0.9, tau=1e-9)
    assert not ema.flat
    calls = []
    monkeypatch.setattr(torch, "cat", lambda *a, **k: calls.append(a) or pytest.fail("torch.cat called"))
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model)
    assert not calls
    torch.testing.assert_close(ema.ema[0].weight, model[0].weight - 0.9)


def test_flat_and_in_place_layouts_agree():
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a, b = ModelEMA(model, tau=3, flat=False), ModelEMA(model, tau=3, flat=True)
    for _ in range(3):
        train_step(model, opt)
        a.update(model)
        b.update(model)
    for (k, x), y in zip(a.ema.state_dict().items(), b.ema.state_dict().values()):
        assert torch.equal(x, y), k


def test_reassigned_parameter_is_followed():
    """A parameter replaced by a new tensor after the first update is read from its new home."""
    model = small_model()
    ema = ModelEMA(model, decay=0.5, tau=1e-9)
    ema.update(model)
    before = ema.ema[4].bias.clone()
    model[4].bias = nn.Parameter(torch.full_like(model[4].bias, 3.0))
    ema.update(model)
    torch.testing.assert_close(ema.ema[4].bias, 0.5 * before + 0.5 * 3.0)


def test_state_dict_round_trip():
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = ModelEMA(model, tau=5)
    for _ in range(3):
        train_step(model, opt)
        ema.update(model)
    state = ema.state_dict()
    assert state["updates"] == 3

    other = ModelEMA(small_model(), tau=5)  # decay and tau are settings, not state
    other.load_state_dict(state)
    assert other.updates == 3
    for (k, a), b in zip(ema.ema.state_dict().items(), other.ema.state_dict().values()):
        assert torch.equal(a, b), k
    # the loaded EMA keeps updating through its flat buffer, exactly like the original
    train_step(model, opt)
    ema.update(model)
    other.update(model)
    for a, b in zip(ema.ema.state_dict().values(), other.ema.state_dict().values()):
        assert torch.equal(a, b)


def test_tied_weights_and_wrong_model():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)
            self.b.weight = self.a.weight

    model = Tied()
    ema = ModelEMA(model, decay=0.5, tau=1e-9)  # d = 0.5 from the first update
    with torch.no_grad():
        model.a.weight.add_(2.0)
    ema.update(model)
    assert ema.ema.a.weight is ema.ema.b.weight
    torch.testing.assert_close(ema.ema.b.weight, model.a.weight - 1.0)
    with pytest.raises(ValueError, match="architecture"):
        ema.update(nn.Linear(3, 3))


def test_model_converted_after_the_first_update_is_followed():
    """Module.to() replaces a parameter's .data (same Parameter object, new memory and strides): the next
    update reads the new memory, whatever the CPU path prepared at the first update."""
    model = small_model()
    ema = ModelEMA(model, decay=0.5, tau=1e-9)  # d = 0.5 from the first update
    ema.update(model)
    before = ema.ema[0].weight.clone()
    model.to(memory_format=torch.channels_last)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model)
    torch.testing.assert_close(ema.ema[0].weight, 0.5 * before + 0.5 * model[0].weight, rtol=1e-6, atol=1e-7)


def test_changed_decay_applies_at_the_next_update():
    model = small_model()
    ema = ModelEMA(model, decay=0.9, tau=1e-9)
    ema.update(model)
    with torch.no_grad():
        model[4].bias.add_(1.0)
    ema.decay = 0.0  # d = 0: the EMA becomes the model
    ema.update(model)
    for k, v in model.state_dict().items():
        assert torch.equal(ema.ema.state_dict()[k], v), k


def test_a_dispatch_mode_sees_the_update_as_ops():
    """Under a TorchDispatchMode (the CUDA-graph emulator records what it replays this way) the update runs
    as dispatched ops, never only inside an opaque call, and gives what it gives without the mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    model = small_model()
    a, b = ModelEMA(model, tau=3), ModelEMA(model, tau=3)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    a.update(model)
    with Record() as rec:
        b.update(model)
    assert any("ema_update" in op or "lerp" in op for op in rec.ops), rec.ops
    assert a.updates == b.updates == 1
    for (k, x), y in zip(a.ema.state_dict().items(), b.ema.state_dict().values()):
        assert torch.equal(x, y), k


def test_reassigned_buffer_is_followed():
    """A buffer replaced by a new tensor after updates have run: the next update reads the new one."""
    model = small_model()
    ema = ModelEMA(model, decay=0.5, tau=1e-9)
    ema.update(model)
    ema.update(model)
    mean = ema.ema[1].running_mean.clone()
    model[1].running_mean = torch.full((4,), 2.0)
    ema.update(model)
    torch.testing.assert_close(ema.ema[1].running_mean, 0.5 * mean + 0.5 * 2.0)


def test_ema_of_a_distillation_step_keeps_the_student_alone():
    """Built from and updated with a distillation step (engine/distill.py: the graphed train step passes
    its step model), possibly DataParallel/compile-wrapped: the EMA holds and follows the student only."""

    class Distill(nn.Module):
        def __init__(self, student):
            super().__init__()
            self.student = student
            self.projector = nn.Linear(2, 2)

    model = small_model()
    step = Distill(model)
    ema = ModelEMA(nn.DataParallel(step), decay=0.5, tau=1e-9)  # d = 0.5 from the first update
    assert set(ema.ema.state_dict()) == set(model.state_dict())
    before = copy.deepcopy(ema.ema.state_dict())
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ema.update(torch.compile(step))
    now = model.state_dict()
    for k, v in ema.ema.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(v, 0.5 * before[k] + 0.5 * now[k])
