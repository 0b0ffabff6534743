"""CI performance gate: each fused CPU op must stay faster than its reference by its floor.

    python benchmarks/gate.py                  # run by .ci/run after the tests; exit 1 on a failure
    python benchmarks/gate.py --write-floors --repeat 3                          # this build's ISA
    python benchmarks/gate.py --write-floors --repeat 1 --more-runs              # add one run to them
    python benchmarks/gate.py --write-floors --keys PRESET/OP[,...]              # only these, merged in
    YOLOFAST_CPU_ARCH=x86-64-v3 python benchmarks/gate.py --write-floors --repeat 3   # the AVX2 floors

One process, 1 thread (OMP/MKL and torch), reference and fused kernel interleaved round after round; the
speed-up of every "preset/op" in benchmarks/floors.json, with its seeded bootstrap interval over the
per-round ratios, against its floor for the ISA the C++ kernels were built for (``YOLOFAST_CPU_ARCH``,
default native: this CPU's). At or above the floor passes; below it the op is measured once more and
fails only when it is below again (one load spike on a shared 2-core machine can move a whole run).
A floor sits halfway (geometrically) between the slowest healthy run measured for it and the median run
made 1.3x slower (``floor_from_runs``), so a 1.3x slower kernel fails and a healthy one passes. Ratios,
not absolute times, on the CPU-time clock (yolofast/bench/clock.py). The table and the CPU line are
printed whatever the outcome. A fused backend that is unavailable (no compiler, failed build) fails the
gate: the CPU kernels are required; ``YOLOFAST_GATE_ALLOW_MISSING=1`` turns that into a skip. Takes
~1 minute a measurement on the 2-core AMD EPYC (31-45 s, plus a re-measurement of any op under its floor;
the smaller presets where the big ones would take minutes: see floors.json).
"""

from __future__ import annotations

import os

# Before torch is imported: the OpenMP pool is sized at first use.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

FLOORS = Path(__file__).with_name("floors.json")
# What the gate times when floors.json is (re)created: every fused CPU op, at presets that fit the budget
# (the 1000/3000-GT dense scenes take 6-30 s per reference call at 1 thread; the 500-GT one ~0.5-1 s).
DEFAULT_KEYS = (
    "loss-b8-640-50gt/tal_assign",
    "loss-b8-640-50gt/bbox_loss",
    "loss-b8-640-50gt/loss_step",
    "loss26-b8-640-50gt/loss26_step",
    "assign-dense-b1-640-500gt/tal_assign",
    "ema-yolov8s/ema_update",
    "musgd-yolo26n/musgd_step",
)
# The slowdown a floor is placed to catch. A floor sits halfway (geometrically) between the slowest healthy
# run measured for it and the median run made CATCH x slower: sqrt(min x median / CATCH). With runs within
# 8 % of each other (min = 0.92 x median) that is 0.84 x median: a healthy run must come in 9 % under the
# slowest one seen (twice: the gate re-measures) to fail, and a 1.3x slower one (0.77 x median) 9 % over
# its expected speed-up to pass. The old rule, 85 % of the slowest run, sat at 0.78 x median in that case:
# on top of a 1.3x slower run, half of which passed.
CATCH = 1.3
ROUNDS = 15
NOTE = ("Per ISA of the C++ build (YOLOFAST_CPU_ARCH; native: this CPU's flags): each op's floor = "
        "sqrt(lowest x median / catch) of the speed-ups (1 thread, CPU time, paired rounds) of the runs "
        "listed: halfway between the slowest healthy run and a median run made `catch` x slower. An op "
        "under its floor is re-measured once and fails only when under again. The gate's dense scene is "
        "B=1, 640 px, 500 GT: the 1000/3000-GT presets need 6-30 s per reference call at 1 thread.")


def floor_from_runs(runs: list[float], catch: float = CATCH) -> float:
    """The floor of one op from its healthy speed-ups: sqrt(lowest x median / ``catch``)."""
    return round(math.sqrt(min(runs) * statistics.median(runs) / catch), 2)


def separates(runs: list[float], catch: float = CATCH) -> bool:
    """Whether the runs are steady enough for a floor to tell a healthy run from one ``catch`` x slower:
    the slowest healthy run above the median slowed ``catch`` x."""
    return min(runs) > statistics.median(runs) / catch


def load_floors(path=FLOORS) -> dict:
    """floors.json: {"backend": "cpp", "rounds": R, "isa": {"avx2": {"floors": {"preset/op": {"floor":
    x, "measured": y}}, ...}, "avx512": {...}}} (an older file's flat "floors" applies to every ISA)."""
    from yolofast.bench.compare import read_json

    data = read_json(path, "create it with `python benchmarks/gate.py --write-floors`")
    sets = list((data.get("isa") or {}).values()) if isinstance(data, dict) else []
    sets = sets or ([data] if isinstance(data, dict) and "floors" in data else [])
    if not sets or not all(isinstance(e, dict) and isinstance(e.get("floors"), dict) and e["floors"]
                           for e in sets):
        raise ValueError(f"{path}: needs a non-empty 'floors' object of 'preset/op': {{'floor': x}} per ISA "
                         "under 'isa' (avx2, avx512); rewrite it with `python benchmarks/gate.py "
                         "--write-floors`")
    return data


def floor_values(data: dict, isa: str | None = None) -> dict:
    """{"preset/op": floor} for ``isa`` (default: the ISA of this build)."""
    from yolofast.bench.floors import build_isa, floors_for_isa

    return floors_for_isa(data, isa or build_isa())[0]


MIN_ROUND_S = 0.1  # a fused call of ~5 ms is timed 20 times per round: one preemption cannot dominate


def measure(keys, backend: str = "cpp", rounds: int = 7, warmup: int = 1,
            progress: bool = True) -> list[dict]:
    """Rows (dicts) of ref and ``backend`` for every "preset/op" in ``keys``, 1 thread, no memory pass."""
    import torch

    from yolofast.bench.cases import build_cases
    from yolofast.bench.runner import Progress, run_cases

    torch.set_num_threads(1)
    by_preset: dict[str, list[str]] = {}
    for k in keys:
        preset, op = k.split("/")
        by_preset.setdefault(preset, []).append(op)
    prog = Progress(len(keys), enabled=progress)
    rows = []
    for preset, ops in by_preset.items():
        cases = build_cases(preset, "cpu", seed=0, backends=("ref", backend), ops=ops)
        # The gate only compares ref against the fused backend: baselines (EMA's foreach/copy) are skipped.
        for c in cases:
            c.variants = [v for v in c.variants if not v.baseline]
        rows += [r.to_dict() for r in run_cases(cases, rounds=rounds, warmup=warmup, memory=False,
                                                min_round_s=MIN_ROUND_S, progress=prog)]
    prog.done()
    return rows


def _write_floors(a, data: dict, keys: list[str], backend: str, rounds: int, measure_fn, out) -> int:
    """Measure ``--repeat`` times; per op, ``floor_from_runs`` of the runs' speed-ups, for the ISA of
    this build (the other ISAs' floors are kept)."""
    from yolofast.bench.floors import build_arch, build_isa, check_floors, cpu_report, format_gate

    runs: dict[str, list[float]] = {}
    for i in range(max(a.repeat, 1)):
        rows = measure_fn(keys, backend=backend, rounds=rounds, progress=not a.quiet)
        ok, results = check_floors(rows, dict.fromkeys(keys, 0.0), backend, allow_missing=False)
        if not ok:
            out(format_gate(results))
            out("gate: cannot write floors: a fused op did not run")
            return 1
        for r in results:
            runs.setdefault(r.key, []).append(r.speedup)
        out(f"run {i + 1}: " + ", ".join(f"{r.key} {r.speedup:.2f}x" for r in results))
    isa, catch = build_isa(), a.catch
    kept = ((data.get("isa") or {}).get(isa) or {}).get("floors") or {}
    if a.more_runs:
        for k in runs:
            runs[k] = list((kept.get(k) or {}).get("runs") or []) + runs[k]
    new = {}
    for k, s in runs.items():
        med = statistics.median(s)
        new[k] = {"floor": floor_from_runs(s, catch), "measured": round(med, 2),
                  "runs": [round(x, 2) for x in s]}
        if len(s) > 1 and not separates(s, catch):
            new[k]["note"] = (f"the runs spread wider than {catch:g}x: this floor cannot tell a {catch:g}x "
                              "slower kernel from a healthy one here; re-measure on a quieter machine")
            out(f"warning: {k}: {new[k]['note']}")
    for old in ("floors", "measured_on"):  # the older flat form: replaced by per-ISA sets
        data.pop(old, None)
    data["note"] = NOTE
    how = (f"floor = sqrt(lowest x median / {catch:g}) of the speed-ups of {len(next(iter(runs.values())))} "
           f"runs of `{'YOLOFAST_CPU_ARCH=' + build_arch() + ' ' if build_arch() != 'native' else ''}"
           f"python benchmarks/gate.py --write-floors{' --keys ' + ','.join(new) if a.keys else ''}` "
           f"(--repeat, --more-runs; {rounds} rounds, 1 thread)")
    if a.keys and kept:  # these keys only: the set's other floors (and how they were set) stay as they are
        for k in new:
            new[k].update(how=how, measured_on=time.strftime("%Y-%m-%d"), cpu=cpu_report())
        data["isa"][isa]["floors"] = {**kept, **new}
    else:
        data.setdefault("isa", {})[isa] = {"floors": new, "arch": build_arch(), "cpu": cpu_report(),
                                           "measured_on": time.strftime("%Y-%m-%d"), "how": how}
    data.pop("margin", None)
    data["rounds"], data["catch"] = rounds, catch
    Path(a.floors).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    out(f"{isa} floors written to {a.floors}: " + ", ".join(f"{k} {v['floor']}x" for k, v in new.items()))
    return 0


def main(argv=None, measure_fn=measure, out=print) -> int:
    from yolofast.bench.floors import build_isa, check_floors, cpu_report, floors_for_isa, format_gate
    from yolofast.bench.runner import Row, format_table

    ap = argparse.ArgumentParser(prog="benchmarks/gate.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--floors", default=str(FLOORS), help="floors file (default: benchmarks/floors.json)")
    ap.add_argument("--rounds", type=int, default=0,
                    help=f"timing rounds (default: floors.json's, else {ROUNDS})")
    ap.add_argument("--repeat", type=int, default=3,
                    help="--write-floors: measure this many times and take each op's median speed-up")
    ap.add_argument("--catch", type=float, default=CATCH,
                    help="--write-floors: the slowdown the floors are placed to catch: floor = sqrt(lowest x "
                         f"median / CATCH) of the measured speed-ups (default {CATCH:g})")
    ap.add_argument("--more-runs", action="store_true",
                    help="--write-floors: add the new runs to the ones floors.json has for this ISA (split "
                         "--repeat 3 into short calls: --repeat 1, then --repeat 1 --more-runs twice)")
    ap.add_argument("--keys", metavar="PRESET/OP[,...]",
                    help="measure these keys only (also ones this ISA has no floor for yet); with "
                         "--write-floors, merge their floors into this ISA's set, keeping its other floors")
    ap.add_argument("--json", metavar="PATH", help="also write the measured rows here")
    ap.add_argument("--write-floors", action="store_true",
                    help="measure and rewrite the floors of this build's ISA (YOLOFAST_CPU_ARCH)")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    a = ap.parse_args(argv)

    try:
        data = load_floors(a.floors)
    except FileNotFoundError as e:
        if not a.write_floors:
            out(f"gate: error: {e}")
            return 2
        data = {"backend": "cpp", "rounds": ROUNDS, "isa": {}}
    except ValueError as e:
        out(f"gate: error: {e}")
        return 2
    backend = data.get("backend", "cpp")
    rounds = a.rounds or int(data.get("rounds", ROUNDS))
    isa = build_isa()
    if data.get("isa") or data.get("floors"):
        floors, source = floors_for_isa(data, isa)
    else:
        floors, source = dict.fromkeys(DEFAULT_KEYS, 0.0), "new file"
    if a.keys:
        keys = [k for k in a.keys.split(",") if k]
        if not a.write_floors and any(k not in floors for k in keys):
            out(f"gate: error: no {isa} floor for {[k for k in keys if k not in floors]}: set it with "
                "--write-floors --keys")
            return 2
        floors = {k: floors.get(k, 0.0) for k in keys}
    if a.write_floors:
        return _write_floors(a, data, list(floors), backend, rounds, measure_fn, out)
    allow_missing = os.environ.get("YOLOFAST_GATE_ALLOW_MISSING", "") == "1"

    t0 = time.perf_counter()
    rows = measure_fn(list(floors), backend=backend, rounds=rounds, progress=not a.quiet)
    secs = time.perf_counter() - t0
    out(f"yolofast CPU gate: {backend} vs ref, 1 thread, {rounds} interleaved rounds, {secs:.0f} s; "
        f"{source}")
    unfloored = [k for k in DEFAULT_KEYS if k not in floors and not a.keys]
    if unfloored:  # an op is gated per ISA only once it has a floor there
        out(f"not gated here (no {isa} floor; set one with --write-floors --keys): {', '.join(unfloored)}")
    out(cpu_report())
    out(format_table([Row.from_dict(r) for r in rows]))
    out("")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n", encoding="utf-8")

    ok, results = check_floors(rows, floors, backend, allow_missing=allow_missing)
    slow = [r.key for r in results if r.suspect]
    if slow:
        out(format_gate(results))
        out("re-measuring " + ", ".join(slow) + " once before failing")
        again = measure_fn(slow, backend=backend, rounds=rounds, progress=not a.quiet)
        out(format_table([Row.from_dict(r) for r in again]))
        _, retried = check_floors(again, {k: floors[k] for k in slow}, backend, allow_missing=allow_missing)
        first = {r.key: r for r in results}
        for r in retried:
            if r.verdict != "PASS":  # under its floor twice: a slower kernel, not one noisy run
                r.verdict = "FAIL"
                r.note = f"{r.note}; first run {first[r.key].speedup:.2f}x".lstrip("; ")
        by_key = {r.key: r for r in retried}
        results = [by_key.get(r.key, r) for r in results]
        ok = all(r.verdict in ("PASS", "SKIP") for r in results)
    out(format_gate(results))
    if ok:
        out("gate: PASS")
        return 0
    out(f"gate: FAIL (a fused CPU op fell under its {isa} floor or did not run); {cpu_report()}")
    out("floors are per ISA of the build; if this CPU kind is new to the gate, measure its floors with "
        "`python benchmarks/gate.py --write-floors --repeat 3` (with the same YOLOFAST_CPU_ARCH)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
