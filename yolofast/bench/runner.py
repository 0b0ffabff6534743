"""Timing and peak memory of benchmark cases: warm-up, interleaved rounds, medians, ratios to the reference.

Why interleaved: on a shared 2-core machine two identical runs differ by up to 50 % in absolute time, but
the reference and the fused kernel timed alternately see the same slow and fast periods, so their ratio
is steadier. Each round times every variant in up to three alternating blocks (``time_case``; the order
rotates per round so none is always first after a cache-cold switch) and keeps each variant's fastest
block; a variant's time is the median over rounds and its speed-up the median over rounds of (reference
time / its time) in the same round. At 1 CPU thread the clock is the process's CPU time (``clock.py``).

Peak memory of one call:
- CUDA: ``torch.cuda.max_memory_allocated`` over the call minus what was allocated before it.
- CPU: measured in a fresh subprocess (``python -m yolofast.bench.runner --peak ...``): after one
  warm-up call it returns freed heap pages to the OS (``malloc_trim``), resets the kernel's high-water mark
  (``/proc/self/clear_refs``), makes the call and reads ``VmHWM - VmRSS(before)``. That counts every byte
  the call touched, including a C++ kernel's ``std::vector`` scratch that a tensor-allocator profile would
  miss. Linux only; elsewhere the column is empty.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

from yolofast.bench.cases import Case, build_cases

__all__ = ["Row", "format_table", "keep_heap_pages", "measure_peaks", "run_cases", "time_case"]


@dataclasses.dataclass
class Row:
    """One line of the table / one entry of the JSON ``rows``."""

    preset: str
    op: str
    backend: str
    device: str
    status: str = "ok"  # "ok", "n/a" (backend unavailable) or "error" (it raised)
    note: str = ""
    baseline: bool = False
    median_ms: float | None = None
    min_ms: float | None = None
    times_ms: list = dataclasses.field(default_factory=list)  # per round: its fastest block, per call
    clock: str = ""  # "cpu" (process CPU time, 1 thread) or "wall": see clock.py
    calls_per_round: int = 0
    speedup: float | None = None  # median over rounds of ref time / this time in the same round
    ratio_vs_ref: float | None = None  # 1 / speedup: fused/ref time (< 1 is faster)
    ratios: list = dataclasses.field(default_factory=list)  # per round: this time / the ref's (paired)
    peak_mb: float | None = None
    mem_saving: float | None = None  # the reference's peak / this peak (> 1: uses less)
    images_per_s: float | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Row:
        """A row from its JSON form (missing fields take their defaults, unknown ones are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw.setdefault("device", "cpu")
        return cls(**kw)


class Progress:
    """One progress line on stderr (rewritten in place on a terminal, one line per case otherwise)."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.i = 0
        self._last = 0

    def start(self, label: str) -> None:
        self.i += 1
        self.label = label
        if self.enabled and not self.tty:
            print(f"bench [{self.i}/{self.total}] {label}", file=self.stream, flush=True)

    def update(self, what: str) -> None:
        if self.enabled and self.tty:
            line = f"bench [{self.i}/{self.total}] {self.label}: {what}"
            self.stream.write("\r" + line[:150].ljust(self._last))
            self.stream.flush()
            self._last = min(len(line), 150)

    def done(self) -> None:
        if self.enabled and self.tty and self._last:
            self.stream.write("\r" + " " * self._last + "\r")
            self.stream.flush()


def _time_calls(fn, n: int, device: str, clock=time.perf_counter) -> float:
    """Seconds per call over ``n`` back-to-back calls (CUDA: device events around the whole batch; CPU:
    ``clock``, the process's CPU time at 1 thread, see clock.py)."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / n
    t0 = clock()
    for _ in range(n):
        fn()
    return (clock() - t0) / n


_HEAP_KEPT: bool | None = None


def keep_heap_pages() -> bool:
    """Make glibc's malloc keep freed memory in the process (mmap threshold 1 GiB, no trimming), once.

    Why: the reference ops allocate tens of MB of temporaries per call; by default glibc returns big
    blocks to the kernel and every call faults them back in. On the 2-core AMD EPYC (Zen 4) VM those page
    faults were 30-50 % of the tal_assign reference's CPU time (sys 180-470 ms next to 300-440 ms of
    user time, 80k-135k faults per call) and varied 2x with the machine's memory state: two runs of one
    commit moved its fused/ref ratio by up to 1.8x. Kept pages: 0 faults after the warm-up and 320-350 ms.
    A long-running trainer under tcmalloc/jemalloc behaves the same way, and it is the op's work, not the
    kernel's page zeroing, that a benchmark should compare. Both variants get the same allocator. Not
    glibc (or not Linux): nothing changes, and False."""
    global _HEAP_KEPT
    if _HEAP_KEPT is None:
        _HEAP_KEPT = False
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6")
            m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameter numbers
            _HEAP_KEPT = bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(
                libc.mallopt(m_trim_threshold, (1 << 31) - 1))
    return _HEAP_KEPT


CHUNKS = 3  # blocks per variant and round, alternated between the variants (ref, fused, ref, fused, ...)


def time_case(case: Case, rounds: int = 7, warmup: int = 1, min_round_s: float = 0.05,
              max_case_s: float | None = None, progress: Progress | None = None,
              chunks: int = CHUNKS) -> list[Row]:
    """Rows of one case: every available variant warmed up, then ``rounds`` interleaved rounds.

    A round gives a variant ``calls_per_round`` calls, chosen from the warm-up so they last >=
    ``min_round_s`` (at 0.05 s a 1 ms op is timed over 50 calls, a 1 s op once), in up to ``chunks``
    blocks that alternate with the other variants' blocks (ref, fused, ref, fused, ... in an order that
    rotates per round); the variant's time in the round is its fastest block's time per call. Why: a
    neighbour's burst slows one block, not the round, and the fastest of three blocks timed within ~0.1 s
    of the other variant's is the closest pair the machine allows (a 1 s reference call is one block).
    ``max_case_s`` caps the rounds of a slow case (the 3000-GT reference takes seconds per call) at about
    that many seconds, but never under 3 rounds. Ratios are taken against the case's "ref" variant. A
    variant that raises is reported as an "error" row. The clock: ``clock.py``.
    """
    from yolofast.bench.clock import clock_name, now

    if not case.device.startswith("cuda"):
        keep_heap_pages()
    clock = now(clock_name(case.device, torch.get_num_threads()))
    rows = {v.name: Row(case.preset.name, case.op, v.name, case.device, note=v.reason, baseline=v.baseline)
            for v in case.variants}
    live, round_s, blocks = [], 0.0, {}
    for v in case.variants:
        if not v.available:
            rows[v.name].status, rows[v.name].note = "n/a", v.reason or "unavailable"
            continue
        try:
            if progress:
                progress.update(f"warm-up {v.name}")
            t_warm = math.inf
            for _ in range(max(warmup, 1)):
                t_warm = min(t_warm, _time_calls(v.fn, 1, case.device, clock))
        except Exception as e:  # a kernel bug must show in the table, not end the benchmark
            rows[v.name].status, rows[v.name].note = "error", f"{type(e).__name__}: {e}"[:300]
            continue
        n = int(min(max(math.ceil(min_round_s / max(t_warm, 1e-7)), 1), 1000))
        k = max(1, min(chunks, n))
        blocks[v.name] = (k, math.ceil(n / k))  # (blocks per round, calls per block)
        rows[v.name].calls_per_round = k * blocks[v.name][1]
        round_s += n * t_warm
        live.append(v)

    if max_case_s is not None and round_s > 0:
        rounds = max(min(rounds, 3), min(rounds, int(max_case_s / round_s)))
    for r in range(rounds):
        k = r % len(live) if live else 0
        order = live[k:] + live[:k]
        best: dict[str, float] = {}
        for j in range(max((blocks[v.name][0] for v in live), default=0)):
            for v in order if j % 2 == 0 else order[::-1]:  # ABBA: neither side always first
                if rows[v.name].status != "ok" or j >= blocks[v.name][0]:
                    continue
                if progress:
                    progress.update(f"round {r + 1}/{rounds} {v.name}")
                try:
                    dt = _time_calls(v.fn, blocks[v.name][1], case.device, clock)
                    best[v.name] = min(best.get(v.name, math.inf), dt)
                except Exception as e:
                    rows[v.name].status, rows[v.name].note = "error", f"{type(e).__name__}: {e}"[:300]
        for name, dt in best.items():
            if rows[name].status == "ok":
                rows[name].times_ms.append(dt * 1e3)
    for row in rows.values():
        row.clock = clock_name(case.device, torch.get_num_threads())
        if row.status == "ok" and row.times_ms:
            row.median_ms = statistics.median(row.times_ms)
            row.min_ms = min(row.times_ms)
            if case.items_per_call:
                row.images_per_s = case.items_per_call / (row.median_ms / 1e3)
    fill_ratios(list(rows.values()))
    return list(rows.values())


def paired_speedup(ref_ms: list, ms: list) -> float | None:
    """Median over rounds of ref/this, each pair timed in the same round (seconds apart): a slow period of
    the machine hits both sides of a pair, so this is steadier than the ratio of the two medians, which
    is the fallback when the rounds do not pair up."""
    if ref_ms and len(ref_ms) == len(ms) and all(ms):
        return statistics.median(a / b for a, b in zip(ref_ms, ms))
    if ref_ms and ms:
        return statistics.median(ref_ms) / statistics.median(ms)
    return None


def fill_ratios(rows: list[Row]) -> None:
    """speedup / ratio_vs_ref / mem_saving of every row against the "ref" row of its (preset, op)."""
    refs = {(r.preset, r.op): r for r in rows if r.backend == "ref" and r.status == "ok"}
    for r in rows:
        ref = refs.get((r.preset, r.op))
        if ref is None or r.status != "ok":
            continue
        s = paired_speedup(ref.times_ms, r.times_ms)
        if s:
            r.speedup, r.ratio_vs_ref = s, 1 / s
        # Every round's ratio, kept so --compare and the gate can tell a shift from the rounds' spread.
        if r is not ref and len(ref.times_ms) == len(r.times_ms) and all(ref.times_ms):
            r.ratios = [round(b / a, 6) for a, b in zip(ref.times_ms, r.times_ms)]
        # Under 1 MB (in-place ops, page granularity) the ratio of two peaks is noise, not a saving.
        if r.peak_mb is not None and ref.peak_mb is not None and ref.peak_mb >= 1.0:
            r.mem_saving = ref.peak_mb / max(r.peak_mb, 0.1)


# ------------------------------------------------------------------------------------------ peak memory
def _proc_status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    with contextlib.suppress(OSError, AttributeError):  # not glibc: RSS may keep freed pages (overstates)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _peak_one_call_cpu(fn) -> float | None:
    """MB above the resident baseline touched by one call of ``fn`` (after a warm-up call)."""
    fn()
    gc.collect()
    if not _reset_hwm():
        return None
    base = _proc_status_kb("VmRSS")
    fn()
    hwm = _proc_status_kb("VmHWM")
    if base is None or hwm is None:
        return None
    return max(hwm - base, 0) / 1024


def _peak_one_call_cuda(fn) -> float:
    fn()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def _peaks_in_process(preset: str, op: str, seed: int, names: list[str]) -> dict:
    """The child's work: build the case here (CPU) and measure each named variant in turn."""
    out = {}
    for case in build_cases(preset, "cpu", seed, ops=(op,)):
        for v in case.variants:
            if v.name not in names or not v.available:
                continue
            try:
                out[v.name] = _peak_one_call_cpu(v.fn)
            except Exception:  # the timing pass reports the error; memory just stays empty
                out[v.name] = None
    return out


def measure_peaks(case: Case, seed: int = 0, threads: int | None = None, timeout_s: float = 1800) -> dict:
    """{variant: peak MB of one call} for the available variants of ``case`` (None where unmeasurable).

    CPU: one fresh subprocess per case, so earlier allocations of this process do not hide in the numbers.
    """
    names = [v.name for v in case.variants if v.available]
    if not names:
        return {}
    if case.device.startswith("cuda"):  # the caching allocator counts exactly: no fresh process needed
        out = {}
        for v in case.variants:
            if v.available:
                try:
                    out[v.name] = _peak_one_call_cuda(v.fn)
                except Exception:  # the timing pass reports the error
                    out[v.name] = None
        return out
    if not os.path.exists("/proc/self/clear_refs"):
        return dict.fromkeys(names)
    cmd = [sys.executable, "-m", "yolofast.bench.runner", "--peak", case.preset.name, case.op,
           ",".join(names), "--seed", str(seed), "--threads", str(threads or torch.get_num_threads())]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        line = [x for x in res.stdout.splitlines() if x.startswith("{")][-1]
        return {k: v for k, v in json.loads(line).items() if k in names}
    except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError):
        return dict.fromkeys(names)


# ------------------------------------------------------------------------------------------ whole runs
def run_cases(cases: list[Case], rounds: int = 7, warmup: int = 1, memory: bool = True, seed: int = 0,
              threads: int | None = None, max_case_s: float | None = None, min_round_s: float = 0.05,
              progress: Progress | None = None) -> list[Row]:
    """Time (and, with ``memory``, measure the peak of) every case; the rows of all cases in order."""
    rows = []
    for case in cases:
        if progress:
            progress.start(f"{case.preset.name} {case.op}")
        case_rows = time_case(case, rounds=rounds, warmup=warmup, min_round_s=min_round_s,
                              max_case_s=max_case_s, progress=progress)
        if memory:
            if progress:
                progress.update("peak memory")
            peaks = measure_peaks(case, seed=seed, threads=threads)
            for r in case_rows:
                if r.status == "ok":
                    r.peak_mb = peaks.get(r.backend)
            fill_ratios(case_rows)
        rows += case_rows
    if progress:
        progress.done()
    return rows


def _fmt(x, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def format_table(rows: list[Row]) -> str:
    """The human table: preset, op, backend, median ms, speed-up vs ref, peak MB, memory vs ref, images/s.

    A row whose backend did not run shows ``n/a (reason)`` or ``error (message)`` after its backend."""
    head = ("preset", "op", "backend", "median ms", "vs ref", "peak MB", "mem vs ref", "img/s")
    cells = []
    for r in rows:
        if r.status != "ok":
            cells.append((r.preset, r.op, r.backend, f"{r.status} ({r.note})" if r.note else r.status))
            continue
        cells.append((
            r.preset, r.op, r.backend + (" *" if r.baseline else ""),
            _fmt(r.median_ms, ".3f" if r.median_ms < 10 else ".1f"),
            _fmt(r.speedup, ".2f", "x"),
            _fmt(r.peak_mb, ".1f"),
            _fmt(r.mem_saving, ".1f", "x less") if r.backend != "ref" else "",
            _fmt(r.images_per_s, ".1f"),
        ))
    widths = [len(h) for h in head]
    for c in cells:
        full = len(c) == len(head)
        for i, x in enumerate(c if full else c[:3]):
            widths[i] = max(widths[i], len(x))
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    out += ["  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip() for c in cells]
    if any(r.baseline for r in rows):
        out.append("* a baseline (not a yolofast backend), shown for context")
    for note in dict.fromkeys(r.note for r in rows if r.backend == "auto" and r.status == "ok" and r.note):
        out.append(f"auto ran: {note}")
    out.append("vs ref: the reference's median time / this one (higher is faster); "
               "mem vs ref: the reference's peak / this one")
    return "\n".join(out)


def _main(argv: list[str]) -> int:
    """Child entry: ``--peak PRESET OP name,name --seed S --threads N`` -> one JSON line of peaks."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m yolofast.bench.runner")
    ap.add_argument("--peak", nargs=3, metavar=("PRESET", "OP", "VARIANTS"), required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    preset, op, names = a.peak
    print(json.dumps(_peaks_in_process(preset, op, a.seed, names.split(","))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
