"""gloo's event-loop threads run at launcher.gloo_loop_nice (SCHED_IDLE or a nice value) in
every process of a run and in the communication benchmark (dtstudy.gloo_loops; why: docs/running-locally.md
"Cores")."""

from __future__ import annotations

import os

import pytest
import torch.multiprocessing as mp
from conftest import run_snakemake, tiny_study

from dtstudy.common.ports import free_port
from dtstudy.gloo_loops import GLOO_LOOP_THREAD


def _threads_priority() -> list[tuple[str, int, int]]:
    """(name, nice, scheduling policy) of every thread of this process."""
    threads = []
    for task in os.scandir("/proc/self/task"):
        name = open(f"{task.path}/comm").read().strip()
        tid = int(task.name)
        threads.append((name, os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)))
    return threads


def _join_and_report(rank: int, world: int, workers: int, priority: int | str, port: int, queue) -> None:
    import torch.distributed as dist

    from dtstudy.launch.process_group import join_process_group
    from dtstudy.runspec import TaskLayout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = join_process_group(TaskLayout(workers, world - workers), rank, rank, "cpu", 1, 30, gloo_loop_nice=priority)
    queue.put((rank, ctx.gloo_loop_nice, _threads_priority()))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("priority", ["idle", 19, 0])
@pytest.mark.slow
def test_joining_a_run_puts_every_gloo_event_loop_and_only_them_at_the_priority(priority):
    # 2 workers and a shard: the default group and the workers' group each have their loops
    world, workers = 3, 2
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    port = free_port()
    processes = [
        context.Process(target=_join_and_report, args=(rank, world, workers, priority, port, queue))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    reports = sorted(queue.get() for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    expected = (0, os.SCHED_IDLE) if priority == "idle" else (priority, os.SCHED_OTHER)
    for rank, ctx_priority, threads in reports:
        assert ctx_priority == priority  # groups made later (a parameter server's) get the same
        loops = [(nice, policy) for name, nice, policy in threads if name == GLOO_LOOP_THREAD]
        others = [(nice, policy) for name, nice, policy in threads if name != GLOO_LOOP_THREAD]
        # a worker is in both groups; gloo names its loop threads so (else nothing is lowered)
        assert len(loops) >= (2 if rank < workers else 1), threads
        assert loops == [expected] * len(loops), threads
        # the compute and the other threads keep theirs
        assert others == [(0, os.SCHED_OTHER)] * len(others), threads


@pytest.mark.parametrize("priority", [7, "idle"])
@pytest.mark.slow
def test_the_communication_benchmark_measures_with_the_runs_loop_priority(tmp_path, priority):
    result = run_snakemake(
        tmp_path,
        tiny_study(launcher={"gloo_loop_nice": priority}),
        "--dry-run",
        "--printshellcmds",
        "--cores",
        "2",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    commbench = [line for line in result.stdout.splitlines() if "project commbench" in line]
    assert len(commbench) == 1 and f"--gloo-loop-nice {priority}" in commbench[0], commbench
