"""The strategy registry: every strategy's class (its family folder's `strategy` module), listed
once, by its spec's name. The top floor of dtstudy.strategies: it imports every family, and no
module of the package's strategies imports it (nor `specs`, which collects the torch-free specs)."""

from __future__ import annotations

from dtstudy.strategies.allreduce.strategy import AllReduce
from dtstudy.strategies.base import CommMeter, DistContext, Strategy
from dtstudy.strategies.compressed.strategy import AllReduceBF16, AllReduceFP16, AllReduceOneBit, AllReducePowerSGD
from dtstudy.strategies.gossip.strategy import Gossip
from dtstudy.strategies.hybrid.strategy import Hybrid
from dtstudy.strategies.local.strategy import EASGD, LocalSGD
from dtstudy.strategies.parameter_server.strategy import PsAsync, PsBackup, PsSync, Ssp
from dtstudy.strategies.reference.strategy import NoExchange
from dtstudy.strategies.specs import SPECS

#: every strategy's class, listed once: its name (its spec's) is the key
STRATEGIES: dict[str, type[Strategy]] = {
    strategy.name: strategy
    for strategy in (
        AllReduce,
        PsSync,
        PsBackup,
        PsAsync,
        Ssp,
        LocalSGD,
        EASGD,
        Gossip,
        AllReduceFP16,
        AllReduceBF16,
        AllReducePowerSGD,
        AllReduceOneBit,
        Hybrid,
        NoExchange,
    )
}


# every implementation has its spec (the very class SPECS holds) and every spec its implementation
_unpaired = sorted(
    name
    for name in STRATEGIES.keys() | SPECS.keys()
    if name not in STRATEGIES or STRATEGIES[name].spec is not SPECS.get(name)
)
if _unpaired:
    raise RuntimeError(f"strategies without both a spec in dtstudy.strategies.specs and a class here: {_unpaired}")


def get_strategy(name: str) -> type[Strategy]:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; allowed: {', '.join(sorted(STRATEGIES))}") from None


__all__ = ["STRATEGIES", "CommMeter", "DistContext", "Strategy", "get_strategy"]
