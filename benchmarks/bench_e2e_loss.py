"""YOLO26's loss step (both branches: decode, assign, losses, forward + backward): yolofast's
``E2EDetectionLoss`` next to Ultralytics' ``E2ELoss``.

    python benchmarks/bench_e2e_loss.py                       # yolofast default vs the reference path
    python benchmarks/bench_e2e_loss.py --ultralytics         # ... and vs Ultralytics' E2ELoss
    python benchmarks/bench_e2e_loss.py --ultralytics --threads 2 --rounds 9 --shapes b16-320-20gt

Ultralytics is never a dependency of yolofast: ``--ultralytics`` imports it (with YOLO_OFFLINE=1), and only
then, from a separate environment that reuses this torch. Inputs: the one-to-many and one-to-one heads' three
(B, 4 + 80, H, W) maps each (reg_max 1), random, requires_grad; GT as in bench_loss_vs_ultralytics.py (sides
log-uniform in 8..320 px). Variants, each from those leaves to their gradients:
- ``yolofast``: ``E2EDetectionLoss`` with the default backends (the ops route ``topk2`` and reg_max 1 to the
  reference until kernels implement them; the one-to-many assignment runs the selected backend);
- ``reference``: every op forced to the pure-PyTorch reference;
- ``ultralytics``: each branch's maps cat into its head's ``boxes`` (B, 4, A) / ``scores`` (B, 80, A), as its
  Detect.forward does in training, then ``E2ELoss``, backward to the maps.
Rounds are interleaved and each ratio is the median of the per-round ratios (never absolute times). The
losses of the first call are printed side by side: they must agree for the timing to mean anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import types

from bench_loss_vs_ultralytics import SHAPES as V8_SHAPES
from bench_loss_vs_ultralytics import make_inputs

# The YOLO26 goals' shapes: the v8 comparison's three and the dense scene (b2, 640 px, 1000 GT).
SHAPES = {**V8_SHAPES, "b2-640-1000gt": (2, 640, 1000)}

NC, STRIDES, EPOCHS = 80, (8, 16, 32), 100
BRANCHES = ("one2many", "one2one")


def make_e2e_inputs(batch: int, imgsz: int, n_gt: int, seed: int = 0):
    """({branch: [(B, 84, H, W)]}, padded GT for yolofast, flat GT for Ultralytics)."""
    import torch

    _, padded, flat = make_inputs(batch, imgsz, n_gt, seed)
    g = torch.Generator().manual_seed(seed + 1)
    maps = {br: [torch.randn(batch, 4 + NC, imgsz // s, imgsz // s, generator=g) for s in STRIDES]
            for br in BRANCHES}
    return maps, padded, flat


def _leaves(maps):
    return {br: [m.clone().requires_grad_(True) for m in ms] for br, ms in maps.items()}


def yolofast_step(maps, padded, backend_name: str | None):
    import contextlib

    from yolofast.loss import E2EDetectionLoss
    from yolofast.ops import backend

    leaves = _leaves(maps)
    crit = E2EDetectionLoss(NC, reg_max=1, strides=STRIDES, epochs=EPOCHS)

    def step():
        for ms in leaves.values():
            for f in ms:
                f.grad = None
        with backend(backend_name) if backend_name else contextlib.nullcontext():
            total, items = crit(leaves, padded)
        total.backward()
        return items

    return step


def v8_step(batch: int, imgsz: int, n_gt: int):
    """Our v8 loss step (DetectionLoss, reg_max 16, one head) at the same shape and GT: what a YOLO26 step
    (two heads) is compared with."""
    from yolofast.loss import DetectionLoss

    maps, padded, _ = make_inputs(batch, imgsz, n_gt)
    leaves = [m.clone().requires_grad_(True) for m in maps]
    crit = DetectionLoss(NC, strides=STRIDES)

    def step():
        for f in leaves:
            f.grad = None
        total, items = crit(leaves, padded)
        total.backward()
        return items

    return step


def ultralytics_criterion():
    """E2ELoss on a minimal model object: default.yaml's gains, epochs 100, a Detect-like last module (nc 80,
    reg_max 1, strides 8/16/32) -- all it reads."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    import torch
    from ultralytics.utils.loss import E2ELoss

    head = torch.nn.Module()
    head.nc, head.reg_max, head.stride = NC, 1, torch.tensor(STRIDES, dtype=torch.float32)
    model = torch.nn.Module()
    model.model = torch.nn.ModuleList([head])
    model.anchor = torch.nn.Parameter(torch.zeros(1))  # its losses take their device from a parameter
    model.args = types.SimpleNamespace(box=7.5, cls=0.5, dfl=1.5, epochs=EPOCHS)
    return E2ELoss(model)


def ultralytics_step(maps, flat):
    import torch

    crit = ultralytics_criterion()
    leaves = _leaves(maps)

    def head_out(ms):
        b = ms[0].shape[0]
        return {"boxes": torch.cat([m[:, :4].reshape(b, 4, -1) for m in ms], -1),
                "scores": torch.cat([m[:, 4:].reshape(b, NC, -1) for m in ms], -1), "feats": ms}

    def step():
        for ms in leaves.values():
            for f in ms:
                f.grad = None
        total, items = crit({br: head_out(ms) for br, ms in leaves.items()}, flat)
        total.sum().backward()
        return torch.stack(list(items.values())) if isinstance(items, dict) else items

    return step


def run(shape: str, variants: list[str], rounds: int, peak: bool = False) -> dict[str, float]:
    import torch

    batch, imgsz, n_gt = SHAPES[shape]
    maps, padded, flat = make_e2e_inputs(batch, imgsz, n_gt)
    steps = {}
    for v in variants:
        if v == "ultralytics":
            steps[v] = ultralytics_step(maps, flat)
        elif v == "v8":
            steps[v] = v8_step(batch, imgsz, n_gt)
        else:
            steps[v] = yolofast_step(maps, padded, "ref" if v == "reference" else None)
    items = {v: [round(float(x), 5) for x in fn()] for v, fn in steps.items() if v != "v8"}  # + the check
    print(f"{shape}: one-to-one items [box, cls, l1] " + "; ".join(f"{v} {it}" for v, it in items.items()),
          flush=True)
    # The process's CPU time at 1 thread (a neighbour's time slices on a shared machine are not charged to
    # the call), the wall clock at more (yolofast/bench/clock.py).
    from yolofast.bench.clock import clock_name, now

    kind = clock_name("cpu", torch.get_num_threads())
    clock = now(kind)
    times = {v: [] for v in variants}
    for _ in range(rounds):
        for v, fn in steps.items():
            t0 = clock()
            fn()
            times[v].append(clock() - t0)
    med = {v: statistics.median(t) for v, t in times.items()}
    out = {v: statistics.median(a / b for a, b in zip(times[v], times["yolofast"])) for v in variants
           if v != "yolofast"}
    cols = "  ".join(f"{v} {med[v] * 1e3:.1f} ms" for v in variants)
    vs = "  ".join(f"yolofast {out[v]:.2f}x faster than {v}" for v in out if v != "v8")
    if "v8" in out:  # the ratio v8 / yolofast26 per round: its inverse is what the YOLO26 step costs
        vs += f"  YOLO26 step = {1 / out['v8']:.2f}x our v8 step"
    print(f"{shape}: {torch.get_num_threads()} thread(s), {kind} clock, {rounds} rounds, median  {cols}\n"
          f"    {vs}", flush=True)
    if peak:
        from yolofast.bench.runner import _peak_one_call_cpu

        mb = {v: _peak_one_call_cpu(fn) for v, fn in steps.items()}
        line = "  ".join(f"{v} {m:.1f} MB" for v, m in mb.items() if m is not None)
        if mb.get("ultralytics") and mb.get("yolofast"):
            line += f"  Ultralytics / yolofast {mb['ultralytics'] / max(mb['yolofast'], 0.1):.1f}x"
        print(f"{shape}: peak memory of one call above the resident set  {line}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ultralytics", action="store_true",
                    help="also time Ultralytics' E2ELoss (imports ultralytics, installed separately)")
    ap.add_argument("--shapes", default="b16-320-20gt", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the reference path (seconds per call in the dense scenes)")
    ap.add_argument("--v8", action="store_true",
                    help="also time our v8 loss step (DetectionLoss, reg_max 16)")
    ap.add_argument("--peak", action="store_true", help="also the peak memory of one call of each variant")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"--shapes: unknown {bad}; choose from {', '.join(SHAPES)}")
    variants = ["yolofast"] + ([] if args.no_reference else ["reference"]) + (["v8"] if args.v8 else [])
    if args.ultralytics:
        try:
            import ultralytics  # noqa: F401
        except ImportError:
            print("--ultralytics: ultralytics is not importable here; install it in a separate venv that "
                  "reuses this torch (README, Benchmarks)", file=sys.stderr)
            return 2
        variants.append("ultralytics")
        torch.set_num_threads(args.threads)  # importing ultralytics may set OMP_NUM_THREADS
    for s in shapes:
        run(s, variants, args.rounds, args.peak)
    return 0


if __name__ == "__main__":
    sys.exit(main())
