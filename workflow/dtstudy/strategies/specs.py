"""What each strategy is before it runs: its knobs (from the config schema) and their checks, and the
processes it needs besides the N workers. Torch-free, so that the config check (run when
the Snakefile is parsed) and the launcher stay light; the implementations that train are
in `dtstudy.strategies.registry`, one class per name here.

A strategy's knobs, their types, defaults, ranges and enums are its schema in
workflow/schemas/config.schema.yaml, `strategy_params.properties.<name>`: the one source of
truth. A spec's `validate` holds only what a schema cannot say: checks that depend on N (the
study's workers) or on several knobs at once.
"""

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


class StrategySpec:
    """A strategy's knobs (`strategy_params.<name>`) and the facts the launcher needs."""

    name: ClassVar[str]
    #: the family the tables and plots group it in (FAMILIES)
    family: ClassVar[str]
    #: the schema of its knobs, strategy_params.properties.<name> (set when SPECS is built);
    #: a strategy the schema gives no knobs takes none
    knob_schema: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}, "additionalProperties": False}
    #: the knobs with their defaults, from `knob_schema`; others are rejected
    defaults: ClassVar[dict[str, Any]] = {}
    #: why train.precision fp16 is refused for it (None: allowed). fp16 scales the loss by a
    #: GradScaler that must unscale every gradient before the update and skip a step with
    #: inf/NaN ones (Strategy.step_optimizer); a strategy says None only once it does so
    no_fp16_because: ClassVar[str | None] = ("its spec does not say that its update steps through the "
                                             "GradScaler (Strategy.step_optimizer)")
    #: why launcher.cluster emulate cannot run it yet (None: it can; dtstudy.emulation)
    not_emulated_because: ClassVar[str | None] = None
    #: the layout of what its extra processes save (None: they save nothing, or it never
    #: changed); part of a resume file's identity, so that a file of an older layout is not
    #: resumed from (the run starts afresh, saying why) rather than failing on a size mismatch
    state_layout: ClassVar[str | None] = None

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
    def step_model(cls, workload: Workload, machine: Machine, workers: int, params: dict[str, Any],
                   stragglers: Stragglers) -> Step:
        """Its step at N=workers from dtstudy.perfmodel.steps' formulas; `params`: its knobs, defaults filled."""
        raise NotImplementedError(f"strategy {cls.name!r} has no performance model")

    @classmethod
    def model_step(cls, workload: Workload, machine: Machine, workers: int, params: dict[str, Any] | None = None,
                   stragglers: Stragglers = NO_STRAGGLERS) -> Step:
        """The modelled step at N=workers on `machine`: compute scaled for the busy workers of a
        node, `step_model`, what hid the exchange, and the barrier's natural jitter. `params`:
        its knobs (the schema's defaults filled in here) plus `placement` for the parameter servers."""
        params = {**cls.defaults, **(params or {})}
        scale = machine.compute_scale.get(machine.local(workers), 1.0) if machine.compute_scale else 1.0
        if scale != 1.0:
            workload = dataclasses.replace(workload, compute_s=workload.compute_s * scale)
        result = dataclasses.replace(cls.step_model(workload, machine, workers, params, stragglers),
                                     overlap=steps.overlap_used(cls.overlaps_backward, workload, machine))
        jitter = natural_wait(machine, workload.compute_s, *cls.barrier(workers, params))
        if jitter <= 0:  # a strategy without a barrier has one participant: none
            return result
        step_s = result.step_s + jitter
        return dataclasses.replace(result, step_s=step_s, straggler_s=result.straggler_s + jitter,
                                   throughput=workers * workload.batch / step_s)


# ----- synchronous all-reduce and its compressed variants ------------------------------

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
        return steps.allreduce_step(cls.name, cls.wire_bytes(workload), cls.compression_passes, workload, machine,
                                    workers, params, stragglers)

    @classmethod
    def parameters_from_bytes(cls, bytes_per_step, workers, params):
        """The whole gradient in a ring every step: 2 (N-1)/N x its wire bytes."""
        return _ring_parameters(bytes_per_step, workers, cls.wire_value_bytes)


class AllReduceFP16Spec(AllReduceSpec):
    name = "allreduce_fp16"
    family = "compressed"
    # a 16-bit cast reads 4 and writes 2 bytes per value and back: ~3 passes of the fp32 bytes
    compression_passes = 3.0
    wire_value_bytes = 2  # half the bytes

    @classmethod
    def wire_bytes(cls, workload):
        return workload.parameters * float(cls.wire_value_bytes)


class AllReduceBF16Spec(AllReduceFP16Spec):
    name = "allreduce_bf16"


class AllReducePowerSGDSpec(AllReduceSpec):
    name = "allreduce_powersgd"
    family = "compressed"
    no_fp16_because = ("its error feedback keeps residuals of the loss-scaled gradients: a change of the "
                       "scale leaves them off by that factor and an overflowing step's inf stays in them")
    # rank r: two matrix products over the gradient and the error feedback, ~6 passes
    compression_passes = 6.0
    needs_matrices = True  # which matrices it factorises depends on their shapes
    #: a matrix is factorised only when that makes it this many times smaller (torch's
    #: PowerSGDState default, which the strategy keeps)
    MIN_COMPRESSION_RATE = 2

    @classmethod
    def sent_share(cls, matrices, rank: int) -> float:
        """Share of the gradient's values PowerSGD all-reduces: a matrix n x m goes as rank-r P
        (n x r) and Q (m x r) when that is smaller by MIN_COMPRESSION_RATE (torch's
        `_should_compress`), whole otherwise; a vector [n, 1] always goes whole."""
        total = sent = 0
        for n, m in matrices:
            total += n * m
            sent += (n + m) * rank if (n + m) * rank * cls.MIN_COMPRESSION_RATE < n * m else n * m
        return sent / total

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        """torch's hook all-reduces three times per bucket, one after the other: the tensors it
        sends whole (vectors, matrices too small to gain), then the rank-r factors P, then Q
        (each needs the one before); the bytes are the share of the gradient's that its runs
        measured, or `sent_share` of the model's matrices at the rank knob."""
        share = workload.measured_share.get(cls.name)
        if share is None:
            if workload.matrices is None:
                raise ValueError("allreduce_powersgd needs the share of the gradient bytes PowerSGD sends "
                                 "(a run's measured bytes_per_step at N > 1, or the model's matrices)")
            share = cls.sent_share(workload.matrices, params["rank"])
        return steps.allreduce_step(cls.name, workload.model_bytes * share, cls.compression_passes,
                                    workload, machine, workers, params, stragglers, messages_per_bucket=3)

    @classmethod
    def parameters_from_bytes(cls, bytes_per_step, workers, params):
        return None  # its bytes depend on the matrices' shapes

    @classmethod
    def exchange_cycle(cls, params):
        """Its first `start_powerSGD_iter` steps all-reduce the whole gradient (torch's hook)."""
        return params["start_powerSGD_iter"], 1

    @classmethod
    def validate(cls, params, workers):
        # PowerSGD's state (warm start, error feedback) needs a plain step first
        stateful = params["warm_start"] or params["use_error_feedback"]
        if stateful and params["start_powerSGD_iter"] < 2:
            raise cls.bad_knob("start_powerSGD_iter", params["start_powerSGD_iter"],
                               "an integer >= 2 is needed while warm_start or use_error_feedback is true")


class AllReduceOneBitSpec(AllReduceSpec):
    name = "allreduce_onebit"
    family = "compressed"
    no_fp16_because = AllReducePowerSGDSpec.no_fp16_because
    # residual add, |x| mean, sign pack, dequantise and new residual: ~6 passes
    compression_passes = 6.0

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        return steps.onebit_step(cls.name, cls.compression_passes, workload, machine, workers, params, stragglers)

    @classmethod
    def parameters_from_bytes(cls, bytes_per_step, workers, params):
        return None  # its bytes depend on the tensors and column groups its quantiser scales


# ----- hybrid: data-parallel convolutions, model-parallel fully connected layers --------

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


# ----- parameter servers --------------------------------------------------------------

#: the request a worker sends each shard before its gradient (parameter_server.protocol:
#: REQUEST_SIZE float64, 5 since a push carries its checkpoint wish; a constant here, as the
#: specs import no torch)
PS_REQUEST_BYTES = 40


class ParameterServerSpec(StrategySpec):
    family = "parameter server"
    # a shard saves a contiguous range of the flattened parameters (db3e04d); before, whole tensors
    state_layout = "flat-range"
    no_fp16_because = ("the shards apply the pushed gradients: a worker's GradScaler can neither unscale "
                       "them there nor skip a step with inf/NaN gradients")
    # emulated: the shards are threads too, their work and messages on the cluster's clock
    # (dtstudy.emulation.runner, docs/emulation.md)

    @classmethod
    def extra_processes(cls, params, workers):
        if params["shards"] is None:
            raise ValueError(f"{cls.name}: the shard count is one per node; ask placed_params(params, nodes) first")
        return params["shards"]

    @classmethod
    def placed_params(cls, params, nodes):
        """`shards: null` (the default): one shard per node of the run, so that each node's
        NIC carries one shard's share (perfmodel.steps.shard_count models the same)."""
        return {**params, "shards": steps.default_shards(nodes) if params["shards"] is None else params["shards"]}

    @classmethod
    def model_step(cls, workload, machine, workers, params=None, stragglers=NO_STRAGGLERS):
        """As every strategy's, with `placement` (where the shards sit, a hardware profile's
        key) at the hardware schema's default where the caller gives none."""
        params = {"placement": _default_placement(), **(params or {})}
        return super().model_step(workload, machine, workers, params, stragglers)

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        """Push to S shards, each waits for all N, updates, answers: 2 phases + the update."""
        return steps.ps_round_step(cls.name, workload, machine, workers, params, stragglers)

    @classmethod
    def parameters_from_bytes(cls, bytes_per_step, workers, params):
        """A worker pushes its fp32 gradient after a request to each shard (`shards` null: one
        per node, and the runs this reads ran on one node)."""
        if bytes_per_step <= 0:
            return None
        shards = {**cls.defaults, **params}["shards"] or 1
        return round((bytes_per_step - PS_REQUEST_BYTES * shards) / 4)


class PsSyncSpec(ParameterServerSpec):
    name = "ps_sync"


class PsBackupSpec(ParameterServerSpec):
    name = "ps_backup"

    #: k when neither `backup` nor `backup_fraction` is given
    DEFAULT_BACKUPS = 1

    @classmethod
    def validate(cls, params, workers):
        backup, fraction = params["backup"], params["backup_fraction"]
        if backup is not None and fraction is not None:
            raise cls.bad_knob("backup_fraction", fraction, f"give backup (a count, here {backup!r}) or "
                               "backup_fraction (a share of N), not both")
        # a single worker has nobody to back it up: N=1 runs as ps_sync, so a study's
        # workers list may start at 1 with a count of 1 (a share is at most N-1 by itself)
        if backup is not None and workers > 1 and backup >= workers:
            raise cls.bad_knob("backup", backup, f"an integer from 0 to N-1 is needed and N={workers} is in workers")

    @classmethod
    def backups(cls, workers: int, params: dict[str, Any]) -> int:
        """k at N=workers: `backup`, or round(backup_fraction * N) when a share is given (1 when
        neither is); at most N-1."""
        backup, fraction = params.get("backup"), params.get("backup_fraction")
        if backup is None:
            backup = cls.DEFAULT_BACKUPS if fraction is None else round(fraction * workers)
        return max(0, min(backup, workers - 1))

    @classmethod
    def quorum(cls, workers: int, params: dict[str, Any]) -> int:
        """The gradients an update waits for: N-k (all N are still sent; N=1 waits for itself)."""
        return workers - cls.backups(workers, params)

    @classmethod
    def barrier(cls, workers, params):
        return workers, 1, cls.quorum(workers, params)

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        """As ps_sync, but the update waits for the (N-k)-th gradient."""
        return steps.ps_round_step(cls.name, workload, machine, workers, params, stragglers,
                                   quorum=cls.quorum(workers, params))


class PsAsyncSpec(ParameterServerSpec):
    name = "ps_async"

    @classmethod
    def barrier(cls, workers, params):
        return 1, 1, None  # no barrier

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        return steps.ps_async_step(cls.name, workload, machine, workers, params, stragglers)


class SspSpec(ParameterServerSpec):
    name = "ssp"

    @classmethod
    def barrier(cls, workers, params):
        staleness = params["staleness"]
        return workers, (workers if staleness is None else staleness) + 1, None

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        """As ps_async (each push its own update, on arrival), but a worker may run only s
        steps ahead: it waits for the slowest over windows of s+1 steps (a fixed straggler
        still paces everybody). Unbounded (staleness null) it is ps_async."""
        if params["staleness"] is None:
            return steps.ps_async_step(PsAsyncSpec.name, workload, machine, workers, params, stragglers)
        return steps.ps_async_step(cls.name, workload, machine, workers, params, stragglers,
                                   window=params["staleness"] + 1)


# ----- local and decentralized ----------------------------------------------------------

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
        return steps.periodic_allreduce_step(cls.name, cls.averaged_bytes(workload), params["period"], workload,
                                             machine, workers, stragglers)


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
        return _ring_parameters(bytes_per_step, workers, 4)

    @classmethod
    def validate(cls, params, workers):
        alpha = params["alpha"]
        if alpha is not None and workers * alpha > 1:
            # the centre moves as c <- (1 - N alpha) c + N alpha mean_i(x_i): past N alpha = 1 it
            # overshoots the mean, past 2 it diverges (Zhang et al. 2015 take alpha = beta / N)
            raise cls.bad_knob("alpha", alpha, f"N*alpha must be <= 1, i.e. alpha <= 1/N = {1 / workers:.4g} "
                                               f"with N={workers} in workers (or set beta = N*alpha instead)")


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


def _ring_parameters(bytes_per_step: float, workers: int, value_bytes: int) -> int | None:
    """The values a ring all-reduce carried, from one worker's bytes (ring_allreduce_bytes of them)."""
    if workers < 2 or bytes_per_step <= 0:
        return None
    return round(bytes_per_step / ring_allreduce_bytes(value_bytes, workers))


# ----- the reference: no exchange at all (the machine's ceiling) ----------------------

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


SPECS: dict[str, type[StrategySpec]] = {spec.name: spec for spec in (
    AllReduceSpec, PsSyncSpec, PsBackupSpec, PsAsyncSpec, SspSpec, LocalSGDSpec, EASGDSpec, GossipSpec,
    AllReduceFP16Spec, AllReduceBF16Spec, AllReducePowerSGDSpec, AllReduceOneBitSpec, HybridSpec,
    NoExchangeSpec,
)}


def _attach_knob_schemas() -> None:
    """Give every spec its knobs from the schema; a spec without a schema (or the reverse),
    or a knob without a default, fails at import rather than in some run."""
    knob_schemas = schema.knob_schemas()
    if knob_schemas.keys() - SPECS.keys():
        raise RuntimeError(f"knobs under strategy_params in {schema.SCHEMA_PATH} for strategies without a spec: "
                           f"{sorted(knob_schemas.keys() - SPECS.keys())}")
    for name, spec in SPECS.items():
        if name not in knob_schemas:  # a strategy without knobs
            continue
        knobs = knob_schemas[name].get("properties", {})
        no_default = sorted(knob for knob, subschema in knobs.items() if "default" not in subschema)
        if no_default or knob_schemas[name].get("additionalProperties") is not False:
            raise RuntimeError(f"{schema.SCHEMA_PATH}: strategy_params.{name} needs additionalProperties: false "
                               f"and a default for every knob (none: {no_default})")
        spec.knob_schema = knob_schemas[name]
        spec.defaults = {knob: subschema["default"] for knob, subschema in knobs.items()}


_attach_knob_schemas()

#: the families, in the order of the plots' panels; "reference" (no_exchange) is the
#: machine's ceiling, drawn on every panel rather than in one of its own
FAMILIES = ("synchronous", "parameter server", "local / decentralized", "compressed", "reference")
REFERENCE_STRATEGY = "no_exchange"
if any(spec.family not in FAMILIES for spec in SPECS.values()):
    raise RuntimeError(f"a strategy's family is not in FAMILIES: {[(n, s.family) for n, s in SPECS.items()]}")

#: the parameter servers: workers push to and pull from shard processes (the model's PS
#: formulas, its calibration of the protocol's round trip, the extra processes of a job)
PARAMETER_SERVERS = frozenset(name for name, spec in SPECS.items() if issubclass(spec, ParameterServerSpec))

#: the 1-bit quantizers the implementation provides (the schema's enum)
ONEBIT_QUANTIZERS = tuple(AllReduceOneBitSpec.knob_schema["properties"]["quantizer"]["enum"])


def get_spec(name: str) -> type[StrategySpec]:
    try:
        return SPECS[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; allowed: {', '.join(sorted(SPECS))}") from None


@functools.cache
def _default_placement() -> str:
    return schema.load_schema_file("hardware.schema.yaml")["$defs"]["placement"]["default"]


def knob_defaults() -> dict[str, dict]:
    """{strategy name: its knobs' defaults} (the schema's)."""
    return {name: dict(spec.defaults) for name, spec in SPECS.items()}


def model_step(strategy: str, workload: Workload, machine: Machine, workers: int, params: dict | None = None,
               stragglers: Stragglers = NO_STRAGGLERS) -> Step:
    """The modelled step of `strategy` at N=workers (its spec's model_step)."""
    return get_spec(strategy).model_step(workload, machine, workers, params, stragglers)
