"""The baton: the N logical workers' threads run one at a time, on the cluster's clock.

Each thread (one logical worker, its global rank) has an emulated time. A thread runs until it
waits: in a collective, a receive, or a clock advance (its step's compute, a straggler's
delay). A waiting thread says when it may go on, on the emulated clock (its own time after an
advance, a collective's end, a message's arrival), or that it cannot yet (None). The baton
then goes to the thread that may go on earliest (ties by rank): events are taken in the
order of the cluster's clock, so a message that arrives earlier is received first even when
its sender had not yet run (conservative discrete-event order). So a run is deterministic
(the same seed gives the same numbers), one worker computes at a time (the cores go to its
intra-op threads, as on a GPU of the cluster), and whoever arrives first at a parameter
server is who the cluster's clock says arrives first.

A waiting thread's answer is read once and kept: it can change only when a message reaches its
mailbox or the collective it waits in completes, and the emulated process group then says so
(`touch`). So a pass of the baton costs the threads whose answer changed, not all N (a
parameter server's shard would otherwise rescan its mailbox for every worker at every pass).
With DTSTUDY_EMULATION_VERIFY=1 every pass re-reads every answer and fails on a kept one that
went stale (the tests run the asynchronous strategies so).

Each thread's random generators (torch's CPU generator, Python's `random`) are its own: a
real worker is a process with its own, and two logical workers must not draw from one
stream in whatever order the baton went round. The generators hold the state of the thread that
ran last: a thread that gets the baton saves that thread's state and restores its own (nothing
when it gets the baton back with no other thread run in between).
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable

import torch

#: when a waiting thread may go on (emulated seconds), or None while it cannot
Ready = Callable[[], float | None]

#: re-read every waiting thread's answer at every pass and check the kept ones (tests)
VERIFY = os.environ.get("DTSTUDY_EMULATION_VERIFY", "") == "1"


class EmulationAborted(RuntimeError):
    """Another logical worker failed (or every one waits on another): this one stops too."""


class Deadlock(RuntimeError):
    """Every logical worker that has not finished waits, and nothing can wake one."""


class BatonScheduler:
    """One baton among `workers` threads (global ranks 0..workers-1), each with its emulated time."""

    def __init__(self, workers: int):
        self.workers = workers
        self.time = [0.0] * workers  # each thread's emulated seconds since the run started
        self._lock = threading.Lock()
        # one condition per thread on the one lock: passing the baton wakes its new holder only
        self._turn = [threading.Condition(self._lock) for _ in range(workers)]
        self._waiting: dict[int, Ready] = {}  # rank -> when may it go on? (read under the lock)
        self._when: dict[int, float | None] = {}  # rank -> its answer as last read
        self._stale: set[int] = set()  # waiting ranks whose answer must be read again
        self._finished: set[int] = set()
        self._holder: int | None = None
        self._rng: dict[int, tuple] = {}  # rank -> its generators' states while another runs
        self._rng_owner: int | None = None  # whose states the generators hold now
        self.failure: BaseException | None = None
        self.switches = 0  # how often the baton changed hands (a cost figure)

    # ----- a thread's calls ------------------------------------------------------------------
    def enter(self, rank: int) -> None:
        """A thread's first call: wait for the baton (rank 0 gets it first, all at time 0)."""
        with self._lock:
            self._waiting[rank] = lambda: 0.0
            self._stale.add(rank)
            if len(self._waiting) + len(self._finished) == self.workers and self._holder is None:
                self._pass()
            self._await(rank)

    def wait_until(self, rank: int, ready: Ready) -> None:
        """Give the baton away until `ready()` gives a time (it is read under the scheduler's
        lock, by whichever thread passes the baton) and no other thread may go on earlier."""
        with self._lock:
            self._waiting[rank] = ready
            self._stale.add(rank)
            self._pass()
            self._await(rank)

    def advance(self, rank: int, seconds: float) -> None:
        """This thread's emulated time moves on by `seconds` (compute, a delay); the baton goes to
        whichever thread is now earliest."""
        self.time[rank] += max(0.0, seconds)
        self.wait_until(rank, lambda: self.time[rank])

    def touch(self, ranks) -> None:
        """What the waiting threads `ranks` (global ranks) wait for may have changed (a message
        reached their mailbox, their collective completed): their answers are read again."""
        with self._lock:
            self._stale.update(ranks)

    def finish(self, rank: int, error: BaseException | None = None) -> None:
        """The thread is done (or failed: every other thread then stops with EmulationAborted)."""
        with self._lock:
            self._finished.add(rank)
            self._waiting.pop(rank, None)
            self._when.pop(rank, None)
            if error is not None and self.failure is None:
                self.failure = error
            if self._holder == rank:
                self._holder = None
            self._pass()

    # ----- under the lock --------------------------------------------------------------------
    def _await(self, rank: int) -> None:
        self._turn[rank].wait_for(lambda: self._holder == rank or self.failure is not None)
        self._waiting.pop(rank, None)
        self._when.pop(rank, None)
        if self.failure is not None:
            raise EmulationAborted(f"logical worker {rank} stops: {type(self.failure).__name__}: {self.failure}")
        self._take_rng(rank)

    def _pass(self) -> None:
        if self.failure is not None:
            self._wake_all()
            return
        runnable = self._runnable()
        if not runnable:  # a missed touch must not read as a deadlock: read every answer again
            self._stale.update(self._waiting)
            runnable = self._runnable()
        if runnable:
            _, chosen = min(runnable)
            self.switches += chosen != self._holder
            self._holder = chosen
            self._turn[chosen].notify()
        elif len(self._finished) < self.workers:
            stuck = sorted(self._waiting)
            self.failure = Deadlock(
                f"logical workers {stuck} all wait and none can go on (mismatched collectives "
                f"or a receive without a send); finished: {sorted(self._finished)}"
            )
            self._holder = None
            self._wake_all()
        else:
            self._holder = None

    def _runnable(self) -> list[tuple[float, int]]:
        """(when, rank) of every waiting thread that may go on, its answer read again if stale."""
        when, waiting = self._when, self._waiting
        for rank in self._stale:
            if rank in waiting:
                when[rank] = waiting[rank]()
        self._stale.clear()
        if VERIFY:
            for rank, ready in waiting.items():
                if when[rank] != ready():
                    raise AssertionError(
                        f"logical worker {rank}'s kept answer {when[rank]} went stale (now {ready()}): a missing touch"
                    )
        return [(t, rank) for rank, t in when.items() if t is not None]

    def _wake_all(self) -> None:
        for turn in self._turn:
            turn.notify()

    def _take_rng(self, rank: int) -> None:
        """The generators become `rank`'s: the last runner's states saved (unless it finished),
        `rank`'s restored (a thread's first turn goes on from the states it finds, as before)."""
        owner = self._rng_owner
        if owner == rank:
            return
        if owner is not None and owner not in self._finished:
            self._rng[owner] = (torch.get_rng_state(), random.getstate())
        state = self._rng.pop(rank, None)
        if state is not None:
            torch.set_rng_state(state[0])
            random.setstate(state[1])
        self._rng_owner = rank
