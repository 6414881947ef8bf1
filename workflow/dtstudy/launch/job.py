"""The callables submitit runs for a training run. Torch-free at import, so that the launcher
that builds and pickles them stays light; torch is imported where a task trains.

- `TrainingJob`: one task per process of the run (one per GPU on SLURM), each a worker or a
  parameter-server shard; checkpoints itself on SIGUSR2 (time-out, preemption).
- `PooledTrainingJob`: locally, one light task that has the study's warm pool (dtstudy.launch.pool)
  fork the run's N + S processes from a process that has already imported everything.
"""

from __future__ import annotations

import time

import submitit

from dtstudy.launch.pool.client import apply_environment, request_training
from dtstudy.runspec import RunSpec


class TrainingJob(submitit.helpers.Checkpointable):
    """The callable that submitit runs in each task (worker or extra process) of a run.

    Checkpointable: on SIGUSR2 (time-out or preemption) the run saves its state at a step
    boundary and rank 0 requeues the job through submitit, which pickles `checkpoint()`;
    the requeued job resumes from the saved state (dtstudy.training.checkpoint).
    """

    def __init__(self, spec: RunSpec, timings: dict | None = None, environ: dict[str, str | None] | None = None):
        self.spec = spec
        self.timings = timings or {}
        self.environ = environ or {}  # LaunchBackend.job_environment

    def __call__(self) -> dict | None:
        apply_environment(self.environ)  # before anything touches CUDA
        from dtstudy.launch.rank_process import run_submitit_task

        return run_submitit_task(self.spec, {**self.timings, "process_start": time.time()})

    def checkpoint(self) -> submitit.helpers.DelayedSubmission:
        """What submitit pickles for the requeued job: the job itself. The training state is
        in the run's resume folder, written by every worker before rank 0 requeues."""
        return submitit.helpers.DelayedSubmission(TrainingJob(self.spec, self.timings, self.environ))


class PooledTrainingJob(submitit.helpers.Checkpointable):
    """A local run as one light submitit task: the warm pool forks the run's processes and
    this task waits for them, printing rank 0's progress into its own log."""

    def __init__(
        self,
        spec: RunSpec,
        pool_address: str,
        timings: dict | None = None,
        environ: dict[str, str | None] | None = None,
    ):
        self.spec, self.pool_address = spec, pool_address
        self.timings = timings or {}
        self.environ = environ or {}  # LaunchBackend.job_environment; the pool hands it to the ranks

    def __call__(self) -> dict | None:
        apply_environment(self.environ)  # also what a pool this task starts inherits

        env = submitit.JobEnvironment()
        return request_training(
            self.pool_address,
            self.spec,
            str(env.job_id),
            str(env.paths.stdout),
            str(env.paths.folder),
            self.timings,
            self.environ,
        )

    def checkpoint(self) -> submitit.helpers.DelayedSubmission:
        return submitit.helpers.DelayedSubmission(
            PooledTrainingJob(self.spec, self.pool_address, self.timings, self.environ)
        )
