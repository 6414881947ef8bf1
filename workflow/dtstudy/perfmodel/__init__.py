"""Latency-bandwidth (alpha-beta) model of one training step of every strategy on N workers."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Callable

from dtstudy.strategies.specs import SPECS

# ----- the machines: links and what a profile says -------------------------------------


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
    powersgd_ratio: float | None = None  # bytes PowerSGD reduces / the gradient's bytes
    #: where the parameters sit (wait-free-backprop overlap); None = the machine's fixed overlap
    layers: LayerProfile | None = None

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
        return cls(delay_s=stragglers.get("delay_ms", 0) / 1000.0, distribution=stragglers.get("distribution", "fixed"),
                   fraction=stragglers.get("fraction", 0.0), count=count)

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


# ----- collectives ------------------------------------------------------------------


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
        t += (nodes - 1) * messages * machine.inter.latency_s + (workers - local) * nbytes_each / machine.inter.bandwidth
    return t


# ----- stragglers as order statistics -------------------------------------------------


def expected_order_statistic(distribution: str, mean_s: float, j: int, k: int) -> float:
    """E of the j-th smallest of k iid delays (j = k: the maximum): fixed = mean; uniform on
    [0, 2 mean]: 2 mean j/(k+1); exponential: mean * sum_{i<j} 1/(k-i) (the max: mean H_k)."""
    if j <= 0 or k <= 0:
        return 0.0
    if distribution == "fixed":
        return mean_s
    if distribution == "uniform":
        return 2 * mean_s * j / (k + 1)
    if distribution == "exponential":
        return mean_s * sum(1.0 / (k - i) for i in range(j))
    raise ValueError(f"unknown straggler distribution {distribution!r}")


def expected_max_of_window_means(distribution: str, mean_s: float, k: int, window: int) -> float:
    """E[max over k workers of the mean of `window` iid delays]: what a worker waits per step
    when workers meet every `window` steps (local SGD's H, EASGD's tau) or may run
    `window - 1` steps ahead (SSP). window 1: the maximum of k draws."""
    if k <= 0:
        return 0.0
    if window <= 1 or distribution == "fixed":
        return expected_order_statistic(distribution, mean_s, k, k)
    # the sum of `window` draws has an Erlang (exponential) or Irwin-Hall (uniform) law;
    # E[max] = integral of 1 - F(x)^k, on a grid
    upper = mean_s * window * (2.0 if distribution == "uniform" else 1.0) + (
        0.0 if distribution == "uniform" else 12 * mean_s * math.sqrt(window))
    points = 4000
    dx = upper / points
    total = 0.0
    for i in range(points):
        x = (i + 0.5) * dx
        total += (1.0 - _window_cdf(distribution, mean_s, window, x) ** k) * dx
    return total / window


def _window_cdf(distribution: str, mean_s: float, window: int, x: float) -> float:
    if distribution == "exponential":
        y = x / mean_s
        term, acc = 1.0, 1.0
        for i in range(1, window):
            term *= y / i
            acc += term
        return 1.0 - math.exp(-y) * acc
    if window > 20:  # Irwin-Hall's alternating sum loses all precision: its normal limit
        mean, sd = window * mean_s, math.sqrt(window / 3) * mean_s
        return 0.5 * math.erfc(-(x - mean) / (sd * math.sqrt(2)))
    # Irwin-Hall of `window` uniforms on [0, 2 mean]
    y = x / (2 * mean_s)
    if y >= window:
        return 1.0
    return sum((-1) ** i * math.comb(window, i) * (y - i) ** window for i in range(int(y) + 1)) / math.factorial(window)


@functools.lru_cache(maxsize=None)
def expected_normal_order_statistic(j: int, k: int) -> float:
    """E of the j-th smallest of k standard normal draws (numerically, in logs so that large
    k stays finite; j = k: the maximum)."""
    if k <= 1:
        return 0.0
    log_coefficient = math.lgamma(k + 1) - math.lgamma(j) - math.lgamma(k - j + 1)
    total, points, low, high = 0.0, 4000, -9.0, 9.0
    dx = (high - low) / points
    for i in range(points):
        x = low + (i + 0.5) * dx
        cdf = 0.5 * math.erfc(-x / math.sqrt(2))
        survival = 0.5 * math.erfc(x / math.sqrt(2))
        if cdf <= 0 or survival <= 0:
            continue
        log_density = log_coefficient + (j - 1) * math.log(cdf) + (k - j) * math.log(survival) - x * x / 2
        total += x * math.exp(log_density) / math.sqrt(2 * math.pi) * dx
    return total


def natural_wait(machine: Machine, compute_s: float, participants: int, window: int = 1,
                 waits_for: int | None = None) -> float:
    """What a barrier over `participants` identical workers waits for their natural jitter:
    sigma = skew_fraction sqrt(pi) compute (E[max of 2] - mean = sigma / sqrt(pi)), the
    mean over `window` steps (sigma / sqrt(window)), Gaussian order statistics."""
    if machine.skew_fraction <= 0 or participants <= 1:
        return 0.0
    sigma = machine.skew_fraction * math.sqrt(math.pi) * compute_s / math.sqrt(window)
    j = participants if waits_for is None else waits_for
    return max(0.0, sigma * expected_normal_order_statistic(j, participants))


def synchronous_wait(stragglers: Stragglers, workers: int, window: int = 1, waits_for: int | None = None) -> float:
    """Expected extra seconds per step of a barrier over N workers of which `slow(N)` draw a
    delay: the slowest (order statistic), or the `waits_for`-th arrival (backup workers)."""
    slow = stragglers.slow(workers)
    if slow == 0:
        return 0.0
    needed = workers if waits_for is None else waits_for
    fast = workers - slow
    if needed <= fast:  # the needed arrivals are all fast workers
        return 0.0
    if needed == workers:
        return expected_max_of_window_means(stragglers.distribution, stragglers.delay_s, slow, window)
    return expected_order_statistic(stragglers.distribution, stragglers.delay_s, needed - fast, slow)


def mean_delay(stragglers: Stragglers, workers: int) -> float:
    """The mean delay per step over the N workers (what asynchronous workers see on average)."""
    return stragglers.delay_s * stragglers.slow(workers) / workers if workers else 0.0


# ----- the strategies --------------------------------------------------------------

ModelFn = Callable[[Workload, Machine, int, dict, Stragglers], Step]
MODELS: dict[str, ModelFn] = {}

#: memory passes over the gradient bytes of each compression on a worker (used when a
#: profile gives `compression_gbyte_s` and no measured seconds per byte): a 16-bit cast
#: reads 4 and writes 2 bytes per value and back (~3 passes of the fp32 bytes); 1-bit:
#: residual add, |x| mean, sign pack, dequantise and new residual (~6 passes); PowerSGD
#: rank r: two matrix products over the gradient and the error feedback (~6 passes)
COMPRESSION_PASSES = {"allreduce_fp16": 3.0, "allreduce_bf16": 3.0, "allreduce_onebit": 6.0,
                      "allreduce_powersgd": 6.0}
#: memory passes over the parameter bytes of a gossip step's averaging with one neighbour
#: (flatten: 2, stack of 2 copies: 4, their mean: 3, copy back: 2); with d neighbours
#: the work is taken as growing with the 1 + d vectors averaged (gossip_mixing_time)
GOSSIP_MIX_PASSES = 11.0
#: memory passes of a shard per pushed gradient (accumulate) and per update (momentum, decay, step)
SERVER_PASSES_PER_GRADIENT = 1.0
SERVER_PASSES_PER_UPDATE = 4.0


def model(name: str):
    def register(fn: ModelFn) -> ModelFn:
        MODELS[name] = fn
        return fn

    return register


def _finish(strategy, workload, workers, compute, exchange, exposed, server=0.0, straggler=0.0) -> Step:
    """A synchronous step: compute + exposed exchange + shard work + waiting; bound = the largest."""
    step_s = compute + exposed + server + straggler
    throughput = workers * workload.batch / step_s
    parts = {"compute": compute, "network": exposed, "server": server, "straggler": straggler}
    bound = max(parts, key=parts.get)
    return Step(strategy, workers, step_s, compute, exchange, exposed, server, straggler, throughput, bound)


def compression_time(strategy: str, nbytes: float, machine: Machine) -> float:
    """Seconds a worker spends compressing and decompressing `nbytes` of gradients."""
    if strategy in machine.compression_s_per_byte:
        return machine.compression_s_per_byte[strategy] * nbytes
    if machine.compression_bandwidth:
        return COMPRESSION_PASSES[strategy] * nbytes / machine.compression_bandwidth
    return 0.0


def gossip_mixing_time(nbytes: float, degree: int, machine: Machine) -> float:
    """Seconds a gossip worker spends averaging its `nbytes` of parameters with `degree`
    neighbours' (the measured kernel is for one neighbour: 2 vectors; scaled by (1+d)/2)."""
    scale = (1 + degree) / 2
    if "gossip" in machine.compression_s_per_byte:
        return machine.compression_s_per_byte["gossip"] * nbytes * scale
    if machine.compression_bandwidth:
        return GOSSIP_MIX_PASSES * nbytes * scale / machine.compression_bandwidth
    return 0.0


#: DDP's default bucket (MiB)
DEFAULT_BUCKET_MB = 25


def buckets(nbytes: float, params: dict) -> int:
    """DDP's gradient buckets (one all-reduce each): bucket_cap_mb MiB."""
    return max(1, math.ceil(nbytes / (params.get("bucket_cap_mb", DEFAULT_BUCKET_MB) * 2**20)))


def wait_free_exposed(timeline: list[tuple[float, ...]], backward_s: float) -> float:
    """Wait-free backprop (Zhang et al. 2017, Poseidon; DDP's buckets, Li et al. 2020):
    `timeline` = per bucket (seconds after backward starts when backprop has produced it, seconds its
    exchange takes), in backprop order; each exchange starts when its bucket is ready and
    the previous exchange is done. More than one duration: stages on separate links (a sum
    inside the node, then a push through the NIC), each bucket through them in turn, each
    link one bucket at a time. The exposed part: the last one's end past backward's end."""
    ends: list[float] = []
    for ready_s, *stages_s in timeline:
        ends += [0.0] * (len(stages_s) - len(ends))
        done = ready_s
        for k, stage_s in enumerate(stages_s):
            done = ends[k] = max(ends[k], done) + stage_s
    return max(0.0, (ends[-1] if ends else 0.0) - backward_s)


def _overlapped(workload: Workload, machine: Machine, exchange: float, params: dict) -> float:
    """The exchange's exposed part: with the workload's layer profile, its buckets' timeline
    (each bucket's exchange the total's share of its bytes: latency and compression spread
    with them); without, the machine's fixed share of compute hides it."""
    layers = workload.layers
    if layers is None:
        return max(0.0, exchange - machine.overlap * workload.compute_s)
    cap = params.get("bucket_cap_mb", DEFAULT_BUCKET_MB) * 2**20
    groups = layers.buckets(cap, workload.bytes_per_parameter)
    total = sum(size for size, _ in groups)
    backward = layers.backward_share * workload.compute_s
    return wait_free_exposed([(ready * backward, exchange * size / total) for size, ready in groups], backward)


#: the strategies whose exchange runs during backward (DDP buckets and comm hooks); the
#: others exchange after it (the parameter servers push once update() is called)
OVERLAPS_BACKWARD = ("allreduce", "allreduce_fp16", "allreduce_bf16", "allreduce_powersgd", "allreduce_onebit")


def overlap_used(strategy: str, workload: Workload, machine: Machine) -> str:
    """What hid the exchange behind backward, for the tables."""
    if strategy not in OVERLAPS_BACKWARD:
        return "none"
    if workload.layers is not None:
        return f"wait-free backprop ({workload.layers.name})"
    return f"fixed {machine.overlap:g} of compute"


def _allreduce_family(strategy: str, wire_bytes: float, workload, machine, workers, params, stragglers,
                      messages_per_bucket: int = 1) -> Step:
    compute = workload.compute_s
    if workers == 1:  # trains unwrapped: nothing to exchange
        return _finish(strategy, workload, 1, compute, 0.0, 0.0, straggler=synchronous_wait(stragglers, 1))
    messages = buckets(workload.model_bytes, params) * messages_per_bucket
    exchange = allreduce_time(wire_bytes, workers, machine, messages)
    exchange += compression_time(strategy, workload.model_bytes, machine) if strategy in COMPRESSION_PASSES else 0.0
    return _finish(strategy, workload, workers, compute, exchange, _overlapped(workload, machine, exchange, params),
                   straggler=synchronous_wait(stragglers, workers))


@model("no_exchange")
def no_exchange(workload, machine, workers, params, stragglers):
    """The ceiling: every worker computes and updates alone; no exchange, no barrier."""
    return _finish("no_exchange", workload, workers, workload.compute_s, 0.0, 0.0,
                   straggler=mean_delay(stragglers, workers))


@model("allreduce")
def allreduce(workload, machine, workers, params, stragglers):
    """DDP: the gradient all-reduced every step, overlapped with backward."""
    return _allreduce_family("allreduce", workload.model_bytes, workload, machine, workers, params, stragglers)


@model("allreduce_fp16")
def allreduce_fp16(workload, machine, workers, params, stragglers):
    """Gradients cast to 16 bits: half the bytes, plus the casts."""
    return _allreduce_family("allreduce_fp16", workload.parameters * 2.0, workload, machine, workers, params,
                             stragglers)


@model("allreduce_bf16")
def allreduce_bf16(workload, machine, workers, params, stragglers):
    """As allreduce_fp16, with bfloat16 casts."""
    return _allreduce_family("allreduce_bf16", workload.parameters * 2.0, workload, machine, workers, params,
                             stragglers)


@model("allreduce_powersgd")
def allreduce_powersgd(workload, machine, workers, params, stragglers):
    """torch's hook all-reduces three times per bucket, one after the other: the tensors it
    sends whole (vectors, matrices too small to gain), then the rank-r factors P, then Q
    (each needs the one before); the bytes are `powersgd_ratio` of the gradient's (from the
    model's matrices or measured)."""
    if workload.powersgd_ratio is None:
        raise ValueError("allreduce_powersgd needs the share of the gradient bytes PowerSGD sends "
                         "(measured bytes_per_step, or model.matrices)")
    return _allreduce_family("allreduce_powersgd", workload.model_bytes * workload.powersgd_ratio, workload,
                             machine, workers, params, stragglers, messages_per_bucket=3)


def onebit_level_bytes(workload: Workload, quantizer: str | None) -> float:
    """The reconstruction values in one worker's 1-bit message: `tensor`, one fp32 scale per
    tensor; `column` (the default), two fp32 means per column group. 0 where not counted."""
    if quantizer == "tensor":
        return 4.0 * workload.tensors
    return 8.0 * workload.column_groups


@model("allreduce_onebit")
def allreduce_onebit(workload, machine, workers, params, stragglers):
    """Signs (1 bit per value) and fp32 levels (onebit_level_bytes). `exchange: allgather`: every
    worker's message all-gathered; each dequantises and sums the N messages (compression time
    grows with N). `reduce_scatter`: the message in N chunks, sent chunk j to worker j (an
    all-to-all, timed as an all-gather of M/N) and the N averaged chunks all-gathered: two
    all-gathers of M/N; quantise the bucket, dequantise N chunks, quantise and dequantise one
    chunk again, dequantise the N gathered chunks."""
    compute = workload.compute_s
    if workers == 1:
        return _finish("allreduce_onebit", workload, 1, compute, 0.0, 0.0, straggler=synchronous_wait(stragglers, 1))
    message = workload.parameters / 8.0 + onebit_level_bytes(workload, params.get("quantizer"))
    per_byte = compression_time("allreduce_onebit", workload.model_bytes, machine)
    messages = buckets(workload.model_bytes, params)
    if params.get("exchange") == "reduce_scatter":
        compression = per_byte * (1.5 + 1 / workers)  # half the passes each way, as below
        exchange = 2 * allgather_time(message / workers, workers, machine, messages) + compression
    else:
        # quantise once, dequantise N messages: half the passes each way
        compression = per_byte / 2 + per_byte / 2 * workers
        exchange = allgather_time(message, workers, machine, messages) + compression
    return _finish("allreduce_onebit", workload, workers, compute, exchange,
                   _overlapped(workload, machine, exchange, params),
                   straggler=synchronous_wait(stragglers, workers))


# -- parameter servers


def ps_phase_time(workload: Workload, machine: Machine, workers: int, shards: int, placement: str) -> float:
    """One direction of a parameter-server exchange (all pushes, or all pulls): the busiest
    link carries its bytes. Each of the N workers sends M/S to each of the S shards.

    Inside one node (N <= g): a shard's link takes the N slices (N M / S) and each worker's
    takes M. Across nodes, `dedicated` shards have a NIC each (N M / S per shard NIC; a
    worker node's NIC carries its g workers' M each); `colocated` shards sit on the worker
    nodes, ceil(S / nodes) on the busiest, whose NIC carries the other nodes' slices for its
    shards, (N - g) M s/S, and sends its workers' slices for remote shards, g M (1 - s/S);
    links are full duplex, so the larger of the two counts."""
    m, n = workload.model_bytes, workers
    nodes, local = machine.nodes(n), machine.local(n)
    if nodes == 1 and placement == "colocated":
        link = machine.p2p_intra
        per_shard = n * m / shards
        return link.time(max(per_shard, m), messages=n)
    if placement == "dedicated":
        link = machine.p2p_intra if nodes == 1 else machine.p2p_inter
        return link.time(max(n * m / shards, local * m if nodes > 1 else m), messages=n)
    link = machine.p2p_inter
    on_busiest = math.ceil(shards / nodes)
    share = min(on_busiest / shards, 1.0)
    nic = max((n - local) * m * share, local * m * (1 - share))  # in and out: full duplex
    return link.time(nic, messages=n)


def server_update_time(workload: Workload, machine: Machine, gradients: int, shards: int) -> float:
    """A shard's work for one update: sum `gradients` slices of M/S bytes, then SGD on its slice."""
    if not machine.server_bandwidth:
        return 0.0
    slice_bytes = workload.model_bytes / shards
    passes = SERVER_PASSES_PER_GRADIENT * gradients + SERVER_PASSES_PER_UPDATE
    return passes * slice_bytes / machine.server_bandwidth


def _ps_sync_like(strategy, workload, machine, workers, params, stragglers, quorum=None, window=1) -> Step:
    shards, placement = params.get("shards", 1), params.get("placement", "colocated")
    phase = ps_phase_time(workload, machine, workers, shards, placement)
    server = server_update_time(workload, machine, workers, shards)
    # push, then the pull of the new parameters (no overlap: update() blocks); each worker's
    # round trip also pays the protocol's own cost, in parallel with the others'
    exchange = 2 * phase + machine.ps_request_s
    wait = synchronous_wait(stragglers, workers, window=window, waits_for=quorum)
    return _finish(strategy, workload, workers, workload.compute_s, exchange, exchange, server=server,
                   straggler=wait)


@model("ps_sync")
def ps_sync(workload, machine, workers, params, stragglers):
    """Push to S shards, each waits for all N, updates, answers: 2 phases + the update."""
    return _ps_sync_like("ps_sync", workload, machine, workers, params, stragglers)


@model("ps_backup")
def ps_backup(workload, machine, workers, params, stragglers):
    """As ps_sync, but the update waits for the (N-k)-th gradient (all N are still sent)."""
    backup = min(params.get("backup", 1), workers - 1)
    return _ps_sync_like("ps_backup", workload, machine, workers, params, stragglers, quorum=workers - backup)


@model("ssp")
def ssp(workload, machine, workers, params, stragglers):
    """As ps_sync, but a worker may run s steps ahead: it waits for the slowest only over
    windows of s+1 steps (a fixed straggler still paces everybody). Unbounded (staleness
    null) it is ps_async."""
    if params.get("staleness", 2) is None:
        return ps_async(workload, machine, workers, params, stragglers)
    return _ps_sync_like("ssp", workload, machine, workers, params, stragglers,
                         window=params.get("staleness", 2) + 1)


@model("ps_async")
def ps_async(workload, machine, workers, params, stragglers):
    """No barrier: each worker cycles pull -> compute -> push at its own pace (its own delay,
    its own unloaded round trip); the shards' links and service rate cap the sum. The step
    is the time of one round (N gradients applied)."""
    shards, placement = params.get("shards", 1), params.get("placement", "colocated")
    link = machine.p2p_intra if machine.nodes(workers) == 1 else machine.p2p_inter
    one_gradient = server_update_time(workload, machine, 1, shards)
    round_trip = 2 * link.time(workload.model_bytes) + machine.ps_request_s  # one worker's push and reply, unloaded
    slow = stragglers.slow(workers)
    cycle = workload.compute_s + round_trip + one_gradient
    rate = (workers - slow) / cycle + slow / (cycle + stragglers.delay_s)  # gradients/s, all workers
    demand_round = workers / rate
    link_round = ps_phase_time(workload, machine, workers, shards, placement)  # both directions overlap
    server_round = workers * one_gradient  # each shard applies N gradients of its slice
    round_s = max(demand_round, link_round, server_round)
    if round_s > demand_round:
        bound = "network" if link_round >= server_round else "server"
    else:
        parts = {"compute": workload.compute_s, "network": round_trip, "server": one_gradient,
                 "straggler": demand_round - cycle}
        bound = max(parts, key=parts.get)
    return Step("ps_async", workers, round_s, workload.compute_s, round_trip, round_trip, one_gradient,
                max(0.0, demand_round - cycle), workers * workload.batch / round_s, bound)


# -- local and decentralized


@model("local_sgd")
def local_sgd(workload, machine, workers, params, stragglers):
    """H local steps, then parameters and momentum buffers (2 M) averaged by all-reduce
    (blocking): 1/H of it per step (the warm-up phase is left out: steady state)."""
    period = params.get("period", 8)
    if workers == 1:
        return _finish("local_sgd", workload, 1, workload.compute_s, 0.0, 0.0,
                       straggler=synchronous_wait(stragglers, 1))
    exchange = allreduce_time(2 * workload.model_bytes, workers, machine) / period
    wait = synchronous_wait(stragglers, workers, window=period)
    return _finish("local_sgd", workload, workers, workload.compute_s, exchange, exchange, straggler=wait)


@model("easgd")
def easgd(workload, machine, workers, params, stragglers):
    """Every tau steps the elastic differences (M) are all-reduced (blocking)."""
    period = params.get("period", 8)
    if workers == 1:
        return _finish("easgd", workload, 1, workload.compute_s, 0.0, 0.0, straggler=synchronous_wait(stragglers, 1))
    exchange = allreduce_time(workload.model_bytes, workers, machine) / period
    wait = synchronous_wait(stragglers, workers, window=period)
    return _finish("easgd", workload, workers, workload.compute_s, exchange, exchange, straggler=wait)


def gossip_degree(topology: str, workers: int) -> int:
    if workers == 1:
        return 0
    if topology == "random_pairs":
        return 1
    return 1 if workers == 2 else 2


@model("gossip")
def gossip(workload, machine, workers, params, stragglers):
    """After each step, the parameters (M) to and from each of `degree` neighbours (ring: 2,
    1 at N=2; random pairs: 1), sent at once. Across nodes a ring crosses each node's NIC
    twice each way; random pairs cross it with probability (N-g)/(N-1) per worker; then the
    averaging (gossip_mixing_time). No global barrier: a worker waits for its neighbours (a
    fixed straggler paces the connected ring)."""
    topology = params.get("topology", "ring")
    degree = gossip_degree(topology, workers)
    if degree == 0:
        return _finish("gossip", workload, 1, workload.compute_s, 0.0, 0.0, straggler=synchronous_wait(stragglers, 1))
    m = workload.model_bytes
    nodes, local = machine.nodes(workers), machine.local(workers)
    exchange = machine.p2p_intra.time(degree * m, messages=degree) if local > 1 else 0.0
    if nodes > 1:
        crossing = 2 * m if topology == "ring" else local * m * (workers - local) / (workers - 1)
        exchange = max(exchange, machine.p2p_inter.time(crossing, messages=degree))
    exchange += gossip_mixing_time(m, degree, machine)  # the averaging, after the messages
    if stragglers.distribution == "fixed":
        wait = synchronous_wait(stragglers, workers)
    else:
        neighbourhood = degree + 1
        slow_share = stragglers.slow(workers) / workers
        # expected max over the neighbourhood: on average slow_share of it is slow
        k = round(slow_share * neighbourhood)
        wait = expected_order_statistic(stragglers.distribution, stragglers.delay_s, k, k)
    return _finish("gossip", workload, workers, workload.compute_s, exchange, exchange, straggler=wait)


# ----- the knobs: the strategies' own defaults (dtstudy.strategies.specs, torch-free) -------

def knob_defaults() -> dict[str, dict]:
    """{strategy name: its knobs' defaults}, from the strategy specs the config check uses."""
    return {name: dict(spec.defaults) for name, spec in SPECS.items()}


def step(strategy: str, workload: Workload, machine: Machine, workers: int, params: dict | None = None,
         stragglers: Stragglers = NO_STRAGGLERS) -> Step:
    """The modelled step of `strategy` at N=workers; `params` are its knobs (defaults filled
    by the caller, see knob_defaults) plus `placement` for the parameter servers."""
    params = params or {}
    scale = machine.compute_scale.get(machine.local(workers), 1.0) if machine.compute_scale else 1.0
    if scale != 1.0:
        workload = dataclasses.replace(workload, compute_s=workload.compute_s * scale)
    result = dataclasses.replace(MODELS[strategy](workload, machine, workers, params, stragglers),
                                 overlap=overlap_used(strategy, workload, machine))
    jitter = natural_wait(machine, workload.compute_s, *JITTER_BARRIER[strategy](workers, params))
    if jitter <= 0:  # a strategy without a barrier has one participant (JITTER_BARRIER): none
        return result
    step_s = result.step_s + jitter
    return dataclasses.replace(result, step_s=step_s, straggler_s=result.straggler_s + jitter,
                               throughput=workers * workload.batch / step_s)


#: (participants, window, waits_for) of each strategy's barrier, for the natural jitter
JITTER_BARRIER = {
    **{name: (lambda n, p: (n, 1, None)) for name in ("allreduce", "allreduce_fp16", "allreduce_bf16",
                                                      "allreduce_powersgd", "allreduce_onebit", "ps_sync")},
    "ps_backup": lambda n, p: (n, 1, max(1, n - min(p.get("backup", 1), n - 1))),
    "ssp": lambda n, p: (n, (p["staleness"] if p.get("staleness", 2) is not None else n) + 1, None),
    "ps_async": lambda n, p: (1, 1, None),
    "no_exchange": lambda n, p: (1, 1, None),  # no barrier
    "local_sgd": lambda n, p: (n, p.get("period", 8), None),
    "easgd": lambda n, p: (n, p.get("period", 8), None),
    "gossip": lambda n, p: (gossip_degree(p.get("topology", "ring"), n) + 1 if n > 1 else 1, 1, None),
}
