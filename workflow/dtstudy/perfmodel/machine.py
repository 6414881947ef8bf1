"""What the performance model computes with: links and machines (from a hardware profile), the
workload of one worker, stragglers, and the modelled step with its parts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Link:
    """A link: `latency_s` per message (alpha), `bandwidth` bytes/s (1/beta)."""

    latency_s: float
    bandwidth: float

    def time(self, nbytes: float, messages: float = 1.0) -> float:
        return messages * self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class Machine:
    """The hardware of a projection; links are per GPU inside a node, per node (NIC) between nodes."""

    gpus_per_node: int
    intra: Link  # collectives inside a node (per GPU)
    inter: Link  # between nodes (one NIC per node, shared by its GPUs)
    intra_p2p: Link | None = None  # point-to-point inside a node (default: intra)
    inter_p2p: Link | None = None  # point-to-point between nodes (default: inter)
    #: the fraction of a step's compute that the all-reduce of DDP/Horovod can hide behind
    #: (gradients are handed to the exchange during backward); the same for every case.
    #: Unused for a workload with a layer profile (the wait-free timeline instead)
    overlap: float = 0.0
    #: bytes/s of a memory pass of the compression kernels (cast, quantise) on a worker
    compression_bandwidth: float | None = None
    #: bytes/s of a memory pass of a parameter-server shard (sum, SGD) on its CPU
    server_bandwidth: float | None = None
    #: measured seconds per gradient byte of each strategy's compression, and per parameter
    #: byte of gossip's averaging ("gossip"); overrides the passes
    compression_s_per_byte: dict = field(default_factory=dict)
    #: natural step-time jitter: E[max of 2 workers' step] - mean, as a share of the step
    #: (measured on this machine; 0 = identical workers). Other N: Gaussian order statistics
    skew_fraction: float = 0.0
    #: {k: factor}: compute time with k busy workers on a node over that of 1 (shared cores
    #: of this machine: the share of a core one process gets over the share each of k get)
    compute_scale: dict = field(default_factory=dict)
    #: how an all-reduce spans nodes (ALLREDUCE_ALGORITHMS): "hierarchical" (inside each node,
    #: then across the nodes) or "ring" (one ring through every GPU, as NCCL's ring)
    allreduce_algorithm: str = "hierarchical"
    #: seconds one worker's push-and-reply round trip to the shards costs beyond their links
    #: and their update: the protocol's own work (the request messages, the shard's receive
    #: from any worker, the wake-ups of both processes). Measured on this machine from the
    #: N=1 parameter-server runs (calibration.ps_request_from_runs); 0 = not modelled
    ps_request_s: float = 0.0

    @property
    def p2p_intra(self) -> Link:
        return self.intra_p2p or self.intra

    @property
    def p2p_inter(self) -> Link:
        return self.inter_p2p or self.inter

    def nodes(self, workers: int) -> int:
        return math.ceil(workers / self.gpus_per_node)

    def local(self, workers: int) -> int:
        return min(workers, self.gpus_per_node)


@dataclass(frozen=True)
class LayerProfile:
    """An architecture's parameter tensors in the order backprop produces their gradients:
    (values, share of backward's FLOPs done when the gradient is ready); and backward's
    share of a step's compute (dtstudy.projection.layer_profiles ships them)."""

    name: str
    tensors: tuple[tuple[int, float], ...]
    backward_share: float
    column_groups: int = 0  # 1-bit's `column` groups over all tensors (first dimension, a vector one)
    #: the fully connected layers, (inputs, outputs) in forward order (hybrid's model-parallel part)
    linear: tuple[tuple[int, int], ...] = ()
    #: positions in `tensors` of those layers' weights and biases
    linear_tensors: frozenset[int] = frozenset()

    def without_linear(self) -> LayerProfile:
        """The profile of the other layers alone (the data-parallel part of hybrid), each
        tensor still ready when it was in the whole network's backward."""
        kept = tuple(t for i, t in enumerate(self.tensors) if i not in self.linear_tensors)
        return LayerProfile(f"{self.name} without its fully connected layers", kept, self.backward_share)

    def buckets(self, cap_bytes: float, bytes_per_value: float) -> list[tuple[float, float]]:
        """(bytes, ready share) per bucket: tensors in backprop order fill a bucket until it
        holds cap_bytes or more (DDP's assignment by size, Horovod's fusion buffer); a bucket
        is ready with its last tensor."""
        out, size = [], 0.0
        for values, ready in self.tensors:
            size += values * bytes_per_value
            if size >= cap_bytes:
                out.append((size, ready))
                size = 0.0
        if size:
            out.append((size, self.tensors[-1][1]))
        return out


@dataclass(frozen=True)
class Workload:
    """What is measured of the model on one worker."""

    parameters: int
    bytes_per_parameter: int
    batch: int  # per worker
    compute_s: float  # one step's forward, backward, update (and batch assembly) at N=1
    tensors: int = 0  # parameter tensors (1-bit's `tensor` quantiser sends one scale each); 0 = not counted
    column_groups: int = 0  # 1-bit's `column` groups (two fp32 levels each); 0 = not counted
    #: the gradient's tensors as matrices (rows, the rest; a vector as (n, 1)), for a strategy
    #: whose bytes depend on their shapes (PowerSGD's factors); None = not known
    matrices: tuple[tuple[int, int], ...] | None = None
    #: {strategy: its bytes a step over the plain all-reduce's of the gradient}, as its runs
    #: at N > 1 measured them, for such a strategy (StrategySpec.needs_matrices) to read first
    measured_share: dict[str, float] = field(default_factory=dict, hash=False)
    #: where the parameters sit (wait-free-backprop overlap); None = the machine's fixed overlap
    layers: LayerProfile | None = None
    #: the fully connected layers, (inputs, outputs) in forward order, where the layer profile
    #: does not say (e.g. a checkpoint's 2-d weights); None = the profile's
    linear: tuple[tuple[int, int], ...] | None = None

    @property
    def fully_connected(self) -> tuple[tuple[int, int], ...]:
        """The fully connected layers (hybrid's model-parallel part): `linear`, else the
        layer profile's; () where neither says."""
        if self.linear is not None:
            return self.linear
        return self.layers.linear if self.layers is not None else ()

    @property
    def linear_parameters(self) -> int:
        """Weights and biases of the fully connected layers (0 where not known)."""
        return sum((n_in + 1) * n_out for n_in, n_out in self.fully_connected)

    @property
    def model_bytes(self) -> float:
        return float(self.parameters * self.bytes_per_parameter)


@dataclass(frozen=True)
class Stragglers:
    """The study's `stragglers` config: `count` slow workers of N (or `fraction` of N)."""

    delay_s: float = 0.0
    distribution: str = "fixed"
    fraction: float = 0.0
    count: int | None = None  # fixed number of slow workers (config `ranks`)

    @classmethod
    def from_config(cls, stragglers: dict | None) -> Stragglers:
        """From the study's `stragglers` keys (ranks or fraction, delay_ms, distribution; the
        seed draws which workers, which the expectations do not need)."""
        if not stragglers:
            return cls()
        count = len(stragglers["ranks"]) if stragglers.get("ranks") else None
        return cls(
            delay_s=stragglers.get("delay_ms", 0) / 1000.0,
            distribution=stragglers.get("distribution", "fixed"),
            fraction=stragglers.get("fraction", 0.0),
            count=count,
        )

    def slow(self, workers: int) -> int:
        if self.delay_s <= 0:
            return 0
        count = self.count if self.count is not None else round(self.fraction * workers)
        return min(count, workers)


NO_STRAGGLERS = Stragglers()


@dataclass(frozen=True)
class Step:
    """One step of one strategy at N workers: the time and its parts (seconds)."""

    strategy: str
    workers: int
    step_s: float  # wall time per step (per worker cycle for the asynchronous ones)
    compute_s: float
    exchange_s: float  # the whole exchange, hidden or not (communication + compression)
    exposed_s: float  # the part of the exchange on the critical path
    server_s: float = 0.0  # parameter-server work on the critical path (or its round time)
    straggler_s: float = 0.0  # waiting for slow workers
    throughput: float = 0.0  # images/s over all workers
    bound: str = "compute"
    overlap: str = "none"  # how the exchange overlaps backward (overlap_used)
