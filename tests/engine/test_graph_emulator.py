"""The CPU stand-in for CUDA graphs (graph_emulator.py) behaves like a graph where the trainer's graph
tests rely on it: capture changes nothing, replay re-runs the recorded work on the same memory, Python
values are frozen at capture, host reads are refused."""

import pytest
import torch
from graph_emulator import EmulatedCuda


def test_capture_changes_nothing_and_replay_reruns():
    w, x = torch.ones(3), torch.full((3,), 2.0)
    g = EmulatedCuda.CUDAGraph()
    with EmulatedCuda.graph(g):
        y = w * x  # made inside: graph memory
        w.add_(y)  # an outside tensor written inside the capture
        w[1:].mul_(10.0)  # ... and through a view
    torch.testing.assert_close(w, torch.ones(3))  # a real capture launches nothing
    x.fill_(3.0)  # new input in the static buffer
    g.replay()
    torch.testing.assert_close(y, torch.full((3,), 3.0))
    torch.testing.assert_close(w, torch.tensor([4.0, 40.0, 40.0]))
    g.replay()  # state carries over between replays: w = (w + w * x) * [1, 10, 10]
    torch.testing.assert_close(w, torch.tensor([16.0, 1600.0, 1600.0]))


def test_python_values_frozen_at_capture():
    w, lr = torch.zeros(2), {"v": 0.5}
    lr_t = torch.tensor(0.5)
    g = EmulatedCuda.CUDAGraph()
    with EmulatedCuda.graph(g):
        w.add_(lr["v"])  # a float: baked in
        w.add_(lr_t)  # a tensor: read at each replay
    lr["v"] = 100.0
    lr_t.fill_(1.0)
    g.replay()
    torch.testing.assert_close(w, torch.full((2,), 1.5))


def test_autograd_and_optimizer_inside_capture():
    """Backward accumulates into the existing .grad and the optimizer's in-place step replays."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD([p], lr=torch.tensor(0.1), momentum=0.9, fused=True)
    x = torch.tensor([3.0, 4.0])
    (p * x).sum().backward()
    opt.step()  # eager step: momentum buffers exist before capture
    opt.zero_grad(set_to_none=False)
    ref = p.detach().clone(), opt.state[p]["momentum_buffer"].clone()
    g = EmulatedCuda.CUDAGraph()
    with EmulatedCuda.graph(g):
        (p * x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    assert torch.equal(p.detach(), ref[0]) and torch.equal(opt.state[p]["momentum_buffer"], ref[1])
    for _ in range(2):
        g.replay()
    buf = ref[1] * 0.9 + x
    buf = buf * 0.9 + x
    torch.testing.assert_close(p.detach(), ref[0] - 0.1 * (ref[1] * 0.9 + x) - 0.1 * buf)
    assert torch.equal(p.grad, torch.zeros(2))


@pytest.mark.parametrize("host_read", [lambda t: t.sum().item(), lambda t: t.nonzero(),
                                       lambda t: t + torch.tensor([1.0, 2.0])])
def test_host_sync_inside_capture_raises(host_read):
    t = torch.ones(2)
    g = EmulatedCuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="not allowed inside a capture"), EmulatedCuda.graph(g):
        host_read(t)


def test_undeclared_write_is_undone_at_capture_and_replayed():
    """native_batch_norm updates its running statistics without marking them written in its schema; a
    capture must still leave them as they were, and each replay must update them once."""
    x = torch.arange(8.0).reshape(4, 2)
    mean, var = torch.zeros(2), torch.ones(2)
    g = EmulatedCuda.CUDAGraph()
    with EmulatedCuda.graph(g):
        torch.nn.functional.batch_norm(x, mean, var, training=True, momentum=0.5)
    assert torch.equal(mean, torch.zeros(2)) and torch.equal(var, torch.ones(2))
    g.replay()
    torch.testing.assert_close(mean, 0.5 * x.mean(0))
    g.replay()
    torch.testing.assert_close(mean, 0.75 * x.mean(0))
