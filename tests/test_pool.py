"""The warm pool that forks local runs: a lost process fails its run in seconds and names
the rank, its MLflow run ends FAILED, a rerun does not leave a second run of the same name,
the run is RUNNING in MLflow with its metrics arriving while it trains, a study folder made
again gets a pool of its own, and Snakemake stops the pool its runs used. An emulated run
forked by the pool is the run its own process makes, and ends when its command is cancelled."""

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
from conftest import REPO, read_json, tiny_study
from mlflow import MlflowClient

from dtstudy.common.run_folder import METRICS, MLFLOW_RUN

FAIL_FAST_S = 30  # a lost rank must end its run well inside this (the job's time limit is 60 min)


def start_launcher(tmp_path: Path, data_dir: Path, strategy: str, epochs: int = 200, **config) -> tuple:
    """`python -m dtstudy train` of a long run tracked in a SQLite store of its own (created
    first, as the workflow's init_tracking rule does)."""
    from dtstudy.tracking.mlflow_store import init_store

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    init_store(uri, "distributed-training-study")
    study = tiny_study(
        strategies=[strategy],
        workers=[2],
        tracking={"uri": uri},
        train={"epochs": epochs, "batch_size": 16, "log_every": 10},
        **config,
    )
    config_path = tmp_path / "study.yaml"
    config_path.write_text(yaml.safe_dump(study))
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-u",
            "-m",
            "dtstudy",
            "train",
            "--config",
            str(config_path),
            "--strategy",
            strategy,
            "--workers",
            "2",
            "--seed",
            "0",
            "--data",
            str(data_dir),
            "--out",
            str(out),
            "--job-dir",
            str(tmp_path / "job"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
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
    return client.search_runs(
        [experiment.experiment_id], "tags.`dtstudy.kind` = 'training'", run_view_type=getattr(ViewType, view)
    )


@pytest.mark.parametrize("strategy", ["allreduce", "ps_sync"])
@pytest.mark.slow
def test_a_killed_worker_fails_its_run_in_seconds_and_names_the_rank(tmp_path, tiny_data, strategy):
    launcher, out, uri = start_launcher(tmp_path, tiny_data, strategy)
    seen = wait_for_output(launcher, r"img/s")
    job_id = re.search(r"submitted job (\d+)", seen).group(1)
    ranks = read_json(tmp_path / "job" / f"{job_id}_ranks.json")
    deadline = time.monotonic() + 60
    while not (out / MLFLOW_RUN).exists() and time.monotonic() < deadline:  # its MLflow run exists
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
    assert not (out / METRICS).exists()
    for pid in ranks.values():  # no rank outlives the run
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z"
    [run] = training_runs(uri)
    assert run.info.status == "FAILED" and "rank 1" in run.data.tags["dtstudy.failure"]


@pytest.mark.slow
def test_mlflow_shows_a_run_while_it_trains_and_a_rerun_supersedes_it(tmp_path, tiny_data):
    # 6 epochs, checked after the 2nd: the 4 left keep it training while the test looks (with
    # 3 epochs the last one sometimes ended before the check, on a fast hour of CI's machine)
    launcher, out, uri = start_launcher(tmp_path, tiny_data, "allreduce", epochs=6, dataset={"subset": 2000})
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
    assert read_json(out / METRICS)["mlflow"]["run_id"] == run.info.run_id
    assert len(client.get_metric_history(run.info.run_id, "val_top1")) == 6

    rerun, _, _ = start_launcher(tmp_path, tiny_data, "allreduce", epochs=1, dataset={"subset": 2000})
    assert rerun.wait(timeout=120) == 0, rerun.stderr.read()
    [current] = training_runs(uri)  # one run of the name in the UI's default view
    assert current.info.run_id != run.info.run_id and current.info.run_name == "allreduce-n2-seed0"
    [old] = [r for r in training_runs(uri, "DELETED_ONLY")]  # the old one kept, marked
    assert old.info.run_id == run.info.run_id
    assert old.data.tags["dtstudy.superseded_by"] == current.info.run_id


def _pool_processes(study: Path) -> list[str]:
    """The command lines of running pools whose working directory is `study` (or was: a
    deleted folder shows as '<path> (deleted)')."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "dtstudy.launch.pool.server" in command and os.readlink(proc / "cwd").startswith(str(study)):
                found.append(command)
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_a_study_folder_made_again_gets_a_pool_of_its_own_and_snakemake_stops_its_pool(tmp_path):
    """A study deleted and made again at the same path (a fresh clone, `rm -rf` of the whole
    folder) must not be served by the old folder's pool: that pool's working directory is
    gone and every relative path of a run failed (results/data/.../meta.json not found).
    And the pool a study's runs used ends with Snakemake (onsuccess), although Snakemake runs
    as `python3` and the rules as `python`."""
    import shutil

    from conftest import run_snakemake

    study = tmp_path / "study"
    config = tiny_study(workers=[1], train={"epochs": 1, "batch_size": 32, "max_steps": 5})
    target = "results/runs/allreduce/n1/seed0/metrics.json"
    for attempt in ("first", "made again"):
        study.mkdir()
        done = run_snakemake(study, config, "--cores", "2", target)
        assert done.returncode == 0, f"{attempt}: {done.stderr[-3000:]}"
        assert (study / target).exists()
        deadline = time.monotonic() + 10  # the stop is asked for at the end; the pool exits within its 1 s tick
        while _pool_processes(study) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _pool_processes(study), f"{attempt}: the study's pool outlived Snakemake"
        shutil.rmtree(study)


def test_the_pool_address_names_the_folder_by_identity_and_the_interpreter_by_its_binary(tmp_path):
    import shutil

    from dtstudy.launch.pool.client import pool_address

    study = tmp_path / "study"
    study.mkdir()
    first = pool_address(study)
    held = os.open(study, os.O_RDONLY)  # as a pool's working directory holds it
    try:
        os.rmdir(study)
        study.mkdir()
        assert pool_address(study) != first
    finally:
        os.close(held)
    # `python` and `python3` of one environment compute the same address
    names = [name for name in ("python", "python3") if shutil.which(name)]
    code = (
        f"import sys; sys.path.insert(0, {str(REPO / 'workflow')!r}); "
        f"from dtstudy.launch.pool.client import pool_address; print(pool_address({str(study)!r}))"
    )
    addresses = {
        subprocess.run([name, "-c", code], capture_output=True, text=True, check=True).stdout for name in names
    }
    assert len(names) == 2 and len(addresses) == 1, addresses


EMULATED = {"launcher": {"cluster": "emulate"}, "emulate": {"hardware": "h100_ib400", "images_per_s": 32000}}


def _emulated_train(tmp_path: Path, data_dir: Path, processes: str, out: str, max_steps: int | None = 6):
    """`python -m dtstudy train` of an emulated run (N = 4) in the study folder `tmp_path`, its
    process forked by the warm pool (launcher.local_processes: pool) or its own (tasks)."""
    config = tiny_study(
        workers=[4],
        train={"epochs": 1 if max_steps else 500, "batch_size": 8, "max_steps": max_steps},
        **{**EMULATED, "launcher": {**EMULATED["launcher"], "local_processes": processes}},
    )
    config_path = tmp_path / f"{out}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-u", "-m", "dtstudy", "train", "--config", str(config_path), "--strategy"]
    command += ["allreduce", "--workers", "4", "--seed", "0", "--data", str(data_dir), "--out", str(tmp_path / out)]
    command += ["--no-tracking"]
    environ = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ
    )


def _pool_jobs(study: Path) -> list[int]:
    """The job processes the study's pool has forked and that still run."""
    jobs = []
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "dtstudy.launch.pool.server" in command and os.readlink(proc / "cwd") == str(study):
                children = (proc / "task" / proc.name / "children").read_text().split()
                jobs += [int(pid) for pid in children]
        except OSError:
            continue
    return jobs


@pytest.mark.slow
def test_an_emulated_run_forked_by_the_pool_is_the_run_its_own_process_makes(tmp_path, tiny_data):
    """The pool saves an emulated run's interpreter start and imports (torch, MLflow, DDP's
    torch._dynamo), and nothing else: the same losses, validation and weights as the run in
    a process of its own, with its progress on the command's own output."""
    import torch

    runs = {}
    for processes in ("tasks", "pool"):
        command = _emulated_train(tmp_path, tiny_data, processes, processes)
        stdout, stderr = command.communicate(timeout=300)
        assert command.returncode == 0, stderr[-3000:]
        runs[processes] = (read_json(tmp_path / processes / METRICS), stdout)
    (own, own_out), (pooled, pooled_out) = runs["tasks"], runs["pool"]
    assert "in the warm pool" in pooled_out and "in the warm pool" not in own_out
    # the run's own progress (the forked process writes to the command's stdout), not only the client's line
    assert "allreduce-n4-seed0: " in pooled_out and "training images" in pooled_out
    assert pooled["train_loss"] == own["train_loss"] and len(own["train_loss"]) == 6
    assert [point["top1"] for point in pooled["val"]] == [point["top1"] for point in own["val"]]
    weights = {name: torch.load(tmp_path / name / "model.pt")["state_dict"] for name in runs}
    assert all(torch.equal(weights["pool"][key], weights["tasks"][key]) for key in weights["tasks"])


@pytest.mark.slow
def test_a_cancelled_emulated_run_stops_in_the_pool(tmp_path, tiny_data):
    """Snakemake cancels a rule by ending its command: the run the pool forked for it must end
    too, not train on unseen and write outputs of a job Snakemake has given up."""
    command = _emulated_train(tmp_path, tiny_data, "pool", "long", max_steps=None)
    wait_for_output(command, r"training images")
    assert _pool_jobs(tmp_path), "no job process in the pool while the run trains"
    command.send_signal(signal.SIGTERM)
    command.wait(timeout=30)
    deadline = time.monotonic() + FAIL_FAST_S
    while _pool_jobs(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _pool_jobs(tmp_path), "the emulated run went on in the pool after its command ended"
    assert not (tmp_path / "long" / METRICS).exists()
