"""GPU timing table of the hot ops: CUDA vs Triton vs the pure-PyTorch reference (DESIGN §6-7).

    python3 benchmarks/gpu_bench.py                      # on a GPU: B=16/64, 640 px, 80 classes, 50/1000 GT
    python3 benchmarks/gpu_bench.py --dry-run            # anywhere: tiny shapes on the CPU (checks this file)
    python3 benchmarks/gpu_bench.py --out table.md       # where the markdown table goes

Writes one markdown table (default: $OUT/gpu_table.md, else benchmarks/results/gpu_table.md) and prints it.
Per op and backend: the median of CUDA-event timings (wall clock on the CPU), the peak memory the call adds
(torch.cuda.max_memory_allocated), the speed-up over the reference, and whether the result agrees with the
reference's (integer outputs of the assigner exactly, losses to 1e-5). bbox_loss is timed forward +
backward, with DFL (reg_max 16) and, at the largest batch, YOLO26's L1 form (reg_max 1, raw distances) on
(B, A, .) tensors and on the head's maps (bbox_loss_maps, what the trainer calls);
ema_update over a yolov8s-sized flat fp32 state (11.2 M values), with torch._foreach_lerp_ over the
per-tensor state as an extra baseline. A backend that is not available, runs out of memory or fails
gets a row that says so; nothing here aborts the table.

Scenes are generated on the device (seeded): GT boxes with log-uniform sides (4 px up to ~4*imgsz/sqrt(n))
and aspect ratios 1/3..3; every anchor inside a GT predicts that GT's box (smallest containing GT, ~20 %
log-normal jitter per side) with its class scored around sigmoid(-1); other anchors predict small boxes and
background scores around sigmoid(-6) -- so the assigner sees realistic candidates, ties and conflicts.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout without an install
    sys.path.insert(0, str(REPO))

FULL = {"batches": (16, 64), "n_gts": (50, 1000), "imgsz": 640, "nc": 80, "ema": "yolov8s"}
DRY = {"batches": (1, 2), "n_gts": (3, 20), "imgsz": 64, "nc": 4, "ema": "tiny"}
STRIDES = (8, 16, 32)
REG_MAX = 16
BUDGET_S = 1.5  # timing per cell: stop after this much (at least MIN_REPS), at most MAX_REPS
MIN_REPS, MAX_REPS = 3, 25


# ------------------------------------------------------------------------------------------------ scenes
def _gen(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def make_scene(B: int, imgsz: int, nc: int, n_gt: int, device, seed: int = 0) -> dict:
    """Head outputs and padded targets of one scene, on ``device`` (see the module docstring)."""
    from yolofast.boxes import make_anchors

    g = _gen(device, seed)
    feats = [torch.empty(1, 1, imgsz // s, imgsz // s, device=device) for s in STRIDES]
    anc, st = make_anchors(feats, STRIDES)  # grid units, (A, 2) and (A, 1)
    A = anc.shape[0]
    anc_px = anc * st
    M = 16 * max(-(-n_gt // 16), 1)
    smax = min(0.8 * imgsz, max(32.0, 4.0 * imgsz / math.sqrt(max(n_gt, 1))))

    def U(*shape):
        return torch.rand(*shape, generator=g, device=device)

    side = torch.exp(math.log(4.0) + U(B, n_gt) * (math.log(smax) - math.log(4.0)))
    ar = torch.exp((U(B, n_gt) * 2 - 1) * math.log(3.0)).sqrt()
    cx, cy = U(B, n_gt) * imgsz, U(B, n_gt) * imgsz
    w, h = side * ar, side / ar
    xyxy = torch.stack((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2), -1).clamp(0, imgsz)
    xyxy[..., 2:] = torch.maximum(xyxy[..., 2:], xyxy[..., :2] + 1)
    gt = torch.zeros(B, M, 4, device=device)
    gt[:, :n_gt] = xyxy
    labels = torch.zeros(B, M, 1, device=device)
    labels[:, :n_gt, 0] = torch.randint(0, nc, (B, n_gt), generator=g, device=device).float()
    mask = torch.zeros(B, M, 1, device=device)
    mask[:, :n_gt] = 1

    # owner: the smallest real GT containing each anchor (-1: none), chunked to <= 2^26 anchor-GT pairs
    area = ((gt[..., 2] - gt[..., 0]) * (gt[..., 3] - gt[..., 1])).masked_fill(mask[..., 0] == 0, math.inf)
    best = torch.full((B, A), math.inf, device=device)
    owner = torch.full((B, A), -1, dtype=torch.long, device=device)
    step = max(1, (1 << 26) // max(B * A, 1))
    for m0 in range(0, M, step):
        bx = gt[:, m0 : m0 + step, None, :]
        inside = (
            (anc_px[:, 0] > bx[..., 0])
            & (anc_px[:, 1] > bx[..., 1])
            & (anc_px[:, 0] < bx[..., 2])
            & (anc_px[:, 1] < bx[..., 3])
        )
        a = torch.where(inside, area[:, m0 : m0 + step, None], math.inf)
        a_min, i_min = a.min(1)
        better = a_min < best
        best = torch.where(better, a_min, best)
        owner = torch.where(better, i_min + m0, owner)
    has = owner >= 0
    own = gt.gather(1, owner.clamp(min=0)[..., None].expand(B, A, 4))
    ltrb_gt = torch.cat((anc_px - own[..., :2], own[..., 2:] - anc_px), -1)
    jitter = torch.exp(torch.randn(B, A, 4, generator=g, device=device) * 0.2)
    ltrb_bg = (U(B, A, 4) * 2.5 + 0.5) * st
    ltrb = torch.where(has[..., None], ltrb_gt * jitter, ltrb_bg) / st
    t = ltrb.clamp(0.01, REG_MAX - 1 - 0.01)
    bins = torch.arange(REG_MAX, device=device, dtype=torch.float32)
    noise = 0.3 * torch.randn(B, A, 4, REG_MAX, generator=g, device=device)
    pred_dist = (-(bins - t[..., None]).abs() * 2.0 + noise).reshape(B, A, 4 * REG_MAX)
    pred_scores = torch.randn(B, A, nc, generator=g, device=device) - 6.0
    own_label = labels[..., 0].gather(1, owner.clamp(min=0)).long()
    fg_logit = torch.randn(B, A, generator=g, device=device) * 1.5 - 1.0
    cur = pred_scores.gather(2, own_label[..., None])[..., 0]
    pred_scores.scatter_(2, own_label[..., None], torch.where(has, fg_logit, cur)[..., None])
    return {
        "pred_dist": pred_dist,
        "pred_scores": pred_scores,
        "anc": anc,
        "stride": st,
        "labels": labels,
        "gt": gt,
        "mask": mask,
    }


def assign_args(sc: dict) -> tuple:
    from yolofast.ops.reference import bbox_decode

    pd_bboxes = bbox_decode(sc["pred_dist"], sc["anc"]) * sc["stride"]
    anc_px = sc["anc"] * sc["stride"]
    return (sc["pred_scores"].sigmoid(), pd_bboxes, anc_px, sc["labels"], sc["gt"], sc["mask"])


def loss_args(sc: dict, assigned: tuple) -> tuple:
    _, tb, ts, fg, _ = assigned
    return (sc["pred_dist"], sc["pred_scores"], sc["anc"], tb / sc["stride"], ts, fg)


# ---------------------------------------------------------------------------------------------- backends
def implementations(op: str, device_type: str) -> list[tuple[str, object, str]]:
    """(backend, callable or None, note) for ``op`` on ``device_type``: ref, then the fused ones."""
    from yolofast.ops import _backend

    # on the CPU (--dry-run) the GPU backends still get their "n/a: why" rows
    names = ["ref", "cuda", "triton"] if device_type == "cuda" else ["ref", "cpp", "cuda", "triton"]
    out = []
    for name in names:
        try:
            ok, why = _backend.availability(op, name, device_type)
        except Exception as e:  # noqa: BLE001 - a broken backend gets a row, not a crash
            ok, why = False, f"{type(e).__name__}: {e}"
        if not ok:
            out.append((name, None, why))
            continue
        out.append((name, _backend.implementation(op, name), why))
    return out


# ------------------------------------------------------------------------------------------------ timing
def _run_topk2(rows, dt, label, a_args):
    """tal_assign as YOLO26's one-to-one branch calls it (top-k 7, then topk2 1) on every backend."""
    ref_out, ref_ms = None, None
    for name, fn, note in implementations("tal_assign", dt):
        if fn is None:
            rows.append(("tal_assign topk2", label, name, f"n/a: {note}", None, None, "-"))
            continue
        try:
            with torch.no_grad():
                call = lambda fn=fn: fn(*a_args[:6], 7, 0.5, 6.0, 1e-9, topk2=1)  # noqa: E731
                out = call()
                ref_out = out if name == "ref" else ref_out
                agree = "reference" if name == "ref" else _agree_tal(out, ref_out)
                ms, peak, reps = measure(call, dt, warmup=1 if name == "ref" else 2)
            ref_ms = ms if name == "ref" else ref_ms
            rows.append(("tal_assign topk2", label, name, f"{reps} reps", ms, peak, agree, ref_ms))
        except Exception as e:  # noqa: BLE001
            msg = "OOM" if _is_oom(e) else f"failed: {type(e).__name__}: {str(e)[:120]}"
            rows.append(("tal_assign topk2", label, name, msg, None, None, "-"))
        _free(dt)


def _sync(device_type):
    if device_type == "cuda":
        torch.cuda.synchronize()


def measure(fn, device_type: str, warmup: int = 2) -> tuple[float, float | None, int]:
    """(median ms, peak MiB added by one call or None on the CPU, reps) of ``fn()``."""
    for _ in range(warmup):
        fn()
    _sync(device_type)
    peak = None
    if device_type == "cuda":
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        keep = fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        del keep
    times = []
    t_end = time.perf_counter() + BUDGET_S
    while len(times) < MAX_REPS and (len(times) < MIN_REPS or time.perf_counter() < t_end):
        if device_type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), peak, len(times)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def _free(device_type):
    gc.collect()
    if device_type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- the cells
def _agree_tal(out, ref) -> str:
    if ref is None:
        return "-"
    n = int((out[3] != ref[3]).sum()) + int((out[4] != ref[4]).sum())
    close = torch.allclose(out[2].float(), ref[2].float(), rtol=1e-5, atol=1e-6)
    return "exact" if n == 0 and close else f"{n} anchors differ" + ("" if close else ", scores differ")


def _agree_loss(out, ref) -> str:
    if ref is None:
        return "-"
    rel = float(((out.double() - ref.double()).abs() / ref.double().abs().clamp(min=1e-12)).max())
    return f"rel {rel:.1e}" + ("" if rel < 1e-5 else " (!)")


def l1_args(sc: dict, l_args: tuple) -> tuple:
    """YOLO26's (reg_max 1) loss inputs from the same scene: the raw distances are the DFL head's decoded
    sides (the expectation over its bins), the targets and scores the same."""
    B, A, R4 = sc["pred_dist"].shape
    bins = torch.arange(R4 // 4, device=sc["pred_dist"].device, dtype=torch.float32)
    raw = sc["pred_dist"].view(B, A, 4, R4 // 4).softmax(-1) @ bins
    return (raw, *l_args[1:])


def _run_loss(rows, dt, label, op, l_args, device, **extra):
    """op's rows: bbox_loss forward + backward on every backend; extra = the reg_max 1 geometry or {}."""
    from yolofast.ops.bbox_loss import REG_MAX1_BACKENDS

    pd = l_args[0].detach().clone().requires_grad_()
    ps = l_args[1].detach().clone().requires_grad_()
    upstream = torch.tensor([7.5, 0.5, 1.5], device=device)
    ref_loss, ref_ms = None, None
    for name, fn, note in implementations("bbox_loss", dt):
        if extra and fn is not None and name not in REG_MAX1_BACKENDS:
            fn, note = None, "no reg_max 1 kernel of this form (C++: the maps form, bbox_loss_maps)"
        if fn is None:
            rows.append((op, label, name, f"n/a: {note}", None, None, "-"))
            continue

        def step(fn=fn):
            pd.grad = ps.grad = None
            loss = fn(pd, ps, *l_args[2:], **extra)
            (loss * upstream).sum().backward()
            return loss

        try:
            loss = step().detach()
            if name == "ref":
                ref_loss = loss
            agree = "reference" if name == "ref" else _agree_loss(loss, ref_loss)
            ms, peak, reps = measure(step, dt)
            ref_ms = ms if name == "ref" else ref_ms
            rows.append((op, label, name, f"{reps} reps", ms, peak, agree, ref_ms))
        except Exception as e:  # noqa: BLE001
            msg = "OOM" if _is_oom(e) else f"failed: {type(e).__name__}: {str(e)[:120]}"
            rows.append((op, label, name, msg, None, None, "-"))
        _free(dt)


def _run_loss_maps(rows, dt, label, l_args, imgsz, device):
    """YOLO26's loss as the trainer calls it: bbox_loss_maps of reg_max 1 maps (B, 4 + nc, h, w), forward +
    backward, per backend (the CUDA and Triton kernels read the maps in place; the reference cats them)."""
    from yolofast.ops import backend, bbox_loss_maps

    raw, scores, anc, tb, ts, fg = l_args
    rows_all = torch.cat((raw, scores), -1).transpose(1, 2)  # (B, 4 + nc, A): built once, outside the timing
    feats, a0 = [], 0
    for s in STRIDES:
        h = w = imgsz // s
        f = rows_all[:, :, a0:a0 + h * w].reshape(raw.shape[0], -1, h, w)
        feats.append(f.contiguous().requires_grad_())
        a0 += h * w
    del rows_all
    upstream = torch.tensor([7.5, 0.5, 1.5], device=device)
    ref_loss, ref_ms = None, None
    for name, fn, note in implementations("bbox_loss", dt):
        if fn is None:
            rows.append(("bbox_loss_maps L1 fwd+bwd", label, name, f"n/a: {note}", None, None, "-"))
            continue

        def step(name=name):
            for f in feats:
                f.grad = None
            with backend(name):
                loss = bbox_loss_maps(feats, anc, tb, ts, fg, 1, strides=STRIDES)
            (loss * upstream).sum().backward()
            return loss

        try:
            loss = step().detach()
            ref_loss = loss if name == "ref" else ref_loss
            agree = "reference" if name == "ref" else _agree_loss(loss, ref_loss)
            ms, peak, reps = measure(step, dt)
            ref_ms = ms if name == "ref" else ref_ms
            rows.append(("bbox_loss_maps L1 fwd+bwd", label, name, f"{reps} reps", ms, peak, agree, ref_ms))
        except Exception as e:  # noqa: BLE001
            msg = "OOM" if _is_oom(e) else f"failed: {type(e).__name__}: {str(e)[:120]}"
            rows.append(("bbox_loss_maps L1 fwd+bwd", label, name, msg, None, None, "-"))
        _free(dt)


def run_scene(rows, device, B, imgsz, nc, n_gt, seed=0, l1=True, l1_maps=True):
    """The scene's rows: tal_assign (and its topk2 form), bbox_loss; l1: also YOLO26's reg_max 1 loss, and
    l1_maps its maps form."""
    dt = torch.device(device).type
    label = f"B={B}, {n_gt} GT"
    try:
        sc = make_scene(B, imgsz, nc, n_gt, device, seed)
        a_args = assign_args(sc)
    except Exception as e:  # noqa: BLE001
        rows.append(("scene", label, "-", f"generation failed: {type(e).__name__}: {e}", None, None, "-"))
        return
    # --- tal_assign
    impls = implementations("tal_assign", dt)
    ref_out, ref_ms, ref_peak, assigned = None, None, None, None
    for name, fn, note in impls:
        if fn is None:
            rows.append(("tal_assign", label, name, f"n/a: {note}", None, None, "-"))
            continue
        try:
            with torch.no_grad():
                out = fn(*a_args)
                if name == "ref":
                    ref_out = out
                agree = "reference" if name == "ref" else _agree_tal(out, ref_out)
                if assigned is None or name != "ref":
                    assigned = out  # a fused backend's assignment feeds the loss (cheaper than the ref's)
                ms, peak, reps = measure(lambda fn=fn: fn(*a_args), dt, warmup=1 if name == "ref" else 2)
            if name == "ref":
                ref_ms, ref_peak = ms, peak
            rows.append(("tal_assign", label, name, f"{reps} reps", ms, peak, agree, ref_ms, ref_peak))
        except Exception as e:  # noqa: BLE001
            msg = "OOM" if _is_oom(e) else f"failed: {type(e).__name__}: {str(e)[:120]}"
            rows.append(("tal_assign", label, name, msg, None, None, "-"))
        _free(dt)
    _run_topk2(rows, dt, label, a_args)
    # --- bbox_loss, forward + backward
    if assigned is None:
        rows.append(("bbox_loss", label, "-", "no assignment to build targets from", None, None, "-"))
        return
    l_args = loss_args(sc, assigned)
    del assigned, ref_out
    _run_loss(rows, dt, label, "bbox_loss fwd+bwd", l_args, device)
    if l1:
        l1a = l1_args(sc, l_args)
        _run_loss(rows, dt, label, "bbox_loss L1 fwd+bwd", l1a, device,
                  stride_tensor=sc["stride"], img_hw=(float(imgsz), float(imgsz)))
        if l1_maps:
            _run_loss_maps(rows, dt, label, l1a, imgsz, device)


def _ema_shapes(model: str) -> list[tuple[int, ...]]:
    if model == "tiny":
        return [(16, 3, 3, 3), (16,), (16,), (32, 16, 3, 3), (32,)]
    try:
        from yolofast.nn import build_model

        m = build_model(model, nc=80)
        return [tuple(t.shape) for t in m.state_dict().values() if t.is_floating_point()]
    except Exception:  # noqa: BLE001 - the model package is not there: the same size in layer-like chunks
        return [(256, 256, 3, 3)] * 18 + [(4000,)] * 5 + [(3232,)]


def run_ema(rows, device, model: str):
    dt = torch.device(device).type
    shapes = _ema_shapes(model)
    n = sum(math.prod(s) for s in shapes)
    label = f"{model} ({n / 1e6:.1f} M fp32)"
    g = _gen(device, 1)
    ema = torch.randn(n, generator=g, device=device)
    model_flat = ema + 0.01 * torch.randn(n, generator=g, device=device)
    decay = torch.tensor(0.9998, dtype=torch.float64, device=device)
    want = ema.clone()
    from yolofast.ops.reference import ema_update_ref

    ema_update_ref(want, model_flat, decay)
    impls = implementations("ema_update", dt)
    ema_list = [t.clone() for t in ema.split([math.prod(s) for s in shapes])]
    model_list = [t.clone() for t in model_flat.split([math.prod(s) for s in shapes])]

    def foreach(e, m, d):  # the per-tensor baseline of DESIGN §2.3 (same bytes, ~200 tensors)
        torch._foreach_lerp_(ema_list, model_list, 1 - 0.9998)

    impls.insert(1, ("foreach_lerp", foreach, "baseline"))
    ref_ms = None
    for name, fn, note in impls:
        if fn is None:
            rows.append(("ema_update", label, name, f"n/a: {note}", None, None, "-"))
            continue
        try:
            e = ema.clone()
            fn(e, model_flat, decay)
            agree = (
                "reference"
                if name == "ref"
                else ("-" if name == "foreach_lerp" else f"max |d| {float((e - want).abs().max()):.1e}")
            )
            ms, peak, reps = measure(lambda fn=fn, e=e: fn(e, model_flat, decay), dt)
            ref_ms = ms if name == "ref" else ref_ms
            rows.append(("ema_update", label, name, f"{reps} reps", ms, peak, agree, ref_ms))
        except Exception as e:  # noqa: BLE001
            msg = f"failed: {type(e).__name__}: {str(e)[:120]}"
            rows.append(("ema_update", label, name, msg, None, None, "-"))
        _free(dt)


# ------------------------------------------------------------------------------------------------- table
def render(rows, header: str) -> str:
    lines = [
        header,
        "",
        "| op | shape | backend | median ms | peak MiB | x ref | agrees with ref | note |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    for row in rows:
        op, shape, backend, note, ms, peak = row[:6]
        agree = row[6]
        ref_ms = row[7] if len(row) > 7 else None
        ms_s = f"{ms:.3f}" if ms is not None else "-"
        peak_s = f"{peak:.1f}" if peak is not None else "-"
        x = f"{ref_ms / ms:.1f}" if (ms and ref_ms and backend != "ref") else "-"
        lines.append(f"| {op} | {shape} | {backend} | {ms_s} | {peak_s} | {x} | {agree} | {note} |")
    return "\n".join(lines) + "\n"


def goals(rows) -> list[str]:
    """The GPU goals, judged on this table (only where both sides were measured)."""
    out = []
    for row in rows:
        if len(row) < 8 or row[4] is None or row[2] in ("ref", "foreach_lerp") or not row[7]:
            continue
        op, shape, backend, _, ms, peak, _, ref_ms = row[:8]
        if "B=64" in shape and op != "ema_update":
            out.append(f"- {op}, {shape}, {backend}: {ref_ms / ms:.1f}x the reference (goal >= 5x)")
        ref_peak = row[8] if len(row) > 8 else None
        if op == "tal_assign" and "1000 GT" in shape:
            mem = f"{ref_peak / peak:.0f}x less memory" if ref_peak and peak else "memory not measured"
            out.append(f"- {op}, {shape}, {backend}: {ref_ms / ms:.0f}x faster, {mem} (goal >= 50x both)")
    return out


def header_text(device, dry: bool) -> str:
    import importlib.util

    triton = "not installed"
    if importlib.util.find_spec("triton") is not None:
        import triton as _t

        triton = _t.__version__
    on_gpu = torch.device(device).type == "cuda"
    dev = torch.cuda.get_device_name(0) if on_gpu else platform.processor() or "cpu"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    kind = "DRY RUN (tiny shapes on the CPU; times meaningless)" if dry else "640 px, 80 classes"
    return (
        f"## yolofast GPU ops: CUDA vs Triton vs reference ({kind})\n\n"
        f"{when}; device: {dev}; torch {torch.__version__} (CUDA {torch.version.cuda}); triton {triton}; "
        f"Python {platform.python_version()}. Median of CUDA-event timings (>= {MIN_REPS} reps, "
        f"~{BUDGET_S} s per cell); peak MiB = memory one call adds (torch.cuda.max_memory_allocated); "
        "bbox_loss = forward + backward with targets from the assigner."
    )


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu_table.md" if out else REPO / "benchmarks" / "results" / "gpu_table.md"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (checks this script)")
    p.add_argument("--device", default=None, help="default: cuda, or cpu for --dry-run")
    p.add_argument("--out", default=None, help="markdown file (default: $OUT/ or benchmarks/results/)")
    p.add_argument("--batches", type=int, nargs="*", default=None)
    p.add_argument("--n-gt", type=int, nargs="*", default=None)
    args = p.parse_args(argv)
    cfg = dict(DRY if args.dry_run else FULL)
    device = args.device or ("cpu" if args.dry_run else "cuda")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device; use --dry-run to check the script on the CPU", file=sys.stderr)
        return 2
    batches = args.batches or cfg["batches"]
    n_gts = args.n_gt or cfg["n_gts"]
    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list[tuple] = []
    t0 = time.perf_counter()
    for B in batches:
        for n_gt in n_gts:
            with contextlib.suppress(KeyboardInterrupt):
                # YOLO26's reg_max 1 loss at the largest batch only, its maps form at the first GT count
                # only (the loss hardly depends on it): the step's time limit (gpu_check.sh)
                run_scene(rows, device, B, cfg["imgsz"], cfg["nc"], n_gt, l1=max(batches) == B,
                          l1_maps=n_gt == n_gts[0])
            print(f"gpu_bench: B={B}, {n_gt} GT done at {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    run_ema(rows, device, cfg["ema"])
    text = render(rows, header_text(device, args.dry_run))
    g = goals(rows)
    if g:
        head = "GPU goals (>= 5x at B=64; the assigner at 1000 GT >= 50x faster and in less memory):"
        text += "\n" + head + "\n" + "\n".join(g) + "\n"
    out = Path(args.out) if args.out else default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"gpu_bench: table written to {out} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
