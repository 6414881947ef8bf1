"""The cluster's clock of an emulated run: each logical worker's emulated seconds.

`EmulatedClock` is a dtstudy.common.timing Clock: the training loop's StepTimer and the
strategy's CommMeter read it as they read a GPU's events, so a step's seconds, its
compute/exchange split and time-to-accuracy are the emulated cluster's. Time moves only by:

- a step's compute (`step_begins`, called by the StepTimer when a step starts): the
  performance model's compute seconds of one worker's step on the hardware profile (its
  batch / one GPU's training rate, scaled for the busy workers of a node as the model does),
  with the profile's natural jitter (`skew_fraction`: the Gaussian spread the model's
  barrier wait assumes), drawn per worker from the run's seed;
- a straggler's delay (`sleep`: dtstudy.training.stragglers sleeps on the step's clock, this one);
- an exchange: a collective ends at max(arrivals) + `ExchangeCosts.collective`, a message
  arrives after `ExchangeCosts.message` (dtstudy.emulation.process_group);
- a parameter-server shard's work (`ShardClock.shard_work`): the performance model's memory
  passes over the shard's slice (dtstudy.perfmodel.steps.shard_passes_time, one per
  gradient taken in and four per update) at the profile's `server_gbyte_s`.

A shard (global rank N + s) sits where the model puts it (`placement`, as
dtstudy.perfmodel.steps.ps_phase_time): `colocated` on the workers' node s mod nodes,
`dedicated` on a node of its own; its messages cross a node's link or stay inside one
accordingly.
"""

from __future__ import annotations

import math
import random

from dtstudy.perfmodel.collectives import allgather_time, allreduce_time, alltoall_time
from dtstudy.perfmodel.machine import Machine
from dtstudy.perfmodel.steps import SERVER_PASSES_PER_GRADIENT, SERVER_PASSES_PER_UPDATE, memory_passes_time


class ExchangeCosts:
    """Seconds of each exchange on `machine` (dtstudy.perfmodel.collectives; the N workers
    fill the nodes in order, `gpus_per_node` each, as a job's tasks do; ranks from `workers`
    on are a parameter server's shards, placed by `placement`)."""

    PLACEMENTS = ("colocated", "dedicated")

    def __init__(self, machine: Machine, workers: int | None = None, placement: str = "colocated"):
        if placement not in self.PLACEMENTS:
            raise ValueError(f"shard placement {placement!r}; allowed: {', '.join(self.PLACEMENTS)}")
        self.machine, self.workers, self.placement = machine, workers, placement
        self._free: dict[tuple[str, int], float] = {}  # a link's way (out of, into a rank or node): busy until

    def node(self, rank: int) -> int:
        """The node global rank `rank` runs on."""
        if self.workers is None or rank < self.workers:
            return rank // self.machine.gpus_per_node
        shard, nodes = rank - self.workers, self.machine.nodes(self.workers)
        return shard % nodes if self.placement == "colocated" else nodes + shard

    def collective(self, kind: str, nbytes: float, members: list[int]) -> float:
        """`nbytes`: the tensor all-reduced or broadcast; each worker's contribution to an
        all-gather or a gather; each worker's output of a reduce-scatter; what each worker sends each
        other one in an all-to-all."""
        p, machine = len(members), self.machine
        if p <= 1:
            return 0.0
        if kind in ("allreduce", "barrier"):
            return allreduce_time(nbytes, p, machine)
        if kind == "broadcast":  # scatter then all-gather: each worker gets its 1/p from the root
            return allgather_time(nbytes / p, p, machine)
        # a ring's (p-1) steps of one worker's share (a gather: the root's link takes the same)
        if kind in ("allgather", "reduce_scatter", "gather"):
            return allgather_time(nbytes, p, machine)
        if kind == "alltoall":
            return alltoall_time(nbytes, p, machine)
        raise ValueError(f"no cost for collective {kind!r}")

    def message(self, nbytes: float, src: int, dst: int) -> float:
        """A point-to-point message between two global ranks, on links of its own."""
        return self._link(src, dst).time(nbytes)

    def deliver(self, nbytes: float, src: int, dst: int, sent: float) -> float:
        """When a message sent at emulated time `sent` arrives, its links shared: its bytes wait
        for the messages before them on the sender's way out and the receiver's way in (a GPU's
        link inside a node, the node's NIC between nodes; full duplex), as the model's busiest
        link carries all its bytes (ps_phase_time: a shard's link takes every worker's slice)."""
        link = self._link(src, dst)
        if self.node(src) == self.node(dst):
            ways = [("out", src), ("in", dst)]
        else:
            ways = [("nic out", self.node(src)), ("nic in", self.node(dst))]
        start = max([sent] + [self._free.get(way, 0.0) for way in ways])
        for way in ways:
            self._free[way] = start + nbytes / link.bandwidth  # the latency is pipelined
        return start + link.time(nbytes)

    def _link(self, src: int, dst: int):
        return self.machine.p2p_intra if self.node(src) == self.node(dst) else self.machine.p2p_inter


class EmulatedClock:
    """One logical worker's clock (a timing.Clock): marks are its emulated seconds."""

    lag = 0  # nothing runs behind the host
    kind = "emulated"

    def __init__(self, scheduler, rank: int, compute_s: float, skew_fraction: float, seed: int):
        self.scheduler, self.rank = scheduler, rank
        self.compute_s = compute_s
        # the model's sigma of one worker's step: E[max of 2] - mean = sigma / sqrt(pi)
        self.sigma = skew_fraction * math.sqrt(math.pi) * compute_s
        self.rng = random.Random(f"emulate-jitter-{seed}-{rank}")
        self.compute_total_s = 0.0

    def mark(self) -> float:
        return self.scheduler.time[self.rank]

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def step_begins(self) -> None:
        """A training step starts: its compute, on the profile's GPU."""
        seconds = self.compute_s
        if self.sigma > 0:
            seconds = max(0.0, seconds + self.rng.gauss(0.0, self.sigma))
        self.compute_total_s += seconds
        self.scheduler.advance(self.rank, seconds)

    def sleep(self, seconds: float) -> None:
        """A delay (a straggler's): the worker's emulated time moves on, the host's does not."""
        self.scheduler.advance(self.rank, seconds)


class ShardClock(EmulatedClock):
    """A parameter-server shard's clock: it trains no steps; its work on the pushes is the
    performance model's (memory passes over its slice at `server_bandwidth` bytes/s; None or
    0: not modelled, as the model's shard_passes_time)."""

    #: memory passes over the shard's slice per piece of work (dtstudy.perfmodel.steps)
    PASSES = {"gradient": SERVER_PASSES_PER_GRADIENT, "update": SERVER_PASSES_PER_UPDATE}

    def __init__(self, scheduler, rank: int, server_bandwidth: float | None):
        super().__init__(scheduler, rank, compute_s=0.0, skew_fraction=0.0, seed=0)
        self.server_bandwidth = server_bandwidth
        self.work_s = 0.0

    def shard_work(self, kind: str, nbytes: float) -> None:
        """The shard did `kind` of work (a gradient taken in, an update applied) on `nbytes`."""
        seconds = memory_passes_time(self.PASSES[kind], nbytes, self.server_bandwidth)
        if seconds:
            self.work_s += seconds
            self.scheduler.advance(self.rank, seconds)
