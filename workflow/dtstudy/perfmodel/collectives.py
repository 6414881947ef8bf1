"""Latency-bandwidth (alpha-beta) times of the collectives on a machine: ring, hierarchical and
flat-ring all-reduce, all-gather, all-to-all."""

from __future__ import annotations

from dtstudy.perfmodel.machine import Link, Machine


def ring_allreduce_bytes(payload_bytes: float, workers: int) -> float:
    """Bytes one worker sends in a ring all-reduce of `payload_bytes`: 2 (N-1)/N of it (what the
    strategies count as sent, and what the calibration reads back from their runs)."""
    return 2.0 * (workers - 1) / workers * payload_bytes


def ring_allreduce_time(nbytes: float, participants: int, link: Link, messages: int = 1) -> float:
    """Ring all-reduce: 2 (p-1) steps of alpha per message, 2 (p-1)/p of the bytes per link."""
    if participants <= 1:
        return 0.0
    p = participants
    return 2 * (p - 1) * messages * link.latency_s + 2 * (p - 1) / p * nbytes / link.bandwidth


def hierarchical_allreduce_time(nbytes: float, workers: int, machine: Machine, messages: int = 1) -> float:
    """Hierarchical all-reduce: reduce-scatter inside the node, all-reduce across the nodes
    (each GPU its 1/g slice, the g slices sharing the node's NIC: 2 (n-1)/n of the bytes per
    node link), all-gather inside the node. One node: a plain ring."""
    local, nodes = machine.local(workers), machine.nodes(workers)
    intra = ring_allreduce_time(nbytes, local, machine.intra, messages)
    inter = ring_allreduce_time(nbytes, nodes, machine.inter, messages)
    return intra + inter


def flat_ring_allreduce_time(nbytes: float, workers: int, machine: Machine, messages: int = 1) -> float:
    """One ring through all N GPUs, node after node (NCCL's ring; Horovod's only all-reduce
    until its hierarchical mode of mid-2018): 2(N-1) steps per message, of which 2(n-1) cross
    a node boundary (alpha between nodes, NCCL's own count) and the others stay inside; every
    link carries the ring's one stream each way, so 2(N-1)/N of the bytes go at the slowest
    link's rate, all links at once. One node: the plain ring inside."""
    nodes = machine.nodes(workers)
    if nodes == 1:
        return ring_allreduce_time(nbytes, workers, machine.intra, messages)
    steps, crossing = 2 * (workers - 1), 2 * (nodes - 1)
    latency = (steps - crossing) * machine.intra.latency_s + crossing * machine.inter.latency_s
    bandwidth = min(machine.intra.bandwidth, machine.inter.bandwidth)
    return messages * latency + steps / workers * nbytes / bandwidth


#: Machine.allreduce_algorithm -> the time of an all-reduce of nbytes over N workers
ALLREDUCE_ALGORITHMS = {"hierarchical": hierarchical_allreduce_time, "ring": flat_ring_allreduce_time}


def allreduce_time(nbytes: float, workers: int, machine: Machine, messages: int = 1) -> float:
    """An all-reduce as the machine's `allreduce_algorithm` spans its nodes."""
    return ALLREDUCE_ALGORITHMS[machine.allreduce_algorithm](nbytes, workers, machine, messages)


def allgather_time(nbytes_each: float, workers: int, machine: Machine, messages: int = 1) -> float:
    """All-gather of `nbytes_each` from every worker: (p-1) messages per worker inside a node;
    each node's NIC brings in the (N - g) messages of the other nodes."""
    local, nodes = machine.local(workers), machine.nodes(workers)
    t = 0.0
    if local > 1:
        t += (local - 1) * messages * machine.intra.latency_s + (local - 1) * nbytes_each / machine.intra.bandwidth
    if nodes > 1:
        t += (nodes - 1) * messages * machine.inter.latency_s + (
            workers - local
        ) * nbytes_each / machine.inter.bandwidth
    return t


def alltoall_time(nbytes_each: float, workers: int, machine: Machine, messages: int = 1) -> float:
    """All-to-all: every worker sends its own `nbytes_each` to each of the others (N-1
    messages). Inside a node each GPU's link carries (g-1) of them; between nodes each node's
    NIC carries its g workers' messages to the N - g others, g (N - g) of them (no message
    is forwarded, unlike an all-gather's)."""
    local, nodes = machine.local(workers), machine.nodes(workers)
    t = 0.0
    if local > 1:
        t += (local - 1) * messages * machine.intra.latency_s + (local - 1) * nbytes_each / machine.intra.bandwidth
    if nodes > 1:
        remote = workers - local
        t += remote * messages * machine.inter.latency_s + local * remote * nbytes_each / machine.inter.bandwidth
    return t
