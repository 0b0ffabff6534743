"""overfit: N optimizer steps on the one fixed batch. A model and loss that work drive the loss far down;
one that cannot is broken (frozen or gradient-less parameters, lr 0, no positives, NaN), not the recipe."""

from __future__ import annotations

import math

import torch

from yolofast.doctor.report import Section, fmt

__all__ = ["overfit", "DEFAULT_STEPS", "DEFAULT_FRACTION"]

# yolov8n, shapes, 192 px, batch 16, AdamW at the auto lr (0.0011), bf16: the loss fell from 238 to 44
# (0.18) in 27 steps and to 24 (0.10) in 60; the 1/8-width test model at 64 px (4 images) peaks at ~16 after
# a few steps and is at 0.3-0.35 of that after 60-80. lr0=0 stays at 1.0. Pass below 0.5.
DEFAULT_STEPS = 30
DEFAULT_FRACTION = 0.5


def start_loss(losses) -> float:
    """The loss to fall from: the highest of the first fifth of the steps (at least 3). At first the
    assigner finds few positive anchors (predictions overlap no GT yet), so the box and DFL losses can
    rise for some steps before they fall: on the test model at 64 px, 6.3 at step 1, 16.5 at step 16."""
    return max(losses[:max(3, len(losses) // 5)])


def _curve_line(losses, width: int = 10) -> str:
    n = len(losses)
    idx = sorted({round(i * (n - 1) / (width - 1)) for i in range(width)}) if n > 1 else [0]
    return "  ".join(f"{i + 1}:{fmt(losses[i], 3)}" for i in idx)


def overfit(sec: Section, s, steps: int = DEFAULT_STEPS, fraction: float = DEFAULT_FRACTION,
            earlier=()) -> dict:
    """Train ``s.step`` in place on ``s.batch``: the total training optimises (with distill_model, its
    distillation term too), clip 10.0 and the scaler, as the trainer's step;
    ``earlier``: the findings of the trace and the gradients, to name the likely cause of a FAIL."""
    tr, opt, model = s.trainer, s.optimizer, s.model
    params = [p for p in s.step.parameters() if p.requires_grad]
    lrs = [float(g["lr"]) for g in opt.param_groups]
    sec.add(f"{steps} steps of {s.optimizer_name} (lr {', '.join(fmt(x, 3) for x in lrs)} per group, no "
            f"warmup) on the fixed batch of {s.batch['img'].shape[0]} images; pass below {fraction:g} x "
            f"the start (the highest loss of the first {max(3, steps // 5)} steps)")
    losses, bad_step, missing = [], None, 0
    s.step.train()
    for step in range(steps):
        with tr.autocast():
            feats = s.step(s.batch["img"])
        total, _ = s.loss([f.float() for f in feats], s.batch)
        v = float(total.detach())
        if not math.isfinite(v):
            bad_step = step + 1
            break
        losses.append(v)
        opt.zero_grad(set_to_none=True)
        tr.scaler.scale(total).backward()
        if step == 0:
            missing = sum(p.grad is None for p in params)
        tr.scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, max_norm=10.0)
        tr.scaler.step(opt)
        tr.scaler.update()
    opt.zero_grad(set_to_none=True)
    tail = min(losses[-5:]) if losses else float("nan")
    start = start_loss(losses) if losses else float("nan")
    threshold = fraction * start
    passed = bad_step is None and len(losses) == steps and tail <= threshold
    out = {"steps": steps, "fraction": fraction, "losses": losses, "threshold": threshold,
           "start": start, "final_ratio": tail / start if losses and start else float("nan"),
           "passed": passed, "lr": lrs, "optimizer": s.optimizer_name}
    if losses:
        sec.add(f"loss {_curve_line(losses)}")
        sec.add(f"{'PASS' if passed else 'FAIL'}: the lowest of the last 5 losses is "
                f"{out['final_ratio']:.3f} x the start {fmt(start, 3)} (threshold {fraction:g})")
    if lrs and all(x == 0 for x in lrs):
        sec.flag("lr-zero", "FAIL", "lr is 0 in every parameter group: no step can change a weight",
                 "set lr0 > 0 (e.g. lr0=0.01 for SGD, 0.001 for AdamW), or optimizer=auto")
    if passed:
        return out
    if bad_step is not None:
        cause = f"the loss became non-finite at step {bad_step}"
        fix = "lower lr0 (or try amp=False); the gradients section shows where a NaN starts"
    elif lrs and all(x == 0 for x in lrs):
        cause, fix = "lr is 0", "set lr0 > 0"
    elif not params:
        cause, fix = "no parameter is trainable", "unfreeze the model (requires_grad_(True))"
    elif all(not p.requires_grad for p in getattr(model, "head", model).parameters()):
        cause, fix = "the head is frozen", "unfreeze the Detect head"
    elif "no-positives" in {f.name for f in earlier}:
        cause, fix = "the assigner gave no positive anchor", "fix the labels (see the trace's assigner line)"
    elif missing:
        cause = f"{missing} parameters get no gradient"
        fix = "see the gradients section's layers the loss does not reach"
    elif any(f.level == "FAIL" for f in earlier):
        names = ", ".join(dict.fromkeys(f.name for f in earlier if f.level == "FAIL"))
        cause = f"the loss fell only to {out['final_ratio']:.2f} x its start; the trace flagged {names}"
        fix = "fix those findings first (below)"
    else:
        cause = (f"the loss fell only to {out['final_ratio']:.2f} x its start in {steps} steps: the model "
                 "or the loss cannot fit one batch")
        fix = "see the trace's loss ratios and the gradients; more steps (steps=) if it is still falling"
    out["cause"] = cause
    sec.flag("overfit-failed", "FAIL", f"{cause}", fix)
    return out
