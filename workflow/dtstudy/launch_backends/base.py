"""The interface every launch backend implements (what a value of launcher.cluster means for a
run), with the defaults most kinds share, and the submitit helpers the submitting kinds share.
Imports submitit only inside the methods that submit or watch a job."""

from __future__ import annotations

import math
import time
from pathlib import Path


class LaunchBackend:
    """What one value of launcher.cluster means for a run: where its processes run, how many
    nodes its job spans, how the job is submitted, found again and submitted again."""

    #: the value of launcher.cluster that selects it (dtstudy.launch_backends.registry); for a
    #: submitting kind also submitit's name of its executor
    kind: str = ""
    #: the launcher keys that mean something for this kind only: a run of another kind does
    #: not log them (dtstudy.tracking.logged_params)
    own_keys: tuple[str, ...] = ()
    #: a run's N workers are threads of the train command's own process on a modelled clock
    #: (dtstudy.emulation): no submitit job, and no throughput measured on real hardware
    emulated: bool = False
    #: a run's processes are this machine's: each reserves one of its cores (the rules' threads)
    processes_on_this_machine: bool = False
    #: a run's job spreads over nodes of launcher.gpus_per_node (or workers_per_node) workers
    spans_nodes: bool = True
    #: a job that lost a process or its node is submitted again, up to launcher.max_resubmits times
    resubmits: bool = False
    #: the job's master task picks MASTER_PORT on its own node; otherwise the launcher picks one
    #: on this machine, where the job's tasks run
    port_from_master_task: bool = False
    #: with launcher.hardware its jobs ask their predicted time, and the study is held to
    #: launcher.gpu_hour_budget (dtstudy.projection.budget)
    predicts_costs: bool = False

    def __repr__(self) -> str:
        return f"<launch backend {self.kind}>"

    def workers_per_node(self, launcher: dict) -> int | None:
        """How many of a run's workers one node holds (None or 0: all N on one node)."""
        if not self.spans_nodes:
            return None
        return launcher["gpus_per_node"] or launcher["workers_per_node"]

    def nodes(self, launcher: dict, workers: int) -> int:
        """The nodes a run of `workers` workers spans: the fewest that hold all N."""
        per_node = self.workers_per_node(launcher)
        return math.ceil(workers / per_node) if per_node else 1

    def max_resubmits(self, launcher: dict) -> int:
        """How many times a job that lost a process or its node is submitted again."""
        return launcher["max_resubmits"] if self.resubmits else 0

    def uses_pool(self, launcher: dict) -> bool:
        """Whether the study's warm pool (dtstudy.launch.pool) forks a run's processes (and
        scores each run's test split)."""
        return False

    def job_environment(self) -> dict[str, str | None]:
        """What a job's tasks take from the launcher's environment (None: unset there)."""
        return {}

    def job_parameters(self, launcher: dict, workers_per_node: int) -> dict:
        """The submitit parameters of a run's job beyond its name, time limit, nodes and tasks
        (a node holding `workers_per_node` workers)."""
        raise TypeError(f"launcher.cluster {self.kind!r} submits no job")

    def executor(self, job_dir: Path, launcher: dict, parameters: dict):
        """The submitit executor that submits a run's job with `parameters` (job_parameters')."""
        import submitit

        # a requeue after a time-out counts against max_requeues; preemptions do not (submitit)
        executor = submitit.AutoExecutor(
            folder=job_dir, cluster=self.kind, slurm_max_num_timeout=launcher["max_requeues"]
        )
        self.set_parameters(executor, parameters)
        return executor

    def set_parameters(self, executor, parameters: dict) -> None:
        executor.update_parameters(**parameters)

    def running_job(self, job_dir: Path, run_name: str, config_sha256: str):
        """The run's job that an earlier launcher submitted and that still runs, to wait on;
        None: none (the default: a job of this kind ends with its launcher)."""
        return None

    def record_job(self, job_dir: Path, job, run_name: str, config_sha256: str) -> None:
        """Leave what `running_job` reads, for a launcher that comes after this one is lost."""

    def forget_job(self, job_dir: Path) -> None:
        """The run's job has ended: no launcher is to wait on it."""

    def evaluation_resources(self, launcher: dict) -> dict:
        """The Snakemake resources of a run's `evaluate` job beyond the profile's defaults."""
        return {}


def cancel_and_wait(job, wait_s: float) -> None:
    """Cancel a submitit job (SLURM: scancel; local: SIGINT to the job's controller) and wait
    up to `wait_s` for it to end, asking the scheduler afresh each time."""
    job.cancel(check=False)
    deadline = time.monotonic() + wait_s
    while not job.done(force_check=True) and time.monotonic() < deadline:
        time.sleep(0.5)
