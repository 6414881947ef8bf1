"""MLflow helpers shared by training, evaluation and aggregation.

Every function takes the tracking URI explicitly and builds its own MlflowClient, so
nothing (active run, global tracking URI) leaks from one call to the next.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
from mlflow.utils.time import get_current_time_millis

from dtstudy.common.run_folder import RunFolder
from dtstudy.config.study_config import tracking_uri as resolve_uri
from dtstudy.errors import ConfigError

STUDY_KIND_TAG = "dtstudy.kind"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"  # MLflow 3: a model-training experiment
PARENT_RUN_TAG = "mlflow.parentRunId"
_SQLITE_PREFIX = "sqlite:///"
_MAX_PARAMS_PER_BATCH = 100  # MLflow's log_batch limit
_MAX_METRICS_PER_BATCH = 1000


def _sqlite_artifact_root(uri: str) -> str | None:
    """Artifacts beside a SQLite store (<db dir>/mlartifacts), None for other stores.

    MLflow's default artifact root for a database store is ./mlruns relative to the
    process's working directory, which scatters artifacts wherever a job happens to run.
    """
    if not uri.startswith(_SQLITE_PREFIX):
        return None
    db_path = uri[len(_SQLITE_PREFIX) :]
    if db_path in ("", ":memory:"):
        return None
    return str(Path(db_path).resolve().parent / "mlartifacts")


def check_server(uri: str, timeout_s: float = 10.0) -> None:
    """For an http(s) URI, fail fast with a clear message when no MLflow server answers
    (MLflow's own client would retry for minutes first)."""
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s) as response:
            response.read()
    except (urllib.error.URLError, OSError) as error:
        raise ConfigError(
            f"config key 'tracking.uri': no MLflow server answers at {uri!r} ({error}); start one "
            "(docs/cluster.md: 'MLflow on a cluster') or set tracking.uri to null for SQLite in results/"
        ) from None


def init_store(uri: str, experiment: str) -> str:
    """Create the store and the experiment if needed; return the experiment id.

    Idempotent. Call it once (one Snakemake rule) before the training jobs start:
    MLflow's SQLite schema set-up races when several processes open a new DB at once.
    """
    uri = resolve_uri(uri)
    check_server(uri)
    if uri.startswith(_SQLITE_PREFIX):
        Path(uri[len(_SQLITE_PREFIX) :]).parent.mkdir(parents=True, exist_ok=True)
    client = client_for(uri)
    existing = client.get_experiment_by_name(experiment)
    if existing is not None:
        if existing.tags.get(EXPERIMENT_KIND_TAG) is None:
            client.set_experiment_tag(existing.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return existing.experiment_id
    try:
        # the kind makes MLflow 3's UI open the experiment on its runs table, not the GenAI overview
        return client.create_experiment(
            experiment, artifact_location=_sqlite_artifact_root(uri), tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
        )
    except MlflowException as error:
        if error.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
        # Another process created it between our lookup and our create.
        return client.get_experiment_by_name(experiment).experiment_id


def flatten_params(params: Mapping, prefix: str = "") -> dict[str, str]:
    """Nested dicts -> {"a.b.c": "value"} with string values, as MLflow params need; an empty
    mapping has no value to log (a strategy without knobs): left out."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, prefix=f"{name}."))
        else:
            flat[name] = str(value)
    return flat


def _artifact_dirs(artifacts: Iterable[str | Path] | Mapping[str | Path, str]) -> dict[Path, str]:
    """{file: artifact folder}; a plain list files each one under its parent folder's name."""
    if isinstance(artifacts, Mapping):
        return {Path(path): folder for path, folder in artifacts.items()}
    return {Path(path): Path(path).parent.name for path in artifacts}


def _chunks(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _log_params_and_metrics(client: MlflowClient, run_id: str, params: Mapping, metrics: Mapping[str, float]) -> None:
    param_list = [Param(key, value) for key, value in flatten_params(params).items()]
    for chunk in _chunks(param_list, _MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=chunk)
    now = get_current_time_millis()
    metric_list = [Metric(key, float(value), now, 0) for key, value in metrics.items()]
    for chunk in _chunks(metric_list, _MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=chunk)


def log_study_run(
    uri: str,
    experiment: str,
    child_run_ids: list[str],
    artifacts: Iterable[str | Path] | Mapping[str | Path, str],
    params: Mapping | None = None,
    metrics: Mapping[str, float] | None = None,
) -> str:
    """Create the parent "study" run, attach artifacts and params, adopt the child runs.

    `artifacts` is a list of files (each logged under its parent folder's name, e.g.
    results/tables/scaling.csv -> tables/scaling.csv) or a {file: artifact folder} mapping.
    Nested `params` are flattened to dotted keys. Every child run (an existing training
    run) gets the tag mlflow.parentRunId = the new run's id. Returns that id.
    """
    uri = resolve_uri(uri)
    experiment_id = init_store(uri, experiment)
    client = client_for(uri)
    run_id = client.create_run(experiment_id, run_name="study", tags={STUDY_KIND_TAG: "study"}).info.run_id
    try:
        _log_params_and_metrics(client, run_id, params or {}, metrics or {})
        for path, folder in _artifact_dirs(artifacts).items():
            client.log_artifact(run_id, str(path), artifact_path=folder or None)
        for child_id in child_run_ids:
            client.set_tag(child_id, PARENT_RUN_TAG, run_id)
    except BaseException:
        client.set_terminated(run_id, status=RunStatus.to_string(RunStatus.FAILED))
        raise
    client.set_terminated(run_id)
    return run_id


def attach_artifacts(uri: str, run_id: str, artifacts: Iterable[str | Path] | Mapping[str | Path, str]) -> None:
    """Log files to an existing run (the study run, after it ended: the projection that
    follows the aggregate step), as log_study_run does: a list or a {file: folder} mapping."""
    client = client_for(resolve_uri(uri))
    for path, folder in _artifact_dirs(artifacts).items():
        client.log_artifact(run_id, str(path), artifact_path=folder or None)


# --- what the MLflow UI shows first -------------------------------------------------------

RUNS_VIEW_KEY = "dtstudy"  # the UI's shared view ?viewStateShareKey=dtstudy
_SHARED_VIEW_TAG = "mlflow.sharedViewState."  # MLflow's UI reads a shared view's state here
RUNS_VIEW_METRICS = (
    "test_top1",
    "final_val_top1",
    "throughput",
    "efficiency",
    "time_to_accuracy_s",
    "compute_s",
    "comm_s",
    "bytes_per_step",
    "wall_time_s",
)
RUNS_VIEW_PARAMS = ("strategy", "workers", "seed")


#: the runs view's sort: not by start time, since MLflow's UI (3.17) nests child runs under a
#: collapsed parent when the table is unsorted or sorted by date, and the training runs would
#: hide under the study run; sorted by anything else it lists them flat
RUNS_VIEW_ORDER = "params.`strategy`"


def publish_runs_view(uri: str, experiment_id: str) -> str:
    """Store a view of the study's runs table in the experiment (MLflow's shared views): the
    training runs, flat, by strategy, the key metrics and parameters as columns.
    Returns the UI path that opens it, on the runs table of the "model training" UI."""
    column = lambda kind, key: f"{kind}.`{key}`"  # noqa: E731 - the UI's column ids
    state = {
        "selectedColumns": [column("params", key) for key in RUNS_VIEW_PARAMS]
        + [column("metrics", key) for key in RUNS_VIEW_METRICS],
        "orderByKey": RUNS_VIEW_ORDER,
        "orderByAsc": True,
        "searchFilter": f"tags.`{STUDY_KIND_TAG}` = '{TRAINING_KIND}'",
    }
    client_for(uri).set_experiment_tag(experiment_id, _SHARED_VIEW_TAG + RUNS_VIEW_KEY, json.dumps(state))
    return f"#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={RUNS_VIEW_KEY}"


# --- training and evaluation runs ---------------------------------------------------------

TRAINING_KIND = "training"
SUPERSEDED_TAG = "dtstudy.superseded_by"


@functools.cache
def client_for(uri: str) -> MlflowClient:
    """One client (one store, one database engine) per URI and process."""
    return MlflowClient(tracking_uri=uri)


def start_training_run(uri: str, experiment: str, run_name: str, tags: Mapping, params: Mapping) -> dict:
    """Create the MLflow run of a training run, RUNNING, with its config as params; earlier
    runs of the same name (a rerun) are marked superseded and moved to MLflow's deleted runs
    (restorable; nothing is lost). Returns {run_id, experiment_id, tracking_uri}."""
    experiment_id = init_store(uri, experiment)
    client = client_for(uri)
    earlier = client.search_runs(
        [experiment_id],
        filter_string=(f"attributes.run_name = '{run_name}' and tags.`{STUDY_KIND_TAG}` = '{TRAINING_KIND}'"),
    )
    run_id = client.create_run(
        experiment_id, run_name=run_name, tags={STUDY_KIND_TAG: TRAINING_KIND, **tags}
    ).info.run_id
    for old in earlier:
        client.set_tag(old.info.run_id, SUPERSEDED_TAG, run_id)
        if old.info.status == "RUNNING":  # an attempt that died without ending its run
            client.set_terminated(old.info.run_id, status="KILLED")
        client.delete_run(old.info.run_id)
    _log_params_and_metrics(client, run_id, params, {})
    return {"run_id": run_id, "experiment_id": experiment_id, "tracking_uri": uri}


def log_metric_points(uri: str, run_id: str, points: list[tuple[str, float, int, int]]) -> None:
    """(key, value, step, timestamp ms) points, one request a batch; each batch is removed
    from `points` once MLflow has it, so that after a failure `points` holds what is still
    to send (and a retry sends nothing twice)."""
    while points:
        batch = points[:_MAX_METRICS_PER_BATCH]
        client_for(uri).log_batch(
            run_id, metrics=[Metric(key, value, timestamp, step) for key, value, step, timestamp in batch]
        )
        del points[: len(batch)]


#: the decimals MLflow shows of a figure: the tables' (dtstudy.analysis.findings) where a table
#: has it, since MLflow's UI prints every digit of a float; other figures keep SHOWN_DIGITS
#: significant digits
SHOWN_DECIMALS = {
    "throughput": 0,
    "throughput_low": 0,
    "throughput_high": 0,
    "throughput_mean": 0,
    "efficiency": 2,
    "efficiency_low": 2,
    "efficiency_high": 2,
    "speedup": 2,
    "speedup_low": 2,
    "speedup_high": 2,
    "compute_s": 5,
    "comm_s": 5,
    "data_s": 5,
    "bytes_per_step": 0,
    "wall_time_s": 1,
    "final_val_top1": 4,
}
SHOWN_DIGITS = 4


def shown(key: str, value: float) -> float:
    """`value` rounded as MLflow shows the figure `key` (SHOWN_DECIMALS)."""
    value = float(value)
    if key in SHOWN_DECIMALS:
        return round(value, SHOWN_DECIMALS[key])
    return float(f"{value:.{SHOWN_DIGITS}g}")


def throughput_figures(metrics: Mapping) -> dict[str, float]:
    """The run's throughput as the tables pool it: the median of its timed windows with its
    bootstrap 95% CI (throughput_low, _high), and the mean over the whole run beside
    (throughput_mean); a run recorded before timed windows has its mean alone."""
    if "throughput_median" not in metrics:
        return {"throughput": metrics["throughput"]}
    low, high = metrics.get("throughput_ci95") or (None, None)
    figures = {
        "throughput": metrics["throughput_median"],
        "throughput_low": low,
        "throughput_high": high,
        "throughput_mean": metrics["throughput"],
    }
    return {key: value for key, value in figures.items() if value is not None}


def _final_metrics(metrics: Mapping) -> list[Metric]:
    now = get_current_time_millis()
    series = [Metric("train_loss_mean", float(loss), now, step) for step, loss in enumerate(metrics["train_loss"])]
    finals = {
        **throughput_figures(metrics),
        "compute_s": metrics["step_time"]["compute_s"],
        "comm_s": metrics["step_time"]["comm_s"],
        "data_s": metrics["step_time"]["data_s"],
        "bytes_per_step": metrics["bytes_per_step"],
        "wall_time_s": metrics["wall_time_s"],
        "time_to_accuracy_s": metrics["time_to_accuracy_s"],
        "final_val_top1": metrics["final_val_top1"],
        **{key: value for key, value in metrics.get("strategy_metrics", {}).items() if isinstance(value, (int, float))},
    }
    return series + [Metric(key, shown(key, value), now, 0) for key, value in finals.items() if value is not None]


def log_training_results(uri: str, record: Mapping, metrics: Mapping, done: set | None = None) -> None:
    """A training run's final figures (the same facts as its metrics.json, which is attached).

    In parts, each one request: `done` (kept by the caller across attempts) names the parts
    already logged, so that a retry after a lost connection logs no part twice."""
    import tempfile

    client, run_id = client_for(uri), record["run_id"]
    done = set() if done is None else done
    tags = {f"env.{key}": str(value) for key, value in flatten_params(metrics["environment"]).items()}
    derived = {
        "global_batch": metrics["global_batch"],
        "per_worker_batch": metrics["per_worker_batch"],
        "lr_schedule": metrics["lr_schedule"],
    }

    def log_artifact():
        with tempfile.TemporaryDirectory() as folder:
            path = RunFolder(folder).metrics  # the run folder's name, for the artifact too
            path.write_text(json.dumps({**metrics, "mlflow": dict(record)}, indent=1))
            client.log_artifact(run_id, str(path))

    parts = [
        ("tags", lambda: client.log_batch(run_id, tags=[RunTag(key, value) for key, value in tags.items()])),
        ("params", lambda: _log_params_and_metrics(client, run_id, derived, {})),
    ]
    parts += [
        (f"metrics{index}", lambda chunk=chunk: client.log_batch(run_id, metrics=chunk))
        for index, chunk in enumerate(_chunks(_final_metrics(metrics), _MAX_METRICS_PER_BATCH))
    ]
    parts.append(("artifact", log_artifact))
    for name, log in parts:
        if name not in done:
            log()
            done.add(name)


FAILURE_TAG = "dtstudy.failure"  # why the run failed, as the launcher saw it (which rank died)
RANK0_FAILURE_TAG = "dtstudy.failure.rank0"  # the exception rank 0 itself ended with


def end_run(uri: str, run_id: str, status: str, reason: str | None = None, reason_tag: str = FAILURE_TAG) -> None:
    """FINISHED, FAILED or KILLED; a failure's reason becomes the tag `reason_tag`."""
    client = client_for(uri)
    if reason:
        client.set_tag(run_id, reason_tag, reason[:4000])
    if client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id, status=status)


def log_table_figures(uri: str, figures: Mapping[str, Mapping[str, float]]) -> None:
    """{run id: {name: value}}: a table's figures of its cell (the efficiency of the strategy at
    its N, pooled over seeds) on each training run the cell pools, rounded as shown."""
    client, now = client_for(uri), get_current_time_millis()
    for run_id, values in figures.items():
        client.log_batch(run_id, metrics=[Metric(key, shown(key, value), now, 0) for key, value in values.items()])


def log_test_metrics(uri: str, run_id: str, result: Mapping) -> None:
    """Add the evaluation's test top-1/top-5 to the training run."""
    now = get_current_time_millis()
    client_for(uri).log_batch(run_id, metrics=[Metric(f"test_{k}", float(result[k]), now, 0) for k in ("top1", "top5")])
