"""End to end: the real workflow on the tiny study with the decentralized and compressed
strategies next to `allreduce`, at N = 1 and 2."""

from __future__ import annotations

import pandas as pd
import pytest

from conftest import read_json, run_snakemake, tiny_study

pytestmark = pytest.mark.e2e

STRATEGIES = ["allreduce", "local_sgd", "easgd", "gossip", "allreduce_fp16", "allreduce_bf16",
              "allreduce_powersgd", "allreduce_onebit"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("decentralized")
    result = run_snakemake(workdir, tiny_study(strategies=STRATEGIES), "--cores", "2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return workdir


def test_both_tables_have_a_row_per_strategy_and_workers(study):
    expected = {(name, n) for name in STRATEGIES for n in (1, 2)}
    for table in ("scaling", "accuracy"):
        rows = pd.read_csv(study / f"results/tables/{table}.csv")
        assert set(zip(rows.strategy, rows.workers)) == expected and len(rows) == len(expected), table
    scaling = pd.read_csv(study / "results/tables/scaling.csv").set_index(["strategy", "workers"])
    assert (scaling.throughput > 0).all()
    sent = scaling.bytes_per_step.xs(2, level="workers")
    assert sent["allreduce_onebit"] < sent["allreduce_powersgd"] < sent["allreduce_fp16"] < sent["allreduce"]
    assert sent["allreduce_fp16"] == sent["allreduce_bf16"] == sent["allreduce"] / 2
    assert sent["local_sgd"] < sent["allreduce"] and sent["easgd"] < sent["allreduce"]
    accuracy = pd.read_csv(study / "results/tables/accuracy.csv")
    assert accuracy.top1_mean.between(0, 1).all()


def test_runs_record_strategy_results(study):
    gossip = read_json(study / "results/runs/gossip/n2/seed0/metrics.json")
    assert gossip["strategy_params"] == {"topology": "ring"}
    assert [entry["step"] for entry in gossip["strategy_metrics"]["consensus_distance"]] == [gossip["steps"]]
    powersgd = read_json(study / "results/runs/allreduce_powersgd/n2/seed0/metrics.json")
    assert powersgd["strategy_metrics"]["powersgd_compression_rate"] > 1
