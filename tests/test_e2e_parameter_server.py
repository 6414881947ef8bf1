"""End to end: the real workflow on the tiny study with allreduce and the four parameter-server
strategies at N = 1, 2 (ps_backup with k = 0, since k must be < N for every N)."""

from __future__ import annotations

import pandas as pd
import pytest

from conftest import read_json, run_snakemake, tiny_study

pytestmark = pytest.mark.e2e

STRATEGIES = ["allreduce", "ps_sync", "ps_backup", "ps_async", "ssp"]
STUDY = tiny_study(strategies=STRATEGIES, strategy_params={"ps_backup": {"backup": 0}, "ps_sync": {"shards": 2}})


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ps-study")
    result = run_snakemake(workdir, STUDY, "--cores", "2", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return workdir


def test_both_tables_have_a_row_per_strategy_and_workers(study):
    expected = {(strategy, n) for strategy in STRATEGIES for n in (1, 2)}
    for name in ("scaling", "accuracy"):
        table = pd.read_csv(study / f"results/tables/{name}.csv")
        assert set(zip(table.strategy, table.workers)) == expected and len(table) == len(expected)
        markdown = (study / f"results/tables/{name}.md").read_text()
        assert all(f"| {strategy}" in markdown for strategy in STRATEGIES)
    assert (pd.read_csv(study / "results/tables/scaling.csv").throughput > 0).all()
    assert pd.read_csv(study / "results/tables/accuracy.csv").top1_mean.between(0, 1).all()


def test_runs_record_the_shards(study):
    for strategy in STRATEGIES[1:]:
        for n in (1, 2):
            metrics = read_json(study / f"results/runs/{strategy}/n{n}/seed0/metrics.json")
            shards = 2 if strategy == "ps_sync" else 1
            assert metrics["environment"]["processes"] == n + shards
            shard_metrics = metrics["strategy_metrics"]
            assert shard_metrics["shards"] == shards
            assert sum(shard_metrics["staleness"].values()) == shard_metrics["gradients_applied"]
            assert shard_metrics["gradients_applied"] == n * metrics["steps"] * shards
    async_run = read_json(study / "results/runs/ps_async/n2/seed0/metrics.json")["strategy_metrics"]
    assert async_run["updates"] == async_run["gradients_applied"]
