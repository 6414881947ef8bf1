"""Distinct CPU cores for a local run's processes, so that a timed run never shares a core.

Snakemake runs jobs side by side as long as their `threads` fit `--cores`, but leaves the
placement to the OS scheduler, which moves processes between cores (and two runs' workers
onto one). A run's job process in the warm pool therefore leases as many cores as the run
has processes: one lock file per core under /tmp (fcntl.flock, released by the kernel when
the last process holding it ends, even a killed one), and each rank pins itself to its own
core. When the cores are not all free (more processes than cores: an oversubscribed run,
or someone else's run) nothing is pinned and metrics.json says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
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


def pin(core: int) -> None:
    """Run this process (and its threads) on `core` only."""
    os.sched_setaffinity(0, {core})
