"""Distinct CPU cores for a local run's processes, so that a timed run never shares a core.

Snakemake runs jobs side by side as long as their `threads` fit `--cores`, but leaves the
placement to the OS scheduler, which moves processes between cores (and two runs' workers
onto one). A run's job process in the warm pool therefore leases the cores its ranks need
(`cores_per_rank`): one lock file per core under /tmp (fcntl.flock, released by the kernel
when the last process holding it ends, even a killed one), and each rank pins itself to its
own cores. A CPU worker, which stands for one GPU, gets one core; a worker whose loader runs
worker processes, or that computes on a GPU, gets the cores its loader needs too (the
DataLoader's workers inherit the rank's pinning). When the cores are not all free (more
processes than cores: an oversubscribed run, or someone else's run) nothing is pinned and
metrics.json says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

LEASE_DIR_ENV = "DTSTUDY_CORE_LEASES"  # another folder of lock files (tests)


def lease_dir() -> Path:
    """The machine's lock files: one folder for every study of this user, so that two
    studies started side by side do not pin their runs to the same cores either."""
    path = Path(os.environ.get(LEASE_DIR_ENV) or f"/tmp/dtstudy-cores-{os.getuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def machine_cores() -> list[int]:
    """The cores this process may run on (the scheduler's affinity mask, e.g. a SLURM cgroup)."""
    return sorted(os.sched_getaffinity(0))


@dataclass
class CoreLease:
    """Cores held by this process (and the children it forks) until `release` or exit."""

    cores: list[int]
    _fds: list[int]

    def release(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []


def lease(count: int) -> CoreLease | None:
    """`count` distinct free cores, or None when as many are not free (nothing held then)."""
    available = machine_cores()
    if count > len(available):
        return None
    held: list[tuple[int, int]] = []
    for core in available:
        fd = os.open(lease_dir() / f"core{core}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        held.append((core, fd))
        if len(held) == count:
            return CoreLease([c for c, _ in held], [f for _, f in held])
    for _, fd in held:
        os.close(fd)
    return None


def cores_per_rank(workers: int, extra: int, on_gpu: bool, loader_workers: int | None, machine: int) -> list[int]:
    """How many cores each rank of a local run is pinned to: its `workers`, then a strategy's
    `extra` processes (parameter-server shards: one core each, they load no data).

    `loader_workers`: the run's `loader.workers` (None: null; 0 for in-memory data, which
    has no loader processes). A CPU worker stands for one GPU: one core, where it also
    decodes (null resolves to 0 loader processes on one core). A worker with k loader
    processes gets 1 + k cores, so that they decode beside it, not on its core; a GPU worker
    with null gets its share of the machine, (machine - extra) // workers, which its loader
    then takes (null: the cores the process may use minus one), as a SLURM task of that many
    CPUs would."""
    if loader_workers is not None:
        per_worker = 1 + loader_workers
    elif on_gpu:
        per_worker = max(1, (machine - extra) // workers)
    else:
        per_worker = 1
    return [per_worker] * workers + [1] * extra


def split(cores: list[int], counts: list[int]) -> list[list[int]]:
    """`cores` cut into consecutive groups of `counts` (rank by rank)."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [cores[start : start + count] for start, count in zip(starts, counts)]


def pin(cores: Iterable[int]) -> None:
    """Run this process (and its threads, and the processes it starts) on `cores` only."""
    os.sched_setaffinity(0, set(cores))
