"""How the distillation term's gradient compares with the detection loss's, on the student's weights.

    python benchmarks/distill_grad_ratio.py DATA.yaml TEACHER.pt [STUDENT_last.pt] [--imgsz 160] [--batches 3]

For a few training batches (no augmentation, 16 images): the detection loss and the distillation term
(``dis * L_dis * batch``, dis = 6), the norms of their gradients w.r.t. the student's weights and the cosine
between them. A fresh yolov8n (seed 1) and fresh projectors unless a distilled run's last.pt is given (its
student and projectors). Used to explain the distillation measurement in the README.
"""

from __future__ import annotations

import argparse

import torch

from yolofast.data import build_dataloader, build_dataset, check_data
from yolofast.engine.checkpoint import load_checkpoint
from yolofast.engine.distill import DistillStep, load_teacher
from yolofast.loss import DetectionLoss
from yolofast.nn import build_model


def _flat(grads, params) -> torch.Tensor:
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])


def main(data: str, teacher_pt: str, student_pt: str | None, imgsz: int, batches: int, dis: float = 6.0):
    torch.set_num_threads(1)
    d = check_data(data)
    loader = build_dataloader(build_dataset(d["train"], imgsz=imgsz, augment=False, nc=d["nc"]), 16, 0,
                              shuffle=False)
    torch.manual_seed(1)
    student = build_model("yolov8n", nc=d["nc"]).train()
    step = DistillStep(student, load_teacher(teacher_pt, student, d["names"], "cpu")).train()
    if student_pt:
        ck = load_checkpoint(student_pt)
        student.load_state_dict(ck["model"].state_dict())
        step.projector.load_state_dict(ck["distill"])
    crit = DetectionLoss(d["nc"])
    params = [p for p in student.parameters() if p.requires_grad]
    for i, batch in zip(range(batches), loader):
        img = batch["img"].float() / 255
        out = step(img)
        det, items = crit(out[:3], batch)
        term = out[3] * dis * img.shape[0]
        g_det = _flat(torch.autograd.grad(det, params, retain_graph=True, allow_unused=True), params)
        g_dis = _flat(torch.autograd.grad(term, params, allow_unused=True), params)
        cos = float(torch.nn.functional.cosine_similarity(g_det, g_dis, dim=0))
        print(f"batch {i}: detection loss {float(det):.1f} (items {[round(float(x), 3) for x in items]}), "
              f"distillation term {float(term):.1f} (dis_loss {float(out[3].detach()) * dis:.3f}); gradient "
              f"norms {float(g_det.norm()):.1f} vs {float(g_dis.norm()):.1f} (ratio "
              f"{float(g_dis.norm() / g_det.norm()):.2f}), cosine {cos:.3f}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data")
    p.add_argument("teacher")
    p.add_argument("student", nargs="?", help="a distilled run's last.pt (student + projectors)")
    p.add_argument("--imgsz", type=int, default=160)
    p.add_argument("--batches", type=int, default=3)
    a = p.parse_args()
    main(a.data, a.teacher, a.student, a.imgsz, a.batches)
