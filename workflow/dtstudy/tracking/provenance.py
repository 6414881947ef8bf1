"""Where a number came from: code version, software versions, hardware."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

REPO_DIR = Path(__file__).resolve().parents[3]


PINNED_ENV = "DTSTUDY_PINNED_CORES"  # the run's cores, rank by rank, for metrics.json (the pool sets it)


def pinned_cores() -> list[int] | None:
    """The run's cores, rank by rank, when its job process pinned them (else None)."""
    value = os.environ.get(PINNED_ENV)
    return [int(c) for c in value.split(",")] if value else None


def git_commit(repo: Path = REPO_DIR) -> dict:
    """The commit of the code that ran, and whether the tree had uncommitted changes."""

    def git(*args):
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernels(device: torch.device) -> dict | None:
    """What decides whether a GPU run repeats to the last digit (train.deterministic); None on
    the CPU, whose kernels are deterministic."""
    if device.type != "cuda":
        return None
    return {
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


def environment(device: torch.device, backend: str | None, processes: int, concurrent: int | None = None) -> dict:
    """Facts about the machine and software of a run, for metrics.json and MLflow (and of a test
    pass, for eval.json: no process group, backend None). `processes`: the job's ranks;
    `concurrent`: how many of them compute at once (None: all; an emulated run's threads take
    turns, one)."""
    concurrent = processes if concurrent is None else concurrent
    pinned = pinned_cores()
    # a pinned rank sees its one core; pinning happened only if every process got its own
    cores = (os.cpu_count() or 1) if pinned else usable_cores()
    if device.type == "cuda":
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    else:
        devices = [cpu_model()]
    return {
        "host": socket.gethostname(),
        "device_type": device.type,
        "devices": devices,
        "backend": backend,
        "cores": cores,
        "processes": processes,
        "concurrent_ranks": concurrent,
        # on CPU each rank that computes is one core; more of them than cores share them
        "oversubscribed": device.type == "cpu" and concurrent > cores,
        # rank by rank (set by the warm pool, dtstudy.launch.cores); None = left to the OS scheduler
        "pinned_cores": pinned,
        "affinity": sorted(os.sched_getaffinity(0)),  # the cores rank 0 could run on
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {p: _version(p) for p in ("torch", "torchvision", "submitit", "mlflow", "snakemake", "dtstudy")},
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # None: unset (every GPU)
        "kernels": kernels(device),
        **git_commit(),
    }
