"""launcher.cluster `local`: one submitit job per run on this machine, its processes forked by
the study's warm pool (launcher.local_processes: pool) or started as one submitit task each
(tasks); never resubmitted: starting the run again resumes it (snakemake --rerun-incomplete)."""

from __future__ import annotations

import os

from dtstudy.launch_backends.base import LaunchBackend

# submitit's local executor sets CUDA_VISIBLE_DEVICES in its tasks from its gpus_per_node
# ("" when 0: no GPU); a local run's tasks must see the GPUs the launcher sees
VISIBLE_GPUS_ENV = "CUDA_VISIBLE_DEVICES"


class LocalBackend(LaunchBackend):
    kind = "local"
    own_keys = ("local_processes",)
    processes_on_this_machine = True
    spans_nodes = False  # this machine is the one node

    def uses_pool(self, launcher: dict) -> bool:
        return launcher["local_processes"] == "pool"

    def job_environment(self) -> dict[str, str | None]:
        return {VISIBLE_GPUS_ENV: os.environ.get(VISIBLE_GPUS_ENV)}

    def job_parameters(self, launcher: dict, workers_per_node: int) -> dict:
        # SIGUSR2 this long before the time limit: the run checkpoints and is requeued
        return {"signal_delay_s": launcher["signal_delay_s"]}

    def set_parameters(self, executor, parameters: dict) -> None:
        # AutoExecutor knows signal_delay_s only for SLURM (it would rename it to
        # slurm_signal_delay_s, and it rejects local_signal_delay_s): set on the local executor
        executor._executor.update_parameters(**parameters)


LOCAL = LocalBackend()
