"""A training run's MLflow run while it trains: created RUNNING at the start, metrics logged as
they are measured, ended FINISHED or FAILED with the run. A background thread does the
MLflow work (and imports MLflow), so that tracking stays off the training loop's path.

The tracking server may go away mid-study (a login node restarted): training never fails for
it. What could not be delivered is kept and retried every `RETRY_S`; the run's end waits up to
`tracking.wait_for_server_s` for the server, and past that writes everything undelivered to
`<run>/mlflow_pending.json`, which `dtstudy.tracking.mlflow_store.deliver_pending` (called by
the aggregate step) sends once the server is back. Nothing measured is lost."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path

from dtstudy.common.atomic_files import write_json
from dtstudy.common.run_folder import MLFLOW_PENDING, RunFolder
from dtstudy.runspec import RunSpec
from dtstudy.tracking.logged_params import applicable_config

RETRY_S = 10.0  # between deliveries while the server is unreachable
# MLflow's own client retries a refused connection for minutes inside one call; here the
# thread retries, so one call gives up soon and the queue keeps what it could not send
_CLIENT_RETRIES = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


class LiveRun:
    """The MLflow run of one training run, fed from rank 0's loop; `disabled()` does nothing."""

    def __init__(
        self,
        uri: str | None,
        experiment: str = "",
        run_name: str = "",
        tags: dict | None = None,
        params: dict | None = None,
        out_dir: str | None = None,
        wait_for_server_s: float = 300.0,
        say=print,
    ):
        self.enabled = uri is not None
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.tags, self.params, self.out_dir = tags or {}, params or {}, out_dir
        self.wait_for_server_s, self.say = wait_for_server_s, say
        self.record: dict | None = None
        self.error: BaseException | None = None  # the last delivery's failure (None: delivered)
        self.fatal: BaseException | None = None  # an answer no retry changes (the server refused it)
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        # undelivered: guarded by _lock (the thread delivers, `_spill` may take them over)
        self._lock = threading.Lock()
        self._points: list[tuple[str, float, int, int]] = []
        self._final: dict | None = None
        self._final_done: set[str] = set()  # the parts of the final results MLflow has
        self._status: tuple[str, str | None] | None = None
        self._spilled = False
        if self.enabled:
            for key, value in _CLIENT_RETRIES.items():
                os.environ.setdefault(key, value)
            self._thread = threading.Thread(target=self._work, name="mlflow-live-run", daemon=True)
            self._thread.start()

    @classmethod
    def disabled(cls) -> LiveRun:
        return cls(None)

    # ----- called from the training loop (cheap: a queue put) ---------------------------
    def log_metric(self, key: str, value: float, step: int) -> None:
        if self.enabled and not self._closed:
            self._queue.put(("metric", (key, float(value), int(step), int(time.time() * 1000))))

    def finish(self, metrics: dict) -> dict | None:
        """Log the run's final figures and metrics.json; wait until MLflow has them (at most
        `wait_for_server_s` while it is unreachable). Returns {run_id, experiment_id,
        tracking_uri}, or {pending, tracking_uri} when the run's MLflow record is left in
        RunFolder.mlflow_pending (with the run's id when it was created); None when tracking
        is off. The run stays RUNNING until `close`."""
        if not self.enabled:
            return None
        self._queue.put(("finish", metrics))
        if self._wait_delivered("logging the final metrics"):
            return self.record
        return {**(self.record or {}), "pending": MLFLOW_PENDING, "tracking_uri": self.uri}

    def close(self, status: str, reason: str | None = None) -> None:
        """End the run with MLflow status FINISHED, FAILED or KILLED (idempotent)."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        self._queue.put(("close", (status, reason)))
        self._wait_delivered(f"ending the run as {status}")
        self._queue.put(("stop", None))

    def _wait_delivered(self, what: str) -> bool:
        """True once the queue and everything undelivered reached MLflow; False after
        `wait_for_server_s` without the server: then it is all in RunFolder.mlflow_pending. An error
        that is not the server's absence (MLflow refused a request) fails the run, as it says."""
        deadline = time.monotonic() + self.wait_for_server_s
        while True:
            alive = self._thread.is_alive()
            if alive:
                self._queue.join()
            with self._lock:
                if self.fatal is not None:
                    raise RuntimeError(f"MLflow ({self.uri}) failed while {what}: {self.fatal}") from self.fatal
                if self._delivered():
                    return True
                spilled = self._spilled
            if spilled:
                break  # the server was given up on before: what is new joins the file
            if not alive or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        self._spill(what)
        return False

    def _delivered(self) -> bool:
        return self.record is not None and not self._points and self._final is None and self._status is None

    def _spill(self, what: str) -> None:
        """Everything undelivered to RunFolder.mlflow_pending (again, with what came since, after a first
        spill); the thread stops delivering."""
        with self._lock:
            if self._delivered():
                return
            first, self._spilled = not self._spilled, True
            pending = {
                "tracking_uri": self.uri,
                "experiment": self.experiment,
                "run_name": self.run_name,
                "tags": self.tags,
                "params": self.params,
                "record": self.record,
                "points": self._points,
                "final": self._final,
                "final_done": sorted(self._final_done),
                "status": self._status,
            }
        where = RunFolder(self.out_dir or ".").mlflow_pending
        if where.exists():  # a close after finish spilled: add to what is there
            pending = {**json.loads(where.read_text()), **{k: v for k, v in pending.items() if v}}
        write_json(where, pending)
        if first:
            self.say(
                f"[mlflow] {self.uri} still unreachable after {self.wait_for_server_s:.0f} s while {what} "
                f"(tracking.wait_for_server_s; last error: {self.error}): {len(pending['points'])} metric "
                f"points and the run's results kept in {where}; the aggregate step delivers them once the "
                "server is back"
            )

    # ----- the background thread ------------------------------------------------------------
    def _work(self) -> None:
        from dtstudy.tracking import mlflow_store

        while True:
            with self._lock:
                waiting = not self._delivered() and not self._spilled
            try:
                kind, item = self._queue.get(timeout=RETRY_S if waiting else None)
            except queue.Empty:
                kind, item = "retry", None
            with self._lock:
                if kind == "metric":
                    self._points.append(item)
                elif kind == "finish":
                    self._final = item
                elif kind == "close":
                    self._status = item
            if kind != "retry":
                self._queue.task_done()
            if kind == "stop":
                return
            if kind == "metric" and not self._queue.empty():
                continue  # batch what has queued up
            self._deliver(mlflow_store)

    def _deliver(self, mlflow_store) -> None:
        """Send what is undelivered, in order; on a failure keep it for the next try."""
        with self._lock:
            if self._spilled:
                return
            try:
                if self.record is None:
                    self.record = mlflow_store.start_training_run(
                        self.uri, self.experiment, self.run_name, self.tags, self.params
                    )
                    if self.out_dir is not None:
                        write_json(RunFolder(self.out_dir).mlflow_run, self.record)
                mlflow_store.log_metric_points(self.uri, self.record["run_id"], self._points)  # empties it
                if self._final is not None:
                    mlflow_store.log_training_results(self.uri, self.record, self._final, self._final_done)
                    self._final = None
                if self._status is not None:
                    mlflow_store.end_run(self.uri, self.record["run_id"], *self._status, mlflow_store.RANK0_FAILURE_TAG)
                    self._status = None
            except Exception as error:  # the server is away: keep it, say so once
                if not server_away(self.uri, error):
                    self.fatal = error
                    self._spilled = True  # nothing more to try
                    return
                if self.error is None:
                    self.say(
                        f"[mlflow] {self.uri} unreachable ({type(error).__name__}: "
                        f"{str(error).splitlines()[0][:200]}): metrics are kept and sent every {RETRY_S:.0f} s"
                    )
                self.error = error
                return
            if self.error is not None:
                self.say(f"[mlflow] {self.uri} reachable again: everything kept has been sent")
                self.error = None


def server_away(uri: str, error: Exception) -> bool:
    """Whether `error` is a tracking server that did not answer (worth retrying), rather than
    an answer (MLflow's RestException: a refused request) or a local store's failure."""
    from mlflow.exceptions import RestException

    return uri.startswith(("http://", "https://")) and not isinstance(error, RestException)


def run_tags(spec: RunSpec) -> dict:
    tags = {"strategy": spec.strategy, "workers": str(spec.workers), "seed": str(spec.seed)}
    return tags if spec.variant is None else {**tags, "variant": spec.variant}


def run_params(spec: RunSpec) -> dict:
    """What a training run was asked to do: the config values that apply to it and the strategy's knobs."""
    return {
        "strategy": spec.strategy,
        "workers": spec.workers,
        "seed": spec.seed,
        "config": applicable_config(spec.config),
        "strategy_params": spec.strategy_params(),
    }


def start_live_run(spec: RunSpec) -> LiveRun:
    """Rank 0's live MLflow run of `spec` (disabled when the spec has no tracking URI)."""
    if spec.tracking_uri is None:
        return LiveRun.disabled()
    tracking = spec.config["tracking"]
    return LiveRun(
        spec.tracking_uri,
        tracking["experiment"],
        spec.run_name,
        run_tags(spec),
        run_params(spec),
        spec.out_dir,
        tracking["wait_for_server_s"],
    )


def recorded_run(out_dir: str | Path) -> dict | None:
    """The MLflow run a run folder's (possibly failed) attempt created, if it got that far."""
    path = RunFolder(out_dir).mlflow_run
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def deliver_pending(run_dir: str | Path) -> dict | None:
    """Send to MLflow what a run kept while its server was away: RunFolder.mlflow_pending (the run itself
    when it was never created, its metric points, final results and end status) and test
    metrics its evaluation could not add (eval.json's `mlflow_logged` false); then record the
    run's id (RunFolder.mlflow_run) and remove the file. Returns the run's record (None: nothing was
    kept). Raises while the server is still away."""
    from dtstudy.tracking import mlflow_store

    folder = RunFolder(run_dir)
    path, evaluation_path = folder.mlflow_pending, folder.evaluation
    pending = json.loads(path.read_text()) if path.exists() else None
    evaluation = json.loads(evaluation_path.read_text()) if evaluation_path.exists() else {}
    test_kept = evaluation.get("mlflow_logged") is False or (
        pending is not None and not evaluation.get("mlflow_run_id") and "top1" in evaluation
    )
    if pending is None and not test_kept:
        return None
    if pending is None:  # only the test metrics: the run's record is in metrics.json
        record = json.loads(folder.metrics.read_text())["mlflow"]
    else:
        record = pending.get("record")
        if record is None:
            record = mlflow_store.start_training_run(
                pending["tracking_uri"], pending["experiment"], pending["run_name"], pending["tags"], pending["params"]
            )
            write_json(path, {**pending, "record": record})  # a failure below must not create it twice
        uri, done = pending["tracking_uri"], set(pending.get("final_done") or [])
        points = [tuple(point) for point in pending.get("points") or []]
        try:  # what was sent is struck from the file if a later request fails
            mlflow_store.log_metric_points(uri, record["run_id"], points)
            if pending.get("final"):
                mlflow_store.log_training_results(uri, record, pending["final"], done)
        except Exception:
            write_json(path, {**pending, "record": record, "points": points, "final_done": sorted(done)})
            raise
    if test_kept:
        mlflow_store.log_test_metrics(record["tracking_uri"], record["run_id"], evaluation)
        write_json(evaluation_path, {**evaluation, "mlflow_run_id": record["run_id"], "mlflow_logged": True})
    if pending is not None:
        mlflow_store.end_run(record["tracking_uri"], record["run_id"], *(pending.get("status") or ("FINISHED", None)))
        write_json(folder.mlflow_run, record)
        path.unlink()
    return record
