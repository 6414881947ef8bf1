"""no_exchange's spec (torch-free): N workers that exchange nothing, the machine's ceiling."""

from __future__ import annotations

from dtstudy.perfmodel import steps
from dtstudy.strategies.spec import StrategySpec


class NoExchangeSpec(StrategySpec):
    name = "no_exchange"
    family = "reference"
    no_fp16_because = None

    @classmethod
    def barrier(cls, workers, params):
        return 1, 1, None  # no barrier

    @classmethod
    def step_limit(cls, params):
        # only its timed windows are used: a short run measures the ceiling as well as a long one
        return params["steps"]

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        """The ceiling: every worker computes and updates alone; no exchange, no barrier."""
        return steps.independent_step(cls.name, workload, workers, stragglers)
