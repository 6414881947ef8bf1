"""Parameter-server strategies (ps_sync, ps_backup, ps_async, ssp): STUDY.md's maths checks
through the real training path, the staleness record, and the knob checks."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from conftest import assert_same_parameters, tiny_study, train_run, validated
from dtstudy.config import ConfigError
from dtstudy.strategies import STRATEGIES
from dtstudy.strategies.ps_protocol import split_by_size

STEPS = 12
TEST_DEADLINE_S = 240  # a hung exchange must not stall the suite until gloo's own timeout


@pytest.fixture(autouse=True)
def deadline():
    """SIGTERM ourselves past the deadline: the launcher then cancels the job and the test fails."""
    timer = threading.Timer(TEST_DEADLINE_S, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    yield
    timer.cancel()


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_data):
    """train_run, each distinct run once per module: run(strategy, workers, batch_size, **knobs)."""
    done = {}

    def run_once(strategy, workers=2, batch_size=32, **knobs):
        key = (strategy, workers, batch_size, tuple(sorted(knobs.items())))
        if key not in done:
            folder = tmp_path_factory.mktemp(strategy)
            done[key] = train_run(folder, tiny_data, workers, batch_size, steps=STEPS, strategy=strategy,
                                  strategy_params=knobs)
        metrics, parameters, _ = done[key]
        return metrics, parameters

    return run_once


@pytest.mark.parametrize("shards", [1, 2])
def test_ps_sync_equals_allreduce_and_one_worker_with_double_batch(run, shards):
    metrics, parameters = run("ps_sync", shards=shards)
    assert_same_parameters(parameters, run("allreduce")[1], atol=1e-5)
    assert_same_parameters(parameters, run("allreduce", workers=1, batch_size=64)[1], atol=1e-5)

    shard_metrics = metrics["strategy_metrics"]
    assert shard_metrics["updates"] == STEPS * shards
    assert shard_metrics["staleness"] == {"0": 2 * STEPS * shards}  # every step waits for both workers
    assert len(shard_metrics["shard_numel"]) == shards and min(shard_metrics["shard_numel"]) > 0
    assert sum(shard_metrics["shard_numel"]) == sum(p.numel() for p in parameters.values())
    assert 0 < shard_metrics["shard_busy_fraction"] < 1
    gradient_bytes = sum(p.numel() for p in parameters.values()) * 4
    assert gradient_bytes < metrics["bytes_per_step"] < gradient_bytes + 100 * shards  # plus request headers
    assert metrics["step_time"]["comm_s"] > 0 and metrics["environment"]["processes"] == 2 + shards


def test_ps_backup_without_backups_and_ssp_without_staleness_equal_ps_sync(run):
    _, sync = run("ps_sync", shards=1)
    assert_same_parameters(run("ps_backup", backup=0)[1], sync, atol=1e-5)
    assert_same_parameters(run("ssp", staleness=0)[1], sync, atol=1e-5)

    # one backup worker: each step's update takes the first gradient and drops the other
    metrics, backup = run("ps_backup", backup=1)
    assert metrics["strategy_metrics"]["updates"] == metrics["strategy_metrics"]["dropped_gradients"] == STEPS
    with pytest.raises(AssertionError):
        assert_same_parameters(backup, sync, atol=1e-5)


def test_ps_async_with_one_worker_is_plain_sgd(run):
    metrics, parameters = run("ps_async", workers=1)
    assert_same_parameters(parameters, run("allreduce", workers=1)[1], atol=1e-5)
    assert metrics["strategy_metrics"]["staleness"] == {"0": STEPS}


def test_ps_async_records_staleness(run):
    metrics, parameters = run("ps_async")
    shard_metrics = metrics["strategy_metrics"]
    histogram = {int(value): count for value, count in shard_metrics["staleness"].items()}
    assert shard_metrics["updates"] == 2 * STEPS  # each worker's gradients, one update each
    assert sum(histogram.values()) == shard_metrics["updates"]
    assert max(histogram) > 0 and shard_metrics["staleness_max"] == max(histogram)
    assert shard_metrics["staleness_mean"] == pytest.approx(
        sum(value * count for value, count in histogram.items()) / shard_metrics["updates"])
    # every gradient is its own update, so the parameters leave the synchronous path
    with pytest.raises(AssertionError):
        assert_same_parameters(parameters, run("ps_sync", shards=1)[1], atol=1e-5)


def test_ssp_keeps_staleness_within_its_bound(run):
    shard_metrics = run("ssp", staleness=1)[0]["strategy_metrics"]
    assert sum(shard_metrics["staleness"].values()) == 2 * STEPS
    assert shard_metrics["staleness_max"] <= 1


def test_registry_and_knob_defaults():
    defaults = {"ps_sync": {"shards": 1}, "ps_backup": {"shards": 1, "backup": 1},
                "ps_async": {"shards": 1}, "ssp": {"shards": 1, "staleness": 2}}
    for name, knobs in defaults.items():
        assert STRATEGIES[name].check_params({}, workers=2) == knobs
        assert STRATEGIES[name].extra_processes({**knobs, "shards": 3}, workers=2) == 3


@pytest.mark.parametrize(
    "strategy, knobs, workers, words",
    [
        ("ps_sync", {"shards": 0}, [1, 2], ["strategy_params.ps_sync.shards", "0", ">= 1"]),
        ("ps_async", {"shards": "two"}, [1, 2], ["strategy_params.ps_async.shards", "'two'"]),
        ("ps_backup", {"backup": 2}, [2, 4], ["strategy_params.ps_backup.backup", "2", "N=2"]),
        ("ps_backup", {"backup": -1}, [2], ["strategy_params.ps_backup.backup", "-1"]),
        ("ssp", {"staleness": -1}, [1, 2], ["strategy_params.ssp.staleness", "-1", ">= 0"]),
    ],
)
def test_bad_knobs_are_rejected_before_any_job(strategy, knobs, workers, words):
    study = tiny_study(strategies=[strategy], workers=workers, strategy_params={strategy: knobs})
    with pytest.raises(ConfigError) as err:
        validated(study)
    for word in words:
        assert word in str(err.value)


def test_good_knobs_pass():
    validated(tiny_study(strategies=["ps_backup", "ssp"], workers=[2, 4],
                         strategy_params={"ps_backup": {"backup": 1, "shards": 2}, "ssp": {"staleness": 0}}))
    # N=1 has nobody to back up: it runs as ps_sync, so the default k=1 fits workers [1, 2, 4]
    validated(tiny_study(strategies=["ps_backup"], workers=[1, 2, 4]))


def test_parameters_split_over_shards_by_size():
    sizes = [150, 6, 2400, 16, 48000, 120, 10080, 84, 840, 10]  # LeNet-5 on 28x28
    owned = split_by_size(sizes, 2)
    assert sorted(i for shard in owned for i in shard) == list(range(len(sizes)))
    assert owned == [[4], [0, 1, 2, 3, 5, 6, 7, 8, 9]]  # the big layer alone, the rest together
    assert [sum(sizes[i] for i in shard) for shard in split_by_size(sizes, 3)] == [48000, 10080, 3626]
    assert split_by_size(sizes, 3) == split_by_size(list(sizes), 3)  # deterministic
    with pytest.raises(ValueError, match="11 parameter-server shards"):
        split_by_size(sizes, 11)
