"""MuSGD and optimizer=auto in the trainer: what args.yaml records, the lr/pg columns, exact resume."""

import copy

import pytest
import torch
import yaml

from yolofast import Trainer
from yolofast.data import make_shapes
from yolofast.engine.checkpoint import load_checkpoint
from yolofast.nn import YOLOV8
from yolofast.optim import MuSGD

TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
FAST = dict(model=TINY, imgsz=64, batch=4, workers=0, verbose=False, plots=False)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return str(make_shapes(root=tmp_path_factory.mktemp("shapes"), n_train=8, n_val=4, imgsz=64))


def test_auto_choice_is_recorded_in_args_yaml(shapes, tmp_path):
    t = Trainer(data=shapes, epochs=1, project=tmp_path, name="auto", **FAST)
    t.train()
    args = yaml.safe_load((tmp_path / "auto" / "args.yaml").read_text())
    lr = round(0.002 * 5 / (4 + 5), 6)
    got = (args["optimizer"], args["lr0"], args["warmup_bias_lr"], args["momentum"])
    assert got == ("AdamW", lr, 0.0, 0.937)
    ta = load_checkpoint(t.last)["train_args"]
    assert (ta["optimizer"], ta["lr0"], ta["warmup_bias_lr"]) == ("AdamW", lr, 0.0)


def test_musgd_run_resumes_exactly(shapes, tmp_path, resume_after_crash):
    """2 epochs straight == 1 epoch, crash, resume: both Muon buffers travel in last.pt, bit for bit."""
    recipe = dict(data=shapes, epochs=2, close_mosaic=1, optimizer="MuSGD", project=tmp_path, **FAST)
    full = Trainer(name="full", **recipe)
    full.train()
    assert isinstance(full.optimizer, MuSGD) and len(full.optimizer.param_groups) == 8
    r = resume_after_crash(recipe)
    r.train()
    a = load_checkpoint(tmp_path / "full/weights/last.pt")
    b = load_checkpoint(tmp_path / "cut/weights/last.pt")
    for k, v in a["model"].state_dict().items():
        assert torch.equal(b["model"].state_dict()[k], v), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and any("momentum_buffer_SGD" in s for s in sa.values())
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)
    tags = [g["param_group"] for g in a["optimizer"]["param_groups"]]
    assert tags == ["weight", "weight", "bn", "bn", "bias", "bias", "muon", "muon"]


def _musgd_model(seed: int):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16), torch.nn.Conv2d(16, 8, 1),
                              torch.nn.Conv2d(8, 8, 3, groups=8, bias=False), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 4 * 4, 5))
    from yolofast.engine import optim

    lr = torch.tensor(0.01)  # a device tensor lr: what the CUDA-graph step gives every group
    groups = optim.musgd_groups(net, 0.01, 0.937, 5e-4)
    for g in groups:
        g["lr"] = lr.clone() * (3 if g["lr"] > 0.015 else 1)
    return net, MuSGD(groups, lr=0.01, momentum=0.937, nesterov=True, muon=0.2, sgd=1.0)


def test_musgd_step_is_capturable():
    """The whole MuSGD step (both buffers, Newton–Schulz, SGD part) inside the emulated CUDA graph: no host
    read, no data-dependent shape, and N replays equal N eager steps bit for bit."""
    from graph_emulator import EmulatedCuda

    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    runs = []
    for graphed in (False, True):
        net, opt = _musgd_model(0)
        net(x).square().mean().backward()
        opt.step()  # eager: the state exists before capture
        if graphed:
            g = EmulatedCuda.CUDAGraph()
            with EmulatedCuda.graph(g):
                opt.step()
            for _ in range(3):
                g.replay()
        else:
            for _ in range(3):
                opt.step()
        runs.append([p.detach().clone() for p in net.parameters()] +
                    [v.clone() for st in opt.state.values() for v in st.values()])
    assert len(runs[0]) == len(runs[1])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert any("momentum_buffer_SGD" in st for st in opt.state.values())
