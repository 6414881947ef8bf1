"""The strategy registry and interface."""

from __future__ import annotations

import pytest

from dtstudy.config import ConfigError
from dtstudy.strategies import STRATEGIES, CommMeter, Strategy, get_strategy
from dtstudy.strategies.allreduce import AllReduce, ring_allreduce_bytes


def test_registry_maps_names_to_strategy_classes():
    assert STRATEGIES["allreduce"] is AllReduce
    for name, cls in STRATEGIES.items():
        assert issubclass(cls, Strategy) and cls.name == name


def test_unknown_strategy_names_the_allowed_ones():
    with pytest.raises(KeyError, match="'telepathy'; allowed: .*allreduce"):
        get_strategy("telepathy")


def test_knob_defaults_and_checks():
    assert AllReduce.check_params({}, workers=2) == {"bucket_cap_mb": 25}
    assert AllReduce.check_params({"bucket_cap_mb": 1}, workers=2) == {"bucket_cap_mb": 1}
    with pytest.raises(ConfigError, match="strategy_params.allreduce.bucket_cap_mb"):
        AllReduce.check_params({"bucket_cap_mb": 0}, workers=2)
    assert AllReduce.extra_processes({}, 4) == 0


@pytest.mark.parametrize("workers, expected", [(1, 0.0), (2, 1000.0), (4, 1500.0)])
def test_ring_allreduce_bytes(workers, expected):
    assert ring_allreduce_bytes(1000, workers) == pytest.approx(expected)


def test_comm_meter_take_resets():
    ticks = iter([1.0, 1.25])
    meter = CommMeter(_clock=lambda: next(ticks))
    with meter.timed():
        meter.bytes_sent += 10
    assert meter.take() == (0.25, 10)
    assert meter.take() == (0.0, 0.0)
