"""The strategy registry: each strategy is one class (one file per family) plus one line here."""

from __future__ import annotations

from .allreduce import AllReduce
from .base import CommMeter, DistContext, Strategy

STRATEGIES: dict[str, type[Strategy]] = {
    AllReduce.name: AllReduce,
}


def get_strategy(name: str) -> type[Strategy]:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; allowed: {', '.join(sorted(STRATEGIES))}") from None


__all__ = ["STRATEGIES", "CommMeter", "DistContext", "Strategy", "get_strategy"]
