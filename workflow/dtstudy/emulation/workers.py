"""N logical workers as threads of this process (and a strategy's extra processes, its
parameter-server shards, as threads too): each bound to its global rank, on its own emulated
clock (installed as its thread's dtstudy.common.timing clock), joined to the emulated
process group, running one body function; the first error of any is raised."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from dtstudy.common.timing import install_clock
from dtstudy.emulation.process_group import BACKEND, EmulatedWorld, bind_thread, installed
from dtstudy.emulation.scheduler import BatonScheduler, EmulationAborted


class LogicalWorkerFailed(RuntimeError):
    """A logical worker raised (the cause is chained), or they all waited on each other."""


class LogicalWorkers:
    """`workers` threads (the run's world: its N workers and any extra processes) sharing one
    scheduler (the clocks) and one emulated world."""

    def __init__(self, workers: int, costs, make_clock: Callable[[BatonScheduler, int], Any]):
        self.workers = workers
        self.scheduler = BatonScheduler(workers)
        self.world = EmulatedWorld(self.scheduler, costs)
        self.make_clock = make_clock
        self.clocks: dict[int, Any] = {}
        self._store = dist.HashStore()  # in-process: init_process_group needs one

    def run(self, body: Callable[[int], Any], name: str = "emulated run") -> list:
        """body(rank) on every logical worker, in its group; their results by rank."""
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        with installed(self.world):
            threads = [
                threading.Thread(target=self._thread, args=(rank, body, results, errors), name=f"emulated-rank-{rank}")
                for rank in range(self.workers)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        if errors or self.scheduler.failure is not None:
            causes = [e for e in errors.values() if not isinstance(e, EmulationAborted)]
            cause = causes[0] if causes else self.scheduler.failure
            raise LogicalWorkerFailed(f"{name} failed: {type(cause).__name__}: {cause}") from cause
        return [results[rank] for rank in range(self.workers)]

    def _thread(self, rank: int, body, results: dict, errors: dict) -> None:
        bind_thread(rank)
        self.clocks[rank] = self.make_clock(self.scheduler, rank)
        install_clock(self.clocks[rank])
        error = None
        try:
            self.scheduler.enter(rank)
            dist.init_process_group(BACKEND, rank=rank, world_size=self.workers, store=self._store)
            results[rank] = body(rank)
        except BaseException as caught:  # every logical worker must end, or the others wait forever
            error = errors[rank] = caught
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            install_clock(None)
            self.scheduler.finish(rank, error)
