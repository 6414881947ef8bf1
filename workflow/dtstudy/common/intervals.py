"""Confidence intervals and spreads of the study's numbers (torch-free).

Two kinds of uncertainty, two tools:
- over seeds (test accuracy, paired accuracy differences): Student's t interval of the
  mean when there are at least `MIN_SEEDS_FOR_CI` values; with two values a t interval is
  a formality (its half-width is 12.7 standard errors), so the table gives the range of
  the two instead and says so;
- over timed windows (throughput, speedup, efficiency): a percentile bootstrap of the
  median of the windows, two-level (the runs of the seeds, then the windows of each run),
  with a fixed generator so that the same windows give the same interval. Windows of one run
  are treated as exchangeable, which holds for a steady state (the warm-up steps are left
  out); with one run only its windows' spread is in the interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95
MIN_SEEDS_FOR_CI = 3
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class Interval:
    """A central value with its interval; `kind` says what the interval is."""

    value: float
    low: float
    high: float
    n: int
    kind: str  # "t95" | "range" | "bootstrap95" | "none" | "exact" (a known value, e.g. a zero reference)

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high

    def __str__(self) -> str:
        return format_interval(self)


NAN_INTERVAL = Interval(math.nan, math.nan, math.nan, 0, "none")


def mean_interval_kind(n: int) -> str:
    """The kind of interval `mean_interval` gives for n values."""
    return "none" if n < 2 else "range" if n < MIN_SEEDS_FOR_CI else "t95"


def mean_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """The mean of `values` with a t interval (n >= MIN_SEEDS_FOR_CI), the min-max range
    (n == 2), or no interval (n == 1)."""
    data = np.asarray([float(v) for v in values if v is not None and not math.isnan(float(v))])
    n = len(data)
    if n == 0:
        return NAN_INTERVAL
    mean = float(data.mean())
    kind = mean_interval_kind(n)
    if kind == "none":
        return Interval(mean, math.nan, math.nan, n, kind)
    if kind == "range":
        return Interval(mean, float(data.min()), float(data.max()), n, kind)
    from scipy import stats  # here: scipy.stats costs every command that imports this module a second

    half = float(stats.t.ppf(0.5 + level / 2, n - 1) * data.std(ddof=1) / math.sqrt(n))
    return Interval(mean, mean - half, mean + half, n, "t95")


def _resampled_medians(groups: Sequence[Sequence[float]], rng: np.random.Generator, resamples: int) -> np.ndarray:
    """`resamples` medians of a two-level bootstrap: the runs drawn with replacement, then
    each drawn run's windows with replacement (Davison & Hinkley 1997, ch. 3.8), so that the
    spread between runs (seeds, the machine's load at the time) is in the interval, not only
    the spread of the windows inside one run."""
    arrays = [np.asarray(g, dtype=float) for g in groups if len(g)]
    lengths = np.array([len(a) for a in arrays])
    padded = np.full((len(arrays), lengths.max()), np.nan)
    for i, a in enumerate(arrays):
        padded[i, : len(a)] = a
    runs = rng.integers(0, len(arrays), size=(resamples, len(arrays)))
    drawn_lengths = lengths[runs][..., None]
    positions = np.floor(rng.random((resamples, len(arrays), lengths.max())) * drawn_lengths).astype(int)
    values = padded[runs[..., None], positions]
    values[np.arange(lengths.max()) >= drawn_lengths] = np.nan  # a shorter run's unused slots
    return row_nanmedians(values.reshape(resamples, -1))


def row_nanmedians(values: np.ndarray) -> np.ndarray:
    """np.nanmedian(values, axis=1) for rows with at least one number, by one sort (NaN sorts
    last): numpy's nanmedian takes a masked-array path per call that was 3/4 of the aggregate's
    time in the default study."""
    ordered = np.sort(values, axis=1)
    counts = np.count_nonzero(~np.isnan(values), axis=1)
    low = np.take_along_axis(ordered, ((counts - 1) // 2)[:, None], axis=1)[:, 0]
    high = np.take_along_axis(ordered, (counts // 2)[:, None], axis=1)[:, 0]
    return (low + high) / 2


def pooled_median(groups: Sequence[Sequence[float]]) -> float:
    pooled = [float(v) for g in groups for v in g]
    return float(np.median(pooled)) if pooled else math.nan


def bootstrap(
    samples: Mapping[str, Sequence[Sequence[float]]],
    statistic: Callable[[Mapping[str, float]], float],
    level: float = LEVEL,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Interval:
    """`statistic` of the medians of several pooled samples, with a percentile bootstrap
    interval. `samples[name]` is a list of groups (one per run) of window values; each
    resample redraws the runs, then their windows, of every sample independently."""
    if any(not any(len(g) for g in groups) for groups in samples.values()):
        return NAN_INTERVAL
    point = statistic({name: pooled_median(groups) for name, groups in samples.items()})
    rng = np.random.default_rng(seed)
    medians = {name: _resampled_medians(groups, rng, resamples) for name, groups in samples.items()}
    values = np.array([statistic({name: float(m[i]) for name, m in medians.items()}) for i in range(resamples)])
    low, high = np.quantile(values, [0.5 - level / 2, 0.5 + level / 2])
    n = min(sum(len(g) for g in groups) for groups in samples.values())
    return Interval(float(point), float(low), float(high), n, "bootstrap95")


def median_interval(groups: Sequence[Sequence[float]], **kwargs) -> Interval:
    """The median of the pooled windows with its bootstrap interval."""
    return bootstrap({"x": groups}, lambda m: m["x"], **kwargs)


def scaled(interval: Interval, factor: float) -> Interval:
    """The interval of `factor` times the quantity (factor > 0): a percentile interval
    scales with it, so E = S / N needs no bootstrap of its own."""
    return Interval(interval.value * factor, interval.low * factor, interval.high * factor, interval.n, interval.kind)


def format_interval(interval: Interval, fmt: str = ".4f") -> str:
    """'0.8512 [0.8401, 0.8623]' (a CI) or '0.8512 (0.8401–0.8623)' (a range of two seeds)."""
    if math.isnan(interval.value):
        return "n/a"
    value = format(interval.value, fmt)
    if interval.kind == "none":
        return value
    low, high = format(interval.low, fmt), format(interval.high, fmt)
    if interval.kind == "range":
        return f"{value} ({low}–{high})"
    return f"{value} [{low}, {high}]"


def overlaps(a: Interval, b: Interval) -> bool:
    """Whether two intervals overlap (NaN bounds count as overlapping: nothing is known)."""
    if any(math.isnan(x) for x in (a.low, a.high, b.low, b.high)):
        return True
    return a.low <= b.high and b.low <= a.high
