"""Optimizer groups, the auto rule, accumulate/weight-decay scaling, schedules and warmup values."""

import math

import pytest
import torch
from torch import nn

from yolofast.engine import optim


def _net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1),
                         nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(4 * 4, 2))


def test_param_groups_partition():
    net = _net()
    bias, decay, norm = optim.param_groups(net)
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(decay) == {id(net[0].weight), id(net[2].weight), id(net[5].weight)}
    assert ids(bias) == {id(net[1].bias), id(net[2].bias), id(net[3].bias), id(net[5].bias)}
    assert ids(norm) == {id(net[1].weight), id(net[3].weight)}
    assert len(bias) + len(decay) + len(norm) == len(list(net.parameters()))


def test_frozen_params_left_out():
    net = _net()
    net[0].weight.requires_grad_(False)
    assert id(net[0].weight) not in {id(p) for g in optim.param_groups(net) for p in g}


def test_sgd_groups_and_decay():
    opt, name, lr, mom = optim.build_optimizer(_net(), "SGD", lr=0.02, momentum=0.9, decay=1e-3)
    assert isinstance(opt, torch.optim.SGD) and name == "SGD" and (lr, mom) == (0.02, 0.9)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 1e-3, 0.0]
    assert all(g["nesterov"] and g["lr"] == 0.02 and g["momentum"] == 0.9 for g in opt.param_groups)


def test_adamw_betas():
    opt, *_ = optim.build_optimizer(_net(), "AdamW", lr=1e-3, momentum=0.937, decay=5e-4)
    assert isinstance(opt, torch.optim.AdamW)
    assert all(g["betas"] == (0.937, 0.999) for g in opt.param_groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 5e-4, 0.0]


def test_unknown_optimizer():
    with pytest.raises(ValueError, match="Lion.*choose one of"):
        optim.build_optimizer(_net(), "Lion")


@pytest.mark.parametrize("nc,lr", [(80, 0.000119), (5, 0.001111), (1, 0.002)])
def test_auto_rule(nc, lr):
    assert optim.auto_optimizer(10_000, nc) == ("AdamW", lr, 0.9)
    assert optim.auto_optimizer(10_001, nc) == ("SGD", 0.01, 0.9)
    opt, name, got_lr, _ = optim.build_optimizer(_net(), "auto", iterations=500, nc=nc)
    assert isinstance(opt, torch.optim.AdamW) and got_lr == lr == opt.param_groups[0]["lr"]
    opt, name, got_lr, mom = optim.build_optimizer(_net(), "auto", iterations=50_000, nc=nc)
    assert isinstance(opt, torch.optim.SGD) and (got_lr, mom) == (0.01, 0.9)


def test_accumulate_and_weight_decay_scaling():
    assert [optim.accumulate_steps(64, b) for b in (1, 16, 24, 48, 64, 128)] == [64, 4, 3, 1, 1, 1]
    assert optim.scaled_weight_decay(5e-4, 16, 4, 64) == pytest.approx(5e-4)
    assert optim.scaled_weight_decay(5e-4, 48, 1, 64) == pytest.approx(5e-4 * 0.75)
    assert optim.scaled_weight_decay(5e-4, 128, 1, 64) == pytest.approx(1e-3)


def test_schedules():
    lin = optim.lr_lambda(100, 0.01)
    assert lin(0) == 1.0 and lin(100) == pytest.approx(0.01) and lin(50) == pytest.approx(0.505)
    cos = optim.lr_lambda(100, 0.01, cos_lr=True)
    assert cos(0) == 1.0 and cos(100) == pytest.approx(0.01) and cos(50) == pytest.approx(0.505)
    assert cos(25) == pytest.approx(1 - (1 - math.cos(math.pi / 4)) / 2 * 0.99)


def test_warmup_iters():
    assert optim.warmup_iters(3.0, 100, 63) == 189
    assert optim.warmup_iters(3.0, 2, 10) == 10  # capped at epochs - 1
    assert optim.warmup_iters(3.0, 1, 10) == 0
    assert optim.warmup_iters(0.5, 10, 7) == 4  # round(3.5) = 4 (banker's rounding)


def test_warmup_values():
    kw = dict(lr_targets=[0.01, 0.01, 0.01], bias_lr0=0.1, momentum0=0.8, momentum=0.937, nbs=64, batch=16)
    lrs, mom, acc = optim.warmup_values(0, 100, **kw)
    assert lrs == [0.1, 0.0, 0.0] and mom == 0.8 and acc == 1
    lrs, mom, acc = optim.warmup_values(25, 100, **kw)
    assert lrs == pytest.approx([0.1 - 0.09 * 0.25, 0.0025, 0.0025]) and mom == pytest.approx(0.83425)
    assert acc == 2  # 1 + 3 * 0.25 = 1.75 -> 2
    lrs, mom, acc = optim.warmup_values(100, 100, **kw)
    assert lrs == pytest.approx([0.01] * 3) and mom == pytest.approx(0.937) and acc == 4
