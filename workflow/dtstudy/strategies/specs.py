"""Every strategy's spec, by name: what it is before it runs (its family, its knobs from the config
schema and their checks, the processes it needs besides the N workers) and its performance
model. Torch-free, so that the config check (run when the Snakefile is parsed) and the launcher
stay light. Each family's folder holds its specs (`<family>/spec.py`, subclasses of
dtstudy.strategies.spec.StrategySpec) beside its implementations (`<family>/strategy.py`,
collected by dtstudy.strategies.registry); this module collects the specs.

A strategy's knobs, their types, defaults, ranges and enums are its schema in
workflow/schemas/config.schema.yaml, `strategy_params.properties.<name>`: the one source of
truth. A spec's `validate` holds only what a schema cannot say: checks that depend on N (the
study's workers) or on several knobs at once.
"""

from __future__ import annotations

from dtstudy.config import schema
from dtstudy.perfmodel.machine import NO_STRAGGLERS, Machine, Step, Stragglers, Workload
from dtstudy.strategies.allreduce.spec import AllReduceSpec
from dtstudy.strategies.compressed.spec import (
    AllReduceBF16Spec,
    AllReduceFP16Spec,
    AllReduceOneBitSpec,
    AllReducePowerSGDSpec,
)
from dtstudy.strategies.gossip.spec import GossipSpec
from dtstudy.strategies.hybrid.spec import HybridSpec
from dtstudy.strategies.local.spec import EASGDSpec, LocalSGDSpec, PeriodicAveragingSpec
from dtstudy.strategies.parameter_server.spec import ParameterServerSpec, PsAsyncSpec, PsBackupSpec, PsSyncSpec, SspSpec
from dtstudy.strategies.reference.spec import NoExchangeSpec
from dtstudy.strategies.spec import StrategySpec

__all__ = [
    "AllReduceBF16Spec",
    "AllReduceFP16Spec",
    "AllReduceOneBitSpec",
    "AllReducePowerSGDSpec",
    "AllReduceSpec",
    "EASGDSpec",
    "FAMILIES",
    "GossipSpec",
    "HybridSpec",
    "LocalSGDSpec",
    "NoExchangeSpec",
    "PARAMETER_SERVERS",
    "ParameterServerSpec",
    "PeriodicAveragingSpec",
    "PsAsyncSpec",
    "PsBackupSpec",
    "PsSyncSpec",
    "REFERENCE_STRATEGY",
    "SPECS",
    "SspSpec",
    "StrategySpec",
    "get_spec",
    "knob_defaults",
    "model_step",
]

#: every strategy's spec, listed once: its `name` is the key
SPECS: dict[str, type[StrategySpec]] = {
    spec.name: spec
    for spec in (
        AllReduceSpec,
        PsSyncSpec,
        PsBackupSpec,
        PsAsyncSpec,
        SspSpec,
        LocalSGDSpec,
        EASGDSpec,
        GossipSpec,
        AllReduceFP16Spec,
        AllReduceBF16Spec,
        AllReducePowerSGDSpec,
        AllReduceOneBitSpec,
        HybridSpec,
        NoExchangeSpec,
    )
}


def _check_knob_schemas_have_specs() -> None:
    """Knobs in the schema for a name without a spec fail at import rather than in some run
    (each spec took its own knobs when it was defined: StrategySpec.take_knob_schema)."""
    orphans = schema.knob_schemas().keys() - SPECS.keys()
    if orphans:
        raise RuntimeError(
            f"knobs under strategy_params in {schema.SCHEMA_PATH} for strategies without a spec: {sorted(orphans)}"
        )


_check_knob_schemas_have_specs()

#: the families, in the order of the plots' panels; "reference" (no_exchange) is the
#: machine's ceiling, drawn on every panel rather than in one of its own
FAMILIES = ("synchronous", "parameter server", "local / decentralized", "compressed", "reference")
REFERENCE_STRATEGY = NoExchangeSpec.name
if any(spec.family not in FAMILIES for spec in SPECS.values()):
    raise RuntimeError(f"a strategy's family is not in FAMILIES: {[(n, s.family) for n, s in SPECS.items()]}")

#: the parameter servers: workers push to and pull from shard processes (the model's PS
#: formulas, its calibration of the protocol's round trip, the extra processes of a job)
PARAMETER_SERVERS = frozenset(name for name, spec in SPECS.items() if issubclass(spec, ParameterServerSpec))


def get_spec(name: str) -> type[StrategySpec]:
    try:
        return SPECS[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; allowed: {', '.join(sorted(SPECS))}") from None


def knob_defaults() -> dict[str, dict]:
    """{strategy name: its knobs' defaults} (the schema's)."""
    return {name: dict(spec.defaults) for name, spec in SPECS.items()}


def model_step(
    strategy: str,
    workload: Workload,
    machine: Machine,
    workers: int,
    params: dict | None = None,
    stragglers: Stragglers = NO_STRAGGLERS,
) -> Step:
    """The modelled step of `strategy` at N=workers (its spec's model_step)."""
    return get_spec(strategy).model_step(workload, machine, workers, params, stragglers)
