"""The warm pool that forks local runs: a lost process fails its run in seconds and names
the rank, its MLflow run ends FAILED, a rerun does not leave a second run of the same name,
and the run is RUNNING in MLflow with its metrics arriving while it trains."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from conftest import read_json, tiny_study
from dtstudy.run_tracker import RUN_ID_FILE
from dtstudy.runspec import METRICS_FILE

FAIL_FAST_S = 30  # a lost rank must end its run well inside this (the job's time limit is 60 min)


def start_launcher(tmp_path: Path, data_dir: Path, strategy: str, epochs: int = 200, **config) -> tuple:
    """`python -m dtstudy train` of a long run tracked in a SQLite store of its own (created
    first, as the workflow's init_tracking rule does)."""
    from dtstudy.tracking import init_store

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    init_store(uri, "distributed-training-study")
    study = tiny_study(strategies=[strategy], workers=[2], tracking={"uri": uri},
                       train={"epochs": epochs, "batch_size": 16, "log_every": 10}, **config)
    config_path = tmp_path / "study.yaml"
    config_path.write_text(yaml.safe_dump(study))
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-u", "-m", "dtstudy", "train", "--config", str(config_path), "--strategy", strategy,
         "--workers", "2", "--seed", "0", "--data", str(data_dir), "--out", str(out),
         "--job-dir", str(tmp_path / "job")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    return launcher, out, uri


def wait_for_output(launcher: subprocess.Popen, pattern: str, timeout_s: float = 120) -> str:
    seen, deadline = "", time.monotonic() + timeout_s
    while time.monotonic() < deadline and not re.search(pattern, seen):
        line = launcher.stdout.readline()
        if not line and launcher.poll() is not None:
            break
        seen += line
    assert re.search(pattern, seen), f"no {pattern!r} in the launcher's output:\n{seen}\n{launcher.stderr.read()}"
    return seen


def training_runs(uri: str, view="ACTIVE_ONLY"):
    from mlflow.entities import ViewType

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("distributed-training-study")
    return client.search_runs([experiment.experiment_id], "tags.`dtstudy.kind` = 'training'",
                              run_view_type=getattr(ViewType, view))


@pytest.mark.parametrize("strategy", ["allreduce", "ps_sync"])
def test_a_killed_worker_fails_its_run_in_seconds_and_names_the_rank(tmp_path, tiny_data, strategy):
    launcher, out, uri = start_launcher(tmp_path, tiny_data, strategy)
    seen = wait_for_output(launcher, r"img/s")
    job_id = re.search(r"submitted job (\d+)", seen).group(1)
    ranks = read_json(tmp_path / "job" / f"{job_id}_ranks.json")
    deadline = time.monotonic() + 60
    while not (out / RUN_ID_FILE).exists() and time.monotonic() < deadline:  # its MLflow run exists
        time.sleep(0.1)
    assert len(ranks) == (3 if strategy == "ps_sync" else 2)  # workers + the shard
    killed_at = time.monotonic()
    os.kill(ranks["1"], signal.SIGKILL)
    launcher.wait(timeout=120)
    took = time.monotonic() - killed_at
    stderr = launcher.stderr.read()
    assert launcher.returncode != 0
    assert took < FAIL_FAST_S, f"the run took {took:.1f} s to fail"
    assert "rank 1 was killed by signal 9" in stderr, stderr
    assert str(tmp_path / "job") in stderr  # where the rank's log is
    assert not (out / METRICS_FILE).exists()
    for pid in ranks.values():  # no rank outlives the run
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z"
    [run] = training_runs(uri)
    assert run.info.status == "FAILED" and "rank 1" in run.data.tags["dtstudy.failure"]


def test_mlflow_shows_a_run_while_it_trains_and_a_rerun_supersedes_it(tmp_path, tiny_data):
    # 6 epochs, checked after the 2nd: the 4 left keep it training while the test looks (with
    # 3 epochs the last one sometimes ended before the check, on a fast hour of CI's machine)
    launcher, out, uri = start_launcher(tmp_path, tiny_data, "allreduce", epochs=6,
                                        dataset={"subset": 2000})
    wait_for_output(launcher, r"epoch 2/6 done")
    [run] = training_runs(uri)
    assert run.info.status == "RUNNING"  # visible while it trains ...
    client = MlflowClient(uri)
    deadline = time.monotonic() + 30  # ... with what was measured so far (logged off the loop's path)
    while time.monotonic() < deadline and len(client.get_metric_history(run.info.run_id, "val_top1")) < 2:
        time.sleep(0.2)
    assert len(client.get_metric_history(run.info.run_id, "val_top1")) >= 2
    assert client.get_metric_history(run.info.run_id, "train_loss")
    assert launcher.wait(timeout=120) == 0, launcher.stderr.read()
    finished = client.get_run(run.info.run_id)
    assert finished.info.status == "FINISHED"
    assert read_json(out / METRICS_FILE)["mlflow"]["run_id"] == run.info.run_id
    assert len(client.get_metric_history(run.info.run_id, "val_top1")) == 6

    rerun, _, _ = start_launcher(tmp_path, tiny_data, "allreduce", epochs=1, dataset={"subset": 2000})
    assert rerun.wait(timeout=120) == 0, rerun.stderr.read()
    [current] = training_runs(uri)  # one run of the name in the UI's default view
    assert current.info.run_id != run.info.run_id and current.info.run_name == "allreduce-n2-seed0"
    [old] = [r for r in training_runs(uri, "DELETED_ONLY")]  # the old one kept, marked
    assert old.info.run_id == run.info.run_id
    assert old.data.tags["dtstudy.superseded_by"] == current.info.run_id
