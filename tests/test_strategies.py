"""The strategy registry and interface."""

from __future__ import annotations

import pytest

from dtstudy.errors import ConfigError
from dtstudy.strategies.registry import get_strategy, STRATEGIES
from dtstudy.strategies.base import CommMeter, Strategy
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


@pytest.mark.parametrize(
    "name, knobs, workers, expected",
    [("allreduce", {}, 4, 4 * 64), ("ps_sync", {}, 4, 4 * 64), ("ps_backup", {"backup": 1}, 4, 3 * 64),
     ("ps_backup", {"backup": 1}, 1, 64), ("ps_async", {}, 4, 64), ("ssp", {"staleness": 0}, 4, 64),
     ("local_sgd", {}, 4, 4 * 64), ("easgd", {}, 4, 4 * 64), ("gossip", {}, 4, 4 * 64),
     ("allreduce_onebit", {}, 4, 4 * 64)],
)
def test_update_batch_is_the_batch_one_update_averages(name, knobs, workers, expected):
    """The rate follows the batch one update averages (docs/strategies.md, "The learning rate across scale")."""
    cls = get_strategy(name)
    assert cls.update_batch(cls.check_params(knobs, workers), workers, 64) == expected
    assert cls.update_batch_rule  # described in metrics.json's lr_schedule


def test_averaged_models_are_the_local_and_decentralized_strategies():
    averaging = {name for name, cls in STRATEGIES.items() if cls.averages_models}
    assert averaging == {"local_sgd", "easgd", "gossip"}
