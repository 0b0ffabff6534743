"""The whole ``ModelEMA.update`` of yolov8s (its Python included) against the two baselines of its goal.

    python benchmarks/bench_model_ema.py                 # 1 thread, 40 interleaved rounds, CPU-time clock
    python benchmarks/bench_model_ema.py --threads 2     # wall clock (CPU time would add up the threads)
    python benchmarks/bench_model_ema.py --parts         # also the kernel alone, to see the Python's share

Over the same tensors (the model's parameters and buffers, 11.2 M floats):
  update        ModelEMA.update(model): the whole call, one multi-tensor kernel call on the CPU
  foreach_lerp  torch._foreach_lerp_(EMA copy's tensors, model tensors, 1 - d)  (goal: update <= 1.0x this)
  copy          one flat copy of the same bytes, flat_a.copy_(flat_b)           (goal: update <= 1.2x this)
  op (--parts)  yolofast.ops.ema_update over prebuilt lists: the kernel and its dispatch, no ModelEMA
Timed as ``yolofast bench`` times every op (yolofast/bench/runner.py): per round each variant runs in up to
three blocks alternating with the others' (the order rotating per round) and keeps its fastest block; at 1
thread the clock is the process's CPU time (yolofast/bench/clock.py), so a neighbour's time slices on the
core are not charged to the call. A ratio printed is the median over rounds of the per-round ratio, so load
that moves the whole round cancels. Absolute times on a shared machine are noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--model", default="yolov8s")
    ap.add_argument("--parts", action="store_true", help="also time the kernel alone (op)")
    args = ap.parse_args(argv)
    import torch

    from yolofast.bench.cases import Case, Variant
    from yolofast.bench.clock import clock_name
    from yolofast.bench.presets import Preset
    from yolofast.bench.runner import time_case
    from yolofast.engine.ema import ModelEMA
    from yolofast.nn import build_model
    from yolofast.ops import ema_update
    from yolofast.ops._backend import describe

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(args.model, nc=80).train()
    ema = ModelEMA(model)
    ema.update(model)  # locates the model's tensors once, as in training
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    src = [named[n].detach() for n in ema._names]
    floats = [(e, m) for e, m in zip(ema._tensors, src) if e.is_floating_point()]
    lerp_a = [e.clone() for e, _ in floats]
    lerp_b = [m for _, m in floats]
    n = sum(t.numel() for t in lerp_b)
    flat_a, flat_b = torch.empty(n), torch.cat([t.reshape(-1) for t in lerp_b])
    w = 1 - 0.9999 * 0.5
    op_ema = [t.clone() for t in ema._tensors]
    d = torch.tensor(0.9999 * 0.5, dtype=torch.float64)
    variants = [
        Variant("update", lambda: ema.update(model)),
        Variant("foreach_lerp", lambda: torch._foreach_lerp_(lerp_a, lerp_b, w)),
        Variant("copy", lambda: flat_a.copy_(flat_b)),
    ]
    if args.parts:
        variants.append(Variant("op", lambda: ema_update(op_ema, src, d)))
    preset = Preset(f"model-ema-{args.model}", "ema", model=args.model)
    rows = {r.backend: r for r in time_case(Case(preset, "model_ema", "cpu", variants), rounds=args.rounds)}
    bad = [f"{k}: {r.note}" for k, r in rows.items() if r.status != "ok"]
    if bad:
        print("failed: " + "; ".join(bad), file=sys.stderr)
        return 1

    ema_op = next((b for op, b, _ in describe("cpu") if op == "ema_update"), "?")
    clock = clock_name("cpu", args.threads)
    print(f"ModelEMA.update of {args.model} ({n / 1e6:.2f} M floats, {len(floats)} float tensors of "
          f"{len(src)}), ema_update={ema_op}, {args.threads} thread(s), {args.rounds} rounds, {clock} clock; "
          "median ms: " + ", ".join(f"{k} {r.median_ms:.2f}" for k, r in rows.items()))
    for name in ("update", "op") if args.parts else ("update",):
        for base in ("foreach_lerp", "copy"):
            r = statistics.median(a / b for a, b in zip(rows[name].times_ms, rows[base].times_ms))
            print(f"  {name} / {base}: {r:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
