"""Knowledge distillation from a teacher detector (``distill_model=teacher.pt``, gain ``dis=6.0``).

What it computes (the same keys and meaning as Ultralytics 8.4):
* the teacher (a yolofast or Ultralytics YOLOv8 detect checkpoint of any scale, with the student's classes)
  runs in eval mode under ``no_grad`` on the same images as the student;
* for each level that feeds the Detect head (P3, P4, P5), the student's map goes through a trainable
  projector ``Conv1x1(c_s -> c_t) -> ReLU -> Conv1x1(c_t -> c_t)`` (student channels to teacher channels);
* each anchor (cell) is weighted by the teacher's confidence there, ``w = max_c sigmoid(teacher logit_c)``;
* level loss ``= sum(w * (proj(s) - t)^2) / (sum(w) * c_t)``; ``L_dis`` = the sum over levels; the step adds
  ``dis * L_dis * batch_size`` to the total and logs ``dis * L_dis`` as the fourth loss item ``dis_loss``.

How it plugs into the trainer, so that DDP, torch.compile and the CUDA-graph step need nothing of their own:
``DistillStep`` is the module the train step runs. It holds the student, the projectors (both trained: they
are its parameters, so the optimizer, gradient clipping, DDP's all-reduce and the graph's static gradients
cover them) and the frozen teacher; its forward returns the student's head maps followed by the 0-d
``L_dis``, and ``DistillLoss`` splits that last entry off again. Validation, the EMA, predict and export see
the student alone: the projectors are saved under the checkpoint's ``distill`` entry (for resume), never in
its ``model``/``ema`` weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from yolofast.cfg import CfgError

__all__ = ["DistillStep", "DistillLoss", "Projector", "distill_loss", "load_teacher", "train_step",
           "checkpoint_state", "restore_state"]


class Projector(nn.Sequential):
    """Student channels -> teacher channels: 1x1 conv -> ReLU -> 1x1 conv (with biases, no norm)."""

    def __init__(self, c_student: int, c_teacher: int):
        super().__init__(nn.Conv2d(c_student, c_teacher, 1), nn.ReLU(), nn.Conv2d(c_teacher, c_teacher, 1))


def distill_loss(student: list[torch.Tensor], teacher: list[torch.Tensor],
                 teacher_cls: list[torch.Tensor]) -> torch.Tensor:
    """The unweighted distillation loss L_dis, summed over levels (float32, 0-d).

    student[i]: projected student map (B, C_i, H_i, W_i); teacher[i]: the teacher's map there, same shape;
    teacher_cls[i]: the teacher's class logits (B, nc, H_i, W_i). Level i contributes
    ``sum_{b,y,x} w * sum_c (s - t)^2 / (sum_{b,y,x} w * C_i)`` with ``w = max_c sigmoid(logit)``.
    """
    total = student[0].new_zeros((), dtype=torch.float32)
    for s, t, logits in zip(student, teacher, teacher_cls, strict=True):
        if s.shape != t.shape:
            raise ValueError(f"distill_loss: projected student map {tuple(s.shape)} != teacher map "
                             f"{tuple(t.shape)}")
        w = logits.detach().float().amax(1, keepdim=True).sigmoid()  # sigmoid is monotonic: max first
        sq = (s.float() - t.detach().float()).square().sum(1, keepdim=True)
        total = total + (w * sq).sum() / (w.sum().clamp_min(1e-9) * s.shape[1])
    return total


def _head_channels(model: nn.Module) -> list[int]:
    """Channels of the maps entering each Detect level (its first box conv's input)."""
    return [int(branch[0].conv.in_channels) for branch in model.head.cv2]


def _check_detector(model: nn.Module, what: str) -> None:
    if not (hasattr(model, "_neck") and hasattr(getattr(model, "head", None), "cv2")):
        raise CfgError(f"distill_model: the {what} must be a yolofast DetectionModel (a YOLOv8 detector "
                       f"with a Detect head), got {type(model).__name__}; train without distill_model or "
                       f"build the model with yolofast.nn.build_model")


def load_teacher(path, student: nn.Module, names: dict, device) -> nn.Module:
    """The teacher of ``distill_model=path``: fp32, eval mode, frozen, on ``device``.

    Read with the project's safe reader (no pickle code runs); the EMA weights when the file has them. It
    must predict the student's classes (the same names, in the same order) at the student's strides."""
    from yolofast.io import load_weights, read_checkpoint
    from yolofast.nn import build_model

    if not Path(str(path)).is_file():
        raise CfgError(f"distill_model={str(path)!r}: file not found; pass a yolofast or Ultralytics YOLOv8 "
                       f"detect checkpoint (.pt) trained on this data's classes")
    src = read_checkpoint(path)
    if src["cfg"] is None:
        raise CfgError(f"distill_model={str(path)!r} holds a custom {src['arch']} without a model config; a "
                       f"teacher must be a YOLOv8 detect checkpoint (yolofast or Ultralytics)")
    names = {int(k): str(v) for k, v in (dict(enumerate(names)) if isinstance(names, (list, tuple))
                                          else dict(names)).items()}
    if src["nc"] != len(names) or src["names"] != names:
        raise CfgError(f"distill_model={str(path)!r} predicts {src['nc']} classes "
                       f"{list(src['names'].values())[:8]} but the data has {len(names)} "
                       f"{list(names.values())[:8]}; a teacher must have the student's classes (same names, "
                       f"same order): train it on this data first")
    teacher = build_model(src["cfg"], nc=src["nc"])
    load_weights(teacher, src["state_dict"], f"distill_model '{path}'")
    _check_detector(teacher, "teacher")
    s_strides = [float(s) for s in student.stride]
    t_strides = [float(s) for s in teacher.stride]
    if s_strides != t_strides:
        raise CfgError(f"distill_model={str(path)!r}: the teacher's head levels have strides {t_strides}, "
                       f"the student's {s_strides}; they must match level by level")
    teacher = teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


class DistillStep(nn.Module):
    """The train step's model with a teacher: ``forward(img) -> [*student maps, L_dis]``.

    ``student`` and ``projector`` (one ``Projector`` per head level) are trained; ``teacher`` stays in eval
    mode whatever ``train()`` is called with, and never gets a gradient."""

    def __init__(self, student: nn.Module, teacher: nn.Module):
        super().__init__()
        _check_detector(student, "student")
        _check_detector(teacher, "teacher")
        self.student, self.teacher = student, teacher.eval().requires_grad_(False)
        p = next(student.parameters())
        self.projector = nn.ModuleList(
            Projector(cs, ct) for cs, ct in zip(_head_channels(student), _head_channels(teacher), strict=True)
        ).to(p.device)

    def train(self, mode: bool = True):
        super().train(mode)
        self.teacher.eval()  # running BN statistics of the teacher must never move
        return self

    def forward(self, img: torch.Tensor) -> list[torch.Tensor]:
        xs = self.student._neck(img)
        maps = self.student.head.forward_feats(xs)
        with torch.no_grad():
            ts = self.teacher._neck(img)
            t_cls = [cv3(t) for cv3, t in zip(self.teacher.head.cv3, ts)]  # the class branch only
        projected = [proj(x) for proj, x in zip(self.projector, xs)]
        return [*maps, distill_loss(projected, ts, t_cls)]


class DistillLoss(nn.Module):
    """``criterion`` on the student's maps plus ``dis * L_dis * batch size``; items gain ``dis * L_dis``."""

    def __init__(self, criterion, dis: float = 6.0):
        super().__init__()
        self.criterion, self.dis = criterion, float(dis)
        self.nc = getattr(criterion, "nc", None)  # what AutoBatch's synthetic batch draws classes from

    def forward(self, feats, batch):
        *maps, l_dis = feats
        total, items = self.criterion(maps, batch)
        d = l_dis.float() * self.dis
        return total + d * maps[0].shape[0], torch.cat([items, d.detach().reshape(1)])


def train_step(model: nn.Module, criterion, args, names: dict, device, channels_last: bool = False):
    """(step model, step loss, extra loss names) for the trainer: ``model``, ``criterion`` and [] when
    ``args.distill_model`` is empty, else a ``DistillStep`` over the loaded teacher, a ``DistillLoss`` and
    ["dis_loss"]."""
    path = getattr(args, "distill_model", None)
    if path in (None, "", False):
        return model, criterion, []
    if getattr(model, "end2end", False):
        raise CfgError(f"distill_model={str(path)!r}: the student has an end-to-end head (YOLO26), whose "
                       "criterion takes both head branches; distillation feeds the one-to-many maps only and "
                       "does not cover it yet. Train without distill_model, or distill into yolo11 / yolov8")
    teacher = load_teacher(path, model, names, device)
    step = DistillStep(model, teacher)
    if channels_last:
        step.teacher.to(memory_format=torch.channels_last)
        step.projector.to(memory_format=torch.channels_last)
    return step, DistillLoss(criterion, args.dis), ["dis_loss"]


def checkpoint_state(step_model: nn.Module) -> dict:
    """The checkpoint entry of the projectors (``{"distill": state_dict}``), or {} without a teacher."""
    if not isinstance(step_model, DistillStep):
        return {}
    return {"distill": {k: v.detach() for k, v in step_model.projector.state_dict().items()}}


def restore_state(step_model: nn.Module, ckpt: dict, path) -> None:
    """Load the projectors of a resumed run (the checkpoint must have them when the run has a teacher)."""
    if not isinstance(step_model, DistillStep):
        return
    state = ckpt.get("distill")
    if not isinstance(state, dict):
        raise CfgError(f"resume: '{path}' was trained with distill_model but holds no projector weights "
                       f"('distill' entry); start a new run with model={path} instead")
    step_model.projector.load_state_dict(state)
