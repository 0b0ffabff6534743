"""The whole ``ModelEMA.update`` of yolov8s (its Python included) against the two baselines of its goal.

    python benchmarks/bench_model_ema.py                 # 1 thread, 40 interleaved rounds
    python benchmarks/bench_model_ema.py --threads 2

Over the same tensors (the model's parameters and buffers, 11.2 M floats):
  update        ModelEMA.update(model): decay on the device, one multi-tensor kernel call on the CPU
  foreach_lerp  torch._foreach_lerp_(ema tensors, model tensors, 1 - d)   (goal: update <= 1.0x this)
  copy          one flat copy of the same bytes, flat_a.copy_(flat_b)      (goal: update <= 1.2x this)
Each round times every variant once, in turn; the ratios printed are medians of the per-round ratios, so
load that moves the whole round cancels. Absolute times on a shared machine are noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--model", default="yolov8s")
    args = ap.parse_args(argv)
    import torch

    from yolofast.engine.ema import ModelEMA
    from yolofast.nn import build_model
    from yolofast.ops._backend import describe

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(args.model, nc=80).train()
    ema = ModelEMA(model)
    ema.update(model)  # locates the model's tensors once, as in training
    floats = [t for t in ema._tensors if t.is_floating_point()]
    src = [t.detach() for t in ema._model_tensors(model) if t.is_floating_point()]
    lerp_a = [t.clone() for t in floats]
    n = sum(t.numel() for t in floats)
    flat_a, flat_b = torch.empty(n), torch.cat([t.reshape(-1) for t in src])
    w = 1 - 0.9999 * 0.5
    variants = {
        "update": lambda: ema.update(model),
        "foreach_lerp": lambda: torch._foreach_lerp_(lerp_a, src, w),
        "copy": lambda: flat_a.copy_(flat_b),
    }
    times = {k: [] for k in variants}
    for fn in variants.values():
        fn()
    for _ in range(args.rounds):
        for k, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ema_op = next((b for op, b, _ in describe("cpu") if op == "ema_update"), "?")
    print(f"ModelEMA.update of {args.model} ({n / 1e6:.2f} M floats, {len(floats)} tensors), "
          f"ema_update={ema_op}, {args.threads} thread(s), {args.rounds} rounds; median ms: "
          + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    for base in ("foreach_lerp", "copy"):
        r = statistics.median(a / b for a, b in zip(times["update"], times[base]))
        print(f"  update / {base}: {r:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
