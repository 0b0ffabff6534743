"""How often does ``yolofast bench --compare`` cry wolf, and how often does it catch a real slowdown?

    python benchmarks/false_alarm_study.py                       # 10 + 10 pairs, ~15 min on 2 busy cores
    python benchmarks/false_alarm_study.py --rounds 25 --min-round-seconds 0.1   # steadier, ~2.5x longer
    python benchmarks/false_alarm_study.py --pairs 3 --rounds 9  # a quick look
    python benchmarks/false_alarm_study.py --pair 0 --out runs/study   # one pair (~2 min), appended
    python benchmarks/false_alarm_study.py --summarise --out runs/study

Runs, one after another, as a user would (each a fresh ``yolofast bench ops ... --json`` process, 1
thread): per pair i, two runs A_i and B_i of the same code, then a run S_i with one op slowed by
``--factor`` through the test-only switch ``YOLOFAST_BENCH_SLOWDOWN`` (the slowed op rotates over
``--slow-ops``). Then, per pair, ``yolofast bench --compare A_i B_i`` (same commit: any regression is a
false alarm) and ``--compare B_i S_i`` (caught when the slowed op is a regression), first as is and then
with ``--remeasure`` (the suspects measured again in the environment of the new run). Interleaving the
healthy and slowed runs keeps a slow afternoon on the machine from landing on one side only.
Prints the counts and writes every file and verdict under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PRESETS = "loss-b8-640-50gt,ema-yolov8s"
OPS = "tal_assign,bbox_loss,ema_update"


def bench_run(path: Path, args, slowdown: str | None) -> None:
    env = dict(os.environ)
    env.pop("YOLOFAST_BENCH_SLOWDOWN", None)
    if slowdown:
        env["YOLOFAST_BENCH_SLOWDOWN"] = slowdown
    cmd = [sys.executable, "-m", "yolofast", "bench", "ops", "--preset", args.presets, "--ops", args.ops,
           "--threads", "1", "--rounds", str(args.rounds),
           "--min-round-seconds", str(args.min_round_seconds), "--no-memory", "--quiet", "--json", str(path)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)


def verdicts(old: Path, new: Path, args, slowdown: str | None, remeasure: bool) -> dict:
    """{"preset/op/backend": {change, interval, verdict}} of one --compare, in the new run's environment
    (so a re-measured slowed run is slowed again)."""
    from yolofast.bench.cli import remeasure_rows
    from yolofast.bench.compare import decide_files

    saved = os.environ.pop("YOLOFAST_BENCH_SLOWDOWN", None)
    if slowdown:
        os.environ["YOLOFAST_BENCH_SLOWDOWN"] = slowdown
    try:
        changes = decide_files(old, new, args.threshold, out=lambda *_: None,
                               remeasure=remeasure_rows if remeasure else None)
    finally:
        os.environ.pop("YOLOFAST_BENCH_SLOWDOWN", None)
        if saved is not None:
            os.environ["YOLOFAST_BENCH_SLOWDOWN"] = saved
    pct = "{:+.1%}".format
    return {f"{c.preset}/{c.op}/{c.backend}": {
        "change": pct(c.change), "interval": "-" if c.low is None else f"[{pct(c.low)}, {pct(c.high)}]",
        "verdict": c.verdict, "note": c.note} for c in changes if c.metric == "ratio"}


def run_pair(i: int, a, out: Path) -> dict:
    """Pair ``i``: runs A, B (same code) and S (one op slowed), and the verdicts of A->B and B->S."""
    op = [o for o in a.slow_ops.split(",") if o][i % len([o for o in a.slow_ops.split(",") if o])]
    sd = f"{op}:{a.factor:g}"
    files = {k: out / f"{k}{i}.json" for k in ("A", "B", "S")}
    load = [_loadavg()]
    t0 = time.perf_counter()
    for k, f in files.items():
        bench_run(f, a, sd if k == "S" else None)
    pair = {"pair": i, "slowed_op": op}
    for mode in ("first", "remeasured")[: 1 if a.no_remeasure else 2]:
        rem = mode == "remeasured"
        pair[f"same_{mode}"] = verdicts(files["A"], files["B"], a, None, rem)
        pair[f"slow_{mode}"] = verdicts(files["B"], files["S"], a, sd, rem)
    load.append(_loadavg())
    pair["loadavg_before_after"] = load
    pair["seconds"] = round(time.perf_counter() - t0)
    same = pair["same_first"]
    slow = {k: v for k, v in pair["slow_first"].items() if f"/{op}/" in k}
    print(f"pair {i} ({pair['seconds']} s, load {load[0]} -> {load[1]}): same commit "
          + ", ".join(f"{k.split('/')[1]} {v['change']} {v['verdict']}" for k, v in same.items())
          + f" | {op} x{a.factor:g}: " + ", ".join(f"{v['change']} {v['interval']} {v['verdict']}"
                                                  for v in slow.values()), flush=True)
    return pair


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def summarise(pairs: list[dict], factor: float, out=print) -> dict:
    """The counts over ``pairs``: same-commit pairs with a false regression, slowed pairs caught, per
    verdict mode ("first", "remeasured")."""
    summary = {}
    for mode in ("first", "remeasured"):
        if not all(f"same_{mode}" in p for p in pairs):
            continue
        false = sum(any(v["verdict"] == "REGRESSION" for v in p[f"same_{mode}"].values()) for p in pairs)
        caught = sum(any(v["verdict"] == "REGRESSION" for k, v in p[f"slow_{mode}"].items()
                         if f"/{p['slowed_op']}/" in k) for p in pairs)
        other = sum(any(v["verdict"] == "REGRESSION" for k, v in p[f"slow_{mode}"].items()
                        if f"/{p['slowed_op']}/" not in k) for p in pairs)
        unsure = sum(sum(v["verdict"] == "inconclusive" for v in p[f"same_{mode}"].values()) for p in pairs)
        summary[mode] = {"false_alarms": false, "caught": caught, "pairs": len(pairs),
                         "false_alarms_on_unslowed_ops_of_slowed_runs": other,
                         "inconclusive_rows_same_commit": unsure}
        out(f"{mode}: same-commit pairs with a false regression {false}/{len(pairs)}; "
            f"{factor:g}x slowdowns caught {caught}/{len(pairs)}; in the slowed runs an un-slowed op "
            f"flagged {other}/{len(pairs)}; inconclusive rows in same-commit pairs {unsure}")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/false_alarm_study.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--pair", type=int, metavar="I",
                    help="run only pair I and append it to OUT/pairs.jsonl (one short call per pair, e.g. "
                         "under `flock /tmp/core1.lock taskset -c 1`); --summarise counts them")
    ap.add_argument("--summarise", action="store_true", help="count the pairs in OUT/pairs.jsonl and exit")
    ap.add_argument("--factor", type=float, default=1.3, help="the planted slowdown of one op")
    ap.add_argument("--slow-ops", default=OPS, help="ops slowed in turn (one per slowed run)")
    ap.add_argument("--presets", default=PRESETS)
    ap.add_argument("--ops", default=OPS, help="the benchmark ops timed in every run")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--min-round-seconds", type=float, default=0.05)
    ap.add_argument("--threshold", type=float, default=0.1)
    ap.add_argument("--no-remeasure", action="store_true", help="count the first verdicts only")
    ap.add_argument("--out", default="runs/false_alarm_study",
                    help="folder for the files (runs/ is git-ignored)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "pairs.jsonl"
    if a.summarise:
        pairs = [json.loads(x) for x in log.read_text(encoding="utf-8").splitlines() if x.strip()]
        print(f"{len(pairs)} pairs in {log}; load average (1/5/15 min) before -> after each: "
              + "; ".join(" -> ".join(p["loadavg_before_after"]) for p in pairs))
        summarise(pairs, a.factor)
        return 0
    if a.pair is not None:
        with log.open("a", encoding="utf-8") as f:
            f.write(json.dumps({**run_pair(a.pair, a, out), "args": vars(a)}) + "\n")
        return 0
    t0 = time.perf_counter()
    record = {"args": vars(a), "pairs": [run_pair(i, a, out) for i in range(a.pairs)]}
    record["summary"] = summarise(record["pairs"], a.factor)
    record["seconds"] = round(time.perf_counter() - t0)
    (out / "summary.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"{record['seconds']} s; files and verdicts in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
