"""End to end: the real workflow on the tiny study (Fashion-MNIST subset, 1 epoch, N = 1, 2)."""

from __future__ import annotations

import mlflow
import pandas as pd
import pytest

from conftest import read_json, run_snakemake, tiny_study

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("study")
    result = run_snakemake(workdir, tiny_study(), "--cores", "2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return workdir


def test_tables_have_a_row_per_strategy_and_workers(study):
    scaling = pd.read_csv(study / "results/tables/scaling.csv")
    assert list(scaling.columns[:8]) == ["strategy", "workers", "seeds", "throughput", "throughput_std",
                                         "speedup", "efficiency", "speedup_vs_allreduce_1"]
    assert list(zip(scaling.strategy, scaling.workers)) == [("allreduce", 1), ("allreduce", 2)]
    assert (scaling.throughput > 0).all() and scaling.speedup[0] == 1.0
    runs = {n: read_json(study / f"results/runs/allreduce/n{n}/seed0/metrics.json") for n in (1, 2)}
    assert scaling.throughput.tolist() == pytest.approx([runs[1]["throughput"], runs[2]["throughput"]])
    assert scaling.efficiency[1] == pytest.approx(runs[2]["throughput"] / runs[1]["throughput"] / 2)

    accuracy = pd.read_csv(study / "results/tables/accuracy.csv")
    assert list(accuracy.columns[:7]) == ["strategy", "workers", "seeds", "top1_mean", "top1_std", "top5_mean",
                                          "time_to_accuracy_s"]
    evals = {n: read_json(study / f"results/runs/allreduce/n{n}/seed0/eval.json") for n in (1, 2)}
    assert accuracy.top1_mean.tolist() == pytest.approx([evals[1]["top1"], evals[2]["top1"]])
    assert all(0 <= e["top1"] <= e["top5"] <= 1 and e["test_images"] == 10000 for e in evals.values())
    for name in ("scaling", "accuracy"):
        assert "| allreduce" in (study / f"results/tables/{name}.md").read_text()


def test_plots_and_logs(study):
    for name in ("throughput", "efficiency", "accuracy", "convergence"):
        plot = study / f"results/plots/{name}.png"
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000
    train_log = (study / "results/logs/train/allreduce/n2/seed0.log").read_text()
    assert "epoch 1/1 done: val top-1" in train_log and "img/s" in train_log


def test_mlflow_holds_every_run_under_the_study_run(study):
    uri = f"sqlite:///{study / 'results/mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["distributed-training-study"])
    study_runs = runs[runs["tags.dtstudy.kind"] == "study"]
    training = runs[runs["tags.dtstudy.kind"] == "training"]
    assert len(study_runs) == 1 and len(training) == 2
    parent_id = study_runs.run_id.iloc[0]
    assert (training["tags.mlflow.parentRunId"] == parent_id).all()
    for n in (1, 2):
        metrics = read_json(study / f"results/runs/allreduce/n{n}/seed0/metrics.json")
        row = training[training.run_id == metrics["mlflow"]["run_id"]].iloc[0]
        assert row["params.workers"] == str(n) and row["tags.strategy"] == "allreduce"
        assert row["metrics.throughput"] == pytest.approx(metrics["throughput"])
        assert row["metrics.test_top1"] == pytest.approx(read_json(metrics_dir(study, n) / "eval.json")["top1"])
        assert row["tags.env.git_commit"] == str(metrics["environment"]["git_commit"])
    artifacts = {a.path for a in mlflow.MlflowClient(uri).list_artifacts(parent_id, "tables")}
    assert {"tables/scaling.csv", "tables/accuracy.csv"} <= artifacts


def metrics_dir(study, n):
    return study / f"results/runs/allreduce/n{n}/seed0"


def test_rerun_has_nothing_to_do(study):
    result = run_snakemake(study, tiny_study(), "--dry-run", "--cores", "2")
    assert result.returncode == 0
    assert "Nothing to be done" in result.stdout + result.stderr
