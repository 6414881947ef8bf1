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
from dtstudy.strategies.compressed.spec import (AllReduceBF16Spec, AllReduceFP16Spec, AllReduceOneBitSpec,
                                                AllReducePowerSGDSpec)
from dtstudy.strategies.gossip.spec import GossipSpec
from dtstudy.strategies.hybrid.spec import HybridSpec
from dtstudy.strategies.local.spec import EASGDSpec, LocalSGDSpec, PeriodicAveragingSpec
from dtstudy.strategies.parameter_server.spec import (ParameterServerSpec, PsAsyncSpec, PsBackupSpec, PsSyncSpec,
                                                      SspSpec)
from dtstudy.strategies.reference.spec import NoExchangeSpec
from dtstudy.strategies.spec import StrategySpec

__all__ = ["AllReduceBF16Spec", "AllReduceFP16Spec", "AllReduceOneBitSpec", "AllReducePowerSGDSpec", "AllReduceSpec",
           "EASGDSpec", "FAMILIES", "GossipSpec", "HybridSpec", "LocalSGDSpec", "NoExchangeSpec", "ONEBIT_QUANTIZERS",
           "PARAMETER_SERVERS", "ParameterServerSpec", "PeriodicAveragingSpec", "PsAsyncSpec", "PsBackupSpec",
           "PsSyncSpec", "REFERENCE_STRATEGY", "SPECS", "SspSpec", "StrategySpec", "get_spec", "knob_defaults",
           "model_step"]

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


def knob_defaults() -> dict[str, dict]:
    """{strategy name: its knobs' defaults} (the schema's)."""
    return {name: dict(spec.defaults) for name, spec in SPECS.items()}


def model_step(strategy: str, workload: Workload, machine: Machine, workers: int, params: dict | None = None,
               stragglers: Stragglers = NO_STRAGGLERS) -> Step:
    """The modelled step of `strategy` at N=workers (its spec's model_step)."""
    return get_spec(strategy).model_step(workload, machine, workers, params, stragglers)
