"""End to end: the real workflow on the tiny study (Fashion-MNIST subset, 1 epoch) with every
registered strategy at N = 1 and 2: tables, plots, MLflow runs, each strategy's own records."""

from __future__ import annotations

import re

import mlflow
import pandas as pd
import pytest
from conftest import job_counts, read_json, run_snakemake, tiny_study

from dtstudy.analysis.tables import ACCURACY_COLUMNS, SCALING_COLUMNS
from dtstudy.strategies.registry import STRATEGIES

pytestmark = pytest.mark.e2e

NAMES = list(STRATEGIES)
PS_FAMILY = ["ps_sync", "ps_backup", "ps_async", "ssp"]
STUDY = tiny_study(strategies=NAMES, strategy_params={"ps_sync": {"shards": 2}})


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("study")
    result = run_snakemake(workdir, STUDY, "--cores", "2", timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return workdir


def run_dir(study, strategy, n):
    return study / f"results/runs/{strategy}/n{n}/seed0"


def test_both_tables_have_a_row_per_strategy_and_workers(study):
    expected = [(name, n) for name in NAMES for n in (1, 2)]
    scaling = pd.read_csv(study / "results/tables/scaling.csv")
    assert list(scaling.columns) == SCALING_COLUMNS
    assert list(zip(scaling.strategy, scaling.workers)) == expected  # in the config's order
    assert (scaling.throughput > 0).all() and (scaling.throughput_low <= scaling.throughput).all()
    runs = {n: read_json(run_dir(study, "allreduce", n) / "metrics.json") for n in (1, 2)}
    allreduce = scaling[scaling.strategy == "allreduce"]
    # one seed: the median of the run's own timed windows
    assert allreduce.throughput.tolist() == pytest.approx([runs[1]["throughput_median"], runs[2]["throughput_median"]])
    assert all(len(runs[n]["throughput_windows"]) >= 5 for n in (1, 2))
    assert allreduce.efficiency.iloc[1] == pytest.approx(
        runs[2]["throughput_median"] / runs[1]["throughput_median"] / 2
    )

    accuracy = pd.read_csv(study / "results/tables/accuracy.csv")
    assert list(accuracy.columns) == ACCURACY_COLUMNS
    with_accuracy = [name for name in NAMES if name != "no_exchange"]  # the ceiling trains no model
    assert list(zip(accuracy.strategy, accuracy.workers)) == [(name, n) for name in with_accuracy for n in (1, 2)]
    evals = {n: read_json(run_dir(study, "allreduce", n) / "eval.json") for n in (1, 2)}
    assert accuracy.top1.iloc[:2].tolist() == pytest.approx([evals[1]["top1"], evals[2]["top1"]])
    assert all(0 <= e["top1"] <= e["top5"] <= 1 and e["test_images"] == 10000 for e in evals.values())
    for name, names in (("scaling", NAMES), ("accuracy", with_accuracy)):
        markdown = (study / f"results/tables/{name}.md").read_text()
        assert all(f"| {strategy}" in markdown for strategy in names)
    findings = (study / "results/tables/findings.md").read_text()
    assert "Noise of this machine" in findings and "Efficiency at N=2" in findings


def test_bytes_per_step_reflect_each_exchange(study):
    """The scaling table carries the bytes each run counted, in the order of the exchanges.
    That the counts are what the exchanges really send is checked where it can fail: for
    fp16/bf16 test_compression.py's test_half_precision_sends_the_16_bit_cast_and_counts_what_it_hands_over
    (the plain all-reduce hook substituted fails it), for PowerSGD and 1-bit
    test_compressed_strategies_send_fewer_bytes and test_onebit_bytes_per_worker."""
    sent = pd.read_csv(study / "results/tables/scaling.csv").set_index(["strategy", "workers"])
    sent = sent.bytes_per_step.xs(2, level="workers")
    for name in ("allreduce", "allreduce_fp16", "allreduce_bf16"):
        assert sent[name] == pytest.approx(read_json(run_dir(study, name, 2) / "metrics.json")["bytes_per_step"])
    assert max(sent["allreduce_onebit"], sent["allreduce_powersgd"]) < sent["allreduce_fp16"] < sent["allreduce"]
    # PowerSGD's steady state, its first start_powerSGD_iter steps of plain all-reduce left out of
    # the timed steps: exactly the share of the model's matrices it sends at its rank (on LeNet-5
    # fewer bytes than 1-bit's; with those steps in, its mean was above 1-bit's)
    from dtstudy.projection import calibration
    from dtstudy.strategies.specs import SPECS

    powersgd = read_json(run_dir(study, "allreduce_powersgd", 2) / "metrics.json")
    matrices = calibration.matrices_from_checkpoint(run_dir(study, "allreduce_powersgd", 2) / "model.pt")
    share = SPECS["allreduce_powersgd"].sent_share(matrices, powersgd["strategy_params"]["rank"])
    assert sent["allreduce_powersgd"] == pytest.approx(share * sent["allreduce"], rel=1e-9)
    assert sent["allreduce_fp16"] == sent["allreduce_bf16"] == sent["allreduce"] / 2
    assert sent["local_sgd"] < sent["allreduce"] and sent["easgd"] < sent["allreduce"]


def test_runs_record_the_strategies_own_results(study):
    for strategy in PS_FAMILY:
        for n in (1, 2):
            metrics = read_json(run_dir(study, strategy, n) / "metrics.json")
            shards = 2 if strategy == "ps_sync" else 1
            assert metrics["environment"]["processes"] == n + shards
            shard_metrics = metrics["strategy_metrics"]
            assert shard_metrics["shards"] == shards
            assert sum(shard_metrics["staleness"].values()) == shard_metrics["gradients_applied"]
            pushed = n * metrics["steps"] * shards
            assert shard_metrics["gradients_applied"] + shard_metrics["dropped_gradients"] == pushed
            # ps_backup's default k=1 drops the late pushes of the version they read at N=2
            # (N=1 runs as ps_sync); a push tagged with a version already updated is dropped
            if (strategy, n) == ("ps_backup", 2):
                assert 0 < shard_metrics["dropped_gradients"] == sum(shard_metrics["dropped_by_worker"])
            else:
                assert shard_metrics["dropped_gradients"] == 0
    async_run = read_json(run_dir(study, "ps_async", 2) / "metrics.json")["strategy_metrics"]
    assert async_run["updates"] == async_run["gradients_applied"]
    gossip = read_json(run_dir(study, "gossip", 2) / "metrics.json")
    assert gossip["strategy_params"] == {"topology": "ring"}
    assert [entry["step"] for entry in gossip["strategy_metrics"]["consensus_distance"]] == [gossip["steps"]]
    powersgd = read_json(run_dir(study, "allreduce_powersgd", 2) / "metrics.json")
    assert powersgd["strategy_metrics"]["powersgd_compression_rate"] > 1


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
    assert len(study_runs) == 1 and len(training) == 2 * len(NAMES)
    parent_id = study_runs.run_id.iloc[0]
    assert (training["tags.mlflow.parentRunId"] == parent_id).all()
    for n in (1, 2):
        metrics = read_json(run_dir(study, "allreduce", n) / "metrics.json")
        row = training[training.run_id == metrics["mlflow"]["run_id"]].iloc[0]
        assert row["params.workers"] == str(n) and row["tags.strategy"] == "allreduce"
        # the table's figure: the median of the timed windows with its interval, rounded as shown
        assert row["metrics.throughput"] == round(metrics["throughput_median"])
        assert row["metrics.throughput_low"] == round(metrics["throughput_ci95"][0])
        assert row["metrics.test_top1"] == pytest.approx(
            read_json(run_dir(study, "allreduce", n) / "eval.json")["top1"]
        )
        assert row["tags.env.git_commit"] == str(metrics["environment"]["git_commit"])
    artifacts = {a.path for a in mlflow.MlflowClient(uri).list_artifacts(parent_id, "tables")}
    assert {"tables/scaling.csv", "tables/accuracy.csv"} <= artifacts
    # the aggregate step recorded the study run, and the projection joined it
    assert read_json(study / "results/mlflow.study_run.json")["run_id"] == parent_id
    projection = {a.path for a in mlflow.MlflowClient(uri).list_artifacts(parent_id, "projection")}
    assert projection == {"projection/projection.csv", "projection/projection.md", "projection/projection.png"}


def test_mlflow_ui_opens_on_the_training_runs_with_their_key_metrics(study):
    """The experiment is a model-training one, and its shared runs view (what the aggregate
    log's link opens) lists the training runs with columns that the runs really have."""
    import json

    client = mlflow.MlflowClient(f"sqlite:///{study / 'results/mlflow.db'}")
    experiment = client.get_experiment_by_name("distributed-training-study")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    view = json.loads(experiment.tags["mlflow.sharedViewState.dtstudy"])
    training = client.search_runs([experiment.experiment_id], view["searchFilter"])
    assert len(training) == 2 * len(NAMES) and all(run.info.run_name != "study" for run in training)
    columns = [re.fullmatch(r"(metrics|params)\.`(.+)`", column).groups() for column in view["selectedColumns"]]
    for kind, key in columns:
        if key == "time_to_accuracy_s":  # logged only by runs that reach the target (none here)
            continue
        assert all(key in getattr(run.data, kind) for run in training), f"no {kind} {key!r} on the training runs"
    assert ("metrics", "test_top1") in columns and ("metrics", "throughput") in columns
    # listed flat: MLflow's UI nests the children under the collapsed study run when the view is
    # sorted by start time (or unsorted), and sorts by a column the training runs have
    assert view["orderByKey"] not in ("", "attributes.start_time")
    kind, key = re.fullmatch(r"(metrics|params)\.`(.+)`", view["orderByKey"]).groups()
    assert all(key in getattr(run.data, kind) for run in training)
    log = (study / "results/logs/aggregate.log").read_text()
    assert (
        f"#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning&viewStateShareKey=dtstudy" in log
    )


def test_rerun_has_nothing_to_do(study):
    result = run_snakemake(study, STUDY, "--dry-run", "--cores", "2")
    assert result.returncode == 0
    assert "Nothing to be done" in result.stdout + result.stderr


def test_changing_how_runs_are_launched_retrains_nothing_and_changing_what_they_compute_retrains_all(study):
    """A longer time limit, more requeues, a budget or another MLflow server address
    (study_config.OPERATIONAL_KEYS) leave the finished runs as they are (init_tracking, seconds,
    checks the tracking settings again); a learning rate does not."""
    from dtstudy.config.study_config import deep_merge

    operational = {
        "launcher": {"timeout_min": 240, "max_requeues": 9, "comm_timeout_s": 90, "gpu_hour_budget": 50.0},
        "tracking": {"wait_for_server_s": 30},
    }
    result = run_snakemake(study, deep_merge(STUDY, operational), "--dry-run", "--cores", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert job_counts(result.stdout) == {"init_tracking": 1}, result.stdout[-2000:]
    result = run_snakemake(study, deep_merge(STUDY, {"train": {"base_lr": 0.07}}), "--dry-run", "--cores", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    output = result.stdout + result.stderr
    assert job_counts(output)["train"] == 2 * len(NAMES) and "params have changed" in output
    run_snakemake(study, STUDY, "--dry-run", "--cores", "2")  # the fixture's config file back


def reported_page(report, path: str) -> str:
    """The data URI under which the Snakemake report `report` embeds the output `path`, as an HTML page."""
    found = re.search(re.escape(f'"{path}": {{') + r'.*?"data_uri": "(data:text/html;[^"]+)"', report.read_text(), re.S)
    assert found, f"{path} is not in {report} as an HTML page"
    return found.group(1)


def test_a_reader_finds_the_runs_through_the_printed_link_and_the_findings_in_the_report(study):
    """Headless Chromium (skipped, saying why, where it cannot start) opens the link the aggregate
    log prints in `mlflow ui` and sees every training run, then the Snakemake report with its
    Findings and the findings page in it."""
    from headless import browser_or_skip, mlflow_ui, rendered

    browser = browser_or_skip()
    link = re.search(r"open (http://localhost:5000/\S+)", (study / "results/logs/aggregate.log").read_text()).group(1)
    with mlflow_ui(f"sqlite:///{study / 'results/mlflow.db'}") as address:
        runs_page = rendered(browser, link.replace("http://localhost:5000", address))
    missing = [f"{name}-n{n}-seed0" for name in NAMES for n in (1, 2) if f"{name}-n{n}-seed0" not in runs_page]
    assert not missing and "study" not in runs_page.split(), (missing, runs_page[:3000])  # the training runs, flat
    report = study / "results/report.html"
    result = run_snakemake(study, STUDY, "--report", str(report), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert {"Findings", "Tables", "Scaling", "Accuracy"} <= set(rendered(browser, report.as_uri()).split())
    findings = rendered(browser, reported_page(report, "results/tables/findings.html"))
    assert "Scaling: how does throughput scale with N?" in " ".join(findings.split())
