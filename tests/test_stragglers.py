"""Straggler injection: who is slow, by how much, reproducibly."""

from __future__ import annotations

import statistics

import pytest

from conftest import train_run
from dtstudy.stragglers import Straggler, slow_ranks

BASE = {"ranks": [], "fraction": 0.0, "delay_ms": 10.0, "distribution": "fixed", "seed": 0}


def test_slow_ranks_given_or_drawn_by_fraction():
    assert slow_ranks({**BASE, "ranks": [3, 1]}, 4) == [1, 3]
    drawn = slow_ranks({**BASE, "fraction": 0.5}, 8)
    assert len(drawn) == 4 and drawn == slow_ranks({**BASE, "fraction": 0.5}, 8)
    assert slow_ranks(BASE, 4) == []


@pytest.mark.parametrize("distribution", ["fixed", "uniform", "exponential"])
def test_delays_have_the_mean_and_repeat_with_the_seed(distribution):
    settings = {**BASE, "ranks": [0], "distribution": distribution}
    one = Straggler(settings, 2, 0)
    delays = [one.next_delay() for _ in range(4000)]
    assert statistics.mean(delays) == pytest.approx(0.010, rel=0.1)
    again = Straggler(settings, 2, 0)
    assert [again.next_delay() for _ in range(4000)] == delays
    assert not Straggler(settings, 2, 1).active


def test_a_slow_worker_slows_allreduce_by_about_the_delay(tmp_path, tiny_data):
    """Synchronous all-reduce waits for the slowest worker every step."""
    steps, delay_ms = 28, 30  # 28 steps = the tiny study's epoch at 2 x 32
    fast, _, _ = train_run(tmp_path / "fast", tiny_data, workers=2, batch_size=32, steps=steps)
    slow, _, _ = train_run(tmp_path / "slow", tiny_data, workers=2, batch_size=32, steps=steps,
                           stragglers={"ranks": [1], "delay_ms": delay_ms})
    assert slow["stragglers"]["ranks"] == [1]
    assert slow["stragglers"]["injected_delay_s"][0] == 0
    assert slow["stragglers"]["injected_delay_s"][1] == pytest.approx(steps * delay_ms / 1000, rel=0.01)
    added = slow["step_time"]["total_s"] - fast["step_time"]["total_s"]
    assert added == pytest.approx(delay_ms / 1000, rel=0.35)
    # the fast worker spends the delay waiting in the exchange
    fast_worker = slow["step_time_per_worker"][0]
    assert fast_worker["comm_s"] > 0.6 * delay_ms / 1000


def test_a_slow_worker_costs_ps_async_much_less_throughput_than_allreduce(tmp_path, tiny_data):
    """Asynchronous workers do not wait for each other (Chen et al. 2016's starting point)."""
    slow = {"ranks": [1], "delay_ms": 30}
    lost = {}
    for strategy in ("allreduce", "ps_async"):
        fast_run, _, _ = train_run(tmp_path / f"{strategy}-fast", tiny_data, workers=2, batch_size=32,
                                   steps=28, strategy=strategy)
        slow_run, _, _ = train_run(tmp_path / f"{strategy}-slow", tiny_data, workers=2, batch_size=32,
                                   steps=28, strategy=strategy, stragglers=slow)
        lost[strategy] = 1 - slow_run["throughput"] / fast_run["throughput"]
    assert lost["allreduce"] > 0.6  # both workers run at the slow one's pace
    assert lost["ps_async"] < 0.75 * lost["allreduce"], lost
