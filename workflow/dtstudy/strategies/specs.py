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

from typing import Any, ClassVar

from dtstudy.config import schema
from dtstudy.errors import ConfigError


class StrategySpec:
    """A strategy's knobs (`strategy_params.<name>`) and the facts the launcher needs."""

    name: ClassVar[str]
    #: the family the tables and plots group it in (FAMILIES)
    family: ClassVar[str]
    #: the schema of its knobs, strategy_params.properties.<name> (set when SPECS is built)
    knob_schema: ClassVar[dict[str, Any]] = {}
    #: the knobs with their defaults, from `knob_schema`; others are rejected
    defaults: ClassVar[dict[str, Any]] = {}

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


# ----- synchronous all-reduce and its compressed variants ------------------------------

class AllReduceSpec(StrategySpec):
    name = "allreduce"
    family = "synchronous"


class AllReduceFP16Spec(AllReduceSpec):
    name = "allreduce_fp16"
    family = "compressed"


class AllReduceBF16Spec(AllReduceSpec):
    name = "allreduce_bf16"
    family = "compressed"


class AllReducePowerSGDSpec(AllReduceSpec):
    name = "allreduce_powersgd"
    family = "compressed"

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


# ----- parameter servers --------------------------------------------------------------

class ParameterServerSpec(StrategySpec):
    family = "parameter server"

    @classmethod
    def extra_processes(cls, params, workers):
        return params["shards"]


class PsSyncSpec(ParameterServerSpec):
    name = "ps_sync"


class PsBackupSpec(ParameterServerSpec):
    name = "ps_backup"

    @classmethod
    def validate(cls, params, workers):
        backup = params["backup"]
        # a single worker has nobody to back it up: N=1 runs as ps_sync, so a study's
        # workers list may start at 1 with the default k=1
        if workers > 1 and backup >= workers:
            raise cls.bad_knob("backup", backup, f"an integer from 0 to N-1 is needed and N={workers} is in workers")


class PsAsyncSpec(ParameterServerSpec):
    name = "ps_async"


class SspSpec(ParameterServerSpec):
    name = "ssp"


# ----- local and decentralized ----------------------------------------------------------

class LocalSGDSpec(StrategySpec):
    name = "local_sgd"
    family = "local / decentralized"


class EASGDSpec(StrategySpec):
    name = "easgd"
    family = "local / decentralized"

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


# ----- the reference: no exchange at all (the machine's ceiling) ----------------------

class NoExchangeSpec(StrategySpec):
    name = "no_exchange"
    family = "reference"


SPECS: dict[str, type[StrategySpec]] = {spec.name: spec for spec in (
    AllReduceSpec, PsSyncSpec, PsBackupSpec, PsAsyncSpec, SspSpec, LocalSGDSpec, EASGDSpec, GossipSpec,
    AllReduceFP16Spec, AllReduceBF16Spec, AllReducePowerSGDSpec, AllReduceOneBitSpec,
    NoExchangeSpec,
)}


def _attach_knob_schemas() -> None:
    """Give every spec its knobs from the schema; a spec without a schema (or the reverse),
    or a knob without a default, fails at import rather than in some run."""
    knob_schemas = schema.knob_schemas()
    if knob_schemas.keys() != SPECS.keys():
        raise RuntimeError(f"strategies without both a spec and a schema under strategy_params in "
                           f"{schema.SCHEMA_PATH}: {sorted(knob_schemas.keys() ^ SPECS.keys())}")
    for name, spec in SPECS.items():
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
