"""The strategy registry: each strategy is one class (its family folder's `strategy` module) plus
one line here, and its knobs one spec class beside it (`<family>/spec.py`, torch-free, for the
config check; collected in dtstudy.strategies.specs)."""

from __future__ import annotations

from dtstudy.strategies.specs import SPECS
from dtstudy.strategies.allreduce.strategy import AllReduce
from dtstudy.strategies.base import CommMeter, DistContext, Strategy
from dtstudy.strategies.compressed.strategy import AllReduceBF16, AllReduceFP16, AllReduceOneBit, AllReducePowerSGD
from dtstudy.strategies.gossip.strategy import Gossip
from dtstudy.strategies.hybrid.strategy import Hybrid
from dtstudy.strategies.local.strategy import EASGD, LocalSGD
from dtstudy.strategies.parameter_server.strategy import PsAsync, PsBackup, PsSync, Ssp
from dtstudy.strategies.reference.strategy import NoExchange

STRATEGIES: dict[str, type[Strategy]] = {
    AllReduce.name: AllReduce,
    PsSync.name: PsSync,
    PsBackup.name: PsBackup,
    PsAsync.name: PsAsync,
    Ssp.name: Ssp,
    LocalSGD.name: LocalSGD,
    EASGD.name: EASGD,
    Gossip.name: Gossip,
    AllReduceFP16.name: AllReduceFP16,
    AllReduceBF16.name: AllReduceBF16,
    AllReducePowerSGD.name: AllReducePowerSGD,
    AllReduceOneBit.name: AllReduceOneBit,
    Hybrid.name: Hybrid,
    NoExchange.name: NoExchange,
}


# every implementation has its spec (knobs, checks) and every spec its implementation
if STRATEGIES.keys() != SPECS.keys():
    raise RuntimeError(f"strategies without both a spec and an implementation: {sorted(STRATEGIES.keys() ^ SPECS.keys())}")


def get_strategy(name: str) -> type[Strategy]:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; allowed: {', '.join(sorted(STRATEGIES))}") from None


__all__ = ["STRATEGIES", "CommMeter", "DistContext", "Strategy", "get_strategy"]
