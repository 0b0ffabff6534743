"""Compare two benchmark runs (``yolofast bench --compare old.json new.json``).

What is compared: for every fused row (a yolofast backend other than "ref"; baselines are context only)
its time RATIO to the reference of the same file when both files have that reference, since two runs on
these shared machines differ by up to 50 % in absolute time while the fused/ref ratio of one run is
stable; absolute medians only when a file has no reference row. A change whose whole bootstrap interval
(``stats.py``, seeded, from the rows' per-round ratios) lies past ``threshold`` (0.1 = the fused op got
10 % slower relative to the reference) is a regression, and so is a fused backend that ran in the old
file and is unavailable or failing in the new one. The CI gate's floors: ``floors.py``.

Both ``yolofast bench --json`` files and ``pytest benchmarks --benchmark-json`` files are accepted (the
latter matched by group, test name and its ``backend`` parameter).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from yolofast.bench import stats
from yolofast.bench.stats import CONFIDENCE, Sample

__all__ = [
    "Change",
    "row_sample",
    "compare",
    "compare_files",
    "decide_files",
    "format_compare",
    "load_results",
]


# ------------------------------------------------------------------------------------------ loading
def _from_pytest_benchmark(data: dict) -> list[dict]:
    """pytest-benchmark JSON -> rows: preset = group, op = test name without params, backend = the
    ``backend``/``impl``/``variant`` parameter or extra_info (benchmarks/conftest.py's ``measure`` records
    ``extra_info["variant"]``), else the bracketed id; ratios against the "ref" row of the same group+op;
    the per-round times when the file has them."""
    rows = []
    for b in data.get("benchmarks", []):
        params = b.get("params") or {}
        extra = b.get("extra_info") or {}
        name = b.get("name", "")
        base, _, ident = name.partition("[")
        backend = (params.get("backend") or extra.get("backend") or extra.get("variant")
                   or params.get("impl") or params.get("variant") or ident.rstrip("]") or "?")
        rows.append({
            "preset": b.get("group") or extra.get("preset") or "",
            "op": extra.get("op") or base,
            "backend": str(backend),
            "status": "ok",
            "baseline": bool(extra.get("baseline", False)),
            "median_ms": b["stats"]["median"] * 1e3,
            # Per-round times (written with --benchmark-save-data; benchmarks/conftest.py turns it on).
            # The tests of one group run one after the other, so their rounds do not pair up.
            "times_ms": [t * 1e3 for t in b["stats"].get("data") or []],
            "paired": False,
        })
    refs = {(r["preset"], r["op"]): r["median_ms"] for r in rows if r["backend"] == "ref"}
    for r in rows:
        ref = refs.get((r["preset"], r["op"]))
        r["ratio_vs_ref"] = r["median_ms"] / ref if ref else None
    return rows


def read_json(path, make_it: str):
    """The JSON in ``path``; a missing or unreadable file raises an error that ends with ``make_it``, the
    way to write a good one."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found; {make_it}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e}); {make_it}") from None


def load_results(path) -> dict:
    """{"source": "yolofast"|"pytest-benchmark", "rows": [...], "meta": {...}} from either kind of file."""
    data = read_json(path, "write one with `yolofast bench --json PATH` or `pytest benchmarks "
                           "--benchmark-json PATH`")
    if isinstance(data, dict) and "rows" in data:
        meta = {k: v for k, v in data.items() if k != "rows"}
        return {"source": "yolofast", "rows": data["rows"], "meta": meta}
    if isinstance(data, dict) and "benchmarks" in data:
        return {"source": "pytest-benchmark", "rows": _from_pytest_benchmark(data),
                "meta": {"git_commit": (data.get("commit_info") or {}).get("id"),
                         "timestamp": data.get("datetime")}}
    raise ValueError(f"{path}: neither a `yolofast bench --json` file (no 'rows') nor a pytest-benchmark "
                     "file (no 'benchmarks')")


# ------------------------------------------------------------------------------------------ compare
@dataclasses.dataclass
class Change:
    preset: str
    op: str
    backend: str
    metric: str  # "ratio" (fused/ref), "ms" (absolute median) or "" (not comparable)
    old: float | None
    new: float | None
    change: float | None  # new / old - 1 (> 0: slower)
    verdict: str  # "ok", "REGRESSION", "inconclusive", "improved", "lost", "new", "gone", "info"
    note: str = ""
    low: float | None = None  # the interval of ``change`` at ``confidence`` (None: none possible)
    high: float | None = None
    confidence: float = CONFIDENCE

    @property
    def suspect(self) -> bool:
        """Worth measuring again: called a regression, or past the threshold without certainty."""
        return self.verdict in ("REGRESSION", "inconclusive") and self.metric != ""


def _index(rows: list[dict]) -> dict:
    return {(r["preset"], r["op"], r["backend"]): r for r in rows}


def _ok(r: dict | None) -> bool:
    return r is not None and r.get("status", "ok") == "ok" and r.get("median_ms") is not None


def row_sample(row: dict, ref: dict | None) -> Sample:
    """The evidence of one row: its per-round paired ratios (``ratios``, else from both rows' per-round
    ``times_ms`` when they pair up), else the unpaired per-round times (pytest-benchmark's ``data``),
    else only its summary ratio. ``ref`` None: absolute per-round times."""
    if ref is None:
        t = row.get("times_ms") or []
        return Sample.paired(t) if t else Sample(summary=row["median_ms"])
    if row.get("ratios"):
        return Sample.paired(row["ratios"])
    a, b = ref.get("times_ms") or [], row.get("times_ms") or []
    if a and b and row.get("paired", True) and len(a) == len(b):
        return Sample.paired([y / x for x, y in zip(a, b)])
    if a and b:
        return Sample.unpaired(a, b)
    return Sample(summary=row["ratio_vs_ref"])


def compare(old: dict, new: dict, threshold: float = 0.1, confidence: float = CONFIDENCE,
            seed: int = stats.SEED) -> list[Change]:
    """Changes per (preset, op, backend) from ``old`` to ``new`` (results of ``load_results``), each with
    its bootstrap interval and the verdict of ``stats.verdict``."""
    if threshold < 0:
        raise ValueError(f"--threshold {threshold}: give a fraction >= 0, e.g. 0.1 for 10 %")
    if not 0.5 <= confidence < 1:
        raise ValueError(f"--confidence {confidence}: give a probability in [0.5, 1), e.g. 0.95")
    o, n = _index(old["rows"]), _index(new["rows"])
    out = []
    for key in list(o) + [k for k in n if k not in o]:
        preset, op, backend = key
        ro, rn = o.get(key), n.get(key)
        is_ref = backend == "ref"
        baseline = bool((ro or rn or {}).get("baseline"))
        if rn is None:
            out.append(Change(*key, "", None, None, None, "gone", "not in the new run"))
            continue
        if not _ok(rn):
            why = f"{rn.get('status', '?')}: {rn.get('note', '')}".strip(": ")
            lost = _ok(ro) and not is_ref and not baseline
            out.append(Change(*key, "", None, None, None, "lost" if lost else "info", why))
            continue
        if not _ok(ro):
            out.append(Change(*key, "", None, None, None, "new", "not measured in the old run"))
            continue
        ref_o, ref_n = o.get((preset, op, "ref")), n.get((preset, op, "ref"))
        use_ratio = (not is_ref and _ok(ref_o) and _ok(ref_n)
                     and ro.get("ratio_vs_ref") is not None and rn.get("ratio_vs_ref") is not None)
        metric = "ratio" if use_ratio else "ms"
        vo, vn = (ro["ratio_vs_ref"], rn["ratio_vs_ref"]) if use_ratio else (ro["median_ms"], rn["median_ms"])
        if is_ref or baseline:  # the reference / baselines only show how the machine moved
            out.append(Change(*key, metric, vo, vn, vn / vo - 1 if vo else None, "info"))
            continue
        so = row_sample(ro, ref_o if use_ratio else None)
        sn = row_sample(rn, ref_n if use_ratio else None)
        est = stats.shift(so, sn, confidence=confidence, seed=seed)
        out.append(Change(*key, metric, math.exp(so.point()), math.exp(sn.point()), est.change,
                          stats.verdict(est, threshold), est.why, est.low, est.high, confidence))
    return out


def regressions(changes: list[Change]) -> list[Change]:
    return [c for c in changes if c.verdict in ("REGRESSION", "lost")]


def _num(metric: str, v) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if metric == "ratio" else f"{v:.2f} ms"


def _pct(v) -> str:
    return "-" if v is None else f"{v * 100:+.1f}%"


def format_compare(changes: list[Change], threshold: float = 0.1) -> str:
    head = ("preset", "op", "backend", "metric", "old", "new", "change", "interval", "verdict")
    cells = []
    for c in changes:
        iv = "-" if c.low is None else f"[{_pct(c.low)}, {_pct(c.high)}]"
        verdict = c.verdict + (f" ({c.note})" if c.note else "")
        metric = {"ratio": "fused/ref", "ms": "median"}.get(c.metric, "-")
        cells.append((c.preset, c.op, c.backend, metric, _num(c.metric, c.old), _num(c.metric, c.new),
                      _pct(c.change), iv, verdict))
    widths = [max([len(h)] + [len(x[i]) for x in cells]) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in cells]
    conf = changes[0].confidence if changes else CONFIDENCE
    lines.append(f"fused/ref: the median over rounds of the fused time / the same round's reference time "
                 f"(lower is faster); interval: {conf * 100:g} % bootstrap interval of the change (seeded)")
    lines.append(f"REGRESSION: the whole interval is slower than the threshold ({threshold * 100:g}%); "
                 "inconclusive: the change is past it but the interval reaches below it")
    bad = regressions(changes)
    names = ", ".join(f"{c.preset}/{c.op}/{c.backend}" for c in bad)
    lines.append(f"{len(bad)} regression(s)" + (f": {names}" if bad else ""))
    unsure = [c for c in changes if c.verdict == "inconclusive"]
    if unsure:
        lines.append(f"{len(unsure)} inconclusive: "
                     + ", ".join(f"{c.preset}/{c.op}/{c.backend}" for c in unsure)
                     + " (re-run with more --rounds, or --compare ... --remeasure)")
    return "\n".join(lines)


def meta_differences(old: dict, new: dict) -> list[str]:
    """What differs between two runs' setups beyond the code (threads, device, torch): worth a warning,
    since a ratio also moves with them (2 threads on a busy 2-core box slow the fused kernels most)."""
    fields = {
        "threads": lambda m: m.get("threads"),
        "clock": lambda m: m.get("clock"),
        "heap_pages_kept": lambda m: m.get("heap_pages_kept"),
        "device": lambda m: (m.get("device") or {}).get("name"),
        "torch": lambda m: (m.get("versions") or {}).get("torch"),
    }
    out = []
    for name, get in fields.items():
        a, b = get(old), get(new)
        if a is not None and b is not None and a != b:
            out.append(f"the runs differ in {name}: {a} vs {b}")
    return out


def compare_files(old_path, new_path, threshold: float = 0.1, out=print, confidence: float = CONFIDENCE,
                  remeasure=None) -> int:
    """Print the comparison; 1 when a fused row regressed past ``threshold`` (or was lost), else 0.

    ``remeasure(new, suspects) -> rows``: measures the suspect (REGRESSION or inconclusive) rows again
    with the code installed now; each suspect is then decided, once, on the rounds of the first
    measurement and the re-measurement together (``pool_rows``)."""
    changes = decide_files(old_path, new_path, threshold, out, confidence, remeasure)
    return 1 if regressions(changes) else 0


def pool_rows(first: dict | None, again: dict) -> dict:
    """One row from a first measurement and its re-measurement: their rounds (and paired ratios) together.

    Why pool and not replace: the two runs are two looks at the same code, and a shift between runs on a
    shared machine moves one of them, not both. Deciding on the re-measurement alone threw away the first
    look: in 10 planted 1.3x slowdowns a caught one (+28 %) was re-measured at +21 % with an interval
    reaching +9 % and became "inconclusive". Pooled, the rounds of a real slowdown agree and the interval
    narrows; a healthy op that one run pushed past the threshold is diluted by the other run."""
    if not _ok(first) or not _ok(again):
        return again
    row = dict(again)
    row["times_ms"] = list(first.get("times_ms") or []) + list(again.get("times_ms") or [])
    if first.get("ratios") and again.get("ratios"):
        row["ratios"] = list(first["ratios"]) + list(again["ratios"])
    else:
        row.pop("ratios", None)
    return row


def decide_files(old_path, new_path, threshold: float = 0.1, out=print, confidence: float = CONFIDENCE,
                 remeasure=None) -> list[Change]:
    """``compare_files``' work: prints the table and returns the changes."""
    old, new = load_results(old_path), load_results(new_path)
    changes = compare(old, new, threshold, confidence)
    out(f"old: {old_path}\nnew: {new_path}")
    for w in meta_differences(old["meta"], new["meta"]):
        out(f"warning: {w}")
    sus = [c for c in changes if c.suspect]
    if remeasure is not None and sus:
        out(format_compare(changes, threshold))
        out("re-measuring " + ", ".join(f"{c.preset}/{c.op}/{c.backend}" for c in sus) + " once")
        again = _index(remeasure(new, sus))
        rows = _index(new["rows"])
        for c in sus:
            for b in (c.backend, "ref"):
                k = (c.preset, c.op, b)
                if k in again:
                    rows[k] = pool_rows(rows.get(k), again[k])
        redo = {(c.preset, c.op, c.backend): c
                for c in compare(old, {**new, "rows": list(rows.values())}, threshold, confidence)}
        for i, c in enumerate(changes):
            if c in sus:
                r = redo[(c.preset, c.op, c.backend)]
                first = f"first run and re-measurement pooled (first: {c.verdict} {_pct(c.change)})"
                r.note = "; ".join(filter(None, [r.note, first]))
                changes[i] = r
    out(format_compare(changes, threshold))
    return changes
