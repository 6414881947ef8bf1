"""The body of one process of a run, however it was started: a submitit task (one per GPU
on SLURM) or a process forked by the warm pool. Joins the process group, trains or serves,
and leaves the group."""

from __future__ import annotations

import torch.distributed as dist

from dtstudy.launch.process_group import PeerWatch, init_from_submitit, join_process_group
from dtstudy.launch_backends.registry import launch_backend
from dtstudy.runspec import RunSpec, lost_rank_path
from dtstudy.strategies.base import DistContext
from dtstudy.strategies.registry import get_strategy
from dtstudy.training.checkpoint import Preemption
from dtstudy.training.loop import train_worker


def run_submitit_task(spec: RunSpec, timings: dict) -> dict | None:
    import submitit

    launcher = spec.config["launcher"]
    ctx = init_from_submitit(
        spec.layout(),
        launcher["device"],
        launcher["timeout_min"],
        launcher["comm_timeout_s"],
        launcher["gloo_loop_nice"],
        launch_backend(spec.config).port_from_master_task,
    )
    if ctx is None:  # an idle slot of the job's task layout
        return None
    # nothing but the peers stops the others when one is lost (submitit's local controller
    # waits for every task): each task watches the rest
    job_env = submitit.JobEnvironment()

    def watch(quiet):
        return PeerWatch(
            ctx.rank,
            ctx.world_size,
            launcher["comm_timeout_s"],
            str(job_env.paths.stderr),
            lost_rank_path(job_env.paths.folder, job_env.job_id),
            quiet,
        )

    return _train_in_group(spec, ctx, timings, watch)


def run_forked_process(spec: RunSpec, rank: int, timings: dict) -> dict | None:
    """Rank `rank` of a local run; MASTER_ADDR/MASTER_PORT are set by the pool (which
    watches the ranks itself and stops them all when one dies)."""
    launcher = spec.config["launcher"]
    ctx = join_process_group(
        spec.layout(),
        rank,
        rank,
        launcher["device"],
        launcher["timeout_min"],
        launcher["comm_timeout_s"],
        launcher["gloo_loop_nice"],
    )
    return _train_in_group(spec, ctx, timings)


def _train_in_group(spec: RunSpec, ctx: DistContext, timings: dict, watch=None) -> dict | None:
    train = spec.config["train"]
    preemption = Preemption(
        ctx.rank,
        spec.workers,
        ctx.worker_group,
        ctx.device,
        train["preempt_check_every"],
        lockstep=get_strategy(spec.strategy).resumable,
        checkpoint_every_s=_minutes_as_s(train["checkpoint_every_min"]),
    ).install()
    # a preempted process's peers end after it on purpose: not a loss
    peers = watch(lambda: preemption.signalled or preemption.stopping).start() if watch else None
    try:
        metrics = train_worker(spec, ctx, preemption, timings)
        if peers:
            peers.leave()
        preemption.ignore_late_signals()
        return metrics
    except BaseException as error:
        if peers and (preemption.signalled or preemption.stopping):
            peers.leave()  # rank 0 requeueing, or a peer of it ending after it
        elif peers:
            peers.fail()  # and names a peer that was killed, when that was the cause
        if isinstance(error, Exception) and preemption.ends_quietly():
            # rank 0 requeues the job (its exchanges fail once it is gone)
            raise SystemExit(
                f"rank {ctx.rank}: preempted; stopped ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
            ) from error
        raise
    finally:
        dist.destroy_process_group()


def _minutes_as_s(minutes: float | None) -> float | None:
    return None if minutes is None else minutes * 60
