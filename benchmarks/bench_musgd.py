"""The MuSGD goals, measured in one run (ratios, medians of interleaved rounds; the CPU is printed):

    PYTHONPATH=. ~/ultra-venv/bin/python benchmarks/bench_musgd.py          # with Ultralytics' MuSGD
    python benchmarks/bench_musgd.py --models yolo26n --threads 1 --rounds 5
    PYTHONPATH=. ~/ultra-venv/bin/python benchmarks/bench_musgd.py --threads 2 \
        --variants cpp ultralytics bmm_floor     # the goals alone (the reference takes seconds at 2 threads)

Per model and thread count (times are this process's CPU time, all threads summed, so that other jobs on a
shared machine do not count): one MuSGD step with the fused op (cpp), the matrix-by-matrix reference (ref),
Ultralytics' MuSGD (where importable) and the step's Newton–Schulz matmuls alone as plain torch.bmm
(bmm_floor); the fp32 mode (for CPUs without native bf16) against the fp32 matmuls alone; and the ops a step
dispatches (TorchDispatchMode; the fused op's internal matmuls are its own, so counted once).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from yolofast.bench.floors import cpu_report
from yolofast.bench.musgd import bmm_floor, count_dispatches, musgd_setup
from yolofast.ops import backend


def _variants(model: str) -> dict:
    out = {}
    for name in ("cpp", "ref"):
        opt, _ = musgd_setup(model)
        out[name] = (lambda o=opt, b=name: _under(b, o.step))
    opt32, _ = musgd_setup(model, ns_dtype=torch.float32)
    out["cpp_fp32"] = lambda o=opt32: _under("cpp", o.step)
    try:
        from ultralytics.optim import MuSGD as U

        uopt, _ = musgd_setup(model, optimizer_cls=U)
        out["ultralytics"] = uopt.step
    except ImportError:
        pass
    out["bmm_floor"] = bmm_floor(opt)
    out["bmm_floor_fp32"] = bmm_floor(opt, torch.float32)
    return out


def _under(name, fn):
    with backend(name):
        fn()


def measure(model: str, threads: int, rounds: int, only=None) -> dict:
    torch.set_num_threads(threads)
    fns = {k: f for k, f in _variants(model).items() if not only or k in only}
    for fn in fns.values():  # warm-up: lazy state, oneDNN primitive caches
        fn()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.process_time()  # CPU time: a shared machine's other jobs do not count
            fn()
            times[k].append(time.process_time() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def dispatches(model: str) -> dict:
    out = {}
    opt, _ = musgd_setup(model)
    opt.step()
    with backend("cpp"):
        out["cpp"] = count_dispatches(opt.step)
    try:
        from ultralytics.optim import MuSGD as U

        uopt, _ = musgd_setup(model, optimizer_cls=U)
        uopt.step()
        out["ultralytics"] = count_dispatches(uopt.step)
    except ImportError:
        pass
    return out


def _ratios(t: dict) -> list[str]:
    pairs = [("cpp vs Ultralytics {:.2f}x faster", "ultralytics", "cpp"),
             ("fp32 mode vs Ultralytics {:.2f}x faster", "ultralytics", "cpp_fp32"),
             ("cpp vs ref {:.2f}x faster", "ref", "cpp"), ("cpp / bmm_floor {:.2f}", "cpp", "bmm_floor"),
             ("fp32 mode / fp32 bmm_floor {:.2f}", "cpp_fp32", "bmm_floor_fp32")]
    return [text.format(t[a] / t[b]) for text, a, b in pairs if a in t and b in t]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["yolo26n", "yolo26s"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--variants", nargs="+", metavar="NAME",
                    help="time only these (cpp, ref, cpp_fp32, ultralytics, bmm_floor, bmm_floor_fp32)")
    a = ap.parse_args(argv)
    print(cpu_report())
    for model in a.models:
        for name, ops in dispatches(model).items():
            print(f"{model} {name}: {sum(ops.values())} ops dispatched per step: "
                  + ", ".join(f"{k} {v}" for k, v in ops.most_common(6)))
        for th in a.threads:
            t = measure(model, th, a.rounds, a.variants)
            line = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items())
            print(f"{model} {th} thread(s): {line}")
            print(f"{model} {th} thread(s): " + "; ".join(_ratios(t)))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
