"""Straggler injection: who is slow, by how much, reproducibly."""

from __future__ import annotations

import statistics

import pytest

from conftest import train_run
from dtstudy.training.stragglers import slow_ranks, Straggler

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


def test_with_allreduce_the_fast_worker_waits_out_the_slow_ones_delay_every_step(tmp_path, tiny_data):
    """Synchronous all-reduce waits for the slowest worker every step.

    Measured inside one run, rank against rank: comparing a slow run with a separate fast run
    depends on how busy the machine's cores are (on 2 cores, a sleeping worker leaves the other
    one a core to itself, so the slow run's compute gets faster)."""
    steps, delay_ms = 28, 30  # 28 steps = the tiny study's epoch at 2 x 32
    slow, _, _ = train_run(tmp_path / "slow", tiny_data, workers=2, batch_size=32, steps=steps,
                           stragglers={"ranks": [1], "delay_ms": delay_ms})
    assert slow["stragglers"]["ranks"] == [1]
    assert slow["stragglers"]["injected_delay_s"][0] == 0
    assert slow["stragglers"]["injected_delay_s"][1] == pytest.approx(steps * delay_ms / 1000, rel=0.01)
    fast_worker, slow_worker = slow["step_time_per_worker"]
    # the fast worker spends the slow one's delay waiting in the exchange ...
    assert fast_worker["comm_s"] - slow_worker["comm_s"] == pytest.approx(delay_ms / 1000, rel=0.35)
    # ... so both go at the slow one's pace
    assert fast_worker["throughput"] == pytest.approx(slow_worker["throughput"], rel=0.1)


def test_with_ps_async_the_fast_worker_goes_ahead_of_the_slow_one(tmp_path, tiny_data):
    """Asynchronous workers do not wait for each other (Chen et al. 2016's starting point);
    the same straggler holds an all-reduce worker to its pace (the test above)."""
    steps, delay_ms = 28, 30
    run, _, _ = train_run(tmp_path / "slow", tiny_data, workers=2, batch_size=32, steps=steps,
                          strategy="ps_async", stragglers={"ranks": [1], "delay_ms": delay_ms})
    fast_worker, slow_worker = run["step_time_per_worker"]
    assert fast_worker["comm_s"] < slow_worker["comm_s"] + 0.3 * delay_ms / 1000  # no waiting for rank 1
    assert fast_worker["throughput"] > 1.25 * slow_worker["throughput"], run["throughput_per_worker"]
