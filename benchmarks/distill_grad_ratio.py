"""How the distillation term's gradient compares with the detection loss's, on the student's weights.

    python benchmarks/distill_grad_ratio.py DATA.yaml TEACHER.pt [STUDENT_last.pt] [--imgsz 160] [--batches 3]
    python benchmarks/distill_grad_ratio.py DATA.yaml TEACHER.pt --clip-steps 20 [--imgsz 192]

For a few training batches (no augmentation, 16 images): the detection loss and the distillation term
(``dis * L_dis * batch``, dis = 6), the norms of their gradients w.r.t. the student's weights and the cosine
between them. A fresh yolov8n (seed 1) and fresh projectors unless a distilled run's last.pt is given (its
student and projectors). Used to explain the distillation measurement in docs/distillation.md.

``--clip-steps N``: what the gradient clip at 10 does to the recipe's optimizer (AdamW, as
``optimizer=auto`` picks for these short runs). From the same fresh student it takes N steps on the same
batches three times: distilled with the clip, distilled without it, and without a teacher with the clip;
then prints how the student's weights moved (the cosine and norm ratio of the displacements). Adam divides
each gradient by its running RMS, so scaling a whole step's gradient (which is all the clip does) should
change the update little; the teacher's term, which changes the gradient's direction, should change it more.
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


def clip_check(data: str, teacher_pt: str, imgsz: int, steps: int, dis: float = 6.0, lr: float = 0.001111,
               max_norm: float = 10.0) -> dict:
    """The student's displacement after ``steps`` AdamW steps (the recipe's auto lr for 5 classes, bf16
    autocast as on this CPU): distilled with and without the clip, and without a teacher with the clip."""
    torch.set_num_threads(1)
    d = check_data(data)
    loader = build_dataloader(build_dataset(d["train"], imgsz=imgsz, augment=False, nc=d["nc"]), 16, 0,
                              shuffle=False)
    batches = [b for _, b in zip(range(steps), loader)]
    torch.manual_seed(1)
    student = build_model("yolov8n", nc=d["nc"]).train()
    step = DistillStep(student, load_teacher(teacher_pt, student, d["names"], "cpu")).train()
    start = {k: v.clone() for k, v in step.state_dict().items()}
    crit = DetectionLoss(d["nc"])
    names = [n for n, p in student.named_parameters() if p.requires_grad]

    def run(teacher: bool, clip: float) -> tuple[torch.Tensor, float]:
        step.load_state_dict(start)
        params = [p for p in (step if teacher else student).parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
        norms = []
        for batch in batches:
            img = batch["img"].float() / 255
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = step(img) if teacher else student(img)
            det, _ = crit([f.float() for f in out[:3]], batch)
            loss = det + out[3].float() * dis * img.shape[0] if teacher else det
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
            opt.step()
        now = dict(student.named_parameters())
        delta = torch.cat([(now[n].detach() - start[f"student.{n}"]).double().flatten() for n in names])
        return delta, sum(norms) / len(norms)

    runs = {"distilled, clip 10": run(True, max_norm), "distilled, no clip": run(True, float("inf")),
            "no teacher, clip 10": run(False, max_norm)}
    ref = runs["distilled, clip 10"][0]
    out = {}
    for k, (delta, norm) in runs.items():
        cos = float(torch.nn.functional.cosine_similarity(ref, delta, dim=0))
        out[k] = {"cos": cos, "norm_ratio": float(delta.norm() / ref.norm()), "grad_norm": norm}
        print(f"{k}: mean pre-clip gradient norm {norm:.0f}; displacement vs 'distilled, clip 10': cosine "
              f"{cos:.4f}, norm ratio {out[k]['norm_ratio']:.3f}", flush=True)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data")
    p.add_argument("teacher")
    p.add_argument("student", nargs="?", help="a distilled run's last.pt (student + projectors)")
    p.add_argument("--imgsz", type=int, default=160)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--clip-steps", type=int, default=0, help="AdamW steps of the clip check (0: off)")
    a = p.parse_args()
    if a.clip_steps:
        clip_check(a.data, a.teacher, a.imgsz, a.clip_steps)
    else:
        main(a.data, a.teacher, a.student, a.imgsz, a.batches)
