"""The study on a real SLURM: a one-node cluster on localhost (tests/slurm/up.sh, started and
stopped here), driven the way a researcher does, `snakemake --profile slurm` from the
repository root, with MLflow behind a real `mlflow server`."""

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

pytestmark = pytest.mark.slurm

SLURM_SCRIPTS = REPO / "tests" / "slurm"
STRATEGIES = ["allreduce", "ps_sync"]  # ps_sync: a shard as an extra task of the SLURM job
# The cluster's time-outs are minutes; the CPU rules are small.
FAST_SLURM = [
    "--default-resources",
    "cpus_per_task=1",
    "mem_mb=1000",
    "runtime=10",
    "--slurm-init-seconds-before-status-checks",
    "2",
]


def tiny_cluster_study(**overrides) -> dict:
    """An overlay on config/cluster.yaml: the tiny study, CPU workers (fake GPUs off)."""
    from dtstudy.config.study_config import deep_merge

    overlay = tiny_study(
        strategies=STRATEGIES,
        model_options={"small_input": True},
        train={"warmup_epochs": 0, "max_steps": None, "steady_state_skip": 5, "log_every": 20},
        launcher={
            "cluster": "slurm",
            "device": "cpu",
            "gpus_per_node": 0,
            "cpus_per_task": 1,
            "partition": None,
            "timeout_min": 10,
            "signal_delay_s": 60,
            "hardware": None,
        },
        tracking={"uri": None},
        # full trainings at every N of the overlay (cluster.yaml's scaling and accuracy runs
        # name N the tiny study does not run)
        scaling={"steps": None, "workers": None, "seeds": None},
        accuracy={"workers": None, "seeds": None},
    )
    overlay["dataset"].update(name="fashion_mnist", root=None)
    return deep_merge(overlay, overrides)


def slurm_snakemake(workdir: Path, overlay: dict, *args: str, **popen) -> subprocess.Popen:
    """`snakemake --profile slurm` from the repository root, the study in `workdir`, with the
    profile's config/cluster.yaml and `overlay` on top of it."""
    overlay_path = workdir / "overlay.yaml"
    overlay_path.write_text(yaml.safe_dump(overlay))
    command = [
        sys.executable,
        "-m",
        "snakemake",
        "--profile",
        "slurm",
        "--directory",
        str(workdir),
        "--configfile",
        "config/cluster.yaml",
        str(overlay_path),
        *FAST_SLURM,
        *args,
    ]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def sacct_states(names: list[str], since: str) -> dict[str, list[str]]:
    """Job name -> the states of its jobs since `since`, one per job (allocations only)."""
    out = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-S", since, "-o", "JobName,State", "--name", ",".join(names)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    states: dict[str, list[str]] = {}
    for line in out.splitlines():
        name, state = line.split("|")
        states.setdefault(name, []).append(state.split()[0])
    return states


def sacct_jobs(since: str) -> list[tuple[str, str, int]]:
    """(name, comment, GPUs held: sacct's AllocTRES gres/gpu) of every job since `since`."""
    out = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-S", since, "-o", "JobName,Comment,AllocTRES"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    jobs = []
    for line in out.splitlines():
        name, comment, tres = line.split("|")
        held = dict(item.split("=", 1) for item in tres.split(",") if "=" in item)
        jobs.append((name, comment, int(held.get("gres/gpu", 0))))
    return jobs


def final_states(name: str, since: str) -> list[str]:
    """The states of job name's jobs since `since` once the last has ended (accounting lags a
    job's end by a few seconds; waits up to a minute)."""
    deadline = time.monotonic() + 60
    while (states := sacct_states([name], since).get(name, ["PENDING"]))[-1] in (
        "PENDING",
        "RUNNING",
        "COMPLETING",
    ) and time.monotonic() < deadline:
        time.sleep(1)
    return states


def queued(names: list[str]) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%j %T"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.split()[0] in names]


def run_names(config: dict) -> list[str]:
    return [f"{s}-n{n}-seed{seed}" for s in config["strategies"] for n in config["workers"] for seed in config["seeds"]]


@pytest.fixture(scope="module")
def slurm_cluster():
    """The one-node SLURM of tests/slurm (kept running if it was already up)."""
    if os.geteuid() != 0:
        pytest.skip("the local SLURM of tests/slurm/up.sh starts its daemons as root")
    up = subprocess.run(["bash", str(SLURM_SCRIPTS / "up.sh")], capture_output=True, text=True)
    assert up.returncode == 0, up.stdout + up.stderr
    yield
    if "already running" not in up.stdout:
        subprocess.run(["bash", str(SLURM_SCRIPTS / "down.sh")], capture_output=True)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` (SQLite behind it, as on a login node) that a test may stop and
    start again (conftest.MlflowServer)."""
    from conftest import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield server
    server.stop()


def make_image_folder(root: Path, per_class: int) -> Path:
    """Two classes of `per_class` 8x8 PNGs each (hard links to one file: thousands are quick)."""
    from PIL import Image

    root.mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(root / "one.png")
    for label in ("a", "b"):
        (root / "train" / label).mkdir(parents=True)
        for index in range(per_class):
            os.link(root / "one.png", root / "train" / label / f"{index}.png")
    (root / "one.png").unlink()
    return root


def test_dry_run_of_the_slurm_profile_lists_every_job_of_the_full_study(tmp_path):
    """`snakemake --profile slurm -n` with only dataset.root filled in: every scaling run (strategy,
    N, seed) as a train_scaling job and every accuracy run as a train job, with its evaluation."""
    full = yaml.safe_load((REPO / "config" / "cluster.yaml").read_text())
    # enough images, once test_fraction (0.1, a train/ folder alone) and val_fraction (0.02) are
    # held out, for a scaling run's 50 + 200 steps in train.epochs 30 at N = 64 (batch 32):
    # 9 steps an epoch, 288 images per worker
    root = make_image_folder(tmp_path / "images", per_class=10500)
    process = slurm_snakemake(tmp_path, {"dataset": {"root": str(root)}}, "--dry-run")
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, output[-5000:]
    assert "Using profiles slurm" in output
    jobs = {"train_scaling": set(), "train": set(), "evaluate": set()}
    evaluation_resources = []
    for block in output.split("\nrule ")[1:]:
        rule = block.split(":", 1)[0]
        if rule in jobs:
            wildcards = next(line for line in block.splitlines() if "wildcards:" in line)
            values = dict(part.strip().split("=") for part in wildcards.split(":", 1)[1].split(","))
            jobs[rule].add((values["strategy"], int(values["workers"]), int(values["seed"])))
        if rule == "evaluate":
            resources = next(line for line in block.splitlines() if "resources:" in line)
            evaluation_resources.append(
                dict(part.strip().split("=", 1) for part in resources.split(":", 1)[1].split(","))
            )
    scaling = {(s, n, seed) for s in full["strategies"] for n in full["workers"] for seed in full["scaling"]["seeds"]}
    accuracy = {(s, n, seed) for s in full["strategies"] for n in full["accuracy"]["workers"] for seed in full["seeds"]}
    assert len(scaling) == 12 * 7 * 2 and len(accuracy) == 12 * 3 * 3
    assert jobs == {"train_scaling": scaling, "train": accuracy, "evaluate": accuracy}
    # each evaluation asks for one GPU on the training runs' partition, with a training task's CPUs
    launcher = full["launcher"]
    assert all(
        (resources["gpu"], resources["slurm_partition"], resources["cpus_per_task"])
        == ("1", launcher["partition"], str(launcher["cpus_per_task"]))
        for resources in evaluation_resources
    )


def test_full_study_without_a_dataset_root_says_what_to_edit(tmp_path):
    process = slurm_snakemake(tmp_path, {}, "--dry-run")
    output = process.communicate(timeout=300)[0]
    assert process.returncode != 0
    assert "dataset.root: '/path/to/imagenet'" in output


def restart_while_training(server, process, runs: list[Path], logs: Path, deadline: float) -> bool:
    """Stop the tracking server once a run has logged to it, start it again once a run said it
    was unreachable; whether the outage met a run that was still training. That run, and those
    that start while the server is away, train on."""
    while not any((run / "mlflow_run.json").exists() for run in runs):
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()[-6000:]
        time.sleep(0.2)
    server.stop()
    while not any("unreachable" in log.read_text() for log in logs.glob("train/*/*/*.log")):
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()[-6000:]
        time.sleep(0.5)
    met_training = not all((run / "metrics.json").exists() for run in runs)
    server.start()
    return met_training


def test_tiny_study_through_the_slurm_profile(tmp_path, slurm_cluster, mlflow_server):
    """The study on SLURM, with its MLflow server stopped while the runs train and started again
    on the same store: the study completes and every metric the runs measured is in MLflow."""
    import mlflow

    # nodes of 8 (fake) GPUs: each job asks for its GPUs as on a GPU cluster; the workers compute on CPUs
    study = tiny_cluster_study(
        tracking={"uri": mlflow_server.uri, "experiment": "slurm-study"}, launcher={"gpus_per_node": 8}
    )
    since = time.strftime("%Y-%m-%dT%H:%M:%S")
    process = slurm_snakemake(tmp_path, study)
    names = run_names(study)
    runs_dirs = {name: tmp_path / "results/runs/{}/{}/seed0".format(*name.split("-")[:2]) for name in names}
    away_until_training_ended = restart_while_training(
        mlflow_server, process, list(runs_dirs.values()), tmp_path / "results/logs", time.monotonic() + 600
    )
    output = process.communicate(timeout=900)[0]
    assert process.returncode == 0, output[-6000:]
    assert away_until_training_ended  # the outage met a run that was still training

    states = sacct_states(names, since)
    assert states == {name: ["COMPLETED"] for name in names}, states
    # the other rules ran as SLURM jobs of Snakemake's executor, training as submitit's
    submitted = [line for line in output.splitlines() if "has been submitted with SLURM jobid" in line]
    assert any("/rule_evaluate/" in line for line in submitted) and any(
        "/rule_aggregate/" in line for line in submitted
    )
    assert not any("/rule_train/" in line for line in submitted)
    jobs = sacct_jobs(since)
    # a training job holds one GPU per worker
    assert sorted((name, gpus) for name, _, gpus in jobs if name in names) == sorted(
        (name, int(name.split("-")[1][1:])) for name in names
    ), jobs
    # in squeue and sacct Snakemake's jobs are the study's by name, and say their rule in their
    # comment; an evaluation holds one GPU (the run's kind of device), the other rules none
    snakemake_jobs = [(name, comment, gpus) for name, comment, gpus in jobs if name not in names]
    assert snakemake_jobs and all(name.startswith("dtstudy_") for name, _, _ in snakemake_jobs), snakemake_jobs
    evaluations = [gpus for _, comment, gpus in snakemake_jobs if comment.startswith("rule_evaluate_wildcards_")]
    assert evaluations == [1] * len(names), snakemake_jobs
    others = {comment: gpus for _, comment, gpus in snakemake_jobs if not comment.startswith("rule_evaluate")}
    assert {"rule_aggregate", "rule_project"} <= others.keys() and set(others.values()) == {0}, snakemake_jobs
    for name in names:
        strategy, workers, _ = name.split("-")
        run = runs_dirs[name]
        metrics, evaluation = read_json(run / "metrics.json"), read_json(run / "eval.json")
        assert metrics["environment"]["processes"] == int(workers[1:]) + (strategy == "ps_sync")
        assert metrics["images"] == metrics["steps"] * 32 * int(workers[1:])
        assert 0 < evaluation["top1"] <= 1
        # every point measured reached MLflow, those of the outage too
        client = mlflow.MlflowClient(mlflow_server.uri)
        run_id = read_json(run / "mlflow_run.json")["run_id"]
        logged = [m.step for m in client.get_metric_history(run_id, "train_loss")]
        every = study["train"]["log_every"]
        assert study["train"]["epochs"] == 1  # rank 0 logs the loss of every `every`-th step of the epoch
        assert sorted(logged) == [step for step in range(metrics["steps"]) if (step + 1) % every == 0] != []
        assert len(client.get_metric_history(run_id, "train_loss_mean")) == metrics["steps"]
    scaling = (tmp_path / "results/tables/scaling.csv").read_text().splitlines()
    assert len(scaling) == 1 + len(names)

    mlflow.set_tracking_uri(mlflow_server.uri)
    runs = mlflow.search_runs(experiment_names=["slurm-study"])
    assert sorted(runs["tags.dtstudy.kind"]) == ["study"] + ["training"] * len(names)
    trained = runs[runs["tags.dtstudy.kind"] == "training"]
    assert trained["metrics.test_top1"].notna().all() and (trained["status"] == "FINISHED").all()
    assert (trained["tags.mlflow.parentRunId"] == runs[runs["tags.dtstudy.kind"] == "study"].run_id.iloc[0]).all()


def test_interrupting_snakemake_cancels_the_slurm_jobs(tmp_path, slurm_cluster):
    # long enough to be interrupted while training: 200 epochs of the tiny data
    study = tiny_cluster_study(strategies=["allreduce"], workers=[2], train={"epochs": 200})
    names = run_names(study)
    process = slurm_snakemake(tmp_path, study, start_new_session=True)
    deadline = time.monotonic() + 240
    while not any(line.endswith("RUNNING") for line in queued(names)):
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()[-5000:]
        time.sleep(1)
    time.sleep(5)  # training for a few seconds
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole process group
    output = process.communicate(timeout=180)[0]
    assert process.returncode != 0
    deadline = time.monotonic() + 60
    while queued(names) and time.monotonic() < deadline:
        time.sleep(1)
    assert queued(names) == [], output[-3000:]
    assert not (tmp_path / "results/runs/allreduce/n2/seed0/metrics.json").exists()


def test_failing_training_job_reports_its_stderr_and_leaves_no_metrics(tmp_path, slurm_cluster):
    """A job that raises (CUDA asked for, no GPU in the job): Snakemake fails, its message
    names the job's stderr file, and no metrics.json is left to pass for a result."""
    study = tiny_cluster_study(strategies=["allreduce"], workers=[1], launcher={"device": "cuda"})
    process = slurm_snakemake(tmp_path, study)
    output = process.communicate(timeout=600)[0]
    assert process.returncode != 0
    stderr_files = list((tmp_path / "results/logs/submitit/allreduce/n1/seed0").glob("*_0_log.err"))
    assert len(stderr_files) == 1
    assert f"its stderr: {stderr_files[0]}" in output, output[-5000:]
    assert "sees no GPU" in stderr_files[0].read_text()
    assert not (tmp_path / "results/runs/allreduce/n1/seed0/metrics.json").exists()


def slurm_run(tmp_path, data_dir, launcher: dict, steps: int, stragglers=None):
    """One allreduce N=2 run through the launcher; returns (metrics, final state_dict, run folder)."""
    import torch
    from conftest import validated

    from dtstudy.common.run_folder import MODEL
    from dtstudy.config.study_config import run_config
    from dtstudy.launch.launcher import run_training_job
    from dtstudy.runspec import RunSpec

    study = validated(
        tiny_study(
            workers=[2],
            stragglers=stragglers or {},
            launcher=launcher,
            train={"epochs": 50, "max_steps": steps, "lr_scaling": "none", "base_lr": 0.1},
        )
    )
    out = tmp_path / launcher["cluster"]
    spec = RunSpec("allreduce", 2, 0, run_config(study, "allreduce"), str(data_dir), str(out))
    metrics = run_training_job(spec, out / "submitit", poll_s=0.5)
    return metrics, torch.load(out / MODEL, weights_only=True)["state_dict"], out


def release_requeued_jobs(name: str, stop) -> None:
    """SLURM holds a requeued job for 2 minutes (BeginTime); the test lets it start at once."""
    while not stop.is_set():
        out = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i %T %r"], capture_output=True, text=True).stdout
        for job_id, state, reason in (line.split() for line in out.splitlines()):
            if state == "PENDING" and reason == "BeginTime":
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
        stop.wait(1)


def test_a_run_longer_than_its_time_limit_is_requeued_and_ends_as_if_uninterrupted(tmp_path, tiny_data, slurm_cluster):
    """Time limit 2 min, SIGUSR2 45 s before it (SLURM sends it 45-75 s after the start: its
    time-limit checks are 30 s apart); a straggler delay stretches the run to about 100 s of
    training (sleeping changes no number). The requeued job resumes from its checkpoint and
    ends with the parameters and losses of an uninterrupted run."""
    import threading

    from conftest import assert_same_parameters

    steps = 450
    reference, reference_params, _ = slurm_run(tmp_path, tiny_data, {"cluster": "local"}, steps)

    stop = threading.Event()
    releaser = threading.Thread(target=release_requeued_jobs, args=("allreduce-n2-seed0", stop), daemon=True)
    releaser.start()
    try:
        launcher = {"cluster": "slurm", "timeout_min": 2, "signal_delay_s": 45, "max_requeues": 5, "device": "cpu"}
        metrics, params, out = slurm_run(
            tmp_path, tiny_data, launcher, steps, stragglers={"ranks": [0], "delay_ms": 200}
        )
    finally:
        stop.set()
        releaser.join()

    log = "".join(path.read_text() for path in (out / "submitit").glob("*_0_log.out"))
    assert "resumed from step" in log, log[-3000:]
    job_id = next((out / "submitit").glob("*_0_log.out")).name.split("_")[0]
    deadline = time.monotonic() + 60  # accounting lags the job's end by a few seconds
    while True:
        states = subprocess.run(
            ["sacct", "-D", "-X", "-n", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True, check=True
        ).stdout.split()
        if states[-1] not in ("RUNNING", "COMPLETING") or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert "REQUEUED" in states and states[-1] == "COMPLETED", states
    assert metrics["steps"] == reference["steps"] == steps
    assert metrics["train_loss"] == pytest.approx(reference["train_loss"], abs=1e-6)
    assert_same_parameters(params, reference_params, atol=1e-6)
    assert not (out / "resume").exists()


def slurm_task_pids(job_id: str, count: int, timeout_s: float = 120) -> dict[int, int]:
    """SLURM_PROCID -> pid of the job's Python tasks on this (the only) node."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tasks = {}
        for environ_path in Path("/proc").glob("[0-9]*/environ"):
            try:
                environ = dict(e.split(b"=", 1) for e in environ_path.read_bytes().split(b"\0") if b"=" in e)
                cmdline = (environ_path.parent / "cmdline").read_bytes()
            except OSError:
                continue
            if (
                environ.get(b"SLURM_JOB_ID") == job_id.encode()
                and b"submitit" in cmdline
                and b"SLURM_PROCID" in environ
            ):
                tasks[int(environ[b"SLURM_PROCID"])] = int(environ_path.parent.name)
        if len(tasks) == count:
            return tasks
        time.sleep(0.5)
    raise AssertionError(f"job {job_id}: found tasks {tasks}, expected {count}")


@pytest.mark.parametrize("strategy, victim", [("ps_sync", 1), ("allreduce", 1)])
def test_a_killed_task_fails_its_slurm_job_within_seconds(tmp_path, tiny_data, slurm_cluster, strategy, victim):
    """A task of a running SLURM job killed with SIGKILL (a process lost on a node): the run
    fails within a minute, far inside its time limit (10 min here, 12 h in
    config/cluster.yaml), naming the rank, and no task of the job is left in the queue."""
    from test_faults import FAIL_WITHIN_S, launch, start, wait_for_failure
    from test_pool import wait_for_output

    slurm = {
        "cluster": "slurm",
        "device": "cpu",
        "gpus_per_node": 0,
        "cpus_per_task": 1,
        "partition": None,
        "timeout_min": 10,
        "signal_delay_s": 60,
        "local_processes": "tasks",
    }
    command, out, _ = launch(tmp_path, tiny_data, strategy, launcher=slurm)
    launcher = start(command)
    seen = wait_for_output(launcher, r"img/s", timeout_s=240)
    job_id = re.search(r"submitted job (\d+)", seen).group(1)
    pids = slurm_task_pids(job_id, 3 if strategy == "ps_sync" else 2)
    killed_at = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    took, stderr = wait_for_failure(launcher, killed_at)
    print(f"SLURM {strategy}: rank {victim} killed, the run failed {took:.1f} s later")
    assert launcher.returncode != 0 and took < FAIL_WITHIN_S, (took, stderr)
    assert f"rank {victim}" in stderr, stderr
    assert not (out / "metrics.json").exists()
    deadline = time.monotonic() + 60
    while queued([f"{strategy}-n2-seed0"]) and time.monotonic() < deadline:
        time.sleep(1)
    assert queued([f"{strategy}-n2-seed0"]) == []


@pytest.mark.parametrize(
    "strategy, damaged",
    [(name, False) for name in STRATEGIES] + [("allreduce", True)],
    ids=[*STRATEGIES, "allreduce-damaged-checkpoint"],
)
def test_a_killed_task_is_resubmitted_and_the_run_ends_as_if_uninterrupted(
    tmp_path, tiny_data, slurm_cluster, strategy, damaged
):
    """A worker's task killed (SIGKILL) after a periodic checkpoint: the job fails within
    launcher.comm_timeout_s naming the rank, the launcher submits it again
    (launcher.max_resubmits), the new job resumes from the checkpoint (ps_sync: the shard's
    too), and the run ends with the metrics of an uninterrupted run of the same seed. An
    uninterrupted local run is the reference: the launcher's keys change no number.
    `damaged`: rank 0's newest checkpoint is truncated on disk before the new job starts: its
    checksum names it, the run resumes from the checkpoint before it, and ends the same."""
    from test_faults import CHECKPOINTED, SLOW, launch, start
    from test_pool import wait_for_output

    comm_timeout_s = 45  # the default
    slurm = {
        "cluster": "slurm",
        "device": "cpu",
        "gpus_per_node": 0,
        "cpus_per_task": 1,
        "partition": None,
        "timeout_min": 10,
        "signal_delay_s": 60,
        "comm_timeout_s": comm_timeout_s,
        "max_resubmits": 1,
    }
    command, out, _ = launch(tmp_path, tiny_data, strategy, train=CHECKPOINTED, launcher=slurm, stragglers=SLOW)
    since = time.strftime("%Y-%m-%dT%H:%M:%S")
    launcher = start(command)
    seen = wait_for_output(launcher, r"submitted job (\d+)", timeout_s=120)
    job_id = re.search(r"submitted job (\d+)", seen).group(1)
    pids = slurm_task_pids(job_id, 3 if strategy == "ps_sync" else 2)
    # damaged: a checkpoint before the newest must exist to resume from (every 5 steps: from 15 on)
    first_kill_step = r"(1[5-9]|[2-9]\d)" if damaged else r"(1\d|[2-9]\d)"
    seen += wait_for_output(launcher, rf"checkpoint at step {first_kill_step}\b", timeout_s=240)
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    seen += wait_for_output(launcher, r"resubmitting it", timeout_s=comm_timeout_s + 30)
    took = time.monotonic() - killed_at
    if damaged:  # the old job has ended; the new one is still starting (seconds before it reads it)
        newest = out / "resume" / "rank0.pt"
        newest.write_bytes(newest.read_bytes()[:-100])
    stdout, stderr = launcher.communicate(timeout=300)
    seen += stdout
    print(f"SLURM {strategy}: rank 1 killed, job {job_id} failed and was resubmitted {took:.1f} s later")
    assert launcher.returncode == 0, seen[-3000:] + stderr[-3000:]
    assert took < comm_timeout_s
    assert re.search(rf"job {job_id} failed: rank 1 was lost \(its process {pids[1]} on", seen), seen[-3000:]
    saved = [int(step) for step in re.findall(r"checkpoint at step (\d+)", seen.split("resubmitting it")[0])]
    resumed = re.search(r"^resumed from step (\d+) ", seen, re.M)
    assert resumed and int(resumed.group(1)) in saved and int(resumed.group(1)) > 0, seen[-3000:]
    if damaged:  # every rank has the checkpoint before the newest: the run resumes there
        assert "rank0.pt is damaged" in seen and int(resumed.group(1)) < saved[-1], seen[-3000:]
    states = final_states(f"{strategy}-n2-seed0", since)
    assert states == ["FAILED", "COMPLETED"], states  # the killed job, the resubmitted one

    assert_ends_as_uninterrupted(tmp_path, tiny_data, strategy, out, SLOW)


def assert_ends_as_uninterrupted(tmp_path, tiny_data, strategy: str, out: Path, stragglers: dict) -> dict:
    """The interrupted run in `out` (test_faults.launch, CHECKPOINTED) has the metrics of an
    uninterrupted local run of the same seed (the launcher's keys change no number) and left
    no resume folder; returns its metrics."""
    from test_faults import CHECKPOINTED, launch

    reference_command, reference_out, _ = launch(
        tmp_path, tiny_data, strategy, "reference", train=CHECKPOINTED, stragglers=stragglers
    )
    reference = subprocess.run(reference_command, capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    metrics, expected = read_json(out / "metrics.json"), read_json(reference_out / "metrics.json")
    assert metrics["steps"] == expected["steps"] == CHECKPOINTED["max_steps"]
    assert metrics["train_loss"] == expected["train_loss"]
    assert [v["top1"] for v in metrics["val"]] == [v["top1"] for v in expected["val"]] != []
    assert metrics["final_val_top1"] == expected["final_val_top1"]
    assert not (out / "resume").exists()
    return metrics


def test_a_launcher_started_again_waits_for_the_job_its_lost_predecessor_left_running(
    tmp_path, tiny_data, slurm_cluster
):
    """The login node's launcher of a run killed while its job trains (Snakemake killed, the
    SSH session closed): the job goes on, and the run's next launcher (Snakemake started
    again) waits for that job instead of submitting a second one; the run ends with its
    metrics and one SLURM job. A job that trains another config (the study edited meanwhile)
    is cancelled, and the run submitted afresh."""
    from test_faults import launch, start
    from test_pool import wait_for_output

    slurm = {
        "cluster": "slurm",
        "device": "cpu",
        "gpus_per_node": 0,
        "cpus_per_task": 1,
        "partition": None,
        "timeout_min": 10,
        "signal_delay_s": 60,
    }
    train = {"max_steps": 100, "batch_size": 32, "log_every": 5}
    slow = {"ranks": [1], "delay_ms": 150, "distribution": "fixed"}  # about 15 s of training
    name = "allreduce-n2-seed0"

    def lose_launcher(command: list[str]) -> str:
        launcher = start(command)
        seen = wait_for_output(launcher, r"img/s", timeout_s=240)
        launcher.kill()  # SIGKILL: no handler runs, the job is not cancelled
        launcher.wait()
        return re.search(r"submitted job (\d+)", seen).group(1)

    since = time.strftime("%Y-%m-%dT%H:%M:%S")
    command, out, _ = launch(tmp_path, tiny_data, "allreduce", train=train, launcher=slurm, stragglers=slow)
    job_id = lose_launcher(command)
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert re.search(
        rf"job {job_id}, submitted by an earlier launcher of this run, is still (RUNNING|PENDING): "
        "waiting for it rather than submitting another",
        again.stdout,
    ), again.stdout[-3000:]
    assert "submitted job" not in again.stdout
    assert read_json(out / "metrics.json")["steps"] == train["max_steps"]
    assert not (tmp_path / "run-job" / "active_job.json").exists()
    assert final_states(name, since) == ["COMPLETED"]

    time.sleep(1)  # sacct's -S has a resolution of seconds
    since = time.strftime("%Y-%m-%dT%H:%M:%S")
    old_job = lose_launcher(command)
    command, out, _ = launch(
        tmp_path, tiny_data, "allreduce", train={**train, "base_lr": 0.07}, launcher=slurm, stragglers=slow
    )
    edited = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert edited.returncode == 0, edited.stdout[-3000:] + edited.stderr[-3000:]
    assert (
        f"cancelling job {old_job}, submitted by an earlier launcher of this run: it trains another config"
        in edited.stdout
    ), edited.stdout[-3000:]
    assert re.search(r"submitted job (\d+)", edited.stdout).group(1) != old_job
    assert read_json(out / "metrics.json")["config"]["train"]["base_lr"] == 0.07
    assert final_states(name, since) == ["CANCELLED", "COMPLETED"]
