"""``yolofast doctor`` / ``Trainer(...).doctor()``: the three checks run by hand when a loop misbehaves.

1. trace: one batch through every stage (images, targets, head maps, assigner, loss branches);
2. gradients: each loss branch's gradient norm over the model, the head and each layer group;
3. overfit: N steps on that one batch; the loss must fall below a fraction of its start.

Everything is built with the trainer's own hooks, so a subclass or recipe is diagnosed as it would train:
``yolofast/engine/doctor_setup.py`` builds the ``Session`` and hands it to ``run`` (the doctor sits below
the engine and imports none of it).
Each problem is a named finding (``report.names``) with a one-line fix; the report is printed and saved as
``doctor.txt``, ``doctor.json`` and ``overfit.png`` in the run folder.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch

from yolofast.doctor.overfit import DEFAULT_FRACTION, DEFAULT_STEPS
from yolofast.doctor.report import Finding, Report, Section
from yolofast.doctor.session import Session

__all__ = ["run", "check_options", "Report", "Finding", "Session", "DEFAULT_STEPS", "DEFAULT_FRACTION"]


def check_options(steps: int, fraction: float) -> None:
    if steps < 1 or not 0 < fraction < 1:
        raise ValueError(f"doctor: steps={steps} must be >= 1 and fraction={fraction} in (0, 1)")


def run(s: Session, steps: int = DEFAULT_STEPS, fraction: float = DEFAULT_FRACTION, save_dir=None,
        verbose: bool | None = None) -> Report:
    """Diagnose the session's model, data, loss and optimizer (``Trainer.doctor()`` builds it with the
    trainer's hooks: engine/doctor_setup.py), then hand the trainer its own parts back; returns the Report
    (``.ok``, ``.names``, ``.findings``, ``.text()``). ``save_dir``: where doctor.txt/.json/overfit.png go
    (default: the trainer's run folder); ``verbose``: print the report (default: the recipe's
    ``verbose``)."""
    from yolofast import __version__
    from yolofast.doctor.gradients import check_gradients
    from yolofast.doctor.overfit import overfit
    from yolofast.doctor.trace import trace_data, trace_model

    check_options(steps, fraction)
    trainer, t_setup = s.trainer, s.setup_s
    t0 = time.time() - t_setup
    a = trainer.args
    try:
        data, model_sec, grad_sec, fit_sec = (Section("data"), Section("trace"), Section("gradients"),
                                              Section("overfit"))
        aug = trace_data(data, s.train_batch, s.nc, "train batch (augmented)")
        fixed = trace_data(data, s.batch, s.nc, "fixed batch (no augmentation)")
        data.data = {"train_batch": aug, "fixed_batch": fixed}
        _dedupe(data)
        tick = time.time()
        feats = _guarded(model_sec, s.forward)
        if feats is not None:
            model_sec.data = trace_model(model_sec, s, [f.detach() for f in feats])
        tick = _took(model_sec, tick)
        if "loss-error" not in {f.name for f in model_sec.findings} and feats is not None:
            grad_sec.data = _guarded(grad_sec, check_gradients, grad_sec, s, feats) or {}
            tick = _took(grad_sec, tick)
            del feats
            earlier = data.findings + model_sec.findings + grad_sec.findings
            fit_sec.data = _guarded(fit_sec, overfit, fit_sec, s, steps, fraction, earlier=earlier) or {}
            _took(fit_sec, tick)
        else:
            for sec in (grad_sec, fit_sec):
                sec.add("skipped: the model or the loss fails on this batch (see the trace)")
        amp = str(trainer.amp_dtype).replace("torch.", "") if trainer.amp_dtype is not None else "off (fp32)"
    finally:
        s.restore()
    n_params = sum(p.numel() for p in s.model.parameters())
    model = a.model if isinstance(a.model, (str, Path)) else type(s.model).__name__  # not a whole dict
    header = [f"yolofast {__version__} doctor  torch {torch.__version__}  {trainer.device}  "
              f"{platform.processor() or platform.machine()}  {torch.get_num_threads()} threads",
              f"model {model} ({n_params / 1e6:.2f}M parameters, nc={s.nc}), data {a.data}, imgsz "
              f"{a.imgsz}, batch {s.batch['img'].shape[0]}, amp {amp}, optimizer {s.optimizer_name}, loss "
              f"{type(s.loss).__name__}"]
    if s.distilling:
        header.append(f"distill_model {a.distill_model} (dis={a.dis:g}): its term is the branch dis; the "
                      f"overfit optimises the total with it, as training does")
    report = Report([data, model_sec, grad_sec, fit_sec], header)
    report.header.append(f"{time.time() - t0:.1f} s in all (setup and data {t_setup:.1f} s)")
    out = Path(save_dir) if save_dir is not None else trainer.save_dir
    report.save(out)
    if a.verbose if verbose is None else verbose:
        print(report.text())
        print(f"saved {out / 'doctor.txt'}, doctor.json, overfit.png")
    return report


def _guarded(sec: Section, fn, *args, **kw):
    """``fn(*args)``; an exception (a user's hook failing on this batch) becomes a FAIL of ``sec``."""
    try:
        return fn(*args, **kw)
    except Exception as e:  # reported as a finding: the report is still written
        sec.flag(f"{sec.title}-error", "FAIL", f"{type(e).__name__}: {e}",
                 "run that hook (forward, get_loss) on this batch by hand; the trace shows its inputs")
        return None


def _took(sec: Section, tick: float) -> float:
    now = time.time()
    sec.data["seconds"] = round(now - tick, 2)
    sec.add(f"({now - tick:.1f} s)")
    return now


def _dedupe(sec: Section) -> None:
    """A finding of both batches (augmented and fixed) once, its messages joined."""
    seen: dict[str, Finding] = {}
    for f in sec.findings:
        if f.name in seen:
            seen[f.name].message += f"; {f.message}"
        else:
            seen[f.name] = f
    sec.findings = list(seen.values())
