"""Submit one training run as a submitit job and block until it ends.

Locally (launcher.cluster: local) submitit's LocalExecutor starts one process per task:
the N workers plus a strategy's extra processes. Interrupting the caller (SIGINT/SIGTERM,
as Snakemake does on Ctrl-C) cancels the job.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from . import resume
from .distributed import free_port
from .train import METRICS_FILE, RunSpec, TrainingJob


class TrainingJobFailed(RuntimeError):
    """A run's job ended without its metrics; the message names the job's stderr file."""


def job_parameters(spec: RunSpec) -> dict:
    """submitit parameters of a run's job: the N workers (one per GPU on a GPU cluster) plus
    the strategy's extra processes as further tasks, over the fewest nodes that hold them."""
    launcher = spec.config["launcher"]
    layout = spec.layout()
    parameters = {
        "name": spec.run_name,
        "timeout_min": launcher["timeout_min"],
        "nodes": layout.nodes,
        "tasks_per_node": layout.tasks_per_node,
    }
    # SIGUSR2 this long before the time limit: the run checkpoints and is requeued
    if launcher["cluster"] == "local":
        # AutoExecutor knows this key only for SLURM; make_executor hands it to the local one
        parameters["signal_delay_s"] = launcher["signal_delay_s"]
        return parameters
    parameters["slurm_signal_delay_s"] = launcher["signal_delay_s"]
    parameters["cpus_per_task"] = launcher["cpus_per_task"]
    if launcher["gpus_per_node"]:
        parameters["gpus_per_node"] = launcher["gpus_per_node"]
    if launcher["mem_gb"] is not None:
        parameters["mem_gb"] = launcher["mem_gb"]
    for key in ("partition", "account", "qos", "constraint"):
        if launcher[key] is not None:
            parameters[f"slurm_{key}"] = launcher[key]
    if launcher["additional_parameters"]:
        parameters["slurm_additional_parameters"] = dict(launcher["additional_parameters"])
    return parameters


def make_executor(spec: RunSpec, job_dir: Path):
    import submitit

    launcher = spec.config["launcher"]
    # a requeue after a time-out counts against max_requeues; preemptions do not (submitit)
    executor = submitit.AutoExecutor(folder=job_dir, cluster=launcher["cluster"],
                                     slurm_max_num_timeout=launcher["max_requeues"])
    parameters = job_parameters(spec)
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


def run(spec: RunSpec, job_dir: str | Path, poll_s: float = 1.0) -> dict:
    """Run the job to its end; return rank 0's metrics. Raises on failure (metrics.json absent)."""
    import submitit

    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = Path(spec.out_dir) / METRICS_FILE
    metrics_path.unlink(missing_ok=True)  # a stale file must not pass for this run's result
    resume.clear(spec.out_dir)  # a fresh run never picks up an earlier run's resume state

    if spec.config["launcher"]["cluster"] == "local":
        # the tasks inherit it (submitit reads it); a SLURM job picks one on its first node
        # (distributed.rendezvous_port)
        os.environ["MASTER_PORT"] = str(free_port())
    job = None

    def cancel(signum, _frame):
        if job is not None:
            print(f"{spec.run_name}: signal {signum}, cancelling job {job.job_id}", flush=True)
            job.cancel(check=False)  # SLURM: scancel; local: SIGINT to the job's controller
            deadline = time.monotonic() + 30
            while not job.done() and time.monotonic() < deadline:
                time.sleep(0.2)
        raise SystemExit(128 + signum)

    # Installed before the job starts: a local job's processes then get SIGINT's default
    # disposition even where ours was inherited as "ignored" (a shell's `&`), and cancel works.
    previous = {sig: signal.signal(sig, cancel) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        job = make_executor(spec, job_dir).submit(TrainingJob(spec))
        print(f"{spec.run_name}: submitted job {job.job_id} with {spec.processes()} tasks; logs in {job_dir}",
              flush=True)
        follower = _LogFollower(Path(job.paths.stdout))
        while not job.done():
            follower.pump()
            time.sleep(poll_s)
        follower.pump()
        try:
            results = job.results()
        except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as error:
            raise TrainingJobFailed(
                f"{spec.run_name}: job {job.job_id} failed (state {job.state}); its stderr: {job.paths.stderr}\n"
                f"{error}"
            ) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    metrics = results[0]
    if metrics is None or not metrics_path.exists():
        raise TrainingJobFailed(f"{spec.run_name}: job {job.job_id} ended without writing {metrics_path}; "
                                f"its stderr: {job.paths.stderr}")
    return metrics
