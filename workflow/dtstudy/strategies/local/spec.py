"""Local SGD's and EASGD's specs (torch-free): workers that average every `period` steps."""

from __future__ import annotations

from dtstudy.perfmodel import steps
from dtstudy.perfmodel.machine import Workload
from dtstudy.strategies.spec import StrategySpec, ring_parameters


class PeriodicAveragingSpec(StrategySpec):
    """Workers that average every `period` steps (all-reduce, blocking)."""

    family = "local / decentralized"
    # each worker's own optimizer steps through its GradScaler; the averages are of parameters
    # and momentum (unscaled), and local_sgd's warm-up averages gradients of equal scales (the
    # workers' scalers see the same averaged gradients, so they skip and rescale together)
    no_fp16_because = None

    @classmethod
    def averaged_bytes(cls, workload: Workload) -> float:
        raise NotImplementedError

    @classmethod
    def barrier(cls, workers, params):
        return workers, params["period"], None

    @classmethod
    def exchange_cycle(cls, params):
        """One average every `period` steps, after local SGD's `warmup_steps` of synchronous SGD."""
        return params.get("warmup_steps", 0), params["period"]

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        return steps.periodic_allreduce_step(
            cls.name, cls.averaged_bytes(workload), params["period"], workload, machine, workers, stragglers
        )


class LocalSGDSpec(PeriodicAveragingSpec):
    name = "local_sgd"

    @classmethod
    def averaged_bytes(cls, workload):
        return 2 * workload.model_bytes  # the parameters and the momentum buffers


class EASGDSpec(PeriodicAveragingSpec):
    name = "easgd"

    @classmethod
    def averaged_bytes(cls, workload):
        return workload.model_bytes  # the elastic differences

    @classmethod
    def parameters_from_bytes(cls, bytes_per_step, workers, params):
        """The fp32 elastic differences in a ring every `period` steps: a run's mean a step
        says the count only at period 1 (how many exchanges fall in its timed steps varies)."""
        if {**cls.defaults, **params}["period"] != 1:
            return None
        return ring_parameters(bytes_per_step, workers, 4)

    @classmethod
    def validate(cls, params, workers):
        alpha = params["alpha"]
        if alpha is not None and workers * alpha > 1:
            # the centre moves as c <- (1 - N alpha) c + N alpha mean_i(x_i): past N alpha = 1 it
            # overshoots the mean, past 2 it diverges (Zhang et al. 2015 take alpha = beta / N)
            raise cls.bad_knob(
                "alpha",
                alpha,
                f"N*alpha must be <= 1, i.e. alpha <= 1/N = {1 / workers:.4g} "
                f"with N={workers} in workers (or set beta = N*alpha instead)",
            )
