"""DDP on CPU with 2 gloo processes (DESIGN §4/§6): the averaged gradients equal the single-process
full-batch ones for a BatchNorm-free model, and a torchrun'd epoch completes with only rank 0 writing.
Also ``unwrap_model``: what it sees through (DDP/DataParallel, torch.compile, a distillation step)."""

from __future__ import annotations

import copy
import importlib.util
import os
import socket
import subprocess
import sys

import torch
import torch.multiprocessing as mp
import yaml
from torch import nn

from yolofast.data import make_shapes
from yolofast.engine.compile import train_step_modules
from yolofast.engine.distributed import destroy_distributed, init_distributed, is_distributed, unwrap_model
from yolofast.loss import DetectionLoss
from yolofast.nn import YOLOV8

NC, IMG, B = 3, 64, 4
_TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
             "yolofast"]


def tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


class _Toy(nn.Module):
    """No BatchNorm: one strided conv per level (8, 16, 32) -> (B, 64 + nc, H/s, W/s) maps."""

    def __init__(self):
        super().__init__()
        self.levels = nn.ModuleList(nn.Conv2d(3, 64 + NC, s, stride=s) for s in (8, 16, 32))

    def forward(self, x):
        return [m(x) for m in self.levels]


def _sum_loss(feats, batch):
    """A loss that is a sum over images (like DetectionLoss's ×B with a shared S)."""
    per_image = sum((f.float() ** 2).mean((1, 2, 3)) for f in feats)
    return per_image.sum(), per_image.detach()[:3]


def _inputs():
    g = torch.Generator().manual_seed(0)
    img = torch.rand(B, 3, IMG, IMG, generator=g)
    n = 3  # GT per image, normalized xywh well inside the image
    xy = torch.rand(B, n, 2, generator=g) * 0.5 + 0.25
    wh = torch.rand(B, n, 2, generator=g) * 0.3 + 0.1
    batch = {"gt_cls": torch.randint(0, NC, (B, 16, 1), generator=g).float(),
             "gt_bboxes": torch.zeros(B, 16, 4), "gt_mask": torch.zeros(B, 16, 1)}
    batch["gt_bboxes"][:, :n] = torch.cat([xy, wh], -1)
    batch["gt_mask"][:, :n] = 1
    return img, batch


def _half(x, rank, world):
    return x.chunk(world)[rank] if torch.is_tensor(x) else x


def _grads(model, criterion, img, batch, device, world, compile=False):
    # aot_eager: Dynamo + AOTAutograd (what torch.compile does under DDP: graphs split at bucket boundaries)
    # without inductor's minutes of C++ codegen on 2 cores.
    train_model, train_loss = train_step_modules(model, criterion, device, compile=compile, world_size=world,
                                                 backend="aot_eager" if compile else None)
    loss, _ = train_loss(train_model(img), batch)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), YOLOFAST_DDP_TIMEOUT="60")
    dev = init_distributed(torch.device("cpu"))
    assert is_distributed()
    img, batch = _inputs()
    res = {}
    for name, crit in (("sum", _sum_loss), ("det", DetectionLoss(NC, strides=(8, 16, 32))),
                       ("det_compiled", DetectionLoss(NC, strides=(8, 16, 32)))):
        torch.manual_seed(0)
        model = _Toy()
        if rank == 1:  # DDP must broadcast rank 0's weights at wrap time
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        part = {k: _half(v, rank, world) for k, v in batch.items()}
        res[name] = _grads(model, crit, _half(img, rank, world), part, dev, world,
                           compile=name.endswith("compiled"))
    from torch._dynamo.utils import counters

    res["graphs"] = counters["stats"]["unique_graphs"]  # det_compiled really went through Dynamo
    torch.save(res, f"{out}/rank{rank}.pt")
    destroy_distributed()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _DistillLike(nn.Module):
    """What unwrap_model knows of engine/distill.py's DistillStep: a ``student`` submodule beside others."""

    def __init__(self, student):
        super().__init__()
        self.student = student
        self.projector = nn.Conv2d(3, 3, 1)


def test_unwrap_model_plain_and_wrapped():
    model = _Toy()
    assert unwrap_model(model) is model
    assert unwrap_model(nn.DataParallel(model)) is model
    assert unwrap_model(torch.compile(model)) is model  # an OptimizedModule: nothing compiles before a call
    assert unwrap_model(nn.DataParallel(torch.compile(model))) is model
    assert unwrap_model(torch.compile(nn.DataParallel(model))) is model
    assert unwrap_model(model, student=True) is model
    assert unwrap_model(nn.DataParallel(torch.compile(model)), student=True) is model


def test_unwrap_model_student_only_when_asked():
    """Checkpoints and the non-finite restore keep a distillation step whole; the EMA follows its student."""
    model = _Toy()
    step = _DistillLike(model)
    assert unwrap_model(step) is step
    assert unwrap_model(nn.DataParallel(torch.compile(step))) is step
    assert unwrap_model(step, student=True) is model
    assert unwrap_model(nn.DataParallel(torch.compile(step)), student=True) is model
    assert unwrap_model(torch.compile(_DistillLike(nn.DataParallel(model))), student=True) is model


def test_unwrap_model_ignores_a_student_that_is_no_module():
    model = _Toy()
    model.student = "not a module"  # a plain attribute: nn.Module keeps it outside _modules
    assert unwrap_model(model, student=True) is model
    assert unwrap_model(torch.compile(model), student=True) is model


def test_ddp_gradients_equal_full_batch(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    img, batch = _inputs()
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    ref = {"sum": _grads(_Toy(), _sum_loss, img, batch, cpu, 1)}  # single process, full batch
    # DetectionLoss divides by S = max(sum of target scores, 1) of the images it sees, so under DDP it is
    # exact w.r.t. the sum of the per-half gradients (each half's loss x its own batch), not the full batch.
    halves = []
    for r in (0, 1):
        torch.manual_seed(0)
        part = {k: _half(v, r, 2) for k, v in batch.items()}
        halves.append(_grads(_Toy(), DetectionLoss(NC, strides=(8, 16, 32)), _half(img, r, 2), part, cpu, 1))
    ref["det"] = ref["det_compiled"] = [a + b for a, b in zip(*halves)]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["graphs"] >= 2 and r1["graphs"] >= 2  # the model's graph(s) and the loss's
    for name in ("sum", "det", "det_compiled"):  # det_compiled: torch.compile of model + loss under DDP
        for g_ref, g0, g1 in zip(ref[name], r0[name], r1[name]):
            assert g_ref.abs().max() > 0
            torch.testing.assert_close(g0, g1, rtol=0, atol=0)  # all-reduced: identical on every rank
            torch.testing.assert_close(g0, g_ref, rtol=1e-5, atol=1e-6)


def test_torchrun_one_epoch_rank0_writes(tmp_path):
    tiny = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
    tiny.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
    model_yaml = tmp_path / "tiny.yaml"
    model_yaml.write_text(yaml.safe_dump(tiny))
    data = make_shapes(root=tmp_path / "data", n_train=8, n_val=4, imgsz=64)
    project = tmp_path / "runs"
    cmd = [*_TORCHRUN, "train", f"model={model_yaml}", f"data={data}", "epochs=1", "imgsz=64", "batch=4",
           "workers=0", f"project={project}", "name=run", "plots=False", "device=cpu"]
    env = {**os.environ, "YOLOFAST_DDP_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(x.name for x in project.iterdir()) == ["run"]  # rank 1 made no run folder of its own
    files = sorted(str(f.relative_to(project / "run")) for f in (project / "run").rglob("*") if f.is_file())
    events = [f for f in files if f.startswith("events.out.tfevents.")]
    assert len(events) == (1 if tensorboard_installed() else 0), files  # TensorBoard: rank 0's alone
    want = [".torchrun_run_id", "args.yaml", "results.csv", "weights/best.pt", "weights/last.pt"]
    assert [f for f in files if f not in events] == want, files  # .torchrun_run_id: a torchrun restart's clue
    rows = (project / "run" / "results.csv").read_text().strip().splitlines()
    assert len(rows) == 2  # header + one epoch, written once (by rank 0)


def test_torchrun_failed_rank_ends_with_error(tmp_path):
    """A rank that raises before training ends the whole run with a non-zero exit, not a hang."""
    cmd = [*_TORCHRUN, "train", "data=does_not_exist.yaml", f"project={tmp_path}"]
    p = subprocess.run(cmd, env={**os.environ, "YOLOFAST_DDP_TIMEOUT": "30"}, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0
    assert "does_not_exist.yaml" in p.stdout + p.stderr


class _TwoBranch(nn.Module):
    """A YOLO26-like head: a one-to-many branch and a one-to-one branch on detached features; ``end2end``
    says which it is, as the real model does."""

    def __init__(self, end2end: bool):
        super().__init__()
        self.end2end = end2end
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.one2many = nn.Conv2d(4, 2, 1)
        self.one2one = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        f = self.stem(x)
        return {"one2many": self.one2many(f), "one2one": self.one2one(f.detach())}


def _branch_loss(out, one2one: bool):
    """The one-to-one term only when ``one2one``: a step that leaves that branch without a gradient."""
    loss = out["one2many"].square().mean()
    return loss + out["one2one"].square().mean() if one2one else loss


def _branch_input(rank):
    return torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(rank))


def _unused_branch_worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), YOLOFAST_DDP_TIMEOUT="60")
    from yolofast.engine.distributed import wrap_ddp

    dev = init_distributed(torch.device("cpu"))
    x, res = _branch_input(rank), {}
    torch.manual_seed(0)
    model = _TwoBranch(end2end=True)
    ddp = wrap_ddp(model, dev)
    res["find_unused"] = ddp.find_unused_parameters
    for step in range(3):  # step 0: rank 1's loss leaves the one-to-one branch out, rank 0's does not
        _branch_loss(ddp(x), one2one=not (rank == 1 and step == 0)).backward()
        res[step] = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    # Without find_unused (a v8-style model): both ranks leave the branch out of step 0, so DDP fails the
    # same way on both (when only one rank does, the other waits in the all-reduce: the hang).
    torch.manual_seed(0)
    plain = wrap_ddp(_TwoBranch(end2end=False), dev)
    res["plain_error"] = None
    try:
        for step in range(2):
            _branch_loss(plain(x), one2one=step > 0).backward()
    except RuntimeError as e:
        res["plain_error"] = str(e)
    torch.save(res, f"{out}/rank{rank}.pt")
    destroy_distributed()


def test_branches_may_go_unused_sees_the_student():
    from yolofast.engine.distributed import branches_may_go_unused

    assert branches_may_go_unused(_TwoBranch(True)) and not branches_may_go_unused(_TwoBranch(False))
    assert branches_may_go_unused(_DistillLike(_TwoBranch(True)))  # distillation: the student's head
    assert not branches_may_go_unused(_Toy())


def test_ddp_head_branch_without_gradient_on_one_rank(tmp_path):
    """An end2end model's one-to-one branch gets no gradient on rank 1's first step: DDP goes on (no hang,
    no error at the next step) and the averaged gradients count rank 1's as 0; a model wrapped without
    find_unused fails on such a step, so the case is real."""
    mp.spawn(_unused_branch_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["find_unused"] and r1["find_unused"]
    for step in range(3):  # single-process gradients of each rank's half, averaged as DDP does
        local = []
        for r in (0, 1):
            torch.manual_seed(0)
            m = _TwoBranch(end2end=True)
            _branch_loss(m(_branch_input(r)), one2one=not (r == 1 and step == 0)).backward()
            local.append([p.grad if p.grad is not None else torch.zeros_like(p) for p in m.parameters()])
        for g_ref0, g_ref1, g0, g1 in zip(*local, r0[step], r1[step]):
            torch.testing.assert_close(g0, g1, rtol=0, atol=0)
            torch.testing.assert_close(g0, (g_ref0 + g_ref1) / 2, rtol=1e-5, atol=1e-7)
    for r in (r0, r1):
        assert r["plain_error"] is not None and "finished reduction" in r["plain_error"], r["plain_error"]
