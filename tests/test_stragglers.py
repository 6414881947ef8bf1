"""Straggler injection: who is slow, by how much, reproducibly."""

from __future__ import annotations

import statistics

import pytest
from conftest import train_run

from dtstudy.training.stragglers import Straggler, slow_ranks

BASE = {"ranks": [], "fraction": 0.0, "delay_ms": 10.0, "distribution": "fixed", "seed": 0}


def test_slow_ranks_given_or_drawn_by_fraction():
    assert slow_ranks({**BASE, "ranks": [3, 1]}, 4, run_seed=0) == [1, 3]
    assert slow_ranks({**BASE, "ranks": [3, 1]}, 4, run_seed=5) == [1, 3]  # given ranks whatever the seed
    drawn = slow_ranks({**BASE, "fraction": 0.5}, 8, run_seed=0)
    assert len(drawn) == 4 and drawn == slow_ranks({**BASE, "fraction": 0.5}, 8, run_seed=0)
    assert slow_ranks(BASE, 4, run_seed=0) == []


def test_each_training_seed_is_its_own_replicate_of_the_stragglers():
    """The draws repeat for the same training seed (every strategy run with that seed meets the
    same stragglers) and differ between training seeds, so the spread over a study's seeds
    includes the stragglers'; stragglers.seed still picks another set of draws."""
    settings = {**BASE, "fraction": 1.0, "distribution": "exponential"}

    def delays(run_seed, rank=0, draw_seed=0):
        straggler = Straggler({**settings, "seed": draw_seed}, 4, rank, run_seed)
        return [straggler.next_delay() for _ in range(50)]

    assert delays(run_seed=1) == delays(run_seed=1)
    assert delays(run_seed=0) != delays(run_seed=1) != delays(run_seed=2) != delays(run_seed=0)
    assert delays(run_seed=0, draw_seed=1) != delays(run_seed=0)
    assert delays(run_seed=0, rank=1) != delays(run_seed=0)  # each worker its own sequence
    by_seed = {tuple(slow_ranks({**BASE, "fraction": 0.25}, 16, run_seed)) for run_seed in range(6)}
    assert all(len(ranks) == 4 for ranks in by_seed) and len(by_seed) > 1


#: 20000 draws of each delay distribution, mean mu = 10 ms: what each must show (variance as a
#: share of mu^2, with its tolerance: 5 sd of a sample variance of 20000 draws; the range)
DRAWS = 20000
SHAPES = {
    "fixed": {"variance": 0.0, "rel": 0.0, "range": "every draw the mean"},
    "uniform": {"variance": 1 / 3, "rel": 0.035, "range": "inside [0, 2 mu], reaching both ends"},  # sd 0.63%
    "exponential": {"variance": 1.0, "rel": 0.10, "range": "from 0, past 6 mu (unbounded)"},  # sd 2.0%
}


def _shape_misses(distribution: str, delays: list[float], mean_s: float) -> list[str]:
    """What in `delays` does not fit `distribution` of mean `mean_s`: mean (within 5%),
    variance (uniform on [0, 2 mu]: mu^2/3; exponential: mu^2; fixed: 0) and range. The
    largest of 20000 exponential draws stays under 6 mu with probability (1 - e^-6)^20000 =
    3e-22; the uniform misses 0.01 mu of an end with (1 - 0.005)^20000 = e^-100."""
    shape, misses = SHAPES[distribution], []
    mean, variance = statistics.mean(delays), statistics.pvariance(delays)
    low, high = min(delays), max(delays)
    if mean != pytest.approx(mean_s, rel=0.05):
        misses.append(f"mean {mean:.5g}")
    if variance != pytest.approx(shape["variance"] * mean_s**2, rel=shape["rel"], abs=1e-15):
        misses.append(f"variance {variance / mean_s**2:.4g} mu^2")
    if distribution == "fixed" and not low == high == mean_s:
        misses.append(f"range [{low:.4g}, {high:.4g}]")
    if distribution == "uniform" and not (0 <= low < 0.01 * mean_s and 1.99 * mean_s < high <= 2 * mean_s):
        misses.append(f"range [{low / mean_s:.4g}, {high / mean_s:.4g}] mu")
    if distribution == "exponential" and not (0 <= low < 0.01 * mean_s and high > 6 * mean_s):
        misses.append(f"range [{low / mean_s:.4g}, {high / mean_s:.4g}] mu")
    return misses


@pytest.mark.parametrize("distribution", ["fixed", "uniform", "exponential"])
def test_delays_have_the_distributions_shape_and_repeat_with_the_seed(distribution, monkeypatch):
    """Each distribution's mean, variance and range over 20000 draws (fixed: the mean every
    step; uniform on [0, 2 mu]: variance mu^2/3; exponential: variance mu^2, unbounded), and the
    same draws again with the same seed. Controls that must fail the same check: a sampler
    that returns the mean for every distribution (the uniform's and exponential's variance 0),
    and one that draws each distribution as another (fixed as uniform, uniform as
    exponential, exponential as uniform)."""
    settings = {**BASE, "ranks": [0], "distribution": distribution}
    one = Straggler(settings, 2, 0, 0)
    delays = [one.next_delay() for _ in range(DRAWS)]
    assert _shape_misses(distribution, delays, 0.010) == []
    again = Straggler(settings, 2, 0, 0)
    assert [again.next_delay() for _ in range(DRAWS)] == delays
    assert not Straggler(settings, 2, 1, 0).active

    as_another = {"fixed": "uniform", "uniform": "exponential", "exponential": "uniform"}[distribution]
    plain_next_delay = Straggler.next_delay

    def drawn_as_another(self):
        self.distribution = as_another
        return plain_next_delay(self)

    controls = {"the mean": lambda self: self.mean_s, f"drawn as {as_another}": drawn_as_another}
    if distribution == "fixed":
        del controls["the mean"]  # right for fixed
    for wrong in controls.values():
        with monkeypatch.context() as patched:
            patched.setattr(Straggler, "next_delay", wrong)
            planted = Straggler(settings, 2, 0, 0)
            assert _shape_misses(distribution, [planted.next_delay() for _ in range(DRAWS)], 0.010) != []


def test_with_allreduce_the_fast_worker_waits_out_the_slow_ones_delay_every_step(tmp_path, tiny_data):
    """Synchronous all-reduce waits for the slowest worker every step.

    Measured inside one run, rank against rank: comparing a slow run with a separate fast run
    depends on how busy the machine's cores are (on 2 cores, a sleeping worker leaves the other
    one a core to itself, so the slow run's compute gets faster)."""
    steps, delay_ms = 28, 30  # 28 steps = the tiny study's epoch at 2 x 32
    slow, _, _ = train_run(
        tmp_path / "slow",
        tiny_data,
        workers=2,
        batch_size=32,
        steps=steps,
        stragglers={"ranks": [1], "delay_ms": delay_ms},
    )
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
    run, _, _ = train_run(
        tmp_path / "slow",
        tiny_data,
        workers=2,
        batch_size=32,
        steps=steps,
        strategy="ps_async",
        stragglers={"ranks": [1], "delay_ms": delay_ms},
    )
    fast_worker, slow_worker = run["step_time_per_worker"]
    assert fast_worker["comm_s"] < slow_worker["comm_s"] + 0.3 * delay_ms / 1000  # no waiting for rank 1
    assert fast_worker["throughput"] > 1.25 * slow_worker["throughput"], run["throughput_per_worker"]
