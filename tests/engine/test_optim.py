"""Optimizer groups, the auto rule, accumulate/weight-decay scaling, schedules and warmup values."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from yolofast.engine import optim
from yolofast.nn import build_model
from yolofast.optim import MuSGD


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


@pytest.mark.parametrize("nc,lr", [(80, 0.000119), (5, 0.001111), (3, 0.001429), (1, 0.002)])
def test_auto_rule(nc, lr):
    """Ultralytics 8.4.190: MuSGD(0.01, 0.9) past 10k iterations, AdamW(round(0.01/(4+nc), 6)) up to it."""
    assert optim.auto_optimizer(10_000, nc) == ("AdamW", lr, 0.9)
    assert optim.auto_optimizer(10_001, nc) == ("MuSGD", 0.01, 0.9)
    opt, name, got_lr, _ = optim.build_optimizer(_net(), "auto", iterations=500, nc=nc)
    assert isinstance(opt, torch.optim.AdamW) and got_lr == lr == opt.param_groups[0]["lr"]
    assert all(g["betas"] == (0.9, 0.999) for g in opt.param_groups)
    opt, name, got_lr, mom = optim.build_optimizer(_net(), "auto", iterations=50_000, nc=nc)
    assert isinstance(opt, MuSGD) and name == "MuSGD" and (got_lr, mom) == (0.01, 0.9)
    assert (opt.muon, opt.sgd) == (0.2, 1.0) and all(g["momentum"] == 0.9 for g in opt.param_groups)


def _recipe(**kw):
    base = dict(optimizer="auto", lr0=0.01, momentum=0.937, weight_decay=5e-4, batch=16, nbs=64, epochs=100,
                warmup_bias_lr=0.1)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("n_images,name,lr", [(128, "AdamW", 0.000119), (118_287, "MuSGD", 0.01)])
def test_auto_rewrites_the_recipe(n_images, name, lr):
    """coco128 x 100 epochs = 200 iterations -> AdamW; COCO x 100 = 184,900 -> MuSGD. The recipe then says
    what ran (args.yaml, train_args: a resume rebuilds it), the bias warmup starts at 0 and the warmup
    ramps momentum to the recipe's 0.937, not the constructor's 0.9."""
    a = _recipe()
    opt, auto, mom, bias_lr = optim.recipe_optimizer(_net(), a, n_images, 4, nc=80, log=lambda m: None)
    assert auto == (name, lr, 0.9) and type(opt).__name__ == name
    assert (a.optimizer, a.lr0, a.warmup_bias_lr, a.momentum) == (name, lr, 0.0, 0.937)
    assert mom == 0.937 and bias_lr == 0.0
    # the rewritten recipe, as a resume reads it from train_args, builds the same optimizer
    opt2, auto2, mom2, bias_lr2 = optim.recipe_optimizer(_net(), a, n_images * 1000, 4, nc=80)
    assert auto2 is None and type(opt2).__name__ == name and (mom2, bias_lr2) == (0.937, 0.0)
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_explicit_musgd_keeps_the_recipe():
    a = _recipe(optimizer="musgd", lr0=0.02)  # names are case-insensitive, as in Ultralytics
    opt, auto, mom, bias_lr = optim.recipe_optimizer(_net(), a, 100, 4, nc=80)
    assert isinstance(opt, MuSGD) and auto is None and (mom, bias_lr) == (0.937, 0.1)
    assert a.optimizer == "musgd" and {g["momentum"] for g in opt.param_groups} == {0.937}
    assert {g["lr"] for g in opt.param_groups if g["params"]} == {0.02}  # no class branch in _net


def test_musgd_groups_yolo26n():
    """YOLO11_YOLO26.md §5.2: 8 groups in Ultralytics' order, x3 lr on cv3/one2one_cv3, every 2-D/4-D
    weight (depthwise and 1x1 head convs too) in Muon, decay only on the muon/weight groups."""
    model = build_model("yolo26n", nc=80)
    opt, *_ = optim.build_optimizer(model, "MuSGD", lr=0.01, momentum=0.937, decay=5e-4)
    got = [(g["param_group"], g["lr"], g["weight_decay"], g["use_muon"], len(g["params"]))
           for g in opt.param_groups]
    assert got == [("weight", 0.03, 5e-4, False, 0), ("weight", 0.01, 5e-4, False, 0),
                   ("bn", 0.03, 0.0, False, 24), ("bn", 0.01, 0.0, False, 90),
                   ("bias", 0.03, 0.0, False, 30), ("bias", 0.01, 0.0, False, 96),
                   ("muon", 0.03, 5e-4, True, 30), ("muon", 0.01, 5e-4, True, 96)]
    assert all(g["nesterov"] for g in opt.param_groups)
    muon = [p for g in opt.param_groups[6:] for p in g["params"]]
    assert all(p.ndim == 4 for p in muon) and sum(p.numel() for p in muon) == 2_552_208
    assert len({(p.shape[0], p[0].numel()) for p in muon}) == 41
    head = model.model[-1]
    boosted = {id(p) for m in (head.cv3, head.one2one_cv3) for p in m.parameters()}
    assert {id(p) for j in (0, 2, 4, 6) for p in opt.param_groups[j]["params"]} == boosted
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == sum(p.requires_grad for p in model.parameters())


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


def test_warmup_bias_groups_by_tag():
    """MuSGD's bias groups are pg4/pg5: the warmup finds them by their tag, not by position."""
    tags = ["weight", "weight", "bn", "bn", "bias", "bias", "muon", "muon"]
    lrs, _, _ = optim.warmup_values(0, 100, lr_targets=[0.03, 0.01] * 4, bias_lr0=0.1, momentum0=0.8,
                                    momentum=0.937, nbs=64, batch=16, tags=tags)
    assert lrs == [0.0, 0.0, 0.0, 0.0, 0.1, 0.1, 0.0, 0.0]
    lrs, _, _ = optim.warmup_values(100, 100, lr_targets=[0.03, 0.01] * 4, bias_lr0=0.1, momentum0=0.8,
                                    momentum=0.937, nbs=64, batch=16, tags=tags)
    assert lrs == pytest.approx([0.03, 0.01] * 4)
