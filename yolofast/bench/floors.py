"""The CI gate's floors: per-ISA lookup, the decision against a floor, and what a failure prints.

A floor is a speed-up (reference time / fused time, 1 thread) that a fused CPU op must keep. The C++
kernels are compiled for one ISA (``-march=native`` by default, ``YOLOFAST_CPU_ARCH`` overrides it, e.g.
``x86-64-v3`` for AVX2), and their speed-ups differ by ISA (bbox_loss: ~1.5x on an AVX2 build, 3-5x on
AVX-512), so ``benchmarks/floors.json`` keeps one set of floors per ISA of the BUILD, not of the machine:
an x86-64-v3 build on an AVX-512 CPU is judged by the AVX2 floors.

The decision is ``stats``' (the same as ``--compare``'s, the floor standing in for the old run): a
measured speed-up at or above its floor passes; below it, it is a suspect - "FAIL" when the whole
bootstrap interval is under the floor, "SUSPECT" when the interval reaches above it - and the gate
measures every suspect once more and fails only when it is below its floor again.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

from yolofast.bench import stats
from yolofast.bench.stats import Sample

__all__ = [
    "ARCH_ENV",
    "GateResult",
    "build_arch",
    "build_isa",
    "check_floors",
    "cpu_report",
    "floors_for_isa",
    "format_gate",
]

ARCH_ENV = "YOLOFAST_CPU_ARCH"
ISAS = ("avx512", "avx2")  # slowest last: the fallback for an ISA without floors of its own
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16", "amx_tile",
              "amx_int8", "avx_vnni")


def build_arch() -> str:
    """The -march the C++ extension is (or will be) built with: ``$YOLOFAST_CPU_ARCH``, else "native"."""
    return os.environ.get(ARCH_ENV, "").strip() or "native"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compiler_macros(arch: str) -> set[str] | None:
    """The ISA macros the compiler defines for ``-march=arch`` (None without a compiler or for a name it
    does not know)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        return None
    try:
        res = subprocess.run([cxx, f"-march={arch}", "-dM", "-E", "-x", "c++", os.devnull],
                             capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return {m.group(1) for m in re.finditer(r"#define (__\w+__) 1", res.stdout)}


def build_isa(arch: str | None = None) -> str:
    """"avx512", "avx2" or "other": what the extension's code uses at ``arch`` (default ``build_arch()``).

    native: this CPU's flags (avx512f / avx2 in /proc/cpuinfo); a named arch: the compiler's macros for
    it (``__AVX512F__`` / ``__AVX2__``), else the x86-64-v4 / -v3 names."""
    arch = arch or build_arch()
    if arch == "native":
        flags = _cpu_flags()
        if "avx512f" in flags:
            return "avx512"
        return "avx2" if "avx2" in flags else "other"
    macros = _compiler_macros(arch)
    if macros is not None:
        if "__AVX512F__" in macros:
            return "avx512"
        return "avx2" if "__AVX2__" in macros else "other"
    if "v4" in arch or "avx512" in arch:
        return "avx512"
    return "avx2" if "v3" in arch else "other"


def cpu_report(arch: str | None = None) -> str:
    """One line for a failing gate: the CPU model, its SIMD flags and the build's arch/ISA."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    flags = _cpu_flags()
    shown = [f for f in _ISA_FLAGS if f in flags] or ["none of " + "/".join(_ISA_FLAGS[:3])]
    arch = arch or build_arch()
    return (f"CPU: {model}, {os.cpu_count()} cores; flags: {' '.join(shown)}; "
            f"kernels built with -march={arch} ({ARCH_ENV}; ISA {build_isa(arch)})")


def floors_for_isa(data: dict, isa: str) -> tuple[dict, str]:
    """({"preset/op": floor}, where they came from) of floors.json ``data`` for ``isa``.

    ``{"isa": {"avx2": {"floors": {...}}, "avx512": {...}}}``; an ISA without its own floors takes, per
    key, the lowest floor of the others (the slower ISA's), and says so. A file of the older flat form
    (``{"floors": {...}}``) applies to every ISA."""
    def values(floors: dict) -> dict:
        return {k: float(v["floor"] if isinstance(v, dict) else v) for k, v in floors.items()}

    by_isa = data.get("isa")
    if not isinstance(by_isa, dict) or not by_isa:
        return values(data["floors"]), "floors.json (one set for every ISA)"
    if isa in by_isa:
        return values(by_isa[isa]["floors"]), f"the {isa} floors"
    merged: dict[str, float] = {}
    for entry in by_isa.values():
        for k, v in values(entry["floors"]).items():
            merged[k] = min(merged.get(k, v), v)
    return merged, f"no {isa} floors: the lowest of {', '.join(sorted(by_isa))} per op"


@dataclasses.dataclass
class GateResult:
    key: str  # "preset/op"
    backend: str
    floor: float
    speedup: float | None
    verdict: str  # "PASS", "FAIL", "SUSPECT" (below the floor, interval reaching above), "SKIP"
    note: str = ""
    low: float | None = None  # the speed-up's bootstrap interval (None: too few rounds / no rounds)
    high: float | None = None
    rounds: list = dataclasses.field(default_factory=list)  # the per-round ratios it was decided on

    @property
    def suspect(self) -> bool:
        return self.verdict in ("FAIL", "SUSPECT") and self.speedup is not None


def _key(k: str) -> tuple[str, str]:
    if not re.fullmatch(r"[^/]+/[^/]+", k):
        raise ValueError(f"floors.json key {k!r} is not 'preset/op' (e.g. 'loss-b8-640-50gt/tal_assign')")
    preset, op = k.split("/")
    return preset, op


def _ok(r: dict | None) -> bool:
    return r is not None and r.get("status", "ok") == "ok" and r.get("median_ms") is not None


def judge(key: str, backend: str, floor: float, ratios: list | None, speedup: float | None,
          confidence: float = stats.CONFIDENCE) -> GateResult:
    """The verdict of one measured op against its floor (``ratios``: per-round fused/ref times)."""
    lo = hi = None
    if ratios:
        speedup, lo, hi = stats.versus_floor(Sample.paired(ratios), confidence)
    res = GateResult(key, backend, floor, speedup, "PASS", low=lo, high=hi, rounds=list(ratios or []))
    if speedup >= floor:
        return res
    below = f"speed-up {speedup:.2f}x < floor {floor:.2f}x"
    if hi is not None and hi >= floor:
        res.verdict, res.note = "SUSPECT", f"{below}, but its interval reaches {hi:.2f}x"
    else:
        res.verdict, res.note = "FAIL", below
    return res


def check_floors(rows: list[dict], floors: dict, backend: str = "cpp", allow_missing: bool = False,
                 confidence: float = stats.CONFIDENCE) -> tuple[bool, list[GateResult]]:
    """Every "preset/op" of ``floors`` ({key: floor speed-up}) against measured ``rows`` (dicts).

    Below the floor: FAIL or SUSPECT (``judge``); a fused row that errored, a reference that did not run,
    or no row at all FAIL; a fused backend that is unavailable FAILS too unless ``allow_missing`` (then
    SKIP). Returns (nothing below its floor or broken, results)."""
    idx = {(r["preset"], r["op"], r["backend"]): r for r in rows}
    results = []
    for k, floor in floors.items():
        preset, op = _key(k)
        floor = float(floor)
        ref, fused = idx.get((preset, op, "ref")), idx.get((preset, op, backend))
        if fused is None:
            results.append(GateResult(k, backend, floor, None, "FAIL", "not measured"))
        elif fused.get("status") == "n/a":
            results.append(GateResult(k, backend, floor, None, "SKIP" if allow_missing else "FAIL",
                                      f"{backend} unavailable: {fused.get('note', '')}"
                                      + ("" if allow_missing else " (YOLOFAST_GATE_ALLOW_MISSING=1 skips)")))
        elif not _ok(fused):
            why = f"{backend} failed: {fused.get('note')}"
            results.append(GateResult(k, backend, floor, None, "FAIL", why))
        elif not _ok(ref):
            results.append(GateResult(k, backend, floor, None, "FAIL", "the reference did not run"))
        else:
            s = fused.get("speedup") or ref["median_ms"] / fused["median_ms"]
            results.append(judge(k, backend, floor, fused.get("ratios"), s, confidence))
    return all(r.verdict in ("PASS", "SKIP") for r in results), results


def format_gate(results: list[GateResult]) -> str:
    head = ("preset/op", "backend", "speed-up", "interval", "floor", "verdict")
    cells = [(r.key, r.backend, "-" if r.speedup is None else f"{r.speedup:.2f}x",
              "-" if r.low is None else f"[{r.low:.2f}x, {r.high:.2f}x]", f"{r.floor:.2f}x",
              r.verdict + (f" ({r.note})" if r.note else "")) for r in results]
    widths = [max([len(h)] + [len(x[i]) for x in cells]) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    lines += ["  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip() for c in cells]
    return "\n".join(lines)
