"""One parameter-server shard: the body of an extra process, shared by every PS strategy.

The strategies differ only in their `UpdatePolicy`: how many gradients of a step make one
update, and how far ahead of the applied updates a worker may run.

A shard takes part in the run's checkpoints (dtstudy.training.checkpoint): at an agreed step
boundary (protocol's docstring) it writes its own rank file, `resume/rank<r>.pt` with r >= N,
holding its parameters, optimizer state, version, clocks and record (`state_dict`); a run
started again agrees with the workers on the newest step every process has a file of and
continues from there.
"""

from __future__ import annotations

import datetime
import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dtstudy.common import timing
from dtstudy.strategies.parameter_server.protocol import (
    NO_BOUNDARY,
    REQUEST_SIZE,
    SETUP_FIELDS,
    STATS_HEADER_SIZE,
    TAG_GRADIENT,
    TAG_PARAMETERS,
    TAG_REQUEST,
    TAG_SAVED,
    TAG_SETUP,
    TAG_STATS,
    TAG_VERSION,
    VALUE_DTYPE,
    BoundaryAction,
    Kind,
)


@dataclass(frozen=True)
class UpdatePolicy:
    """How a shard turns pushed gradients into updates.

    quorum: synchronous: a push is tagged by the parameter version its worker read; the first
        `quorum` pushes that read the current version are averaged into its update, and a push
        that read an older version (its update was made without it) is dropped (Chen et al.
        2016; TensorFlow's SyncReplicasOptimizer). The reply to a push waits for the update
        of the version it read. None: asynchronous: every gradient is an update of its own,
        applied on arrival.
    clock_bound: asynchronous only: a worker's clock is the number of gradients it pushed;
        the reply to its push (which starts its next step) waits until its clock is at most
        `clock_bound` ahead of the slowest worker's (stale synchronous parallel, Ho et al.
        2013; inf: never waits, ps_async). Pulls are answered at once.
    staleness_lr: asynchronous only: divide an update's rate by its staleness (version at
        apply - version read, when >= 1): the staleness-aware rate of Zhang et al. 2016.
    """

    quorum: int | None
    clock_bound: float = math.inf
    staleness_lr: bool = False

    @classmethod
    def synchronous(cls, quorum: int) -> UpdatePolicy:
        """The first `quorum` pushes of a version make its update (ps_sync: all N; ps_backup: N-k)."""
        return cls(quorum=quorum)

    @classmethod
    def asynchronous(cls, clock_bound: float = math.inf, staleness_lr: bool = False) -> UpdatePolicy:
        """Every push an update of its own, on arrival (ps_async; ssp with a finite clock_bound)."""
        return cls(quorum=None, clock_bound=clock_bound, staleness_lr=staleness_lr)

    @property
    def is_asynchronous(self) -> bool:
        return self.quorum is None


@dataclass
class ShardStats:
    """What one shard measured, sent to rank 0 at the end."""

    workers: int = 0
    busy_s: float = 0.0  # applying updates (summing, averaging, the optimizer step)
    wall_s: float = 0.0
    updates: int = 0
    dropped: list[int] = field(default_factory=list)  # per worker: pushes that read an already-updated version
    staleness: Counter = field(default_factory=Counter)  # version at apply - version the worker read
    ahead: Counter = field(default_factory=Counter)  # per answered push: its worker's clock - the slowest's

    def __post_init__(self):
        self.dropped = self.dropped or [0] * self.workers

    @contextmanager
    def busy(self, clock: timing.Clock):
        start = clock.mark()
        yield
        self.busy_s += clock.seconds(start, clock.mark())

    def state_dict(self) -> dict:
        return {
            "busy_s": self.busy_s,
            "wall_s": self.wall_s,
            "updates": self.updates,
            "dropped": list(self.dropped),
            "staleness": self.histogram(self.staleness),
            "ahead": self.histogram(self.ahead),
        }

    def load_state_dict(self, state: dict) -> None:
        self.busy_s, self.wall_s, self.updates = state["busy_s"], state["wall_s"], state["updates"]
        self.dropped = list(state["dropped"])
        self.staleness, self.ahead = as_counter(state["staleness"]), as_counter(state["ahead"])

    @staticmethod
    def histogram(counts: Counter) -> list[int]:
        return [counts[value] for value in range(max(counts, default=-1) + 1)]

    def send(self, dst: int, group) -> None:
        staleness, ahead = self.histogram(self.staleness), self.histogram(self.ahead)
        header = [self.busy_s, self.wall_s, self.updates, self.workers, len(staleness), len(ahead)]
        dist.send(torch.tensor(header, dtype=torch.float64), dst=dst, group=group, tag=TAG_STATS)
        body = torch.tensor([*self.dropped, *staleness, *ahead], dtype=torch.float64)
        dist.send(body, dst=dst, group=group, tag=TAG_STATS)

    @classmethod
    def receive(cls, src: int, group) -> ShardStats:
        header = torch.empty(STATS_HEADER_SIZE, dtype=torch.float64)
        dist.recv(header, src=src, group=group, tag=TAG_STATS)
        busy_s, wall_s, *counts = header.tolist()
        updates, workers, stale_length, ahead_length = (int(v) for v in counts)
        body = torch.zeros(workers + stale_length + ahead_length, dtype=torch.float64)
        dist.recv(body, src=src, group=group, tag=TAG_STATS)
        values = [int(v) for v in body.tolist()]
        dropped, staleness, ahead = (
            values[:workers],
            values[workers : workers + stale_length],
            values[workers + stale_length :],
        )
        return cls(workers, busy_s, wall_s, updates, dropped, as_counter(staleness), as_counter(ahead))


def as_counter(histogram: list[int]) -> Counter:
    """A histogram (count per value 0, 1, ...) as a Counter of the values that occur."""
    return Counter({value: count for value, count in enumerate(histogram) if count})


@dataclass
class VersionGradients:
    """The gradients that read the current version, summed so far."""

    total: torch.Tensor
    lr: float
    count: int


class ShardServer:
    """Owns a slice of the parameters and its optimizer state; answers the N workers."""

    def __init__(
        self,
        workers: int,
        group,
        policy: UpdatePolicy,
        comm_timeout_s: float = 1800.0,
        quiet_timeout_s: float = 1800.0,
        coordinator: bool = False,
    ):
        self.workers, self.group, self.policy = workers, group, policy
        # the first shard agrees the checkpoints' step boundaries with the workers (protocol)
        self.coordinator = coordinator
        # how long the shard waits for the next request: comm_timeout_s while a worker trains
        # (no step waits longer), quiet_timeout_s while every worker starts up or evaluates
        self.comm_timeout_s, self.quiet_timeout_s = comm_timeout_s, quiet_timeout_s
        self.started: set[int] = set()  # workers that have sent a request
        self.finished: set[int] = set()  # workers that sent DONE
        self.version = 0  # updates applied
        self.pending: VersionGradients | None = None  # synchronous: the current version's gradients
        self.clocks = [0] * workers  # gradients pushed, per worker
        self.waiting: list[tuple[int, int]] = []  # (worker, the version it read) until it may go on
        self.idle: set[int] = set()  # workers done with the epoch's pushes (until their next pull)
        self.boundary: tuple[int, BoundaryAction] | None = None  # coordinator: the agreed (step, action)
        self.saving: set[int] = set()  # workers at the boundary, waiting for this shard to save
        self.stats = ShardStats(workers)
        self.files = None  # the run's resume files (dtstudy.training.checkpoint.ResumeFiles)
        # the host's clock, or an emulated shard's (dtstudy.emulation), whose `shard_work`
        # puts the model's time of the shard's work on the cluster's clock
        self.clock = timing.clock_for(torch.device("cpu"))
        self._start = self.clock.mark()  # of serving: the record's wall time counts from here

    def serve(self, files=None) -> None:
        """Answer the workers until every one is done. `files`: the run's resume files (None:
        this shard neither resumes nor saves, and a worker's SAVE is an error)."""
        self.files = files
        self._receive_setup()
        header = torch.empty(REQUEST_SIZE, dtype=torch.float64)
        while len(self.started) < self.workers:  # each worker's first request: its set-up's pull
            self._handle(self._next_request(header), header)
        if files is not None:  # with the workers (a collective): the state of the newest common step
            saved = files.load_agreed(dist.get_rank(), dist.get_world_size(), self.group)
            if saved is not None:
                self.load_state_dict(saved)
        self._start = self.clock.mark() - self.stats.wall_s  # earlier attempts' time counts
        while len(self.finished) < self.workers:
            self._handle(self._next_request(header), header)
        self.stats.wall_s = self._serving_s()
        self.stats.send(dst=0, group=self.group)

    def _handle(self, worker: int, header: torch.Tensor) -> None:
        self.started.add(worker)
        kind, step, read_version, lr, wish = header.tolist()
        if kind == Kind.PUSH:
            dist.recv(self.incoming, src=worker, group=self.group, tag=TAG_GRADIENT)
            self.take(worker, int(read_version), lr, self.incoming, BoundaryAction(int(wish)))
        elif kind == Kind.PULL:
            self.idle.discard(worker)
            self._reply([worker])
        elif kind == Kind.IDLE:
            self.idle.add(worker)
            self._flush_if_nobody_can_push()
        elif kind == Kind.SAVE:
            self.saving.add(worker)
            self._flush_if_nobody_can_push()
            if len(self.saving) == self.workers:
                self._save(int(step), BoundaryAction(int(wish)))
        elif kind == Kind.DONE:
            self.finished.add(worker)
        else:
            raise ValueError(f"parameter-server shard: request of unknown kind {kind} from worker {worker}")

    # ----- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a resumed shard continues from; only at a step boundary, where no push is pending."""
        if self.pending is not None or self.waiting:
            raise RuntimeError(
                f"parameter-server shard: asked to save with {len(self.waiting)} pushes unanswered "
                "(not at a step boundary)"
            )
        return {
            "parameters": self.parameters.detach().clone(),
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            "clocks": list(self.clocks),
            "stats": self.stats.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.parameters.copy_(state["parameters"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version, self.clocks = int(state["version"]), [int(c) for c in state["clocks"]]
        self.stats.load_state_dict(state["stats"])

    def _note_wish(self, wish: BoundaryAction) -> None:
        """The coordinator: a worker asks for a checkpoint or a stop. The boundary is the step
        after the furthest clock: no worker has passed it (a worker has at most the push just
        counted unanswered), and every reply from now on tells it."""
        if wish and self.coordinator and self.boundary is None:
            self.boundary = (max(self.clocks) + 1, wish)

    def _save(self, step: int, action: BoundaryAction) -> None:
        """Every worker is at the boundary `step` (SAVE): write this shard's rank file, tell
        each worker, then go on (a checkpoint) or end once rank 0 has gone (a stop)."""
        if self.files is None:
            raise RuntimeError(
                "parameter-server shard: the workers saved a checkpoint but this shard has no resume files"
            )
        if self.boundary is not None and self.boundary[0] != step:
            raise RuntimeError(
                f"parameter-server shard: the workers saved at step {step}, "
                f"the agreed boundary was step {self.boundary[0]}"
            )
        self.stats.wall_s = self._serving_s()
        self.files.save(dist.get_rank(), step, self.state_dict())
        self.saving.clear()
        self.boundary = None
        if action == BoundaryAction.STOP:
            self.files.stopping()  # before rank 0 may go
        done = torch.tensor([float(step)], dtype=torch.float64)
        works = [dist.isend(done, dst=worker, group=self.group, tag=TAG_SAVED) for worker in range(self.workers)]
        for work in works:
            work.wait()
        if action == BoundaryAction.STOP:
            self._end_with_rank0()

    def _next_request(self, header: torch.Tensor) -> int:
        """Receive the next request from any worker into `header`; returns its sender. A wait
        from any source is the one gloo does not end when a peer dies: it is bounded here."""
        training = self.started - self.finished - self.idle - self.saving
        limit = self.comm_timeout_s if training else self.quiet_timeout_s
        work = dist.irecv(header, group=self.group, tag=TAG_REQUEST)
        try:
            work.wait(timeout=datetime.timedelta(seconds=limit))
        except RuntimeError as error:
            what = (
                f"workers {sorted(training)} were training (launcher.comm_timeout_s)"
                if training
                else "every worker was starting or evaluating (launcher.timeout_min)"
            )
            raise TimeoutError(
                f"parameter-server shard: no request from any worker for {limit:.0f} s while {what}; "
                f"a worker is lost or hangs ({str(error).splitlines()[0][:200]})"
            ) from error
        source = work.source_rank()
        return source if self.group is None else dist.get_global_rank(self.group, source)

    def _end_with_rank0(self) -> None:
        """The job is requeued (a preemption, once every process has saved): wait until rank 0
        has gone, then end. A receive from rank 0 (which sends nothing more) fails once its
        process is gone; the workers' waits on this shard then fail in turn, and every task of
        the job ends."""
        try:
            dist.recv(torch.empty(REQUEST_SIZE, dtype=torch.float64), src=0, group=self.group, tag=TAG_REQUEST)
        except Exception:
            pass
        raise SystemExit("parameter-server shard: the job was preempted and rank 0 has gone; ending")

    def _receive_setup(self) -> None:
        setup = torch.empty(len(SETUP_FIELDS), dtype=torch.float64)
        # rank 0 loads its data and builds the model first: a start-up's wait, not a step's
        dist.irecv(setup, src=0, group=self.group, tag=TAG_SETUP).wait(
            timeout=datetime.timedelta(seconds=self.quiet_timeout_s)
        )
        numel, momentum, dampening, weight_decay, nesterov = setup.tolist()
        self.start(torch.empty(int(numel), dtype=VALUE_DTYPE), momentum, dampening, weight_decay, bool(nesterov))
        dist.recv(self.parameters.data, src=0, group=self.group, tag=TAG_PARAMETERS)

    def start(
        self,
        initial: torch.Tensor,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        self.parameters = torch.nn.Parameter(initial.clone())
        self.incoming = torch.empty_like(self.parameters.data)
        # SGD is elementwise: one flat tensor updates exactly like the workers' per-layer tensors
        self.optimizer = torch.optim.SGD(
            [self.parameters],
            lr=0.0,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )

    def take(
        self,
        worker: int,
        read_version: int,
        lr: float,
        gradient: torch.Tensor,
        wish: BoundaryAction = BoundaryAction.NONE,
    ) -> None:
        """One pushed gradient (of the parameters at `read_version`): update, then answer
        every worker that may go on. `wish`: the checkpoint or stop its worker asks for."""
        self.clocks[worker] += 1
        self._note_wish(wish)
        with self.stats.busy(self.clock):
            if self.policy.is_asynchronous:
                self._work("gradient")
                staleness = self.version - read_version
                if self.policy.staleness_lr and staleness > 1:
                    lr /= staleness
                self._apply(gradient, lr, [read_version])
            elif read_version < self.version:
                self.stats.dropped[worker] += 1  # its version was updated without it
            else:
                self._collect(read_version, lr, gradient)
        self.waiting.append((worker, read_version))
        self._answer_allowed()
        self._flush_if_nobody_can_push()

    def _collect(self, read_version: int, lr: float, gradient: torch.Tensor) -> None:
        self._work("gradient")
        if self.pending is None:
            self.pending = VersionGradients(gradient.clone(), lr, 1)
        else:
            self.pending.total += gradient
            self.pending.count += 1
        if self.pending.count >= self.policy.quorum:
            ready, self.pending = self.pending, None
            self._apply(ready.total.div_(ready.count), ready.lr, [read_version] * ready.count)

    def _apply(self, gradient: torch.Tensor, lr: float, read_versions: list[int]) -> None:
        self._work("update")
        self.parameters.grad = gradient
        self.optimizer.param_groups[0]["lr"] = lr
        self.optimizer.step()
        self.parameters.grad = None
        self.stats.staleness.update(self.version - read for read in read_versions)
        self.stats.updates += 1
        self.version += 1

    def _flush_if_nobody_can_push(self) -> None:
        """Synchronous, at an epoch's end or a checkpoint's boundary: when every worker is either
        idle (or saving) or waiting for the current version, no further push can complete that
        version's quorum (each worker pushes the same number of steps, and drops leave some
        versions short): its update is made with the gradients that arrived, and the waiting
        workers go on."""
        if self.policy.is_asynchronous or self.pending is None:
            return
        waiting = {worker for worker, _ in self.waiting}
        if len(self.idle | self.saving | waiting) < self.workers:
            return
        ready, self.pending = self.pending, None
        with self.stats.busy(self.clock):
            self._apply(ready.total.div_(ready.count), ready.lr, [self.version] * ready.count)
        self._answer_allowed()

    def _serving_s(self) -> float:
        return self.clock.seconds(self._start, self.clock.mark())

    def _work(self, kind: str) -> None:
        """`kind` of work on the slice ("gradient" taken in, "update" applied): on the host it
        takes its own time; an emulated shard's clock charges the model's."""
        charge = getattr(self.clock, "shard_work", None)
        if charge is not None:
            charge(kind, self.parameters.numel() * self.parameters.element_size())

    def may_go_on(self, worker: int, read_version: int) -> bool:
        if not self.policy.is_asynchronous:
            return read_version < self.version  # the update of the version it read is made
        return self.clocks[worker] - min(self.clocks) <= self.policy.clock_bound

    def _answer_allowed(self) -> None:
        still_waiting, ready = [], []
        for worker, read_version in self.waiting:
            if self.may_go_on(worker, read_version):
                self.stats.ahead[self.clocks[worker] - min(self.clocks)] += 1
                ready.append(worker)
            else:
                still_waiting.append((worker, read_version))
        self.waiting = still_waiting
        if ready:
            self._reply(ready)

    def _reply(self, workers: list[int]) -> None:
        """The current version and parameters to each of `workers`, all sends in flight at once
        (ps_sync answers all N after an update: one send's wait no longer delays the next);
        the parameters change only after every send is done."""
        step, action = self.boundary or (NO_BOUNDARY, BoundaryAction.NONE)
        version = torch.tensor([float(self.version), float(step), float(action)], dtype=torch.float64)
        works = []
        for worker in workers:
            works.append(dist.isend(version, dst=worker, group=self.group, tag=TAG_VERSION))
            works.append(dist.isend(self.parameters.data, dst=worker, group=self.group, tag=TAG_PARAMETERS))
        for work in works:
            work.wait()
