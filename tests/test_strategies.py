"""The strategy registry and interface."""

from __future__ import annotations

import pytest

from dtstudy.errors import ConfigError
from dtstudy.strategies.allreduce.strategy import AllReduce, ring_allreduce_bytes
from dtstudy.strategies.base import CommMeter, Strategy
from dtstudy.strategies.registry import STRATEGIES, get_strategy


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
    [
        ("allreduce", {}, 4, 4 * 64),
        ("ps_sync", {}, 4, 4 * 64),
        ("ps_backup", {"backup": 1}, 4, 3 * 64),
        ("ps_backup", {"backup": 1}, 1, 64),
        ("ps_async", {}, 4, 64),
        ("ssp", {"staleness": 0}, 4, 64),
        ("local_sgd", {}, 4, 4 * 64),
        ("easgd", {}, 4, 4 * 64),
        ("gossip", {}, 4, 4 * 64),
        ("allreduce_onebit", {}, 4, 4 * 64),
    ],
)
def test_update_batch_is_the_batch_one_update_averages(name, knobs, workers, expected):
    """The rate follows the batch one update averages (docs/strategies.md, "The learning rate across scale")."""
    cls = get_strategy(name)
    assert cls.update_batch(cls.check_params(knobs, workers), workers, 64) == expected
    assert cls.update_batch_rule  # described in metrics.json's lr_schedule


@pytest.mark.parametrize("workers, backups", [(1, 0), (4, 0), (16, 1), (64, 4), (256, 16)])
def test_ps_backups_as_a_share_of_n(workers, backups):
    """backup_fraction 1/16: k = round(N/16), so the backups grow with N (Chen et al. 2016's ~5%)."""
    cls = get_strategy("ps_backup")
    params = cls.check_params({"backup_fraction": 1 / 16}, workers)
    assert cls.spec.quorum(workers, params) == workers - backups
    assert cls.update_batch(params, workers, 8) == (workers - backups) * 8


def test_ps_backup_share_is_at_most_n_minus_1_and_excludes_a_count():
    cls = get_strategy("ps_backup")
    assert cls.spec.quorum(2, cls.check_params({"backup_fraction": 0.9}, 2)) == 1  # round(1.8) = 2, capped
    with pytest.raises(ConfigError, match=r"strategy_params.ps_backup.backup_fraction': 0.1 .*not both"):
        cls.check_params({"backup": 2, "backup_fraction": 0.1}, 16)
    with pytest.raises(ConfigError, match="strategy_params.ps_backup.backup_fraction"):
        cls.check_params({"backup_fraction": 1.0}, 16)
    # a count must still be < N; a share cannot exceed it
    with pytest.raises(ConfigError, match="strategy_params.ps_backup.backup'"):
        cls.check_params({"backup": 4}, 4)


def test_averaged_models_are_the_local_and_decentralized_strategies():
    averaging = {name for name, cls in STRATEGIES.items() if cls.averages_models}
    assert averaging == {"local_sgd", "easgd", "gossip"}
