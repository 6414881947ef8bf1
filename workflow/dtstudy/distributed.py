"""Process-group set-up of a run's processes: submitit tasks (one per GPU) or a warm pool's forked workers."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .atomic_files import write_text
from .ports import free_port
from .task_layout import TaskLayout
from .strategies import DistContext


def pick_device(preference: str, local_rank: int) -> torch.device:
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("launcher.device is 'cuda' but this task sees no GPU")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def rendezvous_port(job_env, is_master: bool, timeout_s: float) -> int:
    """MASTER_PORT of this attempt of a SLURM job: the master task binds a port free on its
    node and leaves it in the job folder (a shared file system, as submitit requires); the
    other tasks read it there. A port derived from the job id alone (submitit's default) can
    be taken on a shared node; a port chosen on the login node says nothing about the nodes."""
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")  # a requeued job rendezvouses anew
    path = Path(job_env.paths.folder) / f"{job_env.job_id}.attempt{attempt}.port"
    if is_master:
        port = free_port("")
        write_text(path, str(port))
        return port
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no MASTER_PORT from the master task in {path} after {timeout_s:.0f} s")
        time.sleep(0.2)
    return int(path.read_text())


def init_from_submitit(layout: TaskLayout, device_preference: str, timeout_min: int = 30) -> DistContext | None:
    """Join the job's process group: gloo on CPU (one torch thread per worker), NCCL on GPU.

    `layout` (RunSpec.layout) maps the job's tasks to ranks: workers first, then a
    strategy's extra processes. Returns None in an idle task (a spare slot of a multi-node
    layout), which then has nothing to do.
    """
    import submitit

    job_env = submitit.JobEnvironment()
    rank = layout.rank_of_task(job_env.global_rank)
    if rank is None:
        return None
    if job_env.cluster == "slurm":
        os.environ["MASTER_PORT"] = str(rendezvous_port(job_env, job_env.global_rank == 0, timeout_min * 60))
    # MASTER_ADDR (the first node), and locally MASTER_PORT as the launcher pinned it
    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    return join_process_group(layout, rank, env.local_rank, device_preference, timeout_min)


def join_process_group(layout: TaskLayout, rank: int, local_rank: int, device_preference: str,
                       timeout_min: float) -> DistContext:
    """Join the run's process group as `rank` (MASTER_ADDR/MASTER_PORT in the environment):
    gloo on CPU (one torch thread per worker), NCCL on GPU."""
    workers = layout.workers
    workers_device = pick_device(device_preference, local_rank)
    # every rank must name the same backend; a strategy's extra processes (parameter-server
    # shards) still compute on the CPU and talk over a gloo group of their own
    backend = "nccl" if workers_device.type == "cuda" else "gloo"
    device = workers_device if rank < workers else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # a CPU worker stands for one GPU: one thread each, so N workers use N cores
        torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(layout.world_size))
    timeout = datetime.timedelta(minutes=timeout_min)
    dist.init_process_group(backend, rank=rank, world_size=layout.world_size, timeout=timeout)
    worker_group = None
    if layout.world_size > workers:  # strategies with extra processes get a workers-only group
        worker_group = dist.new_group(list(range(workers)))
    return DistContext(
        rank=rank,
        world_size=layout.world_size,
        workers=workers,
        local_rank=local_rank,
        device=device,
        backend=backend,
        worker_group=worker_group,
    )
