"""Confidence intervals of the study's numbers: t intervals over seeds, ranges of two seeds,
bootstrap intervals of window medians (and of ratios of them)."""

import math

import numpy as np
import pytest

from dtstudy.analysis import intervals


def test_t_interval_by_hand():
    # mean 2, sd 1, n 3: half-width t(0.975, 2) / sqrt(3) = 4.302653 / 1.732051
    interval = intervals.mean_interval([1.0, 2.0, 3.0])
    assert interval.kind == "t95"
    assert interval.value == pytest.approx(2.0)
    assert interval.half_width == pytest.approx(4.302653 / math.sqrt(3), rel=1e-5)


def test_two_values_give_their_range_and_one_value_no_interval():
    two = intervals.mean_interval([0.80, 0.84])
    assert (two.kind, two.value, two.low, two.high) == ("range", pytest.approx(0.82), 0.80, 0.84)
    one = intervals.mean_interval([0.8])
    assert one.kind == "none" and one.value == 0.8 and math.isnan(one.low)
    assert intervals.format_interval(two, ".2f") == "0.82 (0.80–0.84)"
    assert intervals.format_interval(intervals.mean_interval([1.0, 2.0, 3.0]), ".1f") == "2.0 [-0.5, 4.5]"


def test_bootstrap_median_is_deterministic_and_brackets_the_median():
    rng = np.random.default_rng(1)
    groups = [list(rng.normal(100, 10, 12)), list(rng.normal(100, 10, 12))]
    first, second = intervals.median_interval(groups), intervals.median_interval(groups)
    assert first == second
    assert first.low < first.value < first.high
    assert first.value == pytest.approx(np.median(groups[0] + groups[1]))


def test_bootstrap_interval_covers_the_true_median_about_95_percent_of_the_time():
    # 300 studies of 2 runs x 15 windows from a known distribution (median 100): a percentile
    # bootstrap of the median covers it in roughly 95% of them (not 50%, not 100%)
    rng = np.random.default_rng(7)
    covered = 0
    trials = 300
    for _ in range(trials):
        groups = [list(rng.normal(100, 8, 15)) for _ in range(2)]
        covered += intervals.median_interval(groups, resamples=1000).contains(100.0)
    assert 0.88 <= covered / trials <= 0.99


def test_bootstrap_width_shrinks_with_more_windows():
    rng = np.random.default_rng(3)
    few = [list(rng.normal(50, 5, 10))]
    many = [few[0] * 9]  # the same values, 9x as many windows
    assert intervals.median_interval(many).half_width < 0.5 * intervals.median_interval(few).half_width


def test_bootstrap_of_a_ratio():
    num = [[200.0, 202.0, 198.0, 201.0, 199.0]]
    den = [[100.0, 101.0, 99.0, 100.5, 99.5]]
    ratio = intervals.bootstrap({"a": num, "b": den}, lambda m: m["a"] / m["b"])
    assert ratio.value == pytest.approx(2.0)
    assert ratio.low < 2.0 < ratio.high
    assert ratio.high - ratio.low < 0.06


def test_missing_sample_gives_nan():
    assert math.isnan(intervals.bootstrap({"a": [[1.0]], "b": []}, lambda m: m["a"] / m["b"]).value)
    assert math.isnan(intervals.mean_interval([]).value)


def test_overlap():
    a = intervals.Interval(1.0, 0.9, 1.1, 3, "t95")
    assert intervals.overlaps(a, intervals.Interval(1.15, 1.05, 1.25, 3, "t95"))
    assert not intervals.overlaps(a, intervals.Interval(1.3, 1.2, 1.4, 3, "t95"))


def test_row_nanmedians_by_hand_and_against_numpy():
    rows = np.array([[1.0, np.nan, 3.0, 2.0], [4.0, 1.0, np.nan, np.nan], [7.0, np.nan, np.nan, np.nan]])
    assert intervals.row_nanmedians(rows).tolist() == [2.0, 2.5, 7.0]
    rng = np.random.default_rng(3)
    values = rng.normal(size=(500, 9))
    values[rng.random(values.shape) < 0.4] = np.nan
    values[:, 0] = rng.normal(size=500)  # every row keeps a number, as every drawn run has a window
    assert np.array_equal(intervals.row_nanmedians(values), np.nanmedian(values, axis=1))
