"""hybrid's spec (torch-free): data-parallel convolutions, model-parallel fully connected layers."""

from __future__ import annotations

from dtstudy.perfmodel import steps
from dtstudy.strategies.spec import StrategySpec


class HybridSpec(StrategySpec):
    name = "hybrid"
    family = "synchronous"  # synchronous SGD, allreduce's update
    overlaps_backward = True  # the data-parallel layers' gradient in DDP's buckets
    needs_fully_connected = True  # its model-parallel layers

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        """Krizhevsky 2014: the other layers' gradient all-reduced behind backward, the
        activations of the fully connected layers exchanged, blocking, forward and backward."""
        return steps.hybrid_step(cls.name, workload, machine, workers, params, stragglers)
