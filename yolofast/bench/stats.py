"""The statistics behind ``yolofast bench --compare`` and the CI gate: is a slowdown real or noise?

A benchmark row keeps every round's paired ratio (fused time / reference time, both timed seconds apart
in the same round). One run's ratio is summarised by the median of its rounds' log-ratios (robust: a
preempted round is an outlier, not a shift). How sure that is comes from a seeded bootstrap: the rounds
of each run are resampled with replacement ``n_boot`` times and the median recomputed, which gives a
percentile interval at ``confidence`` without assuming a distribution. Seeded, so one pair of files
always gets the same verdict.

Why an interval and not one number: on a shared 2-core machine the per-round ratios of one run spread
by +-10-30 %, so two medians of the same code differ by up to ~20 %; a fixed 10 % threshold on the
medians alone called same-commit pairs regressions. A regression here needs the whole interval of the
slowdown above the threshold; a point estimate above it with an interval that reaches below is
"inconclusive" (measure again, or with more rounds).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = [
    "CONFIDENCE",
    "MIN_ROUNDS",
    "Estimate",
    "Sample",
    "shift",
    "versus_floor",
]

CONFIDENCE = 0.95  # two-sided: a regression's lower bound is exceeded by noise with ~2.5 % probability
MIN_ROUNDS = 5  # under this many rounds a median and its bootstrap interval say little
N_BOOT = 4000  # interval ends move by < 0.5 % between seeds at this count (15 rounds per side)
SEED = 0


@dataclasses.dataclass
class Sample:
    """One run's evidence about one fused row: per-round paired log-ratios (preferred), else the per-round
    times of both sides unpaired (pytest-benchmark files time them in separate tests), else only a
    summary ratio (old files without per-round data: no interval possible)."""

    log_ratios: np.ndarray | None = None  # log(fused / ref) per round, paired
    log_ref: np.ndarray | None = None  # unpaired per-round log times
    log_fused: np.ndarray | None = None
    summary: float | None = None  # a ratio without rounds

    @classmethod
    def paired(cls, ratios) -> Sample:
        return cls(log_ratios=np.log(np.asarray(ratios, dtype=np.float64)))

    @classmethod
    def unpaired(cls, ref_times, fused_times) -> Sample:
        return cls(log_ref=np.log(np.asarray(ref_times, dtype=np.float64)),
                   log_fused=np.log(np.asarray(fused_times, dtype=np.float64)))

    @property
    def rounds(self) -> int:
        if self.log_ratios is not None:
            return len(self.log_ratios)
        if self.log_ref is not None and self.log_fused is not None:
            return min(len(self.log_ref), len(self.log_fused))
        return 0

    def point(self) -> float:
        """log of the run's ratio (fused / ref)."""
        if self.log_ratios is not None:
            return float(np.median(self.log_ratios))
        if self.log_ref is not None and self.log_fused is not None:
            return float(np.median(self.log_fused) - np.median(self.log_ref))
        if self.summary is None:
            raise ValueError("a Sample needs per-round data or a summary ratio")
        return math.log(self.summary)

    def boot(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` bootstrap replicates of ``point()`` (resampling rounds with replacement)."""
        if self.log_ratios is not None:
            x = self.log_ratios
            return np.median(x[rng.integers(0, len(x), (n, len(x)))], axis=1)
        a, b = self.log_ref, self.log_fused
        return (np.median(b[rng.integers(0, len(b), (n, len(b)))], axis=1)
                - np.median(a[rng.integers(0, len(a), (n, len(a)))], axis=1))


@dataclasses.dataclass
class Estimate:
    """A relative change with its interval (fractions: +0.3 = 30 % slower) and how it was obtained."""

    change: float
    low: float | None  # None: no interval (too few rounds or no per-round data)
    high: float | None
    confidence: float
    rounds: tuple[int, ...]
    why: str = ""  # set when there is no interval

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None

    def interval_text(self) -> str:
        if not self.has_interval:
            return "-"
        return f"[{self.low * 100:+.1f}%, {self.high * 100:+.1f}%]"


def _interval(reps: np.ndarray, confidence: float) -> tuple[float, float]:
    a = (1 - confidence) / 2
    lo, hi = np.quantile(reps, [a, 1 - a])
    return float(lo), float(hi)


def _no_interval(old: Sample, new: Sample) -> str:
    if old.rounds == 0 or new.rounds == 0:
        return "no per-round data (a file from an older yolofast): the medians alone, less reliable"
    return f"too few rounds ({old.rounds} and {new.rounds}; need >= {MIN_ROUNDS} each)"


def shift(old: Sample, new: Sample, confidence: float = CONFIDENCE, n_boot: int = N_BOOT,
          seed: int = SEED) -> Estimate:
    """How much slower the fused op is in ``new`` than in ``old``, relative to each run's reference:
    ``new ratio / old ratio - 1`` with its bootstrap interval (the runs resampled independently)."""
    d = new.point() - old.point()
    change = math.expm1(d)
    rounds = (old.rounds, new.rounds)
    if min(rounds) < MIN_ROUNDS:
        return Estimate(change, None, None, confidence, rounds, _no_interval(old, new))
    rng = np.random.default_rng(seed)
    reps = new.boot(rng, n_boot) - old.boot(rng, n_boot)
    lo, hi = _interval(reps, confidence)
    return Estimate(change, math.expm1(lo), math.expm1(hi), confidence, rounds)


def versus_floor(sample: Sample, confidence: float = CONFIDENCE, n_boot: int = N_BOOT,
                 seed: int = SEED) -> tuple[float, float | None, float | None]:
    """One run's speed-up (ref / fused) and its bootstrap interval (None when too few rounds)."""
    s = math.exp(-sample.point())
    if sample.rounds < MIN_ROUNDS:
        return s, None, None
    rng = np.random.default_rng(seed)
    lo, hi = _interval(-sample.boot(rng, n_boot), confidence)
    return s, math.exp(lo), math.exp(hi)


def verdict(est: Estimate, threshold: float) -> str:
    """"REGRESSION": the whole interval is slower than ``threshold``; "inconclusive": the point is past it
    but the interval reaches below it, or there is no interval; "improved": the whole interval is faster
    than ``threshold``; else "ok". Without an interval (too few rounds / old files) a point past the
    threshold is "inconclusive", never a regression on its own."""
    if not est.has_interval:
        if est.change > threshold:
            return "inconclusive"
        return "improved" if est.change < -threshold else "ok"
    if est.low > threshold:
        return "REGRESSION"
    if est.change > threshold:
        return "inconclusive"
    if est.high < -threshold:
        return "improved"
    return "ok"
