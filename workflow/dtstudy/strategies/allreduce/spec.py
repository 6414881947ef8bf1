"""allreduce's spec (torch-free): DDP's bucketed all-reduce, overlapped with backward, and its performance model."""

from __future__ import annotations

from typing import ClassVar

from dtstudy.perfmodel import steps
from dtstudy.perfmodel.machine import Workload
from dtstudy.strategies.spec import StrategySpec, ring_parameters


class AllReduceSpec(StrategySpec):
    name = "allreduce"
    family = "synchronous"
    overlaps_backward = True
    # the scaled gradients are averaged (linear), then the GradScaler steps the optimizer;
    # a 16-bit wire (allreduce_fp16) that overflows gives inf, and the step is skipped
    no_fp16_because = None

    #: bytes a gradient value takes on the wire as its runs send it (the study's are fp32)
    wire_value_bytes: ClassVar[int] = 4

    @classmethod
    def wire_bytes(cls, workload: Workload) -> float:
        """The bytes of one worker's gradient on the wire."""
        return workload.model_bytes

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        """DDP: the gradient all-reduced every step, overlapped with backward."""
        return steps.allreduce_step(
            cls.name, cls.wire_bytes(workload), cls.compression_passes, workload, machine, workers, params, stragglers
        )

    @classmethod
    def parameters_from_bytes(cls, bytes_per_step, workers, params):
        """The whole gradient in a ring every step: 2 (N-1)/N x its wire bytes."""
        return ring_parameters(bytes_per_step, workers, cls.wire_value_bytes)
