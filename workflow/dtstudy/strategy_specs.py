"""What each strategy is before it runs: its knobs with their defaults and checks, and the
processes it needs besides the N workers. Torch-free, so that the config check (run when
the Snakefile is parsed) and the launcher stay light; the implementations that train are
in `dtstudy.strategies`, one class per name here.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .errors import ConfigError


def is_whole_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class StrategySpec:
    """A strategy's knobs (`strategy_params.<name>`) and the facts the launcher needs."""

    name: ClassVar[str]
    #: the family the tables and plots group it in (FAMILIES)
    family: ClassVar[str]
    #: the knobs with their defaults; others are rejected
    defaults: ClassVar[dict[str, Any]] = {}

    @classmethod
    def check_params(cls, params: dict[str, Any], workers: int) -> dict[str, Any]:
        """Fill defaults and check the knobs for N=workers; raise ConfigError naming the key."""
        unknown = sorted(set(params) - set(cls.defaults))
        if unknown:
            allowed = ", ".join(sorted(cls.defaults)) or "none"
            raise ConfigError(
                f"config key 'strategy_params.{cls.name}.{unknown[0]}': unknown knob for "
                f"strategy {cls.name!r}; allowed: {allowed}"
            )
        merged = {**cls.defaults, **params}
        cls.validate(merged, workers)
        return merged

    @classmethod
    def validate(cls, params: dict[str, Any], workers: int) -> None:
        """Range checks of the knobs; subclasses raise ConfigError via `cls.bad_knob`."""

    @classmethod
    def bad_knob(cls, knob: str, value: Any, allowed: str) -> ConfigError:
        return ConfigError(f"config key 'strategy_params.{cls.name}.{knob}': {value!r} is not allowed; {allowed}")

    @classmethod
    def require_whole_number(cls, params: dict[str, Any], knob: str, minimum: int) -> None:
        """Raise `bad_knob` unless strategy_params.<name>.<knob> is an int >= minimum."""
        value = params[knob]
        if not is_whole_number(value) or value < minimum:
            raise cls.bad_knob(knob, value, f"a whole number >= {minimum}")

    @classmethod
    def extra_processes(cls, params: dict[str, Any], workers: int) -> int:
        """Processes besides the N workers that this strategy needs in the job (e.g. PS shards)."""
        return 0


# ----- synchronous all-reduce and its compressed variants ------------------------------

class AllReduceSpec(StrategySpec):
    name = "allreduce"
    family = "synchronous"
    defaults = {"bucket_cap_mb": 25}

    @classmethod
    def validate(cls, params, workers):
        if not is_number(params["bucket_cap_mb"]) or params["bucket_cap_mb"] <= 0:
            raise cls.bad_knob("bucket_cap_mb", params["bucket_cap_mb"], "a positive number of MiB")


class AllReduceFP16Spec(AllReduceSpec):
    name = "allreduce_fp16"
    family = "compressed"


class AllReduceBF16Spec(AllReduceSpec):
    name = "allreduce_bf16"
    family = "compressed"


class AllReducePowerSGDSpec(AllReduceSpec):
    name = "allreduce_powersgd"
    family = "compressed"
    defaults = {**AllReduceSpec.defaults, "rank": 2, "start_powerSGD_iter": 10, "warm_start": True,
                "use_error_feedback": True}

    @classmethod
    def validate(cls, params, workers):
        super().validate(params, workers)
        cls.require_whole_number(params, "rank", 1)
        for knob in ("warm_start", "use_error_feedback"):
            if not isinstance(params[knob], bool):
                raise cls.bad_knob(knob, params[knob], "true or false")
        stateful = params["warm_start"] or params["use_error_feedback"]
        cls.require_whole_number(params, "start_powerSGD_iter", 2 if stateful else 0)


ONEBIT_QUANTIZERS = ("column", "tensor")


class AllReduceOneBitSpec(AllReduceSpec):
    name = "allreduce_onebit"
    family = "compressed"
    defaults = {**AllReduceSpec.defaults, "quantizer": "column"}

    @classmethod
    def validate(cls, params, workers):
        super().validate(params, workers)
        if params["quantizer"] not in ONEBIT_QUANTIZERS:
            raise cls.bad_knob("quantizer", params["quantizer"], f"allowed: {', '.join(ONEBIT_QUANTIZERS)}")


# ----- parameter servers --------------------------------------------------------------

class ParameterServerSpec(StrategySpec):
    family = "parameter server"
    defaults = {"shards": 1}

    @classmethod
    def validate(cls, params, workers):
        if not is_whole_number(params["shards"]) or params["shards"] < 1:
            raise cls.bad_knob("shards", params["shards"], "an integer >= 1 (server processes)")

    @classmethod
    def extra_processes(cls, params, workers):
        return params["shards"]


class PsSyncSpec(ParameterServerSpec):
    name = "ps_sync"


class PsBackupSpec(ParameterServerSpec):
    name = "ps_backup"
    defaults = {"shards": 1, "backup": 1}

    @classmethod
    def validate(cls, params, workers):
        super().validate(params, workers)
        backup = params["backup"]
        # a single worker has nobody to back it up: N=1 runs as ps_sync, so a study's
        # workers list may start at 1 with the default k=1
        if not is_whole_number(backup) or backup < 0 or (workers > 1 and backup >= workers):
            raise cls.bad_knob("backup", backup, f"an integer from 0 to N-1 is needed and N={workers} is in workers")


class AsyncParameterServerSpec(ParameterServerSpec):
    """ps_async and ssp: `staleness_lr` divides an update's rate by its staleness (Zhang et
    al. 2016); `momentum` is the shards' momentum (null: train.momentum)."""

    defaults = {"shards": 1, "staleness_lr": False, "momentum": None}

    @classmethod
    def validate(cls, params, workers):
        super().validate(params, workers)
        if not isinstance(params["staleness_lr"], bool):
            raise cls.bad_knob("staleness_lr", params["staleness_lr"], "true or false")
        momentum = params["momentum"]
        if momentum is not None and (not is_number(momentum) or not 0 <= momentum < 1):
            raise cls.bad_knob("momentum", momentum, "null (train.momentum) or a number in [0, 1)")


class PsAsyncSpec(AsyncParameterServerSpec):
    name = "ps_async"


class SspSpec(AsyncParameterServerSpec):
    name = "ssp"
    defaults = {**AsyncParameterServerSpec.defaults, "staleness": 2}

    @classmethod
    def validate(cls, params, workers):
        super().validate(params, workers)
        staleness = params["staleness"]
        if staleness is not None and (not is_whole_number(staleness) or staleness < 0):
            raise cls.bad_knob("staleness", staleness,
                               "an integer >= 0 (clocks ahead of the slowest worker) or null (unbounded)")


# ----- local and decentralized ----------------------------------------------------------

class LocalSGDSpec(StrategySpec):
    name = "local_sgd"
    family = "local / decentralized"
    defaults = {"period": 8, "warmup_steps": 0}

    @classmethod
    def validate(cls, params, workers):
        cls.require_whole_number(params, "period", 1)
        cls.require_whole_number(params, "warmup_steps", 0)


class EASGDSpec(StrategySpec):
    name = "easgd"
    family = "local / decentralized"
    defaults = {"period": 8, "beta": 0.9, "alpha": None}

    @classmethod
    def validate(cls, params, workers):
        cls.require_whole_number(params, "period", 1)
        for knob in ("beta", "alpha"):
            value = params[knob]
            if knob == "alpha" and value is None:
                continue
            if not is_number(value) or not 0 < value <= 1:
                raise cls.bad_knob(knob, value, "a number in (0, 1]")
        alpha = params["alpha"]
        if alpha is not None and workers * alpha > 1:
            # the centre moves as c <- (1 - N alpha) c + N alpha mean_i(x_i): past N alpha = 1 it
            # overshoots the mean, past 2 it diverges (Zhang et al. 2015 take alpha = beta / N)
            raise cls.bad_knob("alpha", alpha, f"N*alpha must be <= 1, i.e. alpha <= 1/N = {1 / workers:.4g} "
                                               f"with N={workers} in workers (or set beta = N*alpha instead)")


GOSSIP_TOPOLOGIES = ("ring", "random_pairs")


class GossipSpec(StrategySpec):
    name = "gossip"
    family = "local / decentralized"
    defaults = {"topology": "ring"}

    @classmethod
    def validate(cls, params, workers):
        if params["topology"] not in GOSSIP_TOPOLOGIES:
            raise cls.bad_knob("topology", params["topology"], f"allowed: {', '.join(GOSSIP_TOPOLOGIES)}")


# ----- the reference: no exchange at all (the machine's ceiling) ----------------------

class NoExchangeSpec(StrategySpec):
    name = "no_exchange"
    family = "reference"


SPECS: dict[str, type[StrategySpec]] = {spec.name: spec for spec in (
    AllReduceSpec, PsSyncSpec, PsBackupSpec, PsAsyncSpec, SspSpec, LocalSGDSpec, EASGDSpec, GossipSpec,
    AllReduceFP16Spec, AllReduceBF16Spec, AllReducePowerSGDSpec, AllReduceOneBitSpec,
    NoExchangeSpec,
)}


#: the families, in the order of the plots' panels; "reference" (no_exchange) is the
#: machine's ceiling, drawn on every panel rather than in one of its own
FAMILIES = ("synchronous", "parameter server", "local / decentralized", "compressed", "reference")
REFERENCE_STRATEGY = "no_exchange"
if any(spec.family not in FAMILIES for spec in SPECS.values()):
    raise RuntimeError(f"a strategy's family is not in FAMILIES: {[(n, s.family) for n, s in SPECS.items()]}")


def get_spec(name: str) -> type[StrategySpec]:
    try:
        return SPECS[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; allowed: {', '.join(sorted(SPECS))}") from None
