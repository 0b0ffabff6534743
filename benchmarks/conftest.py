"""Shared setup of the pytest-benchmark suites in benchmarks/ (bench_<op>.py).

    python -m pytest benchmarks/ --benchmark-columns=min,median,max,rounds

- bench_*.py files are collected (pytest's default pattern is test_*.py), so the folder runs as a whole.
- torch runs on THREADS = 2 threads during every benchmark (DESIGN §6: the CI machines have 2 cores).
- ``measure`` runs one variant into a pytest-benchmark group and records its median; at the end the
  session prints, per group, every variant's time and its ratio to the group's baseline, plus the goals
  that bench modules declare in a module-level ``GOALS`` list of
  ``(group, variant, baseline, max_ratio, text)``: met when median(variant) / median(baseline) <= max_ratio.
  Ratios, never absolute times: on shared 2-core machines those vary by tens of per cent between runs.
"""

from __future__ import annotations

import pytest
import torch

THREADS = 2
RESULTS: dict[str, dict[str, float]] = {}  # group -> variant -> median seconds
_GOALS: list[tuple] = []


def pytest_collect_file(file_path, parent):
    # A file named on the command line is already collected by pytest's python plugin.
    name = file_path.name
    if name.startswith("bench_") and name.endswith(".py") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(session, config, items):
    seen = set()
    for item in items:
        mod = getattr(item, "module", None)
        if mod is not None and mod.__name__ not in seen:
            seen.add(mod.__name__)
            _GOALS.extend(getattr(mod, "GOALS", ()))


@pytest.fixture(autouse=True)
def _threads():
    prev = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(prev)


@pytest.fixture
def measure(benchmark):
    """measure(fn, group=, variant=, rounds=, warmup_rounds=, setup=) -> median seconds (None if disabled)."""

    def run(fn, *, group: str, variant: str, rounds: int = 10, warmup_rounds: int = 1, setup=None):
        benchmark.group = group
        benchmark.extra_info["variant"] = variant
        if setup is None:
            benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=warmup_rounds)
        else:
            benchmark.pedantic(fn, setup=setup, rounds=rounds, warmup_rounds=warmup_rounds)
        if benchmark.disabled or benchmark.stats is None:
            return None
        median = benchmark.stats.stats.median
        RESULTS.setdefault(group, {})[variant] = median
        return median

    return run


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    tr = terminalreporter
    tr.write_sep("=", f"yolofast benchmark ratios ({THREADS} threads, one run)")
    baselines: dict[str, str] = {}
    for g, _, b, _, _ in _GOALS:
        baselines.setdefault(g, b)
    for group, rows in RESULTS.items():
        base = baselines.get(group, "ref" if "ref" in rows else next(iter(rows)))
        tr.write_line(f"{group}:")
        for variant, t in rows.items():
            rel = f"{t / rows[base]:7.3f}x of {base}" if base in rows else ""
            tr.write_line(f"    {variant:22s} {t * 1e3:10.2f} ms  {rel}")
    for group, variant, base, max_ratio, text in _GOALS:
        rows = RESULTS.get(group, {})
        if variant in rows and base in rows:
            ratio = rows[variant] / rows[base]
            verdict = "met" if ratio <= max_ratio else "NOT met"
            tr.write_line(f"goal {text}: {variant}/{base} = {ratio:.3f} (<= {max_ratio:g}) -> {verdict}")
