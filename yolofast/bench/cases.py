"""What is timed: one ``Case`` per (preset, op) with one zero-argument callable per backend or baseline.

Every callable does exactly one unit of work on inputs built once (``inputs.py``), so the runner can call
it any number of times and interleave backends. A backend that cannot run here (not built, no device,
no kernel for that op) becomes a ``Variant`` with ``fn=None`` and the reason, never an exception.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Callable

import torch

from yolofast.bench import inputs as bench_inputs
from yolofast.bench.case_types import Case, Variant
from yolofast.bench.presets import Preset, get_preset

__all__ = ["BACKENDS", "SLOWDOWN_ENV", "Case", "Variant", "build_cases", "op_availability", "slowdowns"]

# yolofast backends tried per device (the first is the reference every ratio is taken against).
BACKENDS = {"cpu": ("ref", "cpp"), "cuda": ("ref", "cuda", "triton")}
# Which yolofast.ops a composite benchmark op runs.
_NEEDS = {
    "tal_assign": ("tal_assign",),
    "bbox_loss": ("bbox_loss",),
    "ema_update": ("ema_update",),
    "loss_step": ("tal_assign", "bbox_loss"),
    "musgd_step": ("ns_orthogonalize",),
    "loss26_step": ("tal_assign", "bbox_loss"),
}


def op_availability(op: str, name: str, device_type: str) -> tuple[bool, str]:
    """Whether backend ``name`` can run every yolofast op that benchmark op ``op`` needs."""
    from yolofast.ops._backend import availability

    if name in ("ref", "auto"):
        return True, ""
    for sub in _NEEDS.get(op, (op,)):
        try:
            ok, why = availability(sub, name, device_type)
        except Exception as e:  # a broken build must show up in the table, not end the run
            ok, why = False, f"{type(e).__name__}: {e}"
        if not ok:
            return False, why
    return True, ""


def _under(name: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with every op forced to backend ``name`` (``auto`` ignores YOLOFAST_BACKEND* too)."""
    from yolofast.ops import backend

    def run():
        with backend(name):
            return fn()

    return run


SLOWDOWN_ENV = "YOLOFAST_BENCH_SLOWDOWN"
_SLOWABLE = (*_NEEDS, "train_step")


def slowdowns(value: str | None = None) -> dict[str, float]:
    """``YOLOFAST_BENCH_SLOWDOWN=op:factor[,op:factor]`` (test only) -> {op: factor}.

    It exists to test the regression check itself: every call of the fused (non-reference) variants of
    benchmark op ``op`` takes ``factor`` times as long (``slowed``), so a known slowdown can be planted
    and its verdict measured (benchmarks/false_alarm_study.py). The reference is never slowed."""
    value = os.environ.get(SLOWDOWN_ENV, "") if value is None else value
    out = {}
    for part in filter(None, (x.strip() for x in value.split(","))):
        op, sep, factor = part.partition(":")
        try:
            f = float(factor) if sep else math.nan
        except ValueError:
            f = math.nan
        if op not in _SLOWABLE or not f >= 1.0 or math.isinf(f):
            raise ValueError(f"{SLOWDOWN_ENV}={value!r}: give op:factor with op one of "
                             f"{', '.join(_SLOWABLE)} and factor >= 1, e.g. bbox_loss:1.3")
        out[op] = f
    return out


def slowed(fn: Callable[[], object], factor: float, device: str = "cpu") -> Callable[[], object]:
    """``fn`` made ``factor`` times as slow on every call: it runs once, then busy-waits
    ``(factor - 1)`` x the time it took, on the clock the runner times it with (``clock.py``: CPU time at
    1 CPU thread, else wall time; CUDA: synchronized wall time).

    Why a busy-wait and not repeated calls: a real 1.3x regression costs 1.3x on every call. Running the
    call twice on 3 of every 10 calls gives the same mean but a 1x/2x mixture, so a block of a few calls -
    what a round times - is anywhere between 1x and 2x, and a burst-robust estimator (the fastest block
    of a round) mostly sees the 1x blocks: it under-states the slowdown and adds spread the real thing
    does not have. The wait scales with the call's own time, so the slowed variant feels the machine's
    load as the real one would, and on the CPU clock it burns CPU time (a sleep would not count)."""
    if factor == 1.0:
        return fn
    import torch

    from yolofast.bench import clock as bench_clock

    cuda = str(device).startswith("cuda")

    def run():
        clock = bench_clock.now(bench_clock.clock_name(device, torch.get_num_threads()))
        if cuda:
            torch.cuda.synchronize()
        t0 = clock()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        until = t0 + factor * (clock() - t0)
        while clock() < until:
            pass
        return out

    run.factor = factor  # what tests read back
    return run


def _backend_variants(op: str, device: str, make_fn, backends) -> list[Variant]:
    factor = slowdowns().get(op, 1.0)
    out = []
    for name in backends:
        ok, why = op_availability(op, name, torch.device(device).type)
        fn = _under(name, make_fn()) if ok else None
        if fn is not None and name != "ref" and factor != 1.0:
            fn = slowed(fn, factor, device)
            why = f"slowed {factor:g}x by {SLOWDOWN_ENV}"
        out.append(Variant(name, fn, why))
    return out


def _loss_cases(p: Preset, device: str, seed: int, backends, ops) -> list[Case]:
    from yolofast.loss import DetectionLoss
    from yolofast.ops import bbox_loss, tal_assign

    li = bench_inputs.loss_inputs(p, seed, device)
    cases = []
    if "tal_assign" in ops:
        args = li.assign_args()

        def make_assign():
            return lambda: tal_assign(*args)

        variants = _backend_variants("tal_assign", device, make_assign, backends)
        cases.append(Case(p, "tal_assign", device, variants, what="tal_assign forward (no gradient)"))
    if "bbox_loss" in ops:
        _, _, anc, tb, ts, fg = li.loss_args()

        def make_loss():
            pd = li.pred_dist.clone().requires_grad_(True)
            ps = li.pred_scores.clone().requires_grad_(True)

            def run():
                pd.grad = ps.grad = None
                bbox_loss(pd, ps, anc, tb, ts, fg).sum().backward()

            return run

        cases.append(Case(p, "bbox_loss", device, _backend_variants("bbox_loss", device, make_loss, backends),
                          what="bbox_loss forward + backward, targets from the reference assigner"))
    if "loss_step" in ops:
        crit = DetectionLoss(p.nc)
        batch = li.batch()

        def make_step():
            feats = [f.requires_grad_(True) for f in li.feats()]

            def run():
                for f in feats:
                    f.grad = None
                crit(feats, batch)[0].backward()

            return run

        cases.append(Case(p, "loss_step", device, _backend_variants("loss_step", device, make_step, backends),
                          what="DetectionLoss on the head maps (decode, assign, losses) forward + backward"))
    return cases


def _e2e_feats(li) -> list[torch.Tensor]:
    """reg_max 1 head maps (B, 4 + C, H_i, W_i) of the same predictions: the DFL expectation of each side
    as the raw distance, then the class logits."""
    from yolofast.ops.reference import bbox_decode

    zero = torch.zeros(1, 2, dtype=li.pred_dist.dtype, device=li.pred_dist.device)
    ltrb = bbox_decode(li.pred_dist, zero)  # (-l, -t, r, b) about a zero anchor
    dist = torch.cat((-ltrb[..., :2], ltrb[..., 2:]), -1)
    pred = torch.cat((dist, li.pred_scores), -1).transpose(1, 2)  # (B, 4 + C, A)
    out, a0 = [], 0
    for h, w in li.level_shapes:
        out.append(pred[..., a0 : a0 + h * w].reshape(pred.shape[0], pred.shape[1], h, w).contiguous())
        a0 += h * w
    return out


def _loss26_case(p: Preset, device: str, seed: int, backends) -> Case:
    """YOLO26's loss step: E2EDetectionLoss (one-to-many top-k 10, one-to-one top-k 7 + topk2 1, reg_max 1)
    on both branches' maps, forward + backward."""
    from yolofast.loss import E2EDetectionLoss

    li = bench_inputs.loss_inputs(p, seed, device)
    crit = E2EDetectionLoss(p.nc)
    batch = li.batch()
    base = _e2e_feats(li)

    def make_step():
        preds = {k: [f.clone().requires_grad_(True) for f in base] for k in ("one2many", "one2one")}

        def run():
            for fs in preds.values():
                for f in fs:
                    f.grad = None
            crit(preds, batch)[0].backward()

        return run

    return Case(p, "loss26_step", device, _backend_variants("loss26_step", device, make_step, backends),
                what="E2EDetectionLoss (YOLO26, both heads: decode, assign, losses) forward + backward")


def _ema_case(p: Preset, device: str, seed: int, backends) -> Case:
    from yolofast.ops import ema_update

    ei = bench_inputs.ema_inputs(p, seed, device)
    # A 0-d float64 tensor on the device, as ModelEMA passes it.
    d = torch.tensor(ei.decay, dtype=torch.float64, device=device)

    def make_ema():
        # As ModelEMA calls it: on the CPU over the separate tensors (the multi-tensor kernel, the same
        # tensors _foreach_lerp_ gets), elsewhere over the flat buffers.
        if torch.device(device).type == "cpu":
            return lambda: ema_update(ei.ema_list, ei.model_list, d)
        return lambda: ema_update(ei.ema_flat, ei.model_flat, d)

    variants = _backend_variants("ema_update", device, make_ema, backends)
    scratch = torch.empty_like(ei.ema_flat)
    variants += [
        Variant("foreach_lerp", lambda: torch._foreach_lerp_(ei.ema_list, ei.model_list, 1 - ei.decay),
                f"torch._foreach_lerp_ over the {len(ei.ema_list)} separate tensors", baseline=True),
        Variant("copy", lambda: scratch.copy_(ei.model_flat), "one flat copy of the same bytes",
                baseline=True),
    ]
    return Case(p, "ema_update", device, variants,
                what=f"ema_update over {ei.numel / 1e6:.2f} M values ({p.model})")


def _step_case(p: Preset, device: str, seed: int) -> Case:
    """A model's train step: forward, its family's criterion (``criterion_for``: the v8 loss, or YOLO26's
    end-to-end loss), backward, clip 10, SGD step, zero_grad, EMA update."""
    from yolofast.engine.ema import ModelEMA
    from yolofast.engine.optim import build_optimizer
    from yolofast.engine.profiler import NullProfiler, StepProfiler
    from yolofast.loss import criterion_for
    from yolofast.nn import build_model
    from yolofast.ops._backend import describe

    si = bench_inputs.step_inputs(p, seed, device)
    torch.manual_seed(seed)
    base = build_model(p.model, nc=p.nc).to(device).train()
    crit = criterion_for(base)
    # The trainer's choice: bf16 autocast on CUDA, fp32 on CPU (CPU autocast is slower there).
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.startswith("cuda") else (
        contextlib.nullcontext)

    def make_step(prof=None):
        model = copy.deepcopy(base)
        opt = build_optimizer(model, "SGD", lr=0.01, momentum=0.937, decay=5e-4)[0]
        ema = ModelEMA(model)
        prof = prof or NullProfiler()  # the phase marks of the trainer's profile=True (profiler.py)

        def run():
            with amp():
                preds = model(si.img)
            prof.mark("forward")
            total, _ = crit(preds, si.batch)
            prof.mark("loss")
            total.backward()
            prof.mark("backward")
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ema.update(model)
            prof.mark("optimizer")

        return run

    def split(n: int) -> dict:
        """Seconds per phase over ``n`` auto-backend steps after one warm-up step (profile=True's split;
        the inputs are made before, so there is no data wait)."""
        prof = StepProfiler(device)
        step = _under("auto", make_step(prof))
        step()
        prof.reset()
        for _ in range(n):
            step()
        return prof.split()

    auto = ", ".join(f"{op}={b}" for op, b, _ in describe(torch.device(device).type))
    factor = slowdowns().get("train_step", 1.0)
    variants = [Variant("ref", _under("ref", make_step())),
                Variant("auto", slowed(_under("auto", make_step()), factor, device), auto)]
    return Case(p, "train_step", device, variants, items_per_call=p.batch, split=split,
                what=f"{p.model} train step (forward, loss, backward, SGD, EMA), B={p.batch}, {p.imgsz} px")


def build_cases(preset, device: str = "cpu", seed: int = 0, backends=None, ops=None) -> list[Case]:
    """The cases of one preset (name or Preset) on ``device``.

    backends: yolofast backends to time (default ``BACKENDS[device type]``; "ref" is always first);
    ops: restrict to these benchmark ops (default all of the preset's kind).
    """
    p = get_preset(preset) if isinstance(preset, str) else preset
    dtype = torch.device(device).type
    from yolofast.ops._backend import BACKENDS as KNOWN

    backends = tuple(backends or BACKENDS.get(dtype, ("ref",)))
    bad = [b for b in backends if b not in KNOWN]
    if bad:
        raise ValueError(f"unknown backend(s) {', '.join(bad)}; choose from {', '.join(KNOWN)}")
    if "ref" not in backends:
        backends = ("ref", *backends)
    backends = ("ref", *[b for b in backends if b != "ref"])
    ops = tuple(ops or p.ops)
    if p.kind in ("loss", "assign"):
        return _loss_cases(p, device, seed, backends, ops)
    if p.kind == "loss26":
        return [_loss26_case(p, device, seed, backends)] if "loss26_step" in ops else []
    if p.kind == "ema":
        return [_ema_case(p, device, seed, backends)] if "ema_update" in ops else []
    if p.kind == "step":
        return [_step_case(p, device, seed)] if "train_step" in ops else []
    if p.kind == "musgd":
        from yolofast.bench.musgd import musgd_case

        return [musgd_case(p, device, seed, _backend_variants)] if "musgd_step" in ops else []
    raise ValueError(f"preset {p.name}: unknown kind {p.kind!r}")
