"""gossip's spec (torch-free): each step, parameters averaged with neighbours; no global barrier."""

from __future__ import annotations

from dtstudy.perfmodel import steps
from dtstudy.strategies.spec import StrategySpec


class GossipSpec(StrategySpec):
    name = "gossip"
    family = "local / decentralized"
    no_fp16_because = None  # its exchange averages parameters; each worker's update is its own
    # memory passes over the parameter bytes of a step's averaging with one neighbour
    # (flatten: 2, stack of 2 copies: 4, their mean: 3, copy back: 2); with d neighbours
    # the work grows with the 1 + d vectors averaged (perfmodel.steps.mixing_time)
    mixing_passes = 11.0

    @classmethod
    def barrier(cls, workers, params):
        # a worker waits for its neighbours only
        return (steps.gossip_degree(params["topology"], workers) + 1 if workers > 1 else 1), 1, None

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        return steps.gossip_step(cls.name, cls.mixing_passes, workload, machine, workers, params, stragglers)
