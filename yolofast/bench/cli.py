"""``yolofast bench``: fused ops against their references, the train step, and run-to-run comparison.

    yolofast bench                                   # ops at every CPU preset (table on stdout)
    yolofast bench all --threads 2 --json run.json   # ops + train step, results with versions and commit
    yolofast bench step --preset step-yolov8n-320-b16  # the train step, and where its time goes
    yolofast bench ops --preset loss-b8-640-50gt --rounds 9
    yolofast bench ops --device cuda                 # the GPU presets (B=16/64, 640 px)
    yolofast bench data --data coco128.yaml            # data pipeline samples/s per core vs Ultralytics
    yolofast bench --list                            # the presets
    yolofast bench --compare old.json new.json --threshold 0.1   # exit 1 on a regression
    yolofast bench --compare main.json branch.json --remeasure   # suspects measured again (this checkout)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["bench_main", "collect_meta", "parse_bench_args", "run_bench"]

SCHEMA = "yolofast-bench/1"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="yolofast bench",
        description="Time each fused op against its pure-PyTorch reference (interleaved rounds, medians, "
                    "ratios, peak memory), the train step (images/s), or compare two result files.",
    )
    ap.add_argument("what", nargs="?", default="ops", choices=("ops", "step", "all"),
                    help="ops: tal_assign/bbox_loss/loss_step/ema_update; step: whole train step; all: both")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    ap.add_argument("--preset", action="append", default=[], metavar="NAME",
                    help="a preset name (repeat or comma-separate); default: every preset of the device")
    ap.add_argument("--ops", default="",
                    help="comma list: only these benchmark ops of the presets (tal_assign, bbox_loss, "
                         "loss_step, ema_update, train_step); default all")
    ap.add_argument("--json", metavar="PATH", help="write the results (with versions, device, commit) here")
    # 1 thread and 15 rounds: on a busy 2-core machine 2 threads make the fused/ref ratio of one run move
    # by up to ~25 % (the OpenMP team waits for a core the neighbour holds); the bootstrap interval of the
    # comparison needs >= 5 rounds a side and narrows roughly as 1/sqrt(rounds).
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: torch's default)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds (median over them)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up calls per backend")
    ap.add_argument("--min-round-seconds", type=float, default=0.05,
                    help="a round gives each variant at least this much time (CPU time at 1 thread), in up "
                         "to 3 blocks alternating with the other variants' (default 0.05)")
    ap.add_argument("--max-case-seconds", type=float, default=60.0,
                    help="cap the rounds of a slow case at about this long (>= 3 rounds); 0: no cap")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generated inputs")
    ap.add_argument("--backends", default="",
                    help="comma list (default: ref,cpp on cpu; ref,cuda,triton on cuda)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    ap.add_argument("--list", action="store_true", help="list the presets and exit")
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"),
                    help="compare two --json (or pytest-benchmark) files; exit 1 past --threshold")
    ap.add_argument("--threshold", type=float, default=0.1,
                    help="regression threshold of --compare, a fraction (0.1: 10%% slower vs the ref); a "
                         "regression needs the whole --confidence interval of the slowdown above it")
    ap.add_argument("--confidence", type=float, default=0.95,
                    help="--compare: confidence of the bootstrap interval (default 0.95, seeded)")
    ap.add_argument("--remeasure", action="store_true",
                    help="--compare: measure a suspect (regression or inconclusive) case once more with "
                         "the code installed now, at the NEW file's threads/rounds/seed, and decide on the "
                         "rounds of both measurements together")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    return ap


def parse_bench_args(argv: list[str]) -> argparse.Namespace:
    """Flags as in the module docstring; ``key=value`` (the rest of the CLI's style) is accepted too."""
    conv = []
    for a in argv:
        m = re.fullmatch(r"([a-z][a-z_-]*)=(.*)", a)
        if m:
            key = m.group(1).replace("_", "-")
            conv += [f"--{key}"] + ([] if m.group(2).lower() in ("true", "") and key in (
                "no-memory", "list", "quiet") else [m.group(2)])
        else:
            conv.append(a)
    return _parser().parse_args(conv)


# ------------------------------------------------------------------------------------------ metadata
def _git_commit() -> tuple[str | None, bool | None]:
    """(HEAD commit, dirty) of the checkout holding this package; (None, None) outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        # --no-optional-locks: a read-only status (no index refresh written).
        st = subprocess.run(["git", "--no-optional-locks", "-C", str(root), "status", "--porcelain", "-uno"],
                            capture_output=True, text=True, timeout=30, check=True).stdout
        return head or None, bool(st.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def collect_meta(device: str, threads: int) -> dict:
    """versions, device, threads, git commit and a UTC timestamp for the JSON header."""
    import torch

    from yolofast import __version__

    commit, dirty = _git_commit()
    if device.startswith("cuda"):
        dev = {"type": "cuda", "name": torch.cuda.get_device_name(torch.device(device)),
               "cuda": torch.version.cuda}
    else:
        dev = {"type": "cpu", "name": _cpu_name(), "cores": os.cpu_count()}
    return {
        "schema": SCHEMA,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_dirty": dirty,
        "versions": {
            "yolofast": __version__,
            "torch": torch.__version__,
            "triton": _version("triton"),
            "python": platform.python_version(),
        },
        "platform": platform.platform(),
        "device": dev,
        "threads": threads,
        "slowdown": os.environ.get("YOLOFAST_BENCH_SLOWDOWN") or None,  # test-only planted slowdown
    }


# ------------------------------------------------------------------------------------------ running
def run_bench(args: argparse.Namespace, out=print) -> dict:
    """Run the benchmark described by parsed ``args``; print the table; return the JSON-able result."""
    import torch

    from yolofast.bench.cases import build_cases
    from yolofast.bench.presets import presets_for
    from yolofast.bench.runner import Progress, format_table, run_cases
    from yolofast.engine.profiler import format_split

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    device = args.device
    names = [n for p in args.preset for n in p.split(",") if n]
    presets = presets_for(args.what, torch.device(device).type, names)
    backends = [b for b in args.backends.split(",") if b] or None
    only = tuple(o for o in args.ops.split(",") if o)
    pending = [(p, op) for p in presets for op in p.ops if not only or op in only]
    if only and not pending:
        raise ValueError(f"--ops {args.ops}: none of the chosen presets has these ops")
    progress = Progress(len(pending), enabled=not args.quiet)
    meta = collect_meta(device, threads)
    t0 = time.perf_counter()
    rows, splits = [], {}
    n_split = max(3, min(args.rounds, 10))  # profiled train steps, after the timed rounds
    for p in presets:  # inputs built per preset and dropped after it: the dense scenes are large
        ops = tuple(op for op in p.ops if not only or op in only)
        if not ops:
            continue
        cases = build_cases(p, device, args.seed, backends, ops=ops)
        rows += run_cases(cases, rounds=args.rounds, warmup=args.warmup, memory=not args.no_memory,
                          seed=args.seed, threads=threads, max_case_s=args.max_case_seconds or None,
                          min_round_s=args.min_round_seconds,
                          progress=progress)
        for c in cases:  # where a train step's time goes: the same split as the trainer's profile=True
            if c.split is not None:
                splits[f"{p.name}/{c.op}"] = {"steps": n_split, "seconds": c.split(n_split)}
        del cases
    progress.done()
    from yolofast.bench.clock import clock_name
    from yolofast.bench.runner import keep_heap_pages

    meta.update(what=args.what, rounds=args.rounds, seed=args.seed, min_round_s=args.min_round_seconds,
                clock=clock_name(device, threads), heap_pages_kept=keep_heap_pages(),
                presets=[p.name for p in presets],
                seconds=round(time.perf_counter() - t0, 1))
    result = {**meta, "rows": [r.to_dict() for r in rows], "splits": splits}
    out(f"yolofast bench {args.what} on {meta['device']['name']} ({device}), {threads} thread(s), "
        f"torch {meta['versions']['torch']}, commit {(meta['git_commit'] or 'n/a')[:12]}"
        f"{' (dirty)' if meta['git_dirty'] else ''}")
    out(format_table(rows))
    for name, sp in splits.items():
        out(f"{name} time split over {sp['steps']} auto-backend steps: {format_split(sp['seconds'])}")
    return result


def remeasure_rows(new: dict, suspects) -> list[dict]:
    """Rows (dicts) of the suspects' fused backends and their references, measured again here with the
    settings recorded in the NEW file (threads, rounds, seed, device)."""
    import torch

    from yolofast.bench.cases import build_cases
    from yolofast.bench.runner import run_cases

    meta = new["meta"]
    if new["source"] != "yolofast":
        raise ValueError("--remeasure needs a `yolofast bench --json` file as NEW (a pytest-benchmark file "
                         "does not say how to rebuild its cases); re-run pytest instead")
    device = "cuda" if (meta.get("device") or {}).get("type") == "cuda" else "cpu"
    if meta.get("threads"):
        torch.set_num_threads(int(meta["threads"]))
    rows = []
    by_case: dict[tuple[str, str], set] = {}
    for c in suspects:
        by_case.setdefault((c.preset, c.op), set()).add(c.backend)
    for (preset, op), backends in by_case.items():
        cases = build_cases(preset, device, int(meta.get("seed", 0)), backends=("ref", *sorted(backends)),
                            ops=(op,))
        for case in cases:
            case.variants = [v for v in case.variants if v.name == "ref" or v.name in backends]
        rows += [r.to_dict() for r in run_cases(cases, rounds=int(meta.get("rounds", 15)), memory=False,
                                                seed=int(meta.get("seed", 0)),
                                                min_round_s=float(meta.get("min_round_s", 0.05)))]
    return rows


def bench_main(argv: list[str]) -> int:
    """Entry point of ``yolofast bench`` (argv: the arguments after ``bench``). Exit codes: 0 done,
    1 ``--compare`` found a regression, 2 bad arguments/files."""
    if argv and argv[0] == "data":  # the training data pipeline (samples/s per core), its own options
        from yolofast.data.bench import bench_data_main

        return bench_data_main(list(argv[1:]))
    try:
        args = parse_bench_args(list(argv))
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    if args.list:
        from yolofast.bench.presets import list_presets

        for p in list_presets():
            print(f"{p.name:30s} {p.kind:6s} {p.describe()}")
        return 0
    if args.compare:
        from yolofast.bench.compare import compare_files

        try:
            return compare_files(args.compare[0], args.compare[1], args.threshold,
                                 confidence=args.confidence,
                                 remeasure=remeasure_rows if args.remeasure else None)
        except (OSError, ValueError, KeyError) as e:
            print(f"yolofast bench: error: {e}", file=sys.stderr)
            return 2
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"yolofast bench: error: --device {args.device} but torch {torch.__version__} sees no CUDA "
              "device; use --device cpu", file=sys.stderr)
        return 2
    try:
        result = run_bench(args)
    except (KeyError, ValueError) as e:  # unknown preset/backend names
        print(f"yolofast bench: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"results written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(bench_main(sys.argv[1:]))
