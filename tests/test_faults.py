"""Faults on the path that SLURM takes too (`launcher.local_processes: tasks`, one submitit
task per process): a process killed while its run trains ends the run within seconds, with the
rank named, no metrics.json and its MLflow run FAILED; a run that crashed resumes from its last
periodic checkpoint when it is started again, and ends as an uninterrupted run would; and many
processes writing to one MLflow SQLite store at once lose no metric."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import assert_same_parameters, read_json, tiny_study
from test_pool import training_runs, wait_for_output

from dtstudy.common.run_folder import METRICS, MLFLOW_RUN, MODEL

FAIL_WITHIN_S = 60  # a lost process must end its run within this; the job's limit is timeout_min
TIMEOUT_MIN = 60  # the runs' time limit: the bound above is far below it
TASKS = {"local_processes": "tasks", "timeout_min": TIMEOUT_MIN}


def launch(tmp_path: Path, data_dir: Path, strategy: str, name: str = "run", train=None, launcher=None, **config):
    """`python -m dtstudy train` of an N=2 run on the tasks path, tracked in a SQLite store
    of its own; the study config and the command, so that the run can be started again."""
    from dtstudy.tracking.mlflow_store import init_store

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    init_store(uri, "distributed-training-study")
    study = tiny_study(
        strategies=[strategy],
        workers=[2],
        tracking={"uri": uri},
        launcher={**TASKS, **(launcher or {})},
        train={"epochs": 200, "batch_size": 16, "log_every": 10, **(train or {})},
        **config,
    )
    config_path = tmp_path / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(study))
    out = tmp_path / name
    command = [
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
        str(tmp_path / f"{name}-job"),
    ]
    return command, out, uri


def start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def task_pids(controller: int) -> dict[int, int]:
    """task number (= rank on one node) -> pid, of the tasks of a local submitit job
    (the children of its controller, whose pid is the job id)."""
    tasks = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != controller:
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        for entry in environ:
            if entry.startswith(b"SUBMITIT_LOCAL_GLOBALID="):
                tasks[int(entry.split(b"=", 1)[1])] = int(stat.parent.name)
    return tasks


def wait_for_tasks(seen: str, count: int) -> tuple[str, dict[int, int]]:
    job_id = re.search(r"submitted job (\d+)", seen).group(1)
    deadline = time.monotonic() + 30
    while len(pids := task_pids(int(job_id))) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(pids) == count, pids
    return job_id, pids


def wait_for_failure(launcher: subprocess.Popen, killed_at: float) -> tuple[float, str]:
    """Seconds from the kill until the launcher failed, and its stderr; a launcher still
    waiting well past the bound is interrupted (it cancels the job) and the test fails."""
    try:
        launcher.wait(timeout=FAIL_WITHIN_S + 30)
    except subprocess.TimeoutExpired:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=60)
        pytest.fail(f"the run was still going {FAIL_WITHIN_S + 30} s after a process was killed")
    return time.monotonic() - killed_at, launcher.stderr.read()


@pytest.mark.parametrize(
    "strategy, victim",
    [
        ("ps_sync", 1),  # a worker: the shard waits for its push, the other worker for the shard
        ("allreduce", 1),
        ("ps_sync", 2),  # the parameter-server shard
        # one of each other family: its waits differ (a shard's receive from any source, local
        # steps between averagings, point-to-point gossip, a compressed all-gather)
        ("ps_async", 1),
        ("local_sgd", 1),
        ("gossip", 1),
        ("allreduce_onebit", 1),
    ],
)
@pytest.mark.slow
def test_a_killed_process_fails_a_tasks_run_within_seconds(tmp_path, tiny_data, strategy, victim):
    command, out, uri = launch(tmp_path, tiny_data, strategy)
    launcher = start(command)
    seen = wait_for_output(launcher, r"img/s")
    job_id, pids = wait_for_tasks(seen, 3 if strategy.startswith("ps_") else 2)
    deadline = time.monotonic() + 60
    while not (out / MLFLOW_RUN).exists() and time.monotonic() < deadline:  # its MLflow run exists
        time.sleep(0.1)
    killed_at = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    took, stderr = wait_for_failure(launcher, killed_at)

    assert launcher.returncode != 0
    assert took < FAIL_WITHIN_S < TIMEOUT_MIN * 60 / 10, f"the run took {took:.1f} s to fail"
    print(f"{strategy}: rank {victim} killed, the run failed {took:.1f} s later")
    # the rank, how it was lost and where its log is (submitit's file of its task)
    assert f"rank {victim} was lost (its process {pids[victim]} on" in stderr, stderr
    assert str(tmp_path / "run-job" / f"{job_id}_{victim}_log.err") in stderr, stderr
    assert not (out / METRICS).exists()
    for pid in pids.values():  # no task outlives the run
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    [run] = training_runs(uri)
    assert run.info.status == "FAILED" and f"rank {victim} was lost" in run.data.tags["dtstudy.failure"]


def _watch_over(tmp_path: Path, monkeypatch, peer_pid: int):
    """Rank 0's PeerWatch of an N=2 run whose rank 1 is process `peer_pid` on this host, with
    the run's store (rank 0 hosts it; the store object must outlive the watch)."""
    import json

    import torch.distributed as dist

    from dtstudy.common.ports import free_port
    from dtstudy.launch.process_group import PeerWatch

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    store.set("dtstudy/peer/1", json.dumps({"host": socket.gethostname(), "pid": peer_pid, "log": "rank1.err"}))
    store.add("dtstudy/beat/1", 1)
    return store, PeerWatch(0, 2, comm_timeout_s=60, log="rank0.err", record=tmp_path / "lost.json").start()


def test_a_failing_process_names_a_peer_whose_death_shows_just_after_its_own_error(tmp_path, monkeypatch):
    """A SIGKILLed peer's connections close before its process shows as gone (on a loaded
    machine, for a moment): the process that fails on the closed connection still names it."""
    peer = subprocess.Popen(["sleep", "60"])
    store, watch = _watch_over(tmp_path, monkeypatch, peer.pid)
    killer = threading.Timer(0.5, peer.kill)  # gone after this process's error arrived
    killer.start()
    started = time.monotonic()
    watch.fail()
    took = time.monotonic() - started
    peer.wait()

    lost = read_json(tmp_path / "lost.json")
    assert (lost["rank"], lost["seen_by"], lost["log"]) == (1, 0, "rank1.err"), lost
    assert lost["why"] == f"its process {peer.pid} on {socket.gethostname()} is gone", lost
    assert took < 2.0, f"fail() took {took:.1f} s after the peer went"


def test_a_process_failing_of_its_own_error_names_no_peer_and_ends_soon(tmp_path, monkeypatch):
    """Its peer lives on (blocked in a collective, say): no peer is named, and the look for a
    killed one ends after LOSS_SETTLE_S; a peer that said it failed ends the look at once."""
    from dtstudy.launch.process_group import LOSS_SETTLE_S

    peer = subprocess.Popen(["sleep", "60"])
    try:
        store, watch = _watch_over(tmp_path, monkeypatch, peer.pid)
        started = time.monotonic()
        watch.fail()
        alive_took = time.monotonic() - started
        store, watch = _watch_over(tmp_path, monkeypatch, peer.pid)
        store.set("dtstudy/failed/1", "1")
        started = time.monotonic()
        watch.fail()
        said_took = time.monotonic() - started
    finally:
        peer.kill()
        peer.wait()
    assert not (tmp_path / "lost.json").exists()
    assert LOSS_SETTLE_S <= alive_took < LOSS_SETTLE_S + 2.5, alive_took
    assert said_took < LOSS_SETTLE_S / 2, said_took


def test_a_slurm_job_ends_all_its_tasks_when_one_fails():
    """srun --kill-on-bad-exit: a task that exits non-zero (a lost peer seen, an error) ends
    the job's other tasks at once, on every node."""
    from test_launcher import spec_for

    from dtstudy.launch.launcher import job_parameters

    assert job_parameters(spec_for(8, {"cluster": "slurm", "gpus_per_node": 4}))["slurm_srun_args"] == [
        "--kill-on-bad-exit=1"
    ]


@pytest.mark.slow
def test_a_frozen_process_is_named_and_its_run_ends(tmp_path, tiny_data):
    """SIGSTOP (a process or node that hangs, its heartbeat stopped with it): the run fails
    soon after half of launcher.comm_timeout_s, naming the rank; the frozen task is ended too."""
    command, out, uri = launch(tmp_path, tiny_data, "ps_sync", launcher={"comm_timeout_s": 10})
    launcher = start(command)
    seen = wait_for_output(launcher, r"img/s")
    job_id, pids = wait_for_tasks(seen, 3)
    frozen_at = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)
    try:
        took, stderr = wait_for_failure(launcher, frozen_at)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGKILL)
    print(f"ps_sync: rank 1 frozen, the run failed {took:.1f} s later")
    assert launcher.returncode != 0 and 5 < took < 10 + 20, (took, stderr)
    assert "rank 1 was lost (no heartbeat for" in stderr, stderr
    assert not (out / METRICS).exists()
    [run] = training_runs(uri)
    assert run.info.status == "FAILED" and "rank 1 was lost" in run.data.tags["dtstudy.failure"]


# ----- crash, rerun, resume ------------------------------------------------------------------

CHECKPOINTED = {
    "max_steps": 120,
    "batch_size": 32,
    "lr_scaling": "none",
    "base_lr": 0.1,
    "log_every": 5,
    "preempt_check_every": 5,
    "checkpoint_every_min": 0.002,
}  # a checkpoint every 5 steps
SLOW = {"ranks": [1], "delay_ms": 30, "distribution": "uniform", "seed": 3}  # ~4 s of training


@pytest.mark.parametrize("processes", ["tasks", "pool"])
@pytest.mark.slow
def test_a_crashed_run_resumes_from_its_last_periodic_checkpoint(tmp_path, tiny_data, processes):
    """allreduce: rank 1 is killed after a checkpoint; the same command again resumes from the
    last checkpoint and ends exactly where an uninterrupted run ends (one submitit task per
    process, as on SLURM, or forked by the warm pool)."""
    import torch

    where = {"local_processes": processes}
    reference_command, reference_out, _ = launch(
        tmp_path, tiny_data, "allreduce", "reference", train=CHECKPOINTED, launcher=where, stragglers=SLOW
    )
    command, out, uri = launch(tmp_path, tiny_data, "allreduce", train=CHECKPOINTED, launcher=where, stragglers=SLOW)
    launcher = start(command)
    seen = wait_for_output(launcher, r"checkpoint at step (1\d|[2-9]\d)\b")
    if processes == "tasks":
        _, pids = wait_for_tasks(seen, 2)
    else:  # the pool's record of its forked ranks
        job_id = re.search(r"submitted job (\d+)", seen).group(1)
        pids = {int(rank): pid for rank, pid in read_json(tmp_path / "run-job" / f"{job_id}_ranks.json").items()}
    os.kill(pids[1], signal.SIGKILL)
    launcher.wait(timeout=FAIL_WITHIN_S + 30)
    seen += launcher.stdout.read()
    assert launcher.returncode != 0 and not (out / METRICS).exists(), seen
    saved = [int(step) for step in re.findall(r"checkpoint at step (\d+)", seen)]
    assert (out / "resume" / "rank0.pt").exists()

    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    reference = subprocess.run(reference_command, capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr

    resumed = re.search(r"^resumed from step (\d+) ", rerun.stdout, re.M)
    assert resumed, rerun.stdout
    step = int(resumed.group(1))
    assert step >= saved[-1] >= 10 and step % 5 == 0 and step < 120, (step, saved)
    print(f"{processes}: killed after the checkpoint at step {saved[-1]}, resumed from step {step}")
    metrics, expected = read_json(out / METRICS), read_json(reference_out / METRICS)
    assert metrics["steps"] == expected["steps"] == 120
    assert metrics["train_loss"] == expected["train_loss"]
    assert [v["top1"] for v in metrics["val"]] == [v["top1"] for v in expected["val"]]
    assert metrics["stragglers"] == expected["stragglers"]
    assert_same_parameters(
        torch.load(out / MODEL, weights_only=True)["state_dict"],
        torch.load(reference_out / MODEL, weights_only=True)["state_dict"],
        atol=1e-7,
    )
    assert not (out / "resume").exists()  # done: nothing left to resume
    assert {run.info.status for run in training_runs(uri)} == {"FINISHED"}


# ----- many writers, one SQLite store ----------------------------------------------------------

WRITERS = 16
CALLS, POINTS = 40, 5  # per writer: batches of metric points, as a live run sends them


def _write_metrics(uri: str, writer: int) -> None:
    from dtstudy.tracking import mlflow_store

    mlflow_store.client_for.cache_clear()  # a forked child opens its own database engine
    record = mlflow_store.start_training_run(
        uri, "distributed-training-study", f"writer-{writer}", {"writer": str(writer)}, {"writer": writer}
    )
    for call in range(CALLS):
        points = [("train_loss", float(writer), call * POINTS + i, int(time.time() * 1000)) for i in range(POINTS)]
        mlflow_store.log_metric_points(uri, record["run_id"], points)
    mlflow_store.end_run(uri, record["run_id"], "FINISHED")


@pytest.mark.slow
def test_sixteen_processes_writing_to_one_sqlite_store_lose_no_metric(tmp_path):
    from mlflow import MlflowClient

    from dtstudy.tracking.mlflow_store import init_store

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    init_store(uri, "distributed-training-study")
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write_metrics, args=(uri, w)) for w in range(WRITERS)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=600)
    assert [writer.exitcode for writer in writers] == [0] * WRITERS
    client = MlflowClient(uri)
    runs = training_runs(uri)
    assert len(runs) == WRITERS and {run.info.status for run in runs} == {"FINISHED"}
    counts = {run.info.run_name: len(client.get_metric_history(run.info.run_id, "train_loss")) for run in runs}
    assert counts == {f"writer-{w}": CALLS * POINTS for w in range(WRITERS)}
