"""Submit one training run as a submitit job and block until it ends. Torch-free: on a SLURM
login node one waiting launcher per run costs a small Python process, not a torch import.

Locally (launcher.cluster: local) the job is one light task that has the study's warm pool
(dtstudy.launch.pool) fork the run's N workers and a strategy's extra processes; on SLURM it is one
task per process (one per GPU). Interrupting the caller (SIGINT/SIGTERM, as Snakemake does
on Ctrl-C) cancels the job.

On SLURM a job that failed because it lost a process or its node (a rank recorded lost by
dtstudy.launch.process_group.PeerWatch, or the job's state NODE_FAIL) is submitted again, up to
launcher.max_resubmits times, when the run's resume folder holds a checkpoint of every worker
(train.checkpoint_every_min): the new job resumes from it (dtstudy.training.checkpoint). Any other
failure (an error in the training code, a bad setting) ends the run at once: a resubmission
would meet it again.

On SLURM a launcher that is lost while its job runs (Snakemake killed, the login session
closed without screen or tmux) leaves the job running; the run's job folder records it
(ACTIVE_JOB_FILE), and the next launcher of the run waits on that job instead of submitting a
second one, when the job trains the same config (else it cancels it first).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import time
from pathlib import Path

from dtstudy.common.atomic_files import write_json
from dtstudy.config.study_config import results_sha256
from dtstudy.launch.job import launcher_environment, PooledTrainingJob, TrainingJob
from dtstudy.launch.pool.client import pool_address
from dtstudy.common.ports import free_port
from dtstudy.tracking.live_run import recorded_run
from dtstudy.runspec import lost_rank_path, RunSpec

NODE_FAIL = "NODE_FAIL"  # SLURM's state of a job whose node failed
#: in a run's job folder while its launcher waits on its SLURM job: the job and the config it trains
ACTIVE_JOB_FILE = "active_job.json"


class TrainingJobFailed(RuntimeError):
    """A run's job ended without its metrics; the message names the job's stderr file."""


def uses_pool(spec: RunSpec) -> bool:
    """Local runs go through the warm pool (launcher.local_processes: pool, the default);
    `tasks` starts one submitit task per process instead, as on SLURM."""
    launcher = spec.config["launcher"]
    return launcher["cluster"] == "local" and launcher["local_processes"] == "pool"


def job_parameters(spec: RunSpec, pooled: bool = False, time_limit_min: int | None = None) -> dict:
    """submitit parameters of a run's job: the N workers (one per GPU on a GPU cluster) plus
    the strategy's extra processes as further tasks, over the fewest nodes that hold them;
    each node asks for the GPUs its workers use, no more. `pooled`: one task, the pool forks
    the processes. `time_limit_min`: the job's time limit (dtstudy.projection.budget's
    prediction); None = launcher.timeout_min."""
    launcher = spec.config["launcher"]
    layout = spec.layout()
    parameters = {
        "name": spec.run_name,
        "timeout_min": launcher["timeout_min"] if time_limit_min is None else time_limit_min,
        "nodes": 1 if pooled else layout.nodes,
        "tasks_per_node": 1 if pooled else layout.tasks_per_node,
    }
    # SIGUSR2 this long before the time limit: the run checkpoints and is requeued
    if launcher["cluster"] == "local":
        # AutoExecutor knows this key only for SLURM; make_executor hands it to the local one
        parameters["signal_delay_s"] = launcher["signal_delay_s"]
        return parameters
    parameters["slurm_signal_delay_s"] = launcher["signal_delay_s"]
    # a task that fails (or sees a peer lost, dtstudy.launch.process_group.PeerWatch) ends the whole
    # job at once, rather than leaving its siblings to hold their GPUs until a time-out
    parameters["slurm_srun_args"] = ["--kill-on-bad-exit=1"]
    parameters["cpus_per_task"] = launcher["cpus_per_task"]
    if launcher["gpus_per_node"]:
        # one GPU per worker on its node: N=1 holds one GPU, not the node's; the shards
        # (extra tasks) compute on CPUs and take none
        gpus = layout.workers_per_node
        if launcher["gpu_request"] == "gres":
            parameters["slurm_gres"] = f"gpu:{gpus}"
        else:
            parameters["gpus_per_node"] = gpus
    if launcher["mem_gb"] is not None:
        parameters["mem_gb"] = launcher["mem_gb"]
    for key in ("partition", "account", "qos", "constraint"):
        if launcher[key] is not None:
            parameters[f"slurm_{key}"] = launcher[key]
    if launcher["additional_parameters"]:
        parameters["slurm_additional_parameters"] = dict(launcher["additional_parameters"])
    return parameters


def evaluation_job_resources(launcher: dict) -> dict:
    """The resources (snakemake-executor-plugin-slurm's names) of a run's `evaluate` job on a
    GPU cluster: one GPU of the training runs' kind, on their partition, account, qos and
    constraint, with the CPUs of a training task and one GPU's share of a node's memory, so that the test pass decodes
    with the same loader workers on the run's kind of device (dtstudy.training.evaluate). None
    extra for a local, emulated or CPU-only study: the profile's default resources apply."""
    if launcher["cluster"] != "slurm" or not launcher["gpus_per_node"]:
        return {}
    resources = {"gres": "gpu:1"} if launcher["gpu_request"] == "gres" else {"gpu": 1}
    resources["cpus_per_task"] = launcher["cpus_per_task"]
    if launcher["mem_gb"] is not None:  # a node's memory for its training tasks: one GPU's share of it
        resources["mem_mb"] = math.ceil(launcher["mem_gb"] * 1024 / launcher["gpus_per_node"])  # --mem=XG: X * 1024 MB
    for key, resource in (("partition", "slurm_partition"), ("account", "slurm_account"),
                          ("qos", "qos"), ("constraint", "constraint")):
        if launcher[key] is not None:
            resources[resource] = launcher[key]
    return resources


def make_executor(spec: RunSpec, job_dir: Path, pooled: bool = False, time_limit_min: int | None = None):
    import submitit

    launcher = spec.config["launcher"]
    # a requeue after a time-out counts against max_requeues; preemptions do not (submitit)
    executor = submitit.AutoExecutor(folder=job_dir, cluster=launcher["cluster"],
                                     slurm_max_num_timeout=launcher["max_requeues"])
    parameters = job_parameters(spec, pooled, time_limit_min)
    if launcher["cluster"] == "local":
        # AutoExecutor would rename signal_delay_s to slurm_signal_delay_s (and it rejects
        # local_signal_delay_s), leaving the local controller at its default
        executor._executor.update_parameters(**parameters)
    else:
        executor.update_parameters(**parameters)
    return executor


class _LogFollower:
    """Copies what rank 0 prints into our stdout, so the rule's log shows progress."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def pump(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            chunk = handle.read()
        self.offset += len(chunk)
        if chunk:
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()


def run_training_job(spec: RunSpec, job_dir: str | Path, poll_s: float = 0.05, time_limit_min: int | None = None) -> dict:
    """Run the job to its end; return rank 0's metrics. Raises on failure (metrics.json absent,
    the run's MLflow run marked FAILED). On SLURM a job that lost a process or its node is
    submitted again to resume from the run's checkpoint (resubmission_refused says when it is
    not). `time_limit_min`: job_parameters'."""
    import submitit

    submitted_at = time.time()
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = spec.folder.metrics
    metrics_path.unlink(missing_ok=True)  # a stale file must not pass for this run's result
    if spec.config["launcher"]["cluster"] == "emulate":  # not a job: `python -m dtstudy train` runs it in-process
        raise ValueError(f"{spec.run_name}: launcher.cluster 'emulate' runs in the calling process "
                         "(dtstudy.emulation.runner.run_emulated), not as a submitit job")
    # spec.folder.resume stays: a run that died resumes from its last checkpoint (dtstudy.training.checkpoint;
    # a finished run leaves none, and state of another config is not used)
    pooled = uses_pool(spec)
    launcher = spec.config["launcher"]
    # locally a run that died resumes when it is started again (snakemake --rerun-incomplete)
    max_resubmits = launcher["max_resubmits"] if launcher["cluster"] == "slurm" else 0

    if launcher["cluster"] == "local" and not pooled:
        # the tasks inherit it (submitit reads it); a SLURM job picks one on its first node
        # (launch.process_group.rendezvous_port)
        os.environ["MASTER_PORT"] = str(free_port())
    job = None

    def cancel(signum, _frame):
        if job is not None:
            print(f"{spec.run_name}: signal {signum}, cancelling job {job.job_id}", flush=True)
            cancel_and_wait(job, wait_s=30)
        raise SystemExit(128 + signum)

    # Installed before the job starts: a local job's processes then get SIGINT's default
    # disposition even where ours was inherited as "ignored" (a shell's `&`), and cancel works.
    previous = {sig: signal.signal(sig, cancel) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        timings = {"submitted": submitted_at}
        environ = launcher_environment(launcher["cluster"])
        if pooled:
            callable_ = PooledTrainingJob(spec, pool_address(), timings, environ)
        else:
            callable_ = TrainingJob(spec, timings, environ)
        what = f"1 task (the warm pool forks its {spec.processes()} processes)" if pooled else f"{spec.processes()} tasks"
        job = running_job(spec, job_dir) if launcher["cluster"] == "slurm" else None
        for attempt in range(max_resubmits + 1):
            if attempt == 0 and job is not None:
                print(f"{spec.run_name}: job {job.job_id}, submitted by an earlier launcher of this run, is still "
                      f"{job.state}: waiting for it rather than submitting another; logs in {job_dir}", flush=True)
            else:
                spec.folder.mlflow_run.unlink(missing_ok=True)  # an earlier MLflow run is not marked
                job = make_executor(spec, job_dir, pooled, time_limit_min).submit(callable_)
                print(f"{spec.run_name}: submitted job {job.job_id} with {what}; logs in {job_dir}", flush=True)
                if launcher["cluster"] == "slurm":
                    write_json(job_dir / ACTIVE_JOB_FILE, {"job_id": job.job_id, "run_name": spec.run_name,
                                                           "config_sha256": results_sha256(spec.config)})
            follower = _LogFollower(Path(job.paths.stdout))
            wait_until_done(job, follower, poll_s)
            lost = lost_process(job)
            if lost is None:
                break
            # known at once: no need to wait for result files (submitit: 15 s)
            mark_failed(spec, f"job {job.job_id} failed: {lost}")
            why_not = resubmission_refused(spec, attempt, max_resubmits)
            if why_not is not None:
                raise TrainingJobFailed(f"{spec.run_name}: job {job.job_id} failed; {lost}; "
                                        f"rank 0's stderr: {job.paths.stderr}{why_not}")
            print(f"{spec.run_name}: job {job.job_id} failed: {lost}; resubmitting it to resume from the "
                  f"checkpoint in {spec.folder.resume} (resubmission {attempt + 1} of at most {max_resubmits}, "
                  f"launcher.max_resubmits)", flush=True)
        try:
            results = job.results()
        except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as error:
            mark_failed(spec, f"job {job.job_id} failed (state {job.state}): {_cause(str(error))}")
            raise TrainingJobFailed(
                f"{spec.run_name}: job {job.job_id} failed (state {job.state}); its stderr: {job.paths.stderr}\n"
                f"{error}"
            ) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if job is not None and job.done():  # a launcher lost mid-wait leaves the record to the next one
            (job_dir / ACTIVE_JOB_FILE).unlink(missing_ok=True)
    metrics = results[0]
    if metrics is None or not metrics_path.exists():
        mark_failed(spec, f"job {job.job_id} ended without writing {metrics_path}")
        raise TrainingJobFailed(f"{spec.run_name}: job {job.job_id} ended without writing {metrics_path}; "
                                f"its stderr: {job.paths.stderr}")
    return metrics


def cancel_and_wait(job, wait_s: float) -> None:
    """Cancel a submitit job (SLURM: scancel; local: SIGINT to the job's controller) and wait
    up to `wait_s` for it to end, asking the scheduler afresh each time."""
    job.cancel(check=False)
    deadline = time.monotonic() + wait_s
    while not job.done(force_check=True) and time.monotonic() < deadline:
        time.sleep(0.5)


def running_job(spec: RunSpec, job_dir: Path):
    """The run's SLURM job that an earlier launcher submitted and that has not ended (the
    launcher was lost: Snakemake killed, the login session closed), as a submitit job to wait
    on; None when there is none. A job that trains another config than `spec`'s (the study was
    edited since) is cancelled, and None returned: the run is submitted afresh."""
    import submitit

    record_path = job_dir / ACTIVE_JOB_FILE
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        return None
    job = submitit.SlurmJob(folder=job_dir, job_id=str(record["job_id"]), tasks=(0,))
    if job.done(force_check=True):
        record_path.unlink(missing_ok=True)
        return None
    if record.get("config_sha256") != results_sha256(spec.config):
        print(f"{spec.run_name}: cancelling job {job.job_id}, submitted by an earlier launcher of this run: it "
              "trains another config", flush=True)
        cancel_and_wait(job, wait_s=60)
        record_path.unlink(missing_ok=True)
        return None
    return job


LOST_RANK_CHECK_S = 1.0  # how often SLURM is asked whether a job that recorded a lost rank has ended


def wait_until_done(job, follower: _LogFollower, poll_s: float) -> None:
    """Follow the job's log until it ends. submitit asks SLURM every half of the job's age (up
    to 10 min); once a process recorded a lost rank the job is ending (srun --kill-on-bad-exit),
    so SLURM is asked every LOST_RANK_CHECK_S: the run fails within seconds, not minutes."""
    lost_record = lost_rank_path(job.paths.folder, job.job_id)
    asked_at = -math.inf
    while True:
        force = lost_record.exists() and time.monotonic() - asked_at >= LOST_RANK_CHECK_S
        if force:
            asked_at = time.monotonic()
        if job.done(force_check=force):
            break
        follower.pump()
        time.sleep(poll_s)
    follower.pump()


def lost_process(job) -> str | None:
    """What a failed job lost: a rank (`lost_rank`) or, on SLURM, its node; None when it lost
    neither (it finished, or failed for another reason)."""
    lost = lost_rank(job)
    if lost is None and job.state == NODE_FAIL:
        lost = f"its node failed (SLURM state {NODE_FAIL})"
    return lost


def resubmission_refused(spec: RunSpec, attempt: int, max_resubmits: int) -> str | None:
    """Why a job that lost a process is not submitted again, as the end of the launcher's
    error ("" on a local machine, where starting the run again resumes it); None when it is.
    A resubmission needs one left and a checkpoint to resume from: without one the new job
    would start from step 0, and a loss that recurs (the out-of-memory killer) would repeat
    the whole run."""
    if spec.config["launcher"]["cluster"] != "slurm":
        return ""
    if attempt >= max_resubmits:
        return f"; not resubmitted: launcher.max_resubmits is {max_resubmits}" + (
            f" and it was resubmitted {attempt} times" if attempt else "")
    missing = missing_checkpoints(spec)
    if missing:
        return (f"; not resubmitted: no checkpoint to resume from in {spec.folder.resume} "
                f"({missing}; train.checkpoint_every_min)")
    return None


def missing_checkpoints(spec: RunSpec) -> str:
    """Which workers have no checkpoint file in the run's resume folder ("" when every one has).
    Only that the files are there: the resumed job checks them (run, config, sha256) and starts
    from step 0 if none is usable, saying why."""
    folder = spec.folder
    missing = [folder.rank_file(rank).name for rank in range(spec.workers)
               if not (folder.rank_file(rank).exists() or folder.previous_rank_file(rank).exists())]
    return f"{', '.join(missing)} missing" if missing else ""


def lost_rank(job) -> str | None:
    """Which rank a failed job lost and where its log is, as the process that saw it recorded
    (dtstudy.launch.process_group.PeerWatch); None when no process recorded one."""
    path = lost_rank_path(job.paths.folder, job.job_id)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    path.unlink(missing_ok=True)  # a local job id is a pid: a later job may get it again
    return f"rank {record['rank']} was lost ({record['why']}); its log: {record['log']}"


def _cause(job_error: str) -> str:
    """The line of a failed job's error that says what went wrong (the exception's message)."""
    lines = [line.strip() for line in job_error.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Exit)\b.*:", line):
            return line
    return lines[0] if lines else "unknown"


def mark_failed(spec: RunSpec, reason: str) -> None:
    """Record why the attempt failed on its MLflow run (when it got as far as creating one),
    and end it as FAILED if its rank 0 could not (a killed process). Imports MLflow only here."""
    record = recorded_run(spec.out_dir)
    if record is None:
        return
    try:
        from dtstudy.tracking import mlflow_store

        mlflow_store.end_run(record["tracking_uri"], record["run_id"], "FAILED", reason)
    except Exception as error:  # the training failure is what the user must see
        print(f"{spec.run_name}: could not mark MLflow run {record['run_id']} FAILED: {error}", flush=True)
