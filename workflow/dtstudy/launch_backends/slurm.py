"""launcher.cluster `slurm`: one SLURM job per run through submitit, one task per process (one
per GPU) over the fewest nodes that hold them. A job that lost a process or its node is
submitted again (launcher.max_resubmits); a launcher lost while its job runs leaves the job
running, recorded in the run's job folder (ACTIVE_JOB_FILE), and the next launcher of the run
waits on it instead of submitting a second one, when it trains the same config."""

from __future__ import annotations

import json
import math
from pathlib import Path

from dtstudy.common.atomic_files import write_json
from dtstudy.launch_backends.base import LaunchBackend, cancel_and_wait

#: in a run's job folder while its launcher waits on its SLURM job: the job and the config it trains
ACTIVE_JOB_FILE = "active_job.json"


class SlurmBackend(LaunchBackend):
    kind = "slurm"
    own_keys = (
        "max_requeues",
        "max_resubmits",
        "gpus_per_node",
        "workers_per_node",
        "gpu_request",
        "hardware",
        "time_limit_margin",
        "gpu_hour_budget",
        "mem_gb",
        "partition",
        "account",
        "qos",
        "constraint",
        "additional_parameters",
    )
    resubmits = True
    # a port derived from the job id alone can be taken on a shared node, and one chosen on
    # the login node says nothing about the nodes (dtstudy.launch.process_group.rendezvous_port)
    port_from_master_task = True
    predicts_costs = True

    def job_parameters(self, launcher: dict, workers_per_node: int) -> dict:
        # SIGUSR2 this long before the time limit: the run checkpoints and is requeued
        parameters = {"slurm_signal_delay_s": launcher["signal_delay_s"]}
        # a task that fails (or sees a peer lost, dtstudy.launch.process_group.PeerWatch) ends the whole
        # job at once, rather than leaving its siblings to hold their GPUs until a time-out
        parameters["slurm_srun_args"] = ["--kill-on-bad-exit=1"]
        parameters["cpus_per_task"] = launcher["cpus_per_task"]
        if launcher["gpus_per_node"]:
            # one GPU per worker on its node: N=1 holds one GPU, not the node's; the shards
            # (extra tasks) compute on CPUs and take none
            if launcher["gpu_request"] == "gres":
                parameters["slurm_gres"] = f"gpu:{workers_per_node}"
            else:
                parameters["gpus_per_node"] = workers_per_node
        if launcher["mem_gb"] is not None:
            parameters["mem_gb"] = launcher["mem_gb"]
        for key in ("partition", "account", "qos", "constraint"):
            if launcher[key] is not None:
                parameters[f"slurm_{key}"] = launcher[key]
        if launcher["additional_parameters"]:
            parameters["slurm_additional_parameters"] = dict(launcher["additional_parameters"])
        return parameters

    def running_job(self, job_dir: Path, run_name: str, config_sha256: str):
        """The run's SLURM job that an earlier launcher submitted and that has not ended (the
        launcher was lost: Snakemake killed, the login session closed), as a submitit job to
        wait on; None when there is none. A job that trains another config (its
        `config_sha256` differs: the study was edited since) is cancelled, and None returned:
        the run is submitted afresh."""
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
        if record.get("config_sha256") != config_sha256:
            print(
                f"{run_name}: cancelling job {job.job_id}, submitted by an earlier launcher of this run: it "
                "trains another config",
                flush=True,
            )
            cancel_and_wait(job, wait_s=60)
            record_path.unlink(missing_ok=True)
            return None
        return job

    def record_job(self, job_dir: Path, job, run_name: str, config_sha256: str) -> None:
        write_json(
            job_dir / ACTIVE_JOB_FILE, {"job_id": job.job_id, "run_name": run_name, "config_sha256": config_sha256}
        )

    def forget_job(self, job_dir: Path) -> None:
        (job_dir / ACTIVE_JOB_FILE).unlink(missing_ok=True)

    def evaluation_resources(self, launcher: dict) -> dict:
        """On a GPU cluster (snakemake-executor-plugin-slurm's names): one GPU of the training
        runs' kind, on their partition, account, qos and constraint, with the CPUs of a training
        task and one GPU's share of a node's memory, so that the test pass decodes with the same
        loader workers on the run's kind of device (dtstudy.training.evaluate). None extra on a
        CPU-only cluster: the profile's default resources apply."""
        if not launcher["gpus_per_node"]:
            return {}
        resources = {"gres": "gpu:1"} if launcher["gpu_request"] == "gres" else {"gpu": 1}
        resources["cpus_per_task"] = launcher["cpus_per_task"]
        if launcher["mem_gb"] is not None:  # a node's memory for its training tasks: one GPU's share of it
            resources["mem_mb"] = math.ceil(launcher["mem_gb"] * 1024 / launcher["gpus_per_node"])  # --mem=XG
        for key, resource in (
            ("partition", "slurm_partition"),
            ("account", "slurm_account"),
            ("qos", "qos"),
            ("constraint", "constraint"),
        ):
            if launcher[key] is not None:
                resources[resource] = launcher[key]
        return resources


SLURM = SlurmBackend()
