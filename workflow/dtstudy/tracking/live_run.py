"""A training run's MLflow run while it trains: created RUNNING at the start, metrics logged as
they are measured, ended FINISHED or FAILED with the run. A background thread does the
MLflow work (and imports MLflow), so that tracking stays off the training loop's path."""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

from dtstudy.atomic_files import write_json
from dtstudy.runspec import RunSpec

RUN_ID_FILE = "mlflow_run.json"  # the run's MLflow id, as soon as it exists (for failure marking)
_CLOSE_TIMEOUT_S = 300


class LiveRun:
    """The MLflow run of one training run, fed from rank 0's loop; `disabled()` does nothing."""

    def __init__(self, uri: str | None, experiment: str = "", run_name: str = "", tags: dict | None = None,
                 params: dict | None = None, out_dir: str | None = None):
        self.enabled = uri is not None
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.record: dict | None = None
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        if self.enabled:
            self._thread = threading.Thread(target=self._work, args=(tags or {}, params or {}, out_dir),
                                            name="mlflow-live-run", daemon=True)
            self._thread.start()

    @classmethod
    def disabled(cls) -> "LiveRun":
        return cls(None)

    # ----- called from the training loop (cheap: a queue put) ---------------------------
    def log_metric(self, key: str, value: float, step: int) -> None:
        if self.enabled and not self._closed:
            self._queue.put(("metric", key, float(value), int(step), int(time.time() * 1000)))

    def finish(self, metrics: dict) -> dict | None:
        """Log the run's final figures and metrics.json; wait until MLflow has them. Returns
        {run_id, experiment_id, tracking_uri} (None when tracking is off). The run stays
        RUNNING until `close`."""
        if not self.enabled:
            return None
        done = threading.Event()
        self._queue.put(("finish", metrics, done))
        self._wait(done, "logging the final metrics")
        return self.record

    def close(self, status: str, reason: str | None = None) -> None:
        """End the run with MLflow status FINISHED, FAILED or KILLED (idempotent)."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        done = threading.Event()
        self._queue.put(("close", status, reason, done))
        self._wait(done, f"ending the run as {status}")

    def _wait(self, done: threading.Event, what: str) -> None:
        while not done.wait(0.1):
            if not self._thread.is_alive():
                break
        if self.error is not None:
            raise RuntimeError(f"MLflow ({self.uri}) failed while {what}: {self.error}") from self.error

    # ----- the background thread ------------------------------------------------------------
    def _work(self, tags: dict, params: dict, out_dir: str | None) -> None:
        try:
            from dtstudy.tracking import mlflow_store

            self.record = mlflow_store.start_training_run(self.uri, self.experiment, self.run_name, tags, params)
            if out_dir is not None:
                write_json(Path(out_dir) / RUN_ID_FILE, self.record)
        except BaseException as error:  # reported by the next finish/close
            self.error = error
            return
        pending = []
        while True:
            item = self._queue.get()
            if item[0] == "metric":
                pending.append(item[1:])
                if not self._queue.empty():
                    continue  # batch what has queued up
            try:
                if pending:
                    mlflow_store.log_metric_points(self.uri, self.record["run_id"], pending)
                    pending = []
                if item[0] == "finish":
                    mlflow_store.log_training_results(self.uri, self.record, item[1])
                    item[2].set()
                elif item[0] == "close":
                    mlflow_store.end_run(self.uri, self.record["run_id"], item[1], item[2], mlflow_store.RANK0_FAILURE_TAG)
                    item[3].set()
                    return
            except BaseException as error:
                self.error = error
                for waiting in item[1:]:
                    if isinstance(waiting, threading.Event):
                        waiting.set()
                if item[0] == "close":
                    return


def run_tags(spec: RunSpec) -> dict:
    return {"strategy": spec.strategy, "workers": str(spec.workers), "seed": str(spec.seed)}


def run_params(spec: RunSpec) -> dict:
    """What a training run was asked to do: config values and strategy knobs."""
    return {"strategy": spec.strategy, "workers": spec.workers, "seed": spec.seed, "config": spec.config,
            "strategy_params": spec.strategy_params()}


def start_live_run(spec: RunSpec) -> LiveRun:
    """Rank 0's live MLflow run of `spec` (disabled when the spec has no tracking URI)."""
    if spec.tracking_uri is None:
        return LiveRun.disabled()
    return LiveRun(spec.tracking_uri, spec.config["tracking"]["experiment"], spec.run_name,
                   run_tags(spec), run_params(spec), spec.out_dir)


def recorded_run(out_dir: str | Path) -> dict | None:
    """The MLflow run a run folder's (possibly failed) attempt created, if it got that far."""
    path = Path(out_dir) / RUN_ID_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
