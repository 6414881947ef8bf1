"""MLflow helpers against a throw-away SQLite store."""

from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from dtstudy.tracking import mlflow_store


@pytest.fixture
def uri(tmp_path):
    return f"sqlite:///{tmp_path}/mlflow.db"


def test_resolve_uri_defaults_to_absolute_sqlite_in_results(tmp_path):
    expected = f"sqlite:///{(tmp_path / 'res' / 'mlflow.db').resolve()}"
    assert mlflow_store.resolve_uri(None, results_dir=tmp_path / "res") == expected
    assert mlflow_store.resolve_uri(None).startswith("sqlite:////")
    assert mlflow_store.resolve_uri("http://mlflow:5000") == "http://mlflow:5000"


def test_flatten_params_uses_dotted_keys():
    flat = mlflow_store.flatten_params({"a": 1, "b": {"c": [1, 2], "d": {"e": None}}, "f": {}})
    assert flat == {"a": "1", "b.c": "[1, 2]", "b.d.e": "None"}  # an empty mapping has no value to log


def test_init_store_is_idempotent_and_keeps_artifacts_beside_the_db(uri, tmp_path):
    first = mlflow_store.init_store(uri, "exp")
    assert mlflow_store.init_store(uri, "exp") == first
    assert mlflow_store.init_store(uri, "other") != first
    location = MlflowClient(tracking_uri=uri).get_experiment(first).artifact_location
    assert Path(location.removeprefix("file://")) == tmp_path / "mlartifacts"


def test_log_study_run_creates_parent_with_artifacts_and_adopts_children(uri, tmp_path):
    experiment_id = mlflow_store.init_store(uri, "exp")
    client = MlflowClient(tracking_uri=uri)
    children = [client.create_run(experiment_id, run_name=f"child{i}").info.run_id for i in range(2)]
    (tmp_path / "tables").mkdir()
    (tmp_path / "plots").mkdir()
    table, plot = tmp_path / "tables" / "scaling.csv", tmp_path / "plots" / "throughput.png"
    table.write_text("strategy,workers\nallreduce,1\n")
    plot.write_bytes(b"not really a png")

    parent_id = mlflow_store.log_study_run(
        uri, "exp", children, [table, plot], params={"model": "lenet5", "workers": [1, 2]}, metrics={"runs": 2}
    )

    found = client.search_runs([experiment_id], filter_string="tags.`dtstudy.kind` = 'study'")
    assert [run.info.run_id for run in found] == [parent_id]
    parent = client.get_run(parent_id)
    assert parent.info.run_name == "study"
    assert parent.info.status == "FINISHED"
    assert parent.data.params == {"model": "lenet5", "workers": "[1, 2]"}
    assert parent.data.metrics == {"runs": 2.0}
    assert [a.path for a in client.list_artifacts(parent_id, "tables")] == ["tables/scaling.csv"]
    assert [a.path for a in client.list_artifacts(parent_id, "plots")] == ["plots/throughput.png"]
    for child in children:
        assert client.get_run(child).data.tags[mlflow_store.PARENT_RUN_TAG] == parent_id
    assert mlflow_store.PARENT_RUN_TAG not in parent.data.tags


def test_log_study_run_accepts_an_artifact_mapping(uri, tmp_path):
    experiment_id = mlflow_store.init_store(uri, "exp")
    note = tmp_path / "note.txt"
    note.write_text("hello")
    parent_id = mlflow_store.log_study_run(uri, "exp", [], {note: "extra"}, params=None)
    client = MlflowClient(tracking_uri=uri)
    assert [a.path for a in client.list_artifacts(parent_id, "extra")] == ["extra/note.txt"]
    assert client.get_run(parent_id).info.experiment_id == experiment_id


def test_log_study_run_marks_parent_failed_on_unknown_child(uri, tmp_path):
    mlflow_store.init_store(uri, "exp")
    with pytest.raises(mlflow.exceptions.MlflowException):
        mlflow_store.log_study_run(uri, "exp", ["0" * 32], [], params={})
    client = MlflowClient(tracking_uri=uri)
    study_runs = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert [run.info.status for run in study_runs] == ["FAILED"]


# ----- a tracking server that goes away mid-run ---------------------------------------------


def _final_metrics(points: int) -> dict:
    """A finished run's metrics.json, as log_training_results reads it."""
    return {
        "environment": {"backend": "gloo"},
        "global_batch": 64,
        "per_worker_batch": 32,
        "lr_schedule": {"rule": "linear"},
        "train_loss": [1.0 / (i + 1) for i in range(points)],
        "throughput": 100.0,
        "step_time": {"compute_s": 0.01, "comm_s": 0.002, "data_s": 0.001},
        "bytes_per_step": 1e5,
        "wall_time_s": 3.0,
        "time_to_accuracy_s": None,
        "final_val_top1": 0.5,
    }


def _logged(uri: str, run_id: str, key: str = "train_loss") -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


@pytest.mark.slow
def test_a_live_run_keeps_its_metrics_while_the_server_is_away_and_sends_them_when_it_is_back(tmp_path):
    """The server stops mid-run and starts again on the same store: training is never held up
    by it (log_metric returns at once), the run says so, and every point reaches MLflow."""
    import time

    from conftest import MlflowServer

    from dtstudy.tracking.live_run import LiveRun

    server = MlflowServer(tmp_path).start()
    said = []
    try:
        live = LiveRun(
            server.uri,
            "outage",
            "allreduce-n2-seed0",
            {"strategy": "allreduce"},
            {"seed": 0},
            str(tmp_path),
            wait_for_server_s=120,
            say=said.append,
        )
        for step in range(5):
            live.log_metric("train_loss", 1.0 / (step + 1), step)
        deadline = time.monotonic() + 60
        while live.record is None or len(_logged(server.uri, live.record["run_id"])) < 5:
            assert time.monotonic() < deadline, said
            time.sleep(0.2)
        server.stop()
        start = time.monotonic()
        for step in range(5, 10):
            live.log_metric("train_loss", 1.0 / (step + 1), step)
        assert time.monotonic() - start < 1.0  # the training loop does not wait for the server
        while not any("unreachable" in line for line in said):
            assert time.monotonic() < deadline + 60, said
            time.sleep(0.2)
        server.start()
        record = live.finish(_final_metrics(10))
        live.close("FINISHED")
        assert "pending" not in record and any("reachable again" in line for line in said), said
        assert _logged(server.uri, record["run_id"]) == [(step, pytest.approx(1.0 / (step + 1))) for step in range(10)]
        run = MlflowClient(server.uri).get_run(record["run_id"])
        assert run.info.status == "FINISHED" and run.data.metrics["final_val_top1"] == 0.5
        assert not (tmp_path / "mlflow_pending.json").exists()
    finally:
        server.stop()


@pytest.mark.slow
def test_a_run_ending_while_the_server_is_away_keeps_its_results_for_the_aggregate_step(tmp_path):
    """Past tracking.wait_for_server_s the run ends anyway: what MLflow lacks (here the whole run:
    the server was away from the start) goes to mlflow_pending.json, and deliver_pending sends it
    once the server is back, the evaluation's test metrics with it. The control: while the server
    is still away, delivering fails and keeps the file."""
    import json

    from conftest import MlflowServer

    from dtstudy.common.run_folder import MLFLOW_PENDING, MLFLOW_RUN
    from dtstudy.errors import ConfigError
    from dtstudy.tracking.live_run import LiveRun, deliver_pending

    server = MlflowServer(tmp_path)  # not started: away from the run's first step
    said = []
    live = LiveRun(
        server.uri,
        "outage",
        "ps_sync-n2-seed0",
        {"strategy": "ps_sync"},
        {"seed": 0},
        str(tmp_path),
        wait_for_server_s=2,
        say=said.append,
    )
    for step in range(7):
        live.log_metric("train_loss", float(step), step)
    record = live.finish(_final_metrics(7))
    live.close("FINISHED")
    assert record == {"pending": MLFLOW_PENDING, "tracking_uri": server.uri}
    assert any("still unreachable after 2 s" in line and "tracking.wait_for_server_s" in line for line in said), said
    kept = json.loads((tmp_path / MLFLOW_PENDING).read_text())
    assert len(kept["points"]) == 7 and kept["final"]["final_val_top1"] == 0.5 and kept["status"] == ["FINISHED", None]
    (tmp_path / "eval.json").write_text(json.dumps({"top1": 0.61, "top5": 0.97, "mlflow_run_id": None}))

    with pytest.raises(ConfigError, match="no MLflow server answers"):
        deliver_pending(tmp_path)  # the control: still away
    assert (tmp_path / MLFLOW_PENDING).exists()

    server.start()
    try:
        delivered = deliver_pending(tmp_path)
        assert not (tmp_path / MLFLOW_PENDING).exists()
        assert json.loads((tmp_path / MLFLOW_RUN).read_text()) == delivered
        assert _logged(server.uri, delivered["run_id"]) == [(step, float(step)) for step in range(7)]
        run = MlflowClient(server.uri).get_run(delivered["run_id"])
        assert run.info.status == "FINISHED" and run.info.run_name == "ps_sync-n2-seed0"
        assert run.data.metrics["final_val_top1"] == 0.5 and run.data.metrics["test_top1"] == 0.61
        assert deliver_pending(tmp_path) is None  # delivered once
    finally:
        server.stop()


def test_final_results_sent_again_after_a_lost_connection_log_no_part_twice(monkeypatch):
    """A retry of log_training_results after the connection dropped mid-way (here: at the
    artifact, after the metrics went through) sends only what is missing. The control: a retry
    that does not keep `done` logs the loss series twice (what the SLURM test first caught)."""

    class FlakyClient:
        def __init__(self):
            self.metric_batches, self.artifacts, self.fail_artifact = [], 0, True

        def log_batch(self, run_id, metrics=(), params=(), tags=()):
            if metrics:
                self.metric_batches.append(len(metrics))

        def log_artifact(self, run_id, path):
            if self.fail_artifact:
                self.fail_artifact = False
                raise ConnectionError("the server went away")
            self.artifacts += 1

    def attempt_twice(done):
        client = FlakyClient()
        monkeypatch.setattr(mlflow_store, "client_for", lambda uri: client)
        with pytest.raises(ConnectionError):
            mlflow_store.log_training_results("http://x", {"run_id": "r"}, _final_metrics(1500), done)
        mlflow_store.log_training_results(
            "http://x", {"run_id": "r"}, _final_metrics(1500), done if done is not None else None
        )
        return client

    every_metric = len(mlflow_store._final_metrics(_final_metrics(1500)))  # the loss series and the finals
    kept = attempt_twice(set())
    assert sum(kept.metric_batches) == every_metric > 1500 and kept.artifacts == 1
    control = attempt_twice(None)
    assert sum(control.metric_batches) == 2 * every_metric


def test_metric_points_sent_before_a_lost_connection_are_not_sent_again(monkeypatch):
    """log_metric_points strikes each batch MLflow has from the list: after a failure the list
    holds only what is still to send, and a retry sends every step once."""
    sent, calls = [], []

    class FlakyClient:
        def log_batch(self, run_id, metrics=()):
            calls.append(len(metrics))
            if len(calls) == 2:
                raise ConnectionError("the server went away")
            sent.extend(metric.step for metric in metrics)

    monkeypatch.setattr(mlflow_store, "client_for", lambda uri: FlakyClient())
    points = [("train_loss", 0.5, step, 0) for step in range(2500)]
    with pytest.raises(ConnectionError):
        mlflow_store.log_metric_points("http://x", "r", points)
    assert len(points) == 1500 and points[0][2] == 1000  # the first batch went through
    mlflow_store.log_metric_points("http://x", "r", points)
    assert points == [] and sent == list(range(2500))  # every step once


# ----- what a training run shows in MLflow ---------------------------------------------------


def test_a_runs_throughput_in_mlflow_is_the_tables_median_of_its_windows_with_its_interval(uri):
    """MLflow's `throughput` is the figure the scaling table pools (the median of the timed
    windows, 9535 here, not the whole run's mean 7592) with its bootstrap CI, rounded as the
    table shows them; the mean is kept beside as throughput_mean."""
    experiment_id = mlflow_store.init_store(uri, "exp")
    run_id = MlflowClient(uri).create_run(experiment_id).info.run_id
    metrics = {
        **_final_metrics(3),
        "throughput": 7592.3871,
        "throughput_median": 9535.4129,
        "throughput_ci95": [9401.2271, 9612.5003],
        "step_time": {"compute_s": 0.0123456789, "comm_s": 0.00200001, "data_s": 0.001},
        "strategy_metrics": {"staleness_mean": 1.23456789},
    }
    mlflow_store.log_training_results(uri, {"run_id": run_id}, metrics)
    logged = MlflowClient(uri).get_run(run_id).data.metrics
    assert (logged["throughput"], logged["throughput_low"], logged["throughput_high"]) == (9535.0, 9401.0, 9613.0)
    assert logged["throughput_mean"] == 7592.0
    assert (logged["compute_s"], logged["comm_s"]) == (0.01235, 0.002)
    assert logged["staleness_mean"] == 1.235
    # a run recorded before timed windows: its mean is all it has
    old_id = MlflowClient(uri).create_run(experiment_id).info.run_id
    mlflow_store.log_training_results(uri, {"run_id": old_id}, _final_metrics(3))
    assert MlflowClient(uri).get_run(old_id).data.metrics["throughput"] == 100.0
    assert "throughput_low" not in MlflowClient(uri).get_run(old_id).data.metrics


def test_a_run_logs_only_the_config_keys_that_apply_to_it():
    """Fashion-MNIST with LeNet-5 and allreduce: no synthetic data set's keys, no image size,
    no input pipeline (in-memory data), no ResNet options, no empty strategy_params; the
    synthetic data set and a ResNet get theirs, a parameter server its knobs once."""
    from conftest import tiny_study, validated

    from dtstudy.config.study_config import run_config
    from dtstudy.runspec import RunSpec
    from dtstudy.tracking.live_run import run_params

    def logged(config: dict, strategy: str) -> dict[str, str]:
        spec = RunSpec(strategy, 2, 0, run_config(validated(config), strategy), "", "")
        return mlflow_store.flatten_params(run_params(spec))

    plain = logged(tiny_study(), "allreduce")
    assert plain["config.dataset.name"] == "fashion_mnist" and plain["config.train.batch_size"] == "32"
    for absent in (
        "config.dataset.synthetic.",
        "config.dataset.image_size",
        "config.loader.",
        "config.model_options.",
        "config.strategy_params",
        "config.launcher.partition",
        "config.stragglers.delay_ms",
    ):
        assert not [key for key in plain if key.startswith(absent)], absent
    assert "config.launcher.local_processes" in plain
    synthetic = logged(tiny_study(dataset={"name": "synthetic"}, model="resnet18"), "ps_sync")
    assert {
        "config.dataset.synthetic.train_size",
        "config.dataset.image_size",
        "config.model_options.small_input",
        "strategy_params.shards",
    } <= set(synthetic)
    assert "config.dataset.root" not in synthetic and not [
        key for key in synthetic if key.startswith("config.strategy_params")
    ]
