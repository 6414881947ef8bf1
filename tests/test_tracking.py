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
    assert flat == {"a": "1", "b.c": "[1, 2]", "b.d.e": "None", "f": "{}"}


def test_init_store_is_idempotent_and_keeps_artifacts_beside_the_db(uri, tmp_path):
    first = mlflow_store.init_store(uri, "exp")
    assert mlflow_store.init_store(uri, "exp") == first
    assert mlflow_store.init_store(uri, "other") != first
    location = MlflowClient(tracking_uri=uri).get_experiment(first).artifact_location
    assert Path(location.removeprefix("file://")) == tmp_path / "mlartifacts"


def test_log_study_run_creates_parent_with_artifacts_and_adopts_children(uri, tmp_path):
    experiment_id = mlflow_store.init_store(uri, "exp")
    client = MlflowClient(tracking_uri=uri)
    children = [client.create_run(experiment_id, run_name=f"child{i}").info.run_id
                for i in range(2)]
    (tmp_path / "tables").mkdir()
    (tmp_path / "plots").mkdir()
    table, plot = tmp_path / "tables" / "scaling.csv", tmp_path / "plots" / "throughput.png"
    table.write_text("strategy,workers\nallreduce,1\n")
    plot.write_bytes(b"not really a png")

    parent_id = mlflow_store.log_study_run(uri, "exp", children, [table, plot],
                                       params={"model": "lenet5", "workers": [1, 2]},
                                       metrics={"runs": 2})

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
    study_runs = client.search_runs(
        [client.get_experiment_by_name("exp").experiment_id])
    assert [run.info.status for run in study_runs] == ["FAILED"]
