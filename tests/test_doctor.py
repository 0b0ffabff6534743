"""yolofast doctor: a healthy recipe passes; each sabotage is caught by its finding's name."""

import copy
import json
import math

import pytest
import torch

from yolofast import Trainer
from yolofast.cli import main
from yolofast.data import make_shapes
from yolofast.doctor.trace import standard_branches
from yolofast.loss import DetectionLoss
from yolofast.nn import YOLOV8, build_model
from yolofast.ops import backend

# yolov8 at 1/8 width (~50k parameters): a doctor run at 64 px takes seconds.
TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
FAST = dict(model=TINY, imgsz=64, batch=4, workers=0, verbose=False, plots=False, amp=False)
STEPS = 60  # the healthy run: the test model needs ~60 steps to halve its loss (overfit.py)


@pytest.fixture(autouse=True)
def _restore_determinism():
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return str(make_shapes(root=tmp_path_factory.mktemp("shapes"), n_train=8, n_val=2, imgsz=64))


def _doctor(cls, shapes, tmp_path, steps=10, **kw):
    """A sabotaged recipe is caught in the trace or the gradients: 10 overfit steps are enough there."""
    recipe = {**FAST, **kw}
    return cls(data=shapes, project=tmp_path, name="doc", **recipe).doctor(steps=steps)


def test_healthy_recipe_passes_and_saves_the_report(shapes, tmp_path):
    r = _doctor(Trainer, shapes, tmp_path, steps=STEPS)
    assert r.ok, r.text()
    assert not r.findings, r.text()
    fit = r.section("overfit").data
    assert fit["passed"] and len(fit["losses"]) == STEPS
    assert min(fit["losses"][-5:]) <= 0.5 * max(fit["losses"][:12])
    d = tmp_path / "doc"
    data = json.loads((d / "doctor.json").read_text())
    assert data["ok"] is True and data["findings"] == []
    trace = data["sections"]["trace"]
    assert set(trace["items"]) == {"box", "cls", "dfl"}
    assert all(abs(v - 1) < 1e-4 for v in trace["ratio_to_standard"].values())
    assert sum(trace["assigner"]["positives_per_image"]) > 0
    assert [h["shape"][1:] for h in trace["head"]] == [[64 + 5, 8, 8], [69, 4, 4], [69, 2, 2]]
    grads = data["sections"]["gradients"]["branches"]
    assert set(grads) == {"box", "cls", "dfl"}  # no residual: the recipe's loss is the standard one
    assert (d / "doctor.txt").read_text().rstrip().endswith("(0 failing, 0 warnings)")
    assert (d / "overfit.png").stat().st_size > 1000


class _Mapped:
    """A loader whose batches pass through ``fn`` (a user's loader with a bug in it)."""

    def __init__(self, loader, fn):
        self.loader, self.fn, self.dataset = loader, fn, loader.dataset

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        return (self.fn(b) for b in self.loader)


class OffByNLabels(Trainer):
    """A loader whose class column is shifted past nc (1-based ids and a wrong names list, say)."""

    def get_dataloader(self, img_path, batch_size=16, mode="train"):
        nc = self.data["nc"]
        return _Mapped(super().get_dataloader(img_path, batch_size, mode),
                       lambda b: {**b, "cls": b["cls"] + nc, "gt_cls": b["gt_cls"] + nc})


class FirstImageOffCanvas(Trainer):
    """A loader that moves image 0's boxes one image width to the right (pixel/normalized mix-up)."""

    def get_dataloader(self, img_path, batch_size=16, mode="train"):
        def move(b):
            b = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in b.items()}
            b["bboxes"][b["batch_idx"] == 0, 0] += 1.0
            b["gt_bboxes"][0, :, 0] += 1.0
            return b

        return _Mapped(super().get_dataloader(img_path, batch_size, mode), move)


def test_labels_out_of_range_caught(shapes, tmp_path):
    r = _doctor(OffByNLabels, shapes, tmp_path)
    assert "labels-out-of-range" in r.names and not r.ok
    f = next(f for f in r.findings if f.name == "labels-out-of-range")
    assert f.level == "FAIL" and "nc=5" in f.fix


def test_boxes_outside_the_image_caught_with_the_reason(shapes, tmp_path):
    r = _doctor(FirstImageOffCanvas, shapes, tmp_path, steps=2)
    assert "boxes-out-of-range" in r.names
    a = r.section("trace").data["assigner"]
    n0 = r.section("data").data["fixed_batch"]["per_image"][0]
    assert a["positives_per_image"][0] == 0 and a["reasons"] == {"outside": n0}
    assert all(u["image"] == 0 and u["reason"] == "outside the image" for u in a["unassigned"])


def test_user_module_left_untouched_and_train_runs_after(shapes, tmp_path):
    module = build_model(TINY, nc=5)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    t = Trainer(data=shapes, project=tmp_path, name="m", epochs=1, **{**FAST, "model": module})
    assert t.doctor(steps=3).section("overfit").data["steps"] == 3
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert t.model is None  # what the doctor borrowed is handed back: train() sets up its own
    assert "fitness" in t.train()
    assert (tmp_path / "m" / "doctor.txt").is_file() and (tmp_path / "m" / "weights" / "last.pt").is_file()


class ClassTermCounted(DetectionLoss):
    """The class term x ``times``, as summing it over a class-target tensor repeated along the batch does."""

    times = 4

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        box, cls, dfl = self.gains
        self.gains = (box, self.times * cls, dfl)


class DuplicatedTargetLoss(Trainer):
    times = 4

    def get_loss(self, model):
        m = model
        loss = ClassTermCounted(m.nc, strides=tuple(float(s) for s in m.stride), box=self.args.box,
                                cls=self.args.cls, dfl=self.args.dfl)
        loss.gains = (loss.gains[0], self.times * self.args.cls, loss.gains[2])
        return loss


def test_branch_scaled_x4_caught(shapes, tmp_path):
    r = _doctor(DuplicatedTargetLoss, shapes, tmp_path)
    assert "loss-branch-scaled" in r.names and not r.ok
    f = next(f for f in r.findings if f.name == "loss-branch-scaled")
    assert "cls branch is 4.00x" in f.message
    ratios = r.section("trace").data["ratio_to_standard"]
    assert ratios["cls"] == pytest.approx(4.0, rel=1e-4) and ratios["box"] == pytest.approx(1.0, rel=1e-4)
    # the gradients section shows the user's cls gradient, found to be 4x the standard one
    g = r.section("gradients").data
    assert set(g["branches"]) == {"box", "cls", "dfl"}
    assert g["scaled_vs_standard"] == {"cls": pytest.approx(4.0, rel=1e-3)}


class Repeated40Times(DuplicatedTargetLoss):
    times = 40


def test_dominant_branch_gradient_flagged(shapes, tmp_path):
    r = _doctor(Repeated40Times, shapes, tmp_path)
    f = next(f for f in r.findings if f.name == "gradient-branch-dominant")
    assert f.message.startswith("the cls gradient is") and "Detect.cls" in f.message


class NaNGradient(Trainer):
    """A loss term that is 0 going forward but whose gradient is NaN (sqrt at 0 times the 0 of abs')."""

    def get_loss(self, model):
        base = super().get_loss(model)

        def loss(feats, batch):
            total, items = base(feats, batch)
            bad = sum((f[:, :1] - f[:, :1].detach()).abs().sqrt().sum() for f in feats)
            return total + bad, items

        return loss


def test_non_finite_gradient_flagged_where_it_starts(shapes, tmp_path):
    r = _doctor(NaNGradient, shapes, tmp_path)
    assert "loss-non-finite" not in r.names  # the loss itself is finite: only its gradient is not
    f = next(f for f in r.findings if f.name == "gradient-non-finite")
    assert f.message.startswith("the rest gradient is non-finite, starting at 22 Detect.box")


class BrokenLoss(Trainer):
    def get_loss(self, model):
        def loss(feats, batch):
            raise RuntimeError("shape mismatch in my loss")

        return loss


def test_failing_loss_reported_not_raised(shapes, tmp_path):
    r = _doctor(BrokenLoss, shapes, tmp_path)
    f = next(f for f in r.findings if f.name == "loss-error")
    assert "shape mismatch in my loss" in f.message
    assert r.section("overfit").lines[0].startswith("skipped")
    assert (tmp_path / "doc" / "doctor.json").is_file()


def test_lr_zero_caught(shapes, tmp_path):
    r = _doctor(Trainer, shapes, tmp_path, optimizer="SGD", lr0=0.0)
    assert {"lr-zero", "overfit-failed"} <= r.names
    fit = r.section("overfit").data
    assert not fit["passed"] and fit["cause"] == "lr is 0"
    assert fit["losses"][-1] == pytest.approx(fit["losses"][0], rel=1e-3)  # nothing moved


class FrozenHead(Trainer):
    def get_model(self, cfg=None, weights=None):
        model = super().get_model(cfg, weights)
        model.head.requires_grad_(False)
        return model


def test_frozen_head_caught(shapes, tmp_path):
    r = _doctor(FrozenHead, shapes, tmp_path)
    assert "head-frozen" in r.names and not r.ok


class WithExtraTerm(Trainer):
    """A loss with a fourth item, the way a distillation term is added (total + B * item)."""

    def get_loss(self, model):
        base = super().get_loss(model)

        class Loss:
            loss_names = ("box", "cls", "dfl", "distill")

            def __call__(self, feats, batch):
                total, items = base(feats, batch)
                extra = sum((f[:, :4] ** 2).mean() for f in feats)  # differentiable, ~1
                return total + extra * feats[0].shape[0], torch.cat((items, extra.detach().reshape(1)))

        return Loss()


def test_extra_loss_term_gets_its_own_gradient_row(shapes, tmp_path):
    r = _doctor(WithExtraTerm, shapes, tmp_path)
    g = r.section("gradients").data["branches"]
    assert set(g) == {"box", "cls", "dfl", "distill"} and g["distill"]["model"] > 0
    assert "loss-total-mismatch" not in r.names and "loss-branch-scaled" not in r.names
    assert set(r.section("trace").data["items"]) == {"box", "cls", "dfl", "distill"}


def test_one_branch_backward_matches_reference():
    """Each branch alone, backpropagated through the fused op (the CPU default), gives the gradient the
    pure-PyTorch reference gives: the per-branch gradients rest on that."""
    torch.manual_seed(0)
    model = build_model(TINY, nc=3).train()
    loss = DetectionLoss(3, strides=tuple(float(s) for s in model.stride))
    img = torch.rand(2, 3, 64, 64)
    batch = {"batch_idx": torch.tensor([0.0, 0, 1]), "cls": torch.tensor([[0.0], [2], [1]]),
             "bboxes": torch.tensor([[0.3, 0.3, 0.2, 0.3], [0.7, 0.6, 0.3, 0.2], [0.5, 0.5, 0.5, 0.4]])}
    feats = [f.detach().double().float() for f in model(img)]
    grads = {}
    for name in ("ref", "auto"):
        leaves = [f.clone().requires_grad_(True) for f in feats]
        with backend(name):
            t = standard_branches(loss, leaves, batch)
            grads[name] = [torch.autograd.grad(t["branches"][k], leaves, retain_graph=True) for k in range(3)]
    for k in range(3):
        for a, b in zip(grads["ref"][k], grads["auto"][k]):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
    total = [sum(grads["auto"][k][i] for k in range(3)) for i in range(3)]
    leaves = [f.clone().requires_grad_(True) for f in feats]
    whole = torch.autograd.grad(loss(leaves, batch)[0], leaves)
    for a, b in zip(total, whole):  # the branches add up to the total's gradient (x batch 2)
        torch.testing.assert_close(2 * a, b, rtol=1e-4, atol=1e-7)


def test_cli_help_and_key_checking(capsys):
    assert main(["doctor", "--help"]) == 0
    out = capsys.readouterr().out
    assert "doctor.txt" in out and "labels-out-of-range" in out
    assert main(["doctor", "lr_0=0.1"]) == 2
    assert "did you mean" in capsys.readouterr().err
    assert main(["doctor", "--steps", "x"]) == 2


@pytest.fixture(scope="module")
def teacher_pt(shapes, tmp_path_factory):
    """A 1/4-width teacher trained for one epoch on the same data (as tests/engine/test_distill.py)."""
    root = tmp_path_factory.mktemp("teacher")
    teacher = {**copy.deepcopy(TINY), "width_multiple": 0.25}
    Trainer(data=shapes, epochs=1, project=root, name="t", **{**FAST, "model": teacher}).train()
    torch.use_deterministic_algorithms(False)
    return str(root / "t" / "weights" / "best.pt")


def test_distillation_is_its_own_gradient_branch(shapes, teacher_pt, tmp_path):
    """distill_model: the dis term reaches the student through the projectors and the maps entering the
    head, never the head itself; the trace shows its share and the overfit optimises the total with it."""
    r = _doctor(Trainer, shapes, tmp_path, steps=3, distill_model=teacher_pt, dis=6.0)
    g = r.section("gradients").data["branches"]
    assert set(g) == {"box", "cls", "dfl", "dis"}, r.text()
    dis = g["dis"]
    assert math.isfinite(dis["model"]) and dis["model"] > 0
    assert dis["head"] == 0 and dis["head_maps"] == 0  # it acts on the head's inputs (P3-P5)
    assert dis["groups"]["projectors (dis)"] > 0 and dis["groups"]["21 C2f"] > 0  # P5's last C2f
    assert all(g[b]["groups"]["projectors (dis)"] == 0 for b in ("box", "cls", "dfl"))
    assert any(line.strip().startswith("projectors (dis)") for line in r.section("gradients").lines)
    trace = r.section("trace").data
    assert set(trace["items"]) == {"box", "cls", "dfl", "dis"} and trace["shares"]["dis"] > 0
    assert "loss-total-mismatch" not in r.names and "loss-branch-scaled" not in r.names
    fit = r.section("overfit").data  # step 1 is the trace's total: box + cls + dfl + dis, x batch
    assert fit["losses"][0] == pytest.approx(trace["total"], rel=1e-4)
