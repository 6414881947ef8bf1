"""The body of one process of a run, however it was started: a submitit task (one per GPU
on SLURM) or a process forked by the warm pool. Joins the process group, trains or serves,
and leaves the group."""

from __future__ import annotations

import torch.distributed as dist

from .distributed import init_from_submitit, join_process_group
from .resume import Preemption
from .runspec import RunSpec
from .strategies import DistContext, get_strategy
from .worker import train_worker


def run_submitit_task(spec: RunSpec, timings: dict) -> dict | None:
    launcher = spec.config["launcher"]
    ctx = init_from_submitit(spec.layout(), launcher["device"], launcher["timeout_min"])
    if ctx is None:  # an idle slot of the job's task layout
        return None
    return _train_in_group(spec, ctx, timings)


def run_forked_process(spec: RunSpec, rank: int, timings: dict) -> dict | None:
    """Rank `rank` of a local run; MASTER_ADDR/MASTER_PORT are set by the pool."""
    launcher = spec.config["launcher"]
    ctx = join_process_group(spec.layout(), rank, rank, launcher["device"], launcher["timeout_min"])
    return _train_in_group(spec, ctx, timings)


def _train_in_group(spec: RunSpec, ctx: DistContext, timings: dict) -> dict | None:
    preemption = Preemption(ctx.rank, spec.workers, ctx.worker_group, ctx.device,
                            spec.config["train"]["preempt_check_every"],
                            lockstep=get_strategy(spec.strategy).resumable).install()
    try:
        metrics = train_worker(spec, ctx, preemption, timings)
        preemption.ignore_late_signals()
        return metrics
    except Exception as error:
        if preemption.ends_quietly():  # rank 0 requeues the job (its exchanges fail once it is gone)
            raise SystemExit(f"rank {ctx.rank}: preempted; stopped "
                             f"({type(error).__name__}: {str(error).splitlines()[0][:200]})") from error
        raise
    finally:
        dist.destroy_process_group()
