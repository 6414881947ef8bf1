"""gloo's event-loop threads, lowered in priority so that they do not hold a core that the
thread they wait for needs (launcher.gloo_loop_nice: idle, or a nice value)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

GLOO_LOOP_THREAD = "gloo_tcp_loop"  # the name gloo gives each device's event-loop thread


def gloo_loop_threads() -> set[int]:
    """Thread ids of this process's gloo event loops (none where there is no /proc)."""
    tasks = Path("/proc/self/task")
    threads = set()
    if tasks.is_dir():
        for task in tasks.iterdir():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                if (task / "comm").read_text().strip() == GLOO_LOOP_THREAD:
                    threads.add(int(task.name))
    return threads


#: launcher.gloo_loop_nice's value for Linux's SCHED_IDLE policy (below every nice value)
IDLE = "idle"


def lower_gloo_event_loops(priority: int | str, threads: set[int] | None = None) -> int:
    """Run this process's gloo event-loop threads (or `threads` of them) at `priority`: IDLE
    (SCHED_IDLE) or a nice value (0: leave them); returns how many.

    gloo's TCP event loop spins on epoll while a message waits for the thread that will
    take it (pytorch/gloo#246). When every core is busy, as with one worker per core, the
    woken thread then waits for the spinner, up to a scheduler tick
    (benchmarks/exchange_latency.py measures what that costs an all-reduce). At nice 19
    the spinner yields to it within its time slice; under SCHED_IDLE at once (the kernel
    preempts an idle-policy thread for any other that wakes), which gossip's point-to-point
    hand-shakes and PowerSGD's three all-reduces per step still needed (docs/running-locally.md,
    "Cores"). Threads of groups created later need another call; Linux only
    (elsewhere nothing is changed)."""
    if priority == 0:
        return 0
    lowered = 0
    for thread in gloo_loop_threads() if threads is None else threads:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if priority == IDLE:
                os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, thread, priority)
            lowered += 1
    return lowered
