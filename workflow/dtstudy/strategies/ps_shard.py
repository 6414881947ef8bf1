"""One parameter-server shard: the body of an extra process, shared by every PS strategy.

The strategies differ only in their `UpdatePolicy`: how many gradients of a step make one
update, and how far ahead of the applied updates a worker may run.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .ps_protocol import (
    REQUEST_SIZE,
    SETUP_FIELDS,
    STATS_HEADER_SIZE,
    TAG_GRADIENT,
    TAG_PARAMETERS,
    TAG_REQUEST,
    TAG_SETUP,
    TAG_STATS,
    TAG_VERSION,
    VALUE_DTYPE,
    Kind,
)


@dataclass(frozen=True)
class UpdatePolicy:
    """How a shard turns pushed gradients into updates.

    quorum: the gradients of one step averaged into that step's update; later gradients of
        an applied step are dropped. None: every gradient is an update of its own, at once.
    staleness_bound: a worker may start step t once t - (updates applied) <= bound: the reply
        to its push of step t-1 waits until then (0: for that step's update; inf: never waits).
        Pulls are answered at once.
    """

    quorum: int | None
    staleness_bound: float = 0


@dataclass
class ShardStats:
    """What one shard measured, sent to rank 0 at the end."""

    busy_s: float = 0.0  # applying updates (summing, averaging, the optimizer step)
    wall_s: float = 0.0
    updates: int = 0
    dropped: int = 0  # late gradients of steps already applied
    staleness: Counter = field(default_factory=Counter)  # version at apply - version the worker read

    @contextmanager
    def busy(self):
        start = time.perf_counter()
        yield
        self.busy_s += time.perf_counter() - start

    def histogram(self) -> list[int]:
        return [self.staleness[value] for value in range(max(self.staleness, default=-1) + 1)]

    def send(self, dst: int, group) -> None:
        histogram = self.histogram()
        header = [self.busy_s, self.wall_s, self.updates, self.dropped, len(histogram)]
        dist.send(torch.tensor(header, dtype=torch.float64), dst=dst, group=group, tag=TAG_STATS)
        if histogram:
            dist.send(torch.tensor(histogram, dtype=torch.float64), dst=dst, group=group, tag=TAG_STATS)

    @classmethod
    def receive(cls, src: int, group) -> ShardStats:
        header = torch.empty(STATS_HEADER_SIZE, dtype=torch.float64)
        dist.recv(header, src=src, group=group, tag=TAG_STATS)
        busy_s, wall_s, updates, dropped, length = header.tolist()
        histogram = torch.zeros(int(length), dtype=torch.float64)
        if length:
            dist.recv(histogram, src=src, group=group, tag=TAG_STATS)
        staleness = Counter({value: int(count) for value, count in enumerate(histogram.tolist()) if count})
        return cls(busy_s, wall_s, int(updates), int(dropped), staleness)


@dataclass
class StepGradients:
    """The gradients of one step summed so far."""

    total: torch.Tensor
    lr: float
    read_versions: list[int]


class ShardServer:
    """Owns a slice of the parameters and its optimizer state; answers the N workers."""

    def __init__(self, workers: int, group, policy: UpdatePolicy):
        self.workers, self.group, self.policy = workers, group, policy
        self.version = 0  # updates applied
        self.pending: dict[int, StepGradients] = {}  # step -> its gradients, until the quorum
        self.waiting: list[tuple[int, int]] = []  # (worker, the step it wants to start)
        self.stats = ShardStats()

    def serve(self) -> None:
        self._receive_setup()
        start = time.perf_counter()
        header = torch.empty(REQUEST_SIZE, dtype=torch.float64)
        done = 0
        while done < self.workers:
            worker = dist.recv(header, group=self.group, tag=TAG_REQUEST)
            kind, step, read_version, lr = header.tolist()
            if kind == Kind.PUSH:
                self._push(worker, int(step), int(read_version), lr)
            elif kind == Kind.PULL:
                self._reply(worker)
            elif kind == Kind.STOP:
                self._end_with_rank0()
            else:
                done += 1
        self.stats.wall_s = time.perf_counter() - start
        self.stats.send(dst=0, group=self.group)

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
        dist.recv(setup, src=0, group=self.group, tag=TAG_SETUP)
        numel, momentum, dampening, weight_decay, nesterov = setup.tolist()
        self.parameters = torch.nn.Parameter(torch.empty(int(numel), dtype=VALUE_DTYPE))
        dist.recv(self.parameters.data, src=0, group=self.group, tag=TAG_PARAMETERS)
        self.incoming = torch.empty_like(self.parameters.data)
        # SGD is elementwise: one flat tensor updates exactly like the workers' per-layer tensors
        self.optimizer = torch.optim.SGD(
            [self.parameters], lr=0.0, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=bool(nesterov),
        )

    def _push(self, worker: int, step: int, read_version: int, lr: float) -> None:
        dist.recv(self.incoming, src=worker, group=self.group, tag=TAG_GRADIENT)
        with self.stats.busy():
            if self.policy.quorum is None:
                self._apply(self.incoming, lr, [read_version])
            elif step < self.version:
                self.stats.dropped += 1
            else:
                self._collect(step, read_version, lr)
        self.waiting.append((worker, step + 1))
        self._answer_allowed()

    def _collect(self, step: int, read_version: int, lr: float) -> None:
        gathered = self.pending.get(step)
        if gathered is None:
            self.pending[step] = StepGradients(self.incoming.clone(), lr, [read_version])
        else:
            gathered.total += self.incoming
            gathered.read_versions.append(read_version)
        while (ready := self.pending.get(self.version)) and len(ready.read_versions) >= self.policy.quorum:
            del self.pending[self.version]
            self._apply(ready.total.div_(len(ready.read_versions)), ready.lr, ready.read_versions)

    def _apply(self, gradient: torch.Tensor, lr: float, read_versions: list[int]) -> None:
        self.parameters.grad = gradient
        self.optimizer.param_groups[0]["lr"] = lr
        self.optimizer.step()
        self.parameters.grad = None
        self.stats.staleness.update(self.version - read for read in read_versions)
        self.stats.updates += 1
        self.version += 1

    def _answer_allowed(self) -> None:
        still_waiting = []
        for worker, step in self.waiting:
            if step - self.version <= self.policy.staleness_bound:
                self._reply(worker)
            else:
                still_waiting.append((worker, step))
        self.waiting = still_waiting

    def _reply(self, worker: int) -> None:
        version = torch.tensor([float(self.version)], dtype=torch.float64)
        dist.send(version, dst=worker, group=self.group, tag=TAG_VERSION)
        dist.send(self.parameters.data, dst=worker, group=self.group, tag=TAG_PARAMETERS)
