"""Knowledge distillation (yolofast/engine/distill.py): the loss by hand, where gradients go, the frozen
teacher, the trainer's distill_model= path (results.csv, checkpoints, resume), torch.compile and the
CUDA-graph step on the CPU emulator."""

from __future__ import annotations

import copy
import csv
from pathlib import Path

import pytest
import torch
from torch import nn

from yolofast import Trainer
from yolofast.cfg import CfgError
from yolofast.data import make_shapes
from yolofast.engine.checkpoint import load_checkpoint
from yolofast.engine.compile import train_step_modules
from yolofast.engine.distill import DistillLoss, DistillStep, Projector, distill_loss, load_teacher
from yolofast.engine.trainer import RESULTS_COLUMNS
from yolofast.loss import DetectionLoss
from yolofast.nn import YOLOV8, build_model

# Student: yolov8 layout at 1/8 width (8..32 channels); teacher: 1/4 width (16..64), a larger "scale".
TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
TEACHER = {**copy.deepcopy(TINY), "width_multiple": 0.25}
FAST = dict(model=TINY, imgsz=64, batch=4, workers=0, verbose=False, plots=False)
RECT3 = Path(__file__).resolve().parents[3] / "shared" / "data" / "ultralytics"  # beside the checkout


@pytest.fixture(autouse=True)
def _clean_state():
    yield
    torch.use_deterministic_algorithms(False)
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """8 train + 4 val synthetic images of 64 px (2 batches of 4 per epoch)."""
    return str(make_shapes(root=tmp_path_factory.mktemp("shapes"), n_train=8, n_val=4, imgsz=64))


@pytest.fixture(scope="module")
def teacher_pt(shapes, tmp_path_factory):
    """A wider teacher trained for one epoch on the same data: its best.pt (yolofast format)."""
    root = tmp_path_factory.mktemp("teacher")
    Trainer(data=shapes, epochs=1, project=root, name="t", **{**FAST, "model": TEACHER}).train()
    torch.use_deterministic_algorithms(False)
    return str(root / "t" / "weights" / "best.pt")


def test_loss_by_hand():
    """One level, B=1, C=2, two cells: w = sigmoid(max logit) = (sigmoid(2), sigmoid(0)),
    squared distances per cell (1^2 + 2^2, 3^2 + 0^2) = (5, 9): loss = (5 w0 + 9 w1) / ((w0 + w1) * 2)."""
    s = torch.tensor([[[[1.0, 3.0]], [[2.0, -1.0]]]])  # (1, 2, 1, 2)
    t = torch.tensor([[[[0.0, 0.0]], [[0.0, -1.0]]]])
    logits = torch.tensor([[[[2.0, -5.0]], [[1.0, 0.0]]]])  # cell 0: max 2.0, cell 1: max 0.0
    w0, w1 = 1 / (1 + torch.exp(torch.tensor(-2.0))), torch.tensor(0.5)
    want = (5 * w0 + 9 * w1) / ((w0 + w1) * 2)
    torch.testing.assert_close(distill_loss([s], [t], [logits]), want)
    # levels add up; a level is invariant to a common scale of its weights only through sigmoid: doubled
    torch.testing.assert_close(distill_loss([s, s], [t, t], [logits, logits]), 2 * want)


def test_loss_weights_come_from_the_teacher_confidence():
    """A cell where the teacher sees nothing (logits -20) barely counts; a confident one dominates."""
    s = torch.zeros(1, 4, 1, 2)
    t = torch.stack([torch.ones(4), torch.zeros(4)], -1).view(1, 4, 1, 2)  # error only in cell 0
    sure = torch.tensor([[[[20.0, -20.0]]]])
    unsure = torch.tensor([[[[-20.0, 20.0]]]])
    assert distill_loss([s], [t], [sure]).item() == pytest.approx(1.0, rel=1e-6)  # 4 / (1 * 4)
    assert distill_loss([s], [t], [unsure]).item() < 1e-8


def test_zero_when_student_is_teacher_with_identity_projector():
    torch.manual_seed(0)
    student = build_model(TINY, nc=3).eval()  # eval: the teacher's BN uses running stats, so must this one
    step = DistillStep(student, copy.deepcopy(student))
    step.projector = nn.ModuleList(nn.Identity() for _ in range(3))
    out = step.eval()(torch.rand(2, 3, 64, 64))
    assert len(out) == 4 and out[-1].item() == 0.0
    # and not zero with the trainable projector (random init) or another teacher
    step2 = DistillStep(student, build_model(TINY, nc=3))
    assert step2.eval()(torch.rand(2, 3, 64, 64))[-1].item() > 0


def test_projector_maps_student_to_teacher_channels():
    student, teacher = build_model(TINY, nc=3), build_model(TEACHER, nc=3)
    step = DistillStep(student, teacher)
    for p, s_in, t_in in zip(step.projector, student.head.cv2, teacher.head.cv2):
        assert isinstance(p, Projector)
        assert p[0].in_channels == s_in[0].conv.in_channels and p[-1].out_channels == t_in[0].conv.in_channels
        assert isinstance(p[1], nn.ReLU) and p[0].kernel_size == p[2].kernel_size == (1, 1)


def _batch(B=2, nc=3, M=16, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    img = torch.rand(B, 3, 64, 64, generator=g)
    xy, wh = torch.rand(B, M, 2, generator=g) * 0.5 + 0.25, torch.rand(B, M, 2, generator=g) * 0.3 + 0.1
    mask = (torch.arange(M)[None, :, None] < n).float().expand(B, M, 1).contiguous()
    return img, {"gt_cls": torch.randint(0, nc, (B, M, 1), generator=g).float(),
                 "gt_bboxes": torch.cat([xy, wh], -1), "gt_mask": mask}


def test_gradients_reach_student_and_projector_never_teacher():
    torch.manual_seed(0)
    step = DistillStep(build_model(TINY, nc=3), build_model(TEACHER, nc=3)).train()
    assert not step.teacher.training  # train() keeps the teacher in eval mode
    loss_fn = DistillLoss(DetectionLoss(3), dis=6.0)
    before = copy.deepcopy(step.teacher.state_dict())
    opt = torch.optim.SGD([p for p in step.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    img, batch = _batch()
    for i in range(3):
        out = step(img)
        total, items = loss_fn([f.float() for f in out], batch)
        if i == 0:  # the dis term's own gradient: projector and the student's neck, not its head
            out[-1].backward(retain_graph=True)
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in step.projector.parameters())
            assert step.student.model[15].cv2.conv.weight.grad.abs().sum() > 0  # P3 neck C2f
            assert all(p.grad is None for p in step.student.head.parameters())
            opt.zero_grad(set_to_none=True)
        total.backward()
        assert all(p.grad is None for p in step.teacher.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert items.shape == (4,) and items[3] > 0
    for k, v in step.teacher.state_dict().items():  # weights and BN statistics untouched
        assert torch.equal(v, before[k]), k


def test_distill_loss_total_is_detection_plus_dis_times_batch():
    torch.manual_seed(0)
    step = DistillStep(build_model(TINY, nc=3), build_model(TEACHER, nc=3)).train()
    crit = DetectionLoss(3)
    img, batch = _batch(B=3)
    out = [f.float() for f in step(img)]
    total, items = DistillLoss(crit, dis=2.5)(out, batch)
    base_total, base_items = crit(out[:3], batch)
    torch.testing.assert_close(total, base_total + 2.5 * out[3] * 3)
    torch.testing.assert_close(items, torch.cat([base_items, (2.5 * out[3]).reshape(1)]).detach())


def test_teacher_must_have_the_students_classes(teacher_pt):
    student = build_model(TINY, nc=5)
    names = {i: n for i, n in enumerate(["circle", "square", "triangle", "star", "ellipse"])}
    load_teacher(teacher_pt, student, names, "cpu")  # the data's own classes: fine
    with pytest.raises(CfgError, match="the student's classes"):
        load_teacher(teacher_pt, build_model(TINY, nc=4), {i: f"c{i}" for i in range(4)}, "cpu")
    with pytest.raises(CfgError, match="the student's classes"):  # same count, other names
        load_teacher(teacher_pt, student, {i: f"c{i}" for i in range(5)}, "cpu")
    with pytest.raises(CfgError, match="file not found"):
        load_teacher("/nonexistent/teacher.pt", student, names, "cpu")


@pytest.mark.skipif(not (RECT3 / "yolov8n-rect3.pt").is_file(), reason="Ultralytics' files not present")
def test_ultralytics_teacher(shapes):
    """An Ultralytics 8.4 best.pt (fp16 pickled modules, read without importing Ultralytics) teaches."""
    student = build_model(TINY, nc=3)
    teacher = load_teacher(RECT3 / "yolov8n-rect3.pt", student, {0: "red", 1: "green", 2: "blue"}, "cpu")
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    out = DistillStep(student, teacher).train()(torch.rand(2, 3, 64, 64))
    assert len(out) == 4 and torch.isfinite(out[-1]) and out[-1] > 0
    with pytest.raises(CfgError, match="the student's classes"):  # through the trainer, before training
        Trainer(data=shapes, epochs=1, distill_model=str(RECT3 / "yolov8n-rect3.pt"), **FAST).train()


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_trainer_with_teacher(shapes, teacher_pt, tmp_path):
    t = Trainer(data=shapes, epochs=2, project=tmp_path, name="d", distill_model=teacher_pt, dis=6.0, **FAST)
    t.train()
    assert t.loss_names == ["box_loss", "cls_loss", "dfl_loss", "dis_loss"] and t.tloss.shape == (4,)
    assert t.tloss[3] > 0
    rows = _rows(tmp_path / "d" / "results.csv")
    cols = list(rows[0])
    n = list(RESULTS_COLUMNS).index("lr/pg2") + 1
    assert cols == [*RESULTS_COLUMNS[:n], "train/dis_loss", *RESULTS_COLUMNS[n:]]
    assert all(float(r["train/dis_loss"]) > 0 for r in rows)
    # the projectors are trained by the optimizer (in its groups) and kept for resume in last.pt, outside
    # the model/EMA weights that val/predict/export read
    ids = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    assert all(id(p) in ids for p in t.step_model.projector.parameters())
    last, best = (load_checkpoint(tmp_path / "d" / "weights" / f) for f in ("last.pt", "best.pt"))
    student_keys = set(build_model(TINY, nc=5).state_dict())
    for ck in (last, best):
        assert set(ck["model"].state_dict()) == set(ck["ema"].state_dict()) == student_keys
    assert set(last["distill"]) == set(t.step_model.projector.state_dict())
    for k, v in t.step_model.projector.state_dict().items():
        assert torch.equal(last["distill"][k], v)
    from yolofast import YOLO

    res = YOLO(str(tmp_path / "d" / "weights" / "best.pt")).predict(torch.rand(1, 3, 64, 64), imgsz=64)
    assert len(res) == 1
    # without a teacher: Ultralytics' columns exactly, three loss items
    plain = Trainer(data=shapes, epochs=1, project=tmp_path, name="p", **FAST)
    plain.train()
    assert list(_rows(tmp_path / "p" / "results.csv")[0]) == list(RESULTS_COLUMNS)
    assert plain.tloss.shape == (3,) and plain.step_model is plain.model


def test_resume_with_teacher_equals_uninterrupted(shapes, teacher_pt, tmp_path, resume_after_crash):
    recipe = dict(data=shapes, epochs=2, project=tmp_path, distill_model=teacher_pt, **FAST)
    Trainer(name="full", **recipe).train()
    r = resume_after_crash(recipe)
    assert isinstance(r.args.distill_model, str)
    r.train()
    a, b = (load_checkpoint(tmp_path / n / "weights" / "last.pt") for n in ("full", "cut"))
    assert a["updates"] == b["updates"]
    for part in ("model", "ema"):
        sa, sb = a[part].state_dict(), b[part].state_dict()
        for k in sa:
            torch.testing.assert_close(sb[k], sa[k], rtol=0, atol=1e-6, msg=f"{part} {k}")
    for k in a["distill"]:
        torch.testing.assert_close(b["distill"][k], a["distill"][k], rtol=0, atol=1e-6, msg=f"distill {k}")
    ra, rb = _rows(tmp_path / "full" / "results.csv"), _rows(tmp_path / "cut" / "results.csv")
    assert [float(x["train/dis_loss"]) for x in ra] == pytest.approx([float(x["train/dis_loss"]) for x in rb],
                                                                      rel=1e-5)


def test_nonfinite_restore_puts_the_projectors_back(shapes, teacher_pt, tmp_path):
    """Three non-finite losses in a row restore the start-of-epoch state: the projectors too, not only the
    student, EMA and optimizer (whose moments would otherwise meet diverged projector weights)."""
    # batch 2, nbs 2: 4 optimizer steps an epoch; epoch 2 is calls 4..7, call 4 steps, 5-7 are NaN.
    t = Trainer(data=shapes, epochs=2, project=tmp_path, name="nan", distill_model=teacher_pt,
                **{**FAST, "batch": 2, "nbs": 2, "val": False, "mosaic": 0.0, "warmup_epochs": 0.0})
    calls, seen = {"n": 0}, {}

    def poison(tr):
        crit = tr.train_loss

        def loss(feats, batch):
            total, items = crit(feats, batch)
            calls["n"] += 1
            return (total * float("nan") if calls["n"] - 1 in (5, 6, 7) else total), items

        tr.train_loss = loss

    def at_epoch_start(tr):
        if tr.epoch == 1:
            seen["proj"] = {k: v.clone() for k, v in tr.step_model.projector.state_dict().items()}

    def after_step(tr):
        if tr.epoch == 1:  # the one good step of epoch 2 moved the projectors: the restore has work to do
            now = tr.step_model.projector.state_dict()
            seen["moved"] = any(not torch.equal(now[k], v) for k, v in seen["proj"].items())

    t.add_callback("on_pretrain_routine_end", poison)
    t.add_callback("on_train_epoch_start", at_epoch_start)
    t.add_callback("optimizer_step", after_step)
    with pytest.warns(UserWarning, match="restored model, EMA, optimizer and scaler"):
        t.train()
    assert t.nonfinite.restores == 1 and seen["moved"]
    for k, v in t.step_model.projector.state_dict().items():
        torch.testing.assert_close(v, seen["proj"][k], rtol=0, atol=0, msg=k)


def test_compiled_distill_step_fullgraph_equals_eager():
    """torch.compile (fullgraph, aot_eager: the graphs inductor gets) of the step with the teacher's
    forward inside: no graph break, the eager loss, items and gradients."""
    torch.manual_seed(0)
    step = DistillStep(build_model(TINY, nc=3), build_model(TEACHER, nc=3)).train()
    loss_fn = DistillLoss(DetectionLoss(3))
    img, batch = _batch()

    def run(model, fn):
        step.zero_grad(set_to_none=True)
        total, items = fn([f.float() for f in model(img)], batch)
        total.backward()
        return total.detach(), items, [p.grad.clone() for p in step.parameters() if p.grad is not None]

    ref = run(step, loss_fn)
    cmodel, closs = train_step_modules(step, loss_fn, torch.device("cpu"), compile="aot_eager")
    got = run(cmodel, closs)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    assert len(got[2]) == len(ref[2]) == sum(p.requires_grad for p in step.parameters())
    for x, y in zip(got[2], ref[2]):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_trainer_graph_run_with_teacher_equals_eager_emulated(tmp_path, emulated_graphs, shapes, teacher_pt):
    """The CUDA-graph step with the teacher's forward inside the captured step (CPU emulator): the graphed
    run's losses (dis_loss included), EMA and projectors equal the eager run's, and it really replayed."""
    data = make_shapes(root=tmp_path, n_train=16, n_val=4, imgsz=64)
    out = []
    for graph in (False, True):
        t = Trainer(model=TINY, data=data, imgsz=64, batch=4, nbs=4, epochs=2, workers=0, verbose=False,
                    plots=False, val=False, lr0=0.002, warmup_epochs=0.5, device="cpu", optimizer="SGD",
                    cuda_graph=graph, project=tmp_path, name=f"g{int(graph)}", distill_model=teacher_pt)
        losses = []
        t.add_callback("on_train_epoch_end", lambda tr, losses=losses: losses.append(tr.tloss.clone()))
        t.train()
        if graph:
            assert t.graph is not None and t.graph.off is None and t.graph.replays == 5
        ema = [v.flatten() for v in t.ema.ema.state_dict().values() if v.is_floating_point()]
        proj = [v.flatten() for v in t.step_model.projector.state_dict().values()]
        out.append((torch.stack(losses), torch.cat(ema), torch.cat(proj)))
    assert out[0][0].shape == (2, 4)
    for a, b in zip(out[1], out[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bench_train_step_distill_variants(emulated_graphs):
    """benchmarks/bench_train_step.py's "_dis" variants run the step with a yolov8s teacher: eager and
    captured in a (CPU-emulated) CUDA graph, whose replays move the weights."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train_step.py"
    spec = importlib.util.spec_from_file_location("yolofast_bench_train_step", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    eager = mod.make_step("bf16_cl_dis", imgsz=64, batch=2, nc=3, device=torch.device("cpu"))
    assert torch.isfinite(eager())
    step = mod.make_step("graph_bf16_cl_dis", imgsz=64, batch=2, nc=3, device=torch.device("cpu"))
    losses = [float(step()) for _ in range(3)]
    assert step.graphed.graph.replays == 3 and losses[0] != losses[2]
    with pytest.raises(ValueError, match="unknown variant"):
        mod.make_step("bf17_dis", imgsz=64, batch=2, nc=3, device=torch.device("cpu"))


def test_distill_experiment_script_pairs_seeds_and_sets_the_clip(shapes, teacher_pt, tmp_path):
    """benchmarks/distill_experiment.py: a student without and one with the teacher per seed, the clip
    applied to both arms (Trainer.max_norm: a tiny clip shrinks every step, a huge one none), and a finished
    run is read back instead of trained again."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "distill_experiment.py"
    spec = importlib.util.spec_from_file_location("yolofast_distill_experiment", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    recipe = {**FAST, "data": shapes, "epochs": 1, "mosaic": 0.0}
    for max_norm, frac in ((1e-3, 1.0), (1e9, 0.0)):
        res = mod.run(teacher_pt, seeds=(0,), max_norm=max_norm, project=tmp_path, overrides=recipe)
        assert [r["arm"] for r in res] == ["without a teacher", "dis=6"]
        assert [r["clip_frac"] for r in res] == [frac, frac]
        assert res[0]["dis_loss"] != res[0]["dis_loss"] and res[1]["dis_loss"] > 0  # NaN: no column
    csv_file = tmp_path / "dis6_clip1e+09_s0" / "results.csv"
    before = csv_file.stat().st_mtime_ns
    again = mod.run(teacher_pt, seeds=(0,), max_norm=1e9, project=tmp_path, overrides=recipe)
    assert [(r["map"], r["grad_norm"]) for r in again] == [(r["map"], r["grad_norm"]) for r in res]
    assert csv_file.stat().st_mtime_ns == before
    assert "| gain (paired by seed) |" in mod.table(res)


def test_clip_check_compares_adam_displacements(shapes, teacher_pt):
    """benchmarks/distill_grad_ratio.py --clip-steps: three runs from one start on the same batches; the
    reference compared with itself is exact, and dropping the teacher changes the displacement more than
    dropping the clip does (here after 3 steps of a yolov8n at 64 px)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "distill_grad_ratio.py"
    spec = importlib.util.spec_from_file_location("yolofast_distill_grad_ratio", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.clip_check(str(Path(shapes)), teacher_pt, imgsz=64, steps=3)
    assert out["distilled, clip 10"]["cos"] == pytest.approx(1.0)
    assert out["distilled, clip 10"]["grad_norm"] > 10  # every step clipped, as in the real runs
    assert out["no teacher, clip 10"]["cos"] < out["distilled, no clip"]["cos"]


def _ddp_worker(rank, world, port, out, teacher_state):
    import os

    from yolofast.engine.distributed import destroy_distributed, init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), YOLOFAST_DDP_TIMEOUT="60")
    dev = init_distributed(torch.device("cpu"))
    torch.set_num_threads(1)  # as the one-process reference: a conv's backward sums in a per-thread order
    step = _ddp_step(teacher_state)
    if rank == 1:  # DDP must broadcast rank 0's student and projectors at wrap time
        with torch.no_grad():
            for p in step.parameters():
                if p.requires_grad:
                    p.add_(1.0)
    img, batch = _batch(B=4)
    grads = _ddp_grads(step, img.chunk(world)[rank], {k: v.chunk(world)[rank] for k, v in batch.items()},
                       dev, world)
    torch.save(grads, f"{out}/rank{rank}.pt")
    destroy_distributed()


def _ddp_step(teacher_state):
    torch.manual_seed(0)
    teacher = build_model(TEACHER, nc=3)
    teacher.load_state_dict(teacher_state)
    return DistillStep(build_model(TINY, nc=3), teacher).train()


def _ddp_grads(step, img, batch, dev, world):
    model, loss_fn = train_step_modules(step, DistillLoss(DetectionLoss(3)), dev, world_size=world)
    loss, _ = loss_fn([f.float() for f in model(img)], batch)
    loss.backward()
    return [p.grad.clone() for p in step.parameters() if p.requires_grad]


def test_ddp_all_reduces_student_and_projector_gradients(tmp_path):
    """2 gloo ranks, each half the batch: every trainable gradient (student and projectors) is identical on
    both ranks and equals the sum of the two halves' gradients in one process (BN statistics per half, as
    per rank); the teacher is not part of the all-reduce (no gradient)."""
    import socket

    import torch.multiprocessing as mp

    teacher_state = build_model(TEACHER, nc=3).state_dict()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, str(tmp_path), teacher_state), nprocs=2, join=True)
    img, batch = _batch(B=4)
    # One thread, as in the ranks: with the default threads on a 2-core machine the conv backward sums in
    # another order here than in the ranks, and 3 of 216 elements differed by up to 4e-4 relative.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        halves = [_ddp_grads(_ddp_step(teacher_state), img.chunk(2)[r],
                             {k: v.chunk(2)[r] for k, v in batch.items()}, torch.device("cpu"), 1)
                  for r in (0, 1)]
    finally:
        torch.set_num_threads(threads)
    ref = [a + b for a, b in zip(*halves)]
    g0, g1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    n_proj = sum(1 for _ in _ddp_step(teacher_state).projector.parameters())
    assert len(g0) == len(ref) and n_proj > 0
    for a, b, want in zip(g0, g1, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, want, rtol=1e-4, atol=1e-6)
    assert all(g.abs().sum() > 0 for g in g0[-n_proj:])  # the projectors' (registered last) got gradients


def test_torchrun_epoch_with_teacher(tmp_path, teacher_pt):
    """`torchrun ... yolofast train distill_model=...`: 2 CPU ranks train one epoch with the teacher; rank 0
    writes results.csv with train/dis_loss and a last.pt holding the projectors."""
    import os
    import subprocess
    import sys

    import yaml

    model_yaml = tmp_path / "tiny.yaml"
    model_yaml.write_text(yaml.safe_dump(TINY))
    data = make_shapes(root=tmp_path / "data", n_train=8, n_val=4, imgsz=64)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "yolofast", "train", f"model={model_yaml}", f"data={data}", "epochs=1", "imgsz=64", "batch=4",
           "workers=0", f"project={tmp_path / 'runs'}", "name=run", "plots=False", "device=cpu",
           f"distill_model={teacher_pt}"]
    env = {**os.environ, "YOLOFAST_DDP_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = _rows(tmp_path / "runs" / "run" / "results.csv")
    assert len(rows) == 1 and float(rows[0]["train/dis_loss"]) > 0
    assert "distill" in load_checkpoint(tmp_path / "runs" / "run" / "weights" / "last.pt")
