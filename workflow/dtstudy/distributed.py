"""Process-group set-up inside one task of a submitit job."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .strategies import DistContext


def pick_device(preference: str, local_rank: int) -> torch.device:
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("launcher.device is 'cuda' but this task sees no GPU")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def init_from_submitit(workers: int, device_preference: str, timeout_min: int = 30) -> DistContext:
    """Join the job's process group: gloo on CPU (one torch thread per worker), NCCL on GPU."""
    import submitit

    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    workers_device = pick_device(device_preference, env.local_rank)
    # every rank must name the same backend; a strategy's extra processes (parameter-server
    # shards) still compute on the CPU and talk over a gloo group of their own
    backend = "nccl" if workers_device.type == "cuda" else "gloo"
    device = workers_device if env.rank < workers else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # a CPU worker stands for one GPU: one thread each, so N workers use N cores
        torch.set_num_threads(1)
    dist.init_process_group(
        backend, rank=env.rank, world_size=env.world_size, timeout=datetime.timedelta(minutes=timeout_min)
    )
    worker_group = None
    if env.world_size > workers:  # strategies with extra processes get a workers-only group
        worker_group = dist.new_group(list(range(workers)))
    return DistContext(
        rank=env.rank,
        world_size=env.world_size,
        workers=workers,
        local_rank=env.local_rank,
        device=device,
        backend=backend,
        worker_group=worker_group,
    )
