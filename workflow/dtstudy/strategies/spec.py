"""What every strategy's spec gives (StrategySpec): its name, its knobs and their checks, the
processes it needs besides the N workers, and its performance model. Torch-free, as every
family's `spec` module that subclasses it (dtstudy.strategies.specs collects them). The ground
floor of dtstudy.strategies: it imports nothing of the package's strategies."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

from dtstudy.config import schema
from dtstudy.errors import ConfigError
from dtstudy.perfmodel import steps
from dtstudy.perfmodel.collectives import ring_allreduce_bytes
from dtstudy.perfmodel.machine import NO_STRAGGLERS, Machine, Step, Stragglers, Workload
from dtstudy.perfmodel.waits import natural_wait

#: the knob schema of a strategy the config schema gives none
NO_KNOBS = {"type": "object", "properties": {}, "additionalProperties": False}


class StrategySpec:
    """A strategy's knobs (`strategy_params.<name>`) and the facts the launcher needs. A subclass
    that gives a `name` takes its knobs from the schema as it is defined (`take_knob_schema`)."""

    #: the value users write in `strategies`: the one place a strategy's name is typed (its
    #: class, dtstudy.strategies.base.Strategy, and the registry take it from here)
    name: ClassVar[str]
    #: the family the tables and plots group it in (FAMILIES)
    family: ClassVar[str]
    #: the schema of its knobs, strategy_params.properties.<name> (`take_knob_schema`);
    #: a strategy the schema gives no knobs takes none
    knob_schema: ClassVar[dict[str, Any]] = NO_KNOBS
    #: the knobs with their defaults, from `knob_schema`; others are rejected
    defaults: ClassVar[dict[str, Any]] = {}
    #: why train.precision fp16 is refused for it (None: allowed). fp16 scales the loss by a
    #: GradScaler that must unscale every gradient before the update and skip a step with
    #: inf/NaN ones (Strategy.step_optimizer); a strategy says None only once it does so
    no_fp16_because: ClassVar[str | None] = (
        "its spec does not say that its update steps through the GradScaler (Strategy.step_optimizer)"
    )
    #: why launcher.cluster emulate cannot run it yet (None: it can; dtstudy.emulation)
    not_emulated_because: ClassVar[str | None] = None
    #: the layout of what its extra processes save (None: they save nothing, or it never
    #: changed); part of a resume file's identity, so that a file of an older layout is not
    #: resumed from (the run starts afresh, saying why) rather than failing on a size mismatch
    state_layout: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # on definition, not when some collector runs: a strategy's class imported alone
        # (without dtstudy.strategies.specs) checks its knobs as the config check does
        if "name" in cls.__dict__:
            cls.take_knob_schema(schema.knob_schemas().get(cls.name))

    @classmethod
    def take_knob_schema(cls, knob_schema: dict[str, Any] | None) -> None:
        """Its knobs from their schema, strategy_params.properties.<name> (None: it has none); a
        knob without a default fails here, at import, rather than in some run."""
        if knob_schema is None:  # none of its own, whatever the class it extends takes
            knob_schema = NO_KNOBS
        knobs = knob_schema.get("properties", {})
        no_default = sorted(knob for knob, subschema in knobs.items() if "default" not in subschema)
        if no_default or knob_schema.get("additionalProperties") is not False:
            raise RuntimeError(
                f"{schema.SCHEMA_PATH}: strategy_params.{cls.name} needs additionalProperties: false "
                f"and a default for every knob (none: {no_default})"
            )
        cls.knob_schema = knob_schema
        cls.defaults = {knob: subschema["default"] for knob, subschema in knobs.items()}

    @classmethod
    def check_params(cls, params: dict[str, Any], workers: int) -> dict[str, Any]:
        """Check the knobs against the schema and for N=workers, fill defaults; raise ConfigError naming the key."""
        schema.check(params, cls.knob_schema, prefix=("strategy_params", cls.name))
        merged = {**cls.defaults, **params}
        cls.validate(merged, workers)
        return merged

    @classmethod
    def validate(cls, params: dict[str, Any], workers: int) -> None:
        """Checks beyond the schema (on N, on several knobs); subclasses raise `cls.bad_knob`."""

    @classmethod
    def bad_knob(cls, knob: str, value: Any, allowed: str) -> ConfigError:
        return ConfigError(f"config key 'strategy_params.{cls.name}.{knob}': {value!r} is not allowed; {allowed}")

    @classmethod
    def extra_processes(cls, params: dict[str, Any], workers: int) -> int:
        """Processes besides the N workers that this strategy needs in the job (e.g. PS shards)."""
        return 0

    @classmethod
    def placed_params(cls, params: dict[str, Any], nodes: int) -> dict[str, Any]:
        """The knobs (`check_params`'s) once the run's node count is known: a knob whose
        default depends on it filled in (the parameter servers' shards). Default: unchanged."""
        return params

    @classmethod
    def step_limit(cls, params: dict[str, Any]) -> int | None:
        """The steps its runs stop after, besides train.max_steps (None: no limit of its own)."""
        return None

    @classmethod
    def exchange_cycle(cls, params: dict[str, Any]) -> tuple[int, int]:
        """(the steps before its exchange settles into its steady state, the steps of one cycle
        of it). A run's timed windows start after the first and span whole cycles
        (dtstudy.training.measurements.timed_window), so that each window holds the share of
        exchanges a long run has. Default: the same exchange every step, from the first."""
        return 0, 1

    # ----- its performance model -------------------------------------------------------

    #: memory passes over the gradient bytes of its own work on a worker (a compression's
    #: casts or quantisation), used when a profile gives compression_gbyte_s and the machine
    #: has no measured seconds per byte for it; 0 = no such work. The communication benchmark
    #: times the exchange of every strategy that has some
    compression_passes: ClassVar[float] = 0.0
    #: its exchange is handed gradients during backward (DDP's buckets and comm hooks) and
    #: may hide behind it; the others exchange after it
    overlaps_backward: ClassVar[bool] = False
    #: its model needs the fully connected layers' shapes (Workload.fully_connected: a layer
    #: profile's, or a run's model.pt); the projection finds them first
    needs_fully_connected: ClassVar[bool] = False
    #: its bytes depend on the model's shapes, not on the parameter count alone: its model
    #: reads the share of the plain all-reduce's bytes that its runs at N > 1 measured
    #: (Workload.measured_share), or counts it from the gradient's matrices (Workload.matrices),
    #: which the projection then finds first
    needs_matrices: ClassVar[bool] = False

    @classmethod
    def parameters_from_bytes(cls, bytes_per_step: float, workers: int, params: dict[str, Any]) -> int | None:
        """The model's parameter count that its run's bytes a step at N=workers imply (the
        study's gradients are fp32), for the projection's calibration; None where they do not
        say it alone (no exchange, or bytes that depend on the model's shapes or on chance)."""
        return None

    @classmethod
    def barrier(cls, workers: int, params: dict[str, Any]) -> tuple[int, int, int | None]:
        """The barrier its workers meet, for their natural jitter: (participants, window of steps
        between meetings, the arrival it waits for; None = the last). One participant: none."""
        return workers, 1, None

    @classmethod
    def step_model(
        cls, workload: Workload, machine: Machine, workers: int, params: dict[str, Any], stragglers: Stragglers
    ) -> Step:
        """Its step at N=workers from dtstudy.perfmodel.steps' formulas; `params`: its knobs, defaults filled."""
        raise NotImplementedError(f"strategy {cls.name!r} has no performance model")

    @classmethod
    def model_step(
        cls,
        workload: Workload,
        machine: Machine,
        workers: int,
        params: dict[str, Any] | None = None,
        stragglers: Stragglers = NO_STRAGGLERS,
    ) -> Step:
        """The modelled step at N=workers on `machine`: compute scaled for the busy workers of a
        node, `step_model`, what hid the exchange, and the barrier's natural jitter. `params`:
        its knobs (the schema's defaults filled in here) plus `placement` for the parameter servers."""
        params = {**cls.defaults, **(params or {})}
        scale = machine.compute_scale.get(machine.local(workers), 1.0) if machine.compute_scale else 1.0
        if scale != 1.0:
            workload = dataclasses.replace(workload, compute_s=workload.compute_s * scale)
        result = dataclasses.replace(
            cls.step_model(workload, machine, workers, params, stragglers),
            overlap=steps.overlap_used(cls.overlaps_backward, workload, machine),
        )
        jitter = natural_wait(machine, workload.compute_s, *cls.barrier(workers, params))
        if jitter <= 0:  # a strategy without a barrier has one participant: none
            return result
        step_s = result.step_s + jitter
        return dataclasses.replace(
            result, step_s=step_s, straggler_s=result.straggler_s + jitter, throughput=workers * workload.batch / step_s
        )


def ring_parameters(bytes_per_step: float, workers: int, value_bytes: int) -> int | None:
    """The values a ring all-reduce carried, from one worker's bytes (ring_allreduce_bytes of them)."""
    if workers < 2 or bytes_per_step <= 0:
        return None
    return round(bytes_per_step / ring_allreduce_bytes(value_bytes, workers))


@functools.cache
def default_placement() -> str:
    """Where a parameter server's shards sit when the caller gives no `placement` (the hardware schema's default)."""
    return schema.load_schema_file("hardware.schema.yaml")["$defs"]["placement"]["default"]
