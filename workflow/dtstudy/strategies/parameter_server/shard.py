"""One parameter-server shard: the body of an extra process, shared by every PS strategy.

The strategies differ only in their `UpdatePolicy`: how many gradients of a step make one
update, and how far ahead of the applied updates a worker may run.
"""

from __future__ import annotations

import datetime
import math
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dtstudy.strategies.parameter_server.protocol import Kind, REQUEST_SIZE, SETUP_FIELDS, STATS_HEADER_SIZE, TAG_GRADIENT, TAG_PARAMETERS, TAG_REQUEST, TAG_SETUP, TAG_STATS, TAG_VERSION, VALUE_DTYPE


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
    def synchronous(cls, quorum: int) -> "UpdatePolicy":
        """The first `quorum` pushes of a version make its update (ps_sync: all N; ps_backup: N-k)."""
        return cls(quorum=quorum)

    @classmethod
    def asynchronous(cls, clock_bound: float = math.inf, staleness_lr: bool = False) -> "UpdatePolicy":
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
    def busy(self):
        start = time.perf_counter()
        yield
        self.busy_s += time.perf_counter() - start

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
        dropped, staleness, ahead = values[:workers], values[workers:workers + stale_length], values[workers + stale_length:]
        as_counter = lambda histogram: Counter({v: c for v, c in enumerate(histogram) if c})  # noqa: E731
        return cls(workers, busy_s, wall_s, updates, dropped, as_counter(staleness), as_counter(ahead))


@dataclass
class VersionGradients:
    """The gradients that read the current version, summed so far."""

    total: torch.Tensor
    lr: float
    count: int


class ShardServer:
    """Owns a slice of the parameters and its optimizer state; answers the N workers."""

    def __init__(self, workers: int, group, policy: UpdatePolicy, comm_timeout_s: float = 1800.0,
                 quiet_timeout_s: float = 1800.0):
        self.workers, self.group, self.policy = workers, group, policy
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
        self.stats = ShardStats(workers)

    def serve(self) -> None:
        self._receive_setup()
        start = time.perf_counter()
        header = torch.empty(REQUEST_SIZE, dtype=torch.float64)
        done = 0
        while done < self.workers:
            worker = self._next_request(header)
            self.started.add(worker)
            kind, _step, read_version, lr = header.tolist()
            if kind == Kind.PUSH:
                dist.recv(self.incoming, src=worker, group=self.group, tag=TAG_GRADIENT)
                self.take(worker, int(read_version), lr, self.incoming)
            elif kind == Kind.PULL:
                self.idle.discard(worker)
                self._reply(worker)
            elif kind == Kind.IDLE:
                self.idle.add(worker)
                self._flush_if_nobody_can_push()
            elif kind == Kind.STOP:
                self._end_with_rank0()
            else:
                self.finished.add(worker)
                done += 1
        self.stats.wall_s = time.perf_counter() - start
        self.stats.send(dst=0, group=self.group)

    def _next_request(self, header: torch.Tensor) -> int:
        """Receive the next request from any worker into `header`; returns its sender. A wait
        from any source is the one gloo does not end when a peer dies: it is bounded here."""
        training = self.started - self.finished - self.idle
        limit = self.comm_timeout_s if training else self.quiet_timeout_s
        work = dist.irecv(header, group=self.group, tag=TAG_REQUEST)
        try:
            work.wait(timeout=datetime.timedelta(seconds=limit))
        except RuntimeError as error:
            what = (f"workers {sorted(training)} were training (launcher.comm_timeout_s)" if training
                    else "every worker was starting or evaluating (launcher.timeout_min)")
            raise TimeoutError(f"parameter-server shard: no request from any worker for {limit:.0f} s while {what}; "
                               f"a worker is lost or hangs ({str(error).splitlines()[0][:200]})") from error
        source = work.source_rank()
        return source if self.group is None else dist.get_global_rank(self.group, source)

    def _end_with_rank0(self) -> None:
        """The job is requeued (preemption): wait until rank 0 has gone, then end. A receive
        from rank 0 (which sends nothing more) fails once its process is gone; the workers'
        waits on this shard then fail in turn, and every task of the job ends."""
        try:
            dist.recv(torch.empty(REQUEST_SIZE, dtype=torch.float64), src=0, group=self.group, tag=TAG_REQUEST)
        except Exception:
            pass
        raise SystemExit("parameter-server shard: the job was preempted and rank 0 requeued it; ending")

    def _receive_setup(self) -> None:
        setup = torch.empty(len(SETUP_FIELDS), dtype=torch.float64)
        # rank 0 loads its data and builds the model first: a start-up's wait, not a step's
        dist.irecv(setup, src=0, group=self.group, tag=TAG_SETUP).wait(timeout=datetime.timedelta(seconds=self.quiet_timeout_s))
        numel, momentum, dampening, weight_decay, nesterov = setup.tolist()
        self.start(torch.empty(int(numel), dtype=VALUE_DTYPE), momentum, dampening, weight_decay, bool(nesterov))
        dist.recv(self.parameters.data, src=0, group=self.group, tag=TAG_PARAMETERS)

    def start(self, initial: torch.Tensor, momentum: float = 0.0, dampening: float = 0.0,
              weight_decay: float = 0.0, nesterov: bool = False) -> None:
        self.parameters = torch.nn.Parameter(initial.clone())
        self.incoming = torch.empty_like(self.parameters.data)
        # SGD is elementwise: one flat tensor updates exactly like the workers' per-layer tensors
        self.optimizer = torch.optim.SGD([self.parameters], lr=0.0, momentum=momentum, dampening=dampening,
                                         weight_decay=weight_decay, nesterov=nesterov)

    def take(self, worker: int, read_version: int, lr: float, gradient: torch.Tensor) -> None:
        """One pushed gradient (of the parameters at `read_version`): update, then answer
        every worker that may go on."""
        self.clocks[worker] += 1
        with self.stats.busy():
            if self.policy.is_asynchronous:
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
        if self.pending is None:
            self.pending = VersionGradients(gradient.clone(), lr, 1)
        else:
            self.pending.total += gradient
            self.pending.count += 1
        if self.pending.count >= self.policy.quorum:
            ready, self.pending = self.pending, None
            self._apply(ready.total.div_(ready.count), ready.lr, [read_version] * ready.count)

    def _apply(self, gradient: torch.Tensor, lr: float, read_versions: list[int]) -> None:
        self.parameters.grad = gradient
        self.optimizer.param_groups[0]["lr"] = lr
        self.optimizer.step()
        self.parameters.grad = None
        self.stats.staleness.update(self.version - read for read in read_versions)
        self.stats.updates += 1
        self.version += 1

    def _flush_if_nobody_can_push(self) -> None:
        """Synchronous, at an epoch's end: when every worker is either idle or waiting for the
        current version, no further push can complete that version's quorum (each worker
        pushes the same number of steps, and drops leave some versions short): its update is
        made with the gradients that arrived, and the waiting workers go on."""
        if self.policy.is_asynchronous or self.pending is None:
            return
        waiting = {worker for worker, _ in self.waiting}
        if len(self.idle | waiting) < self.workers:
            return
        ready, self.pending = self.pending, None
        with self.stats.busy():
            self._apply(ready.total.div_(ready.count), ready.lr, [self.version] * ready.count)
        self._answer_allowed()

    def may_go_on(self, worker: int, read_version: int) -> bool:
        if not self.policy.is_asynchronous:
            return read_version < self.version  # the update of the version it read is made
        return self.clocks[worker] - min(self.clocks) <= self.policy.clock_bound

    def _answer_allowed(self) -> None:
        still_waiting = []
        for worker, read_version in self.waiting:
            if self.may_go_on(worker, read_version):
                self.stats.ahead[self.clocks[worker] - min(self.clocks)] += 1
                self._reply(worker)
            else:
                still_waiting.append((worker, read_version))
        self.waiting = still_waiting

    def _reply(self, worker: int) -> None:
        version = torch.tensor([float(self.version)], dtype=torch.float64)
        dist.send(version, dst=worker, group=self.group, tag=TAG_VERSION)
        dist.send(self.parameters.data, dst=worker, group=self.group, tag=TAG_PARAMETERS)
