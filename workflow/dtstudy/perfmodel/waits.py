"""What barriers wait for: stragglers' delays and the workers' natural jitter as order statistics."""

from __future__ import annotations

import functools
import math

from dtstudy.perfmodel.machine import Machine, Stragglers


def expected_order_statistic(distribution: str, mean_s: float, j: int, k: int) -> float:
    """E of the j-th smallest of k iid delays (j = k: the maximum): fixed = mean; uniform on
    [0, 2 mean]: 2 mean j/(k+1); exponential: mean * sum_{i<j} 1/(k-i) (the max: mean H_k)."""
    if j <= 0 or k <= 0:
        return 0.0
    if distribution == "fixed":
        return mean_s
    if distribution == "uniform":
        return 2 * mean_s * j / (k + 1)
    if distribution == "exponential":
        return mean_s * sum(1.0 / (k - i) for i in range(j))
    raise ValueError(f"unknown straggler distribution {distribution!r}")


def expected_max_of_window_means(distribution: str, mean_s: float, k: int, window: int) -> float:
    """E[max over k workers of the mean of `window` iid delays]: what a worker waits per step
    when workers meet every `window` steps (local SGD's H, EASGD's tau) or may run
    `window - 1` steps ahead (SSP). window 1: the maximum of k draws."""
    if k <= 0:
        return 0.0
    if window <= 1 or distribution == "fixed":
        return expected_order_statistic(distribution, mean_s, k, k)
    # the sum of `window` draws has an Erlang (exponential) or Irwin-Hall (uniform) law;
    # E[max] = integral of 1 - F(x)^k, on a grid
    upper = mean_s * window * (2.0 if distribution == "uniform" else 1.0) + (
        0.0 if distribution == "uniform" else 12 * mean_s * math.sqrt(window)
    )
    points = 4000
    dx = upper / points
    total = 0.0
    for i in range(points):
        x = (i + 0.5) * dx
        total += (1.0 - _window_cdf(distribution, mean_s, window, x) ** k) * dx
    return total / window


def _window_cdf(distribution: str, mean_s: float, window: int, x: float) -> float:
    if distribution == "exponential":
        y = x / mean_s
        term, acc = 1.0, 1.0
        for i in range(1, window):
            term *= y / i
            acc += term
        return 1.0 - math.exp(-y) * acc
    if window > 20:  # Irwin-Hall's alternating sum loses all precision: its normal limit
        mean, sd = window * mean_s, math.sqrt(window / 3) * mean_s
        return 0.5 * math.erfc(-(x - mean) / (sd * math.sqrt(2)))
    # Irwin-Hall of `window` uniforms on [0, 2 mean]
    y = x / (2 * mean_s)
    if y >= window:
        return 1.0
    return sum((-1) ** i * math.comb(window, i) * (y - i) ** window for i in range(int(y) + 1)) / math.factorial(window)


@functools.cache
def expected_normal_order_statistic(j: int, k: int) -> float:
    """E of the j-th smallest of k standard normal draws (numerically, in logs so that large
    k stays finite; j = k: the maximum)."""
    if k <= 1:
        return 0.0
    log_coefficient = math.lgamma(k + 1) - math.lgamma(j) - math.lgamma(k - j + 1)
    total, points, low, high = 0.0, 4000, -9.0, 9.0
    dx = (high - low) / points
    for i in range(points):
        x = low + (i + 0.5) * dx
        cdf = 0.5 * math.erfc(-x / math.sqrt(2))
        survival = 0.5 * math.erfc(x / math.sqrt(2))
        if cdf <= 0 or survival <= 0:
            continue
        log_density = log_coefficient + (j - 1) * math.log(cdf) + (k - j) * math.log(survival) - x * x / 2
        total += x * math.exp(log_density) / math.sqrt(2 * math.pi) * dx
    return total


def natural_wait(
    machine: Machine, compute_s: float, participants: int, window: int = 1, waits_for: int | None = None
) -> float:
    """What a barrier over `participants` identical workers waits for their natural jitter:
    sigma = skew_fraction sqrt(pi) compute (E[max of 2] - mean = sigma / sqrt(pi)), the
    mean over `window` steps (sigma / sqrt(window)), Gaussian order statistics."""
    if machine.skew_fraction <= 0 or participants <= 1:
        return 0.0
    sigma = machine.skew_fraction * math.sqrt(math.pi) * compute_s / math.sqrt(window)
    j = participants if waits_for is None else waits_for
    return max(0.0, sigma * expected_normal_order_statistic(j, participants))


def synchronous_wait(stragglers: Stragglers, workers: int, window: int = 1, waits_for: int | None = None) -> float:
    """Expected extra seconds per step of a barrier over N workers of which `slow(N)` draw a
    delay: the slowest (order statistic), or the `waits_for`-th arrival (backup workers)."""
    slow = stragglers.slow(workers)
    if slow == 0:
        return 0.0
    needed = workers if waits_for is None else waits_for
    fast = workers - slow
    if needed <= fast:  # the needed arrivals are all fast workers
        return 0.0
    if needed == workers:
        return expected_max_of_window_means(stragglers.distribution, stragglers.delay_s, slow, window)
    return expected_order_statistic(stragglers.distribution, stragglers.delay_s, needed - fast, slow)


def mean_delay(stragglers: Stragglers, workers: int) -> float:
    """The mean delay per step over the N workers (what asynchronous workers see on average)."""
    return stragglers.delay_s * stragglers.slow(workers) / workers if workers else 0.0
