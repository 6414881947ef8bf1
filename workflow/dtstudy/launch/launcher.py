"""Submit one training run as a submitit job and block until it ends. Torch-free: on a SLURM
login node one waiting launcher per run costs a small Python process, not a torch import.

What differs between a local job and a SLURM job (the job's parameters, the environment its
tasks take, whether a lost process means a new job, how a job an earlier launcher left running
is found) is the run's launch backend's (dtstudy.launch_backends, chosen by launcher.cluster);
this module takes a job through its attempts: submit, wait, resubmit. Locally the job is one
light task that has the study's warm pool (dtstudy.launch.pool) fork the run's N workers and a
strategy's extra processes; on SLURM it is one task per process (one per GPU). Interrupting the
caller (SIGINT/SIGTERM, as Snakemake does on Ctrl-C) cancels the job.

On SLURM a job that failed because it lost a process or its node (a rank recorded lost by
dtstudy.launch.process_group.PeerWatch, or the job's state NODE_FAIL) is submitted again, up to
launcher.max_resubmits times, when the run's resume folder holds a checkpoint of every worker
(train.checkpoint_every_min): the new job resumes from it (dtstudy.training.checkpoint). Any other
failure (an error in the training code, a bad setting) ends the run at once: a resubmission
would meet it again.

On SLURM a launcher that is lost while its job runs (Snakemake killed, the login session
closed without screen or tmux) leaves the job running; the run's job folder records it
(dtstudy.launch_backends.slurm.ACTIVE_JOB_FILE), and the next launcher of the run waits on that
job instead of submitting a second one, when the job trains the same config (else it cancels it
first).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import signal
import sys
import time
from pathlib import Path

from dtstudy.common.ports import free_port
from dtstudy.config.study_config import results_sha256
from dtstudy.launch.job import PooledTrainingJob, TrainingJob
from dtstudy.launch.pool.client import pool_address
from dtstudy.launch_backends.base import cancel_and_wait
from dtstudy.launch_backends.registry import launch_backend
from dtstudy.runspec import RunSpec, lost_rank_path
from dtstudy.tracking.live_run import recorded_run

NODE_FAIL = "NODE_FAIL"  # SLURM's state of a job whose node failed


class TrainingJobFailed(RuntimeError):
    """A run's job ended without its metrics; the message names the job's stderr file."""


def job_parameters(spec: RunSpec, pooled: bool = False, time_limit_min: int | None = None) -> dict:
    """submitit parameters of a run's job: the N workers (one per GPU on a GPU cluster) plus
    the strategy's extra processes as further tasks, over the fewest nodes that hold them, and
    what the run's launch backend adds (LaunchBackend.job_parameters). `pooled`: one task, the
    pool forks the processes. `time_limit_min`: the job's time limit (dtstudy.projection.budget's
    prediction); None = launcher.timeout_min."""
    launcher = spec.config["launcher"]
    layout = spec.layout()
    parameters = {
        "name": spec.run_name,
        "timeout_min": launcher["timeout_min"] if time_limit_min is None else time_limit_min,
        "nodes": 1 if pooled else layout.nodes,
        "tasks_per_node": 1 if pooled else layout.tasks_per_node,
    }
    return {**parameters, **launch_backend(spec.config).job_parameters(launcher, layout.workers_per_node)}


def make_executor(spec: RunSpec, job_dir: Path, pooled: bool = False, time_limit_min: int | None = None):
    parameters = job_parameters(spec, pooled, time_limit_min)
    return launch_backend(spec.config).executor(job_dir, spec.config["launcher"], parameters)


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


def run_training_job(
    spec: RunSpec, job_dir: str | Path, poll_s: float = 0.05, time_limit_min: int | None = None
) -> dict:
    """Run the job to its end; return rank 0's metrics. Raises on failure (metrics.json absent,
    the run's MLflow run marked FAILED). On SLURM a job that lost a process or its node is
    submitted again to resume from the run's checkpoint (resubmission_refused says when it is
    not). `time_limit_min`: job_parameters'."""
    run = RunLauncher(spec, Path(job_dir), poll_s, time_limit_min)
    with run.cancelled_on_signal():
        run.start()
        while (lost := run.wait()) is not None:
            run.resubmit(lost)  # or raises TrainingJobFailed
        metrics = run.results()
    return run.checked(metrics)


class RunLauncher:
    """One run's job through its attempts: submitted (or the one an earlier launcher left
    running, waited on), followed to its end, submitted again after a loss its backend
    resubmits."""

    def __init__(self, spec: RunSpec, job_dir: Path, poll_s: float, time_limit_min: int | None):
        timings = {"submitted": time.time()}
        self.spec, self.job_dir, self.poll_s, self.time_limit_min = spec, job_dir, poll_s, time_limit_min
        job_dir.mkdir(parents=True, exist_ok=True)
        spec.folder.metrics.unlink(missing_ok=True)  # a stale file must not pass for this run's result
        self.backend = launch_backend(spec.config)
        if self.backend.emulated:  # not a job: `python -m dtstudy train` runs it in-process
            raise ValueError(
                f"{spec.run_name}: launcher.cluster {self.backend.kind!r} runs in the calling "
                "process (dtstudy.emulation.runner.run_emulated), not as a submitit job"
            )
        # spec.folder.resume stays: a run that died resumes from its last checkpoint (dtstudy.training.checkpoint;
        # a finished run leaves none, and state of another config is not used)
        launcher = spec.config["launcher"]
        self.pooled = self.backend.uses_pool(launcher)
        self.max_resubmits, self.resubmissions = self.backend.max_resubmits(launcher), 0
        if not self.pooled and not self.backend.port_from_master_task:
            # the tasks inherit it (submitit reads it); a SLURM job picks one on its first node
            # (launch.process_group.rendezvous_port)
            os.environ["MASTER_PORT"] = str(free_port())
        self.job = None
        environ = self.backend.job_environment()
        self.callable = (
            PooledTrainingJob(spec, pool_address(), timings, environ)
            if self.pooled
            else TrainingJob(spec, timings, environ)
        )

    @functools.cached_property
    def config_sha256(self) -> str:
        return results_sha256(self.spec.config)

    @contextlib.contextmanager
    def cancelled_on_signal(self):
        """SIGINT and SIGTERM cancel the job while the block runs. Installed before the job
        starts: a local job's processes then get SIGINT's default disposition even where ours
        was inherited as "ignored" (a shell's `&`), and cancel works."""

        def cancel(signum, _frame):
            if self.job is not None:
                print(f"{self.spec.run_name}: signal {signum}, cancelling job {self.job.job_id}", flush=True)
                cancel_and_wait(self.job, wait_s=30)
            raise SystemExit(128 + signum)

        previous = {sig: signal.signal(sig, cancel) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.job is not None and self.job.done():  # a launcher lost mid-wait leaves the record to the next one
                self.backend.forget_job(self.job_dir)

    def start(self) -> None:
        """Wait on the run's job that an earlier launcher left running, else submit one."""
        self.job = self.backend.running_job(self.job_dir, self.spec.run_name, self.config_sha256)
        if self.job is None:
            self.submit()
            return
        print(
            f"{self.spec.run_name}: job {self.job.job_id}, submitted by an earlier launcher of this run, is still "
            f"{self.job.state}: waiting for it rather than submitting another; logs in {self.job_dir}",
            flush=True,
        )

    def submit(self) -> None:
        spec = self.spec
        spec.folder.mlflow_run.unlink(missing_ok=True)  # an earlier MLflow run is not marked
        self.job = make_executor(spec, self.job_dir, self.pooled, self.time_limit_min).submit(self.callable)
        what = (
            f"1 task (the warm pool forks its {spec.processes()} processes)"
            if self.pooled
            else f"{spec.processes()} tasks"
        )
        print(f"{spec.run_name}: submitted job {self.job.job_id} with {what}; logs in {self.job_dir}", flush=True)
        self.backend.record_job(self.job_dir, self.job, spec.run_name, self.config_sha256)

    def wait(self) -> str | None:
        """Follow the job's log to its end; what it lost (lost_process), None when nothing."""
        wait_until_done(self.job, _LogFollower(Path(self.job.paths.stdout)), self.poll_s)
        return lost_process(self.job)

    def resubmit(self, lost: str) -> None:
        """Submit the job that lost `lost` again, to resume from the run's checkpoint;
        TrainingJobFailed when it is not (resubmission_refused)."""
        spec, job = self.spec, self.job
        # known at once: no need to wait for result files (submitit: 15 s)
        mark_failed(spec, f"job {job.job_id} failed: {lost}")
        why_not = resubmission_refused(spec, self.resubmissions, self.max_resubmits)
        if why_not is not None:
            raise TrainingJobFailed(
                f"{spec.run_name}: job {job.job_id} failed; {lost}; rank 0's stderr: {job.paths.stderr}{why_not}"
            )
        self.resubmissions += 1
        print(
            f"{spec.run_name}: job {job.job_id} failed: {lost}; resubmitting it to resume from the "
            f"checkpoint in {spec.folder.resume} (resubmission {self.resubmissions} of at most "
            f"{self.max_resubmits}, launcher.max_resubmits)",
            flush=True,
        )
        self.submit()

    def results(self) -> dict | None:
        """Rank 0's result as the ended job returns it; TrainingJobFailed when the job failed."""
        import submitit

        job = self.job
        try:
            return job.results()[0]
        except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as error:
            mark_failed(self.spec, f"job {job.job_id} failed (state {job.state}): {_cause(str(error))}")
            raise TrainingJobFailed(
                f"{self.spec.run_name}: job {job.job_id} failed (state {job.state}); its stderr: {job.paths.stderr}\n"
                f"{error}"
            ) from None

    def checked(self, metrics: dict | None) -> dict:
        """`metrics`, once the run's metrics.json is there; TrainingJobFailed when not."""
        metrics_path, job = self.spec.folder.metrics, self.job
        if metrics is None or not metrics_path.exists():
            mark_failed(self.spec, f"job {job.job_id} ended without writing {metrics_path}")
            raise TrainingJobFailed(
                f"{self.spec.run_name}: job {job.job_id} ended without writing {metrics_path}; "
                f"its stderr: {job.paths.stderr}"
            )
        return metrics


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
    if not launch_backend(spec.config).resubmits:
        return ""
    if attempt >= max_resubmits:
        return f"; not resubmitted: launcher.max_resubmits is {max_resubmits}" + (
            f" and it was resubmitted {attempt} times" if attempt else ""
        )
    missing = missing_checkpoints(spec)
    if missing:
        return (
            f"; not resubmitted: no checkpoint to resume from in {spec.folder.resume} "
            f"({missing}; train.checkpoint_every_min)"
        )
    return None


def missing_checkpoints(spec: RunSpec) -> str:
    """Which workers have no checkpoint file in the run's resume folder ("" when every one has).
    Only that the files are there: the resumed job checks them (run, config, sha256) and starts
    from step 0 if none is usable, saying why."""
    folder = spec.folder
    missing = [
        folder.rank_file(rank).name
        for rank in range(spec.workers)
        if not (folder.rank_file(rank).exists() or folder.previous_rank_file(rank).exists())
    ]
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
