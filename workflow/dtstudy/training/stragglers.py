"""Straggler injection: a seeded delay added to the compute of chosen workers every step.

On identical CPUs every worker runs at the same pace and the difference between synchronous
and asynchronous strategies hardly shows; slow workers make it measurable (Chen et al. 2016).

The draws (which ranks, what delays) come from `stragglers.seed` together with the run's
training seed: every strategy run with the same seed meets the same stragglers (a paired
comparison), and each training seed is an independent replicate of them, so the spread over
seeds includes the stragglers' (as the emulated clock's jitter, drawn per seed, already did).
"""

from __future__ import annotations

import random

from dtstudy.common import timing

DISTRIBUTIONS = ("fixed", "uniform", "exponential")


def slow_ranks(stragglers: dict, workers: int, run_seed: int) -> list[int]:
    """The slow workers of a run with N=workers and training seed run_seed: the given ranks,
    or a seeded draw of round(fraction * N) of them."""
    if stragglers["ranks"]:
        return sorted(stragglers["ranks"])
    count = round(stragglers["fraction"] * workers)
    return sorted(random.Random(f"ranks-{stragglers['seed']}-{run_seed}").sample(range(workers), count))


def check(stragglers: dict, workers_list: list[int]) -> None:
    """Raise ValueError naming the key when the straggler settings cannot apply to every N."""
    if stragglers["ranks"] and stragglers["fraction"]:
        raise ValueError("config key 'stragglers': give either ranks or fraction, not both")
    for rank in stragglers["ranks"]:
        too_small = [n for n in workers_list if rank >= n]
        if too_small:
            raise ValueError(
                f"config key 'stragglers.ranks': rank {rank} does not exist with N={too_small[0]} workers "
                f"(ranks are 0..N-1 for every N in workers {workers_list}); use stragglers.fraction instead"
            )


class Straggler:
    """Sleeps at every step on a slow worker; does nothing on the others."""

    def __init__(self, stragglers: dict, workers: int, rank: int, run_seed: int):
        self.active = rank in slow_ranks(stragglers, workers, run_seed) and stragglers["delay_ms"] > 0
        self.mean_s = stragglers["delay_ms"] / 1000.0
        self.distribution = stragglers["distribution"]
        self.rng = random.Random(f"delays-{stragglers['seed']}-{run_seed}-{rank}")
        self.total_s = 0.0

    def next_delay(self) -> float:
        if self.distribution == "fixed":
            return self.mean_s
        if self.distribution == "uniform":
            return self.rng.uniform(0.0, 2.0 * self.mean_s)
        return self.rng.expovariate(1.0 / self.mean_s)

    def delay(self, clock: timing.Clock) -> None:
        """The next delay on `clock`, the step's: the device's timeline (a GPU's after the work
        queued before), or an emulated worker's."""
        if self.active:
            seconds = self.next_delay()
            clock.sleep(seconds)
            self.total_s += seconds
