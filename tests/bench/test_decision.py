"""The regression decision itself: statistics on synthetic per-round data, the slowdown switch, the
per-ISA floors and what a failing gate prints. No timing: every number here is made up or counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from yolofast.bench import floors as fl
from yolofast.bench import stats
from yolofast.bench.cases import build_cases, slowdowns, slowed
from yolofast.bench.stats import Sample


def _rounds(ratio: float, n: int, spread: float, seed: int) -> list[float]:
    """Per-round ratios as a busy machine gives them: log-normal scatter plus one preempted round."""
    rng = np.random.default_rng(seed)
    r = ratio * np.exp(rng.normal(0.0, spread, n))
    r[rng.integers(n)] *= 1.8  # a neighbour took the core for that round
    return r.tolist()


# ------------------------------------------------------------------------------------------ statistics
def test_a_clear_regression_is_caught_with_its_interval():
    old, new = Sample.paired(_rounds(0.25, 15, 0.05, 1)), Sample.paired(_rounds(0.25 * 1.3, 15, 0.05, 2))
    est = stats.shift(old, new)
    assert est.has_interval and est.low < est.change < est.high
    assert 0.2 < est.change < 0.4 and est.low > 0.1
    assert stats.verdict(est, 0.1) == "REGRESSION"
    assert est.interval_text().startswith("[+") and est.rounds == (15, 15)


def test_pure_noise_is_not_flagged():
    flagged = 0
    for seed in range(40):  # same code, two runs: the rounds differ only by noise (and a preempted round)
        old = Sample.paired(_rounds(0.25, 15, 0.08, 2 * seed))
        new = Sample.paired(_rounds(0.25, 15, 0.08, 2 * seed + 1))
        flagged += stats.verdict(stats.shift(old, new), 0.1) == "REGRESSION"
    assert flagged == 0


def test_too_few_rounds_are_inconclusive_not_a_regression():
    old, new = Sample.paired([0.25, 0.26, 0.24]), Sample.paired([0.4, 0.41, 0.39])
    est = stats.shift(old, new)
    assert not est.has_interval and "too few rounds (3 and 3" in est.why
    assert stats.verdict(est, 0.1) == "inconclusive" and est.change == pytest.approx(0.6, rel=0.01)
    # a small change with too few rounds is still fine to call ok
    assert stats.verdict(stats.shift(old, Sample.paired([0.25, 0.26, 0.25])), 0.1) == "ok"


def test_a_wide_interval_past_the_threshold_is_inconclusive():
    old = Sample.paired(_rounds(0.25, 7, 0.25, 3))
    new = Sample.paired([x * 1.2 for x in _rounds(0.25, 7, 0.25, 3)])
    est = stats.shift(old, new)
    assert est.change == pytest.approx(0.2) and est.low < 0.1
    assert stats.verdict(est, 0.1) == "inconclusive"


def test_the_verdict_is_reproducible_with_a_seed():
    old, new = Sample.paired(_rounds(0.25, 11, 0.1, 4)), Sample.paired(_rounds(0.3, 11, 0.1, 5))
    a, b = stats.shift(old, new, seed=7), stats.shift(old, new, seed=7)
    assert (a.low, a.high) == (b.low, b.high)
    c = stats.shift(old, new, seed=8)
    assert (c.low, c.high) != (a.low, a.high) and c.change == a.change  # only the interval resamples
    assert abs(c.low - a.low) < 0.03  # and not by much: 4000 resamples


def test_unpaired_samples_and_the_floor_interval():
    ref = [100.0 * (1 + 0.02 * i) for i in range(9)]
    fused = [10.0 * (1 + 0.02 * i) for i in range(9)]
    s = Sample.unpaired(ref, fused)
    assert np.exp(s.point()) == pytest.approx(0.1, rel=1e-6) and s.rounds == 9
    speed, lo, hi = stats.versus_floor(Sample.paired([0.1] * 4 + [0.11, 0.09] * 3))
    assert speed == pytest.approx(10.0) and lo < 10.0 < hi
    assert stats.versus_floor(Sample.paired([0.1, 0.1]))[1:] == (None, None)


# ------------------------------------------------------------------------------------------ slowdown
def test_slowdown_switch_parses_and_refuses_bad_values(monkeypatch):
    assert slowdowns("bbox_loss:1.5, tal_assign:2") == {"bbox_loss": 1.5, "tal_assign": 2.0}
    assert slowdowns("") == {}
    for bad in ("bbox_loss", "bbox_loss:0.5", "nosuchop:1.3", "bbox_loss:x", "bbox_loss:inf"):
        with pytest.raises(ValueError, match="YOLOFAST_BENCH_SLOWDOWN"):
            slowdowns(bad)
    monkeypatch.setenv("YOLOFAST_BENCH_SLOWDOWN", "ema_update:1.3")
    assert slowdowns() == {"ema_update": 1.3}


class _FakeClock:
    """A clock that a call advances by ``call_s`` and every reading by ``tick_s`` (a busy-wait's step)."""

    def __init__(self, tick_s=1e-5):
        self.t, self.tick_s = 0.0, tick_s

    def __call__(self):
        self.t += self.tick_s
        return self.t


@pytest.mark.parametrize("factor", [1.0, 1.3, 1.5, 2.0, 2.25])
def test_slowed_costs_the_factor_on_every_call(monkeypatch, factor):
    from yolofast.bench import clock as bench_clock

    fake = _FakeClock()
    monkeypatch.setattr(bench_clock, "now", lambda kind: fake)
    calls = [0]

    def fn():  # one call: 10 ms on the clock, a different length each time would not matter
        calls[0] += 1
        fake.t += 0.010

    f = slowed(fn, factor)
    for _ in range(20):
        t0 = fake.t
        f()
        # every call, not on average: within one clock step (and its own reading) of factor x 10 ms
        assert fake.t - t0 == pytest.approx(factor * 0.010, abs=3e-4)
    assert calls[0] == 20  # the call itself runs once: the rest is waiting on the clock


def test_slowed_waits_on_the_clock_the_runner_times_with(monkeypatch):
    import time

    from yolofast.bench import clock as bench_clock

    seen = []
    real = bench_clock.now
    monkeypatch.setattr(bench_clock, "now", lambda kind: seen.append(kind) or real(kind))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    slowed(lambda: None, 1.3)()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    slowed(lambda: None, 1.3)()
    assert seen == ["cpu", "wall"]
    assert bench_clock.now("cpu") is time.process_time and bench_clock.now("wall") is time.perf_counter


def test_the_switch_slows_the_fused_calls_of_one_op_only(monkeypatch):
    from yolofast.bench import clock as bench_clock

    monkeypatch.setenv("YOLOFAST_BENCH_SLOWDOWN", "bbox_loss:1.5")
    cases = {c.op: c for c in build_cases("tiny-loss", ops=("tal_assign", "bbox_loss"))}
    cpp = cases["bbox_loss"].variant("cpp")
    if not cpp.available:
        pytest.skip(f"C++ extension unavailable: {cpp.reason}")
    assert "slowed 1.5x" in cpp.reason and cases["bbox_loss"].variant("ref").reason == ""
    assert "slowed" not in cases["tal_assign"].variant("cpp").reason
    fake = _FakeClock(tick_s=1e-3)
    monkeypatch.setattr(bench_clock, "now", lambda kind: fake)
    t0 = fake.t
    cpp.fn()  # the real call takes no fake time: only the clock's own readings move it
    slowed_s = fake.t - t0
    t0 = fake.t
    cases["bbox_loss"].variant("ref").fn()
    cases["tal_assign"].variant("cpp").fn()
    assert fake.t == t0  # the reference and the other op never read the clock: they are not slowed
    assert slowed_s == pytest.approx(3e-3, abs=1.5e-3)  # 1 ms call reading -> waits until 1.5 ms, 1 ms steps


# ------------------------------------------------------------------------------------------ floors
def test_build_isa_from_the_arch(monkeypatch):
    assert fl.build_isa("x86-64-v3") == "avx2"
    assert fl.build_isa("x86-64-v4") == "avx512"
    monkeypatch.setattr(fl, "_compiler_macros", lambda arch: None)  # no compiler: by name
    assert (fl.build_isa("x86-64-v3"), fl.build_isa("x86-64-v4"), fl.build_isa("armv8-a")) == (
        "avx2", "avx512", "other")
    monkeypatch.setattr(fl, "_cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.delenv("YOLOFAST_CPU_ARCH", raising=False)
    assert fl.build_arch() == "native" and fl.build_isa() == "avx2"
    monkeypatch.setattr(fl, "_cpu_flags", lambda: {"avx2", "avx512f"})
    assert fl.build_isa() == "avx512"
    monkeypatch.setenv("YOLOFAST_CPU_ARCH", "x86-64-v3")  # an AVX2 build on an AVX-512 CPU: AVX2 floors
    assert fl.build_isa() == "avx2"


def test_per_isa_floor_lookup():
    data = {"isa": {"avx2": {"floors": {"p/bbox_loss": {"floor": 1.3}, "p/tal_assign": 30.0}},
                    "avx512": {"floors": {"p/bbox_loss": {"floor": 3.0}, "p/tal_assign": 25.0}}}}
    assert fl.floors_for_isa(data, "avx2") == ({"p/bbox_loss": 1.3, "p/tal_assign": 30.0}, "the avx2 floors")
    assert fl.floors_for_isa(data, "avx512")[0] == {"p/bbox_loss": 3.0, "p/tal_assign": 25.0}
    # an ISA without floors: the lower (slower ISA's) floor of each op
    floors, why = fl.floors_for_isa(data, "other")
    assert floors == {"p/bbox_loss": 1.3, "p/tal_assign": 25.0} and "no other floors" in why
    assert fl.floors_for_isa({"floors": {"p/x": {"floor": 2.0}}}, "avx2")[0] == {"p/x": 2.0}  # older file


def test_judge_against_a_floor():
    tight = [1 / 3.0 * (1 + 0.01 * (i % 3 - 1)) for i in range(9)]
    assert fl.judge("p/op", "cpp", 2.5, tight, None).verdict == "PASS"
    r = fl.judge("p/op", "cpp", 3.5, tight, None)
    assert r.verdict == "FAIL" and r.high < 3.5 and "3.00x < floor 3.50x" in r.note
    wide = [1 / 3.0 * (1 + 0.3 * (i % 3 - 1)) for i in range(9)]
    r = fl.judge("p/op", "cpp", 3.2, wide, None)
    assert r.verdict == "SUSPECT" and r.suspect and "interval reaches" in r.note
    assert fl.judge("p/op", "cpp", 3.2, None, 3.1).verdict == "FAIL"  # no rounds: the median alone


def test_cpu_report_names_model_flags_and_arch(monkeypatch):
    monkeypatch.setattr(fl, "_cpu_flags", lambda: {"avx2", "fma", "avx512f", "amx_bf16", "avx512_bf16"})
    monkeypatch.setenv("YOLOFAST_CPU_ARCH", "x86-64-v3")
    line = fl.cpu_report()
    assert line.startswith("CPU: ") and "cores" in line
    assert "flags: avx2 fma avx512f avx512_bf16 amx_bf16" in line
    assert "-march=x86-64-v3" in line and "ISA avx2" in line
