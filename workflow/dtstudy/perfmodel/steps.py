"""The step formulas by kind of exchange (all-reduce, all-gather, the activations of
model-parallel layers, parameter server, periodic averaging, gossip), with no strategy in
them: each strategy's spec (dtstudy.strategies.specs) picks its formula and gives its numbers
(bytes on the wire, compression passes, windows)."""

from __future__ import annotations

import dataclasses
import math

from dtstudy.perfmodel.collectives import allgather_time, allreduce_time, alltoall_time, ring_allreduce_bytes
from dtstudy.perfmodel.machine import Machine, Step, Stragglers, Workload
from dtstudy.perfmodel.waits import expected_order_statistic, mean_delay, synchronous_wait

#: memory passes of a shard per pushed gradient (accumulate) and per update (momentum, decay, step)
SERVER_PASSES_PER_GRADIENT = 1.0
SERVER_PASSES_PER_UPDATE = 4.0


def finish(strategy, workload, workers, compute, exchange, exposed, server=0.0, straggler=0.0) -> Step:
    """A synchronous step: compute + exposed exchange + shard work + waiting; bound = the largest."""
    step_s = compute + exposed + server + straggler
    throughput = workers * workload.batch / step_s
    parts = {"compute": compute, "network": exposed, "server": server, "straggler": straggler}
    bound = max(parts, key=parts.get)
    return Step(strategy, workers, step_s, compute, exchange, exposed, server, straggler, throughput, bound)


def alone(strategy: str, workload: Workload, stragglers: Stragglers) -> Step:
    """N=1 of a strategy that exchanges nothing with one worker: its compute and its own delay."""
    return finish(strategy, workload, 1, workload.compute_s, 0.0, 0.0, straggler=synchronous_wait(stragglers, 1))


def kernel_time(strategy: str, passes: float, nbytes: float, machine: Machine) -> float:
    """Seconds of a strategy's own work on `nbytes` (compression, averaging): the machine's
    measured seconds per byte for it, else `passes` memory passes at its compression rate."""
    if strategy in machine.compression_s_per_byte:
        return machine.compression_s_per_byte[strategy] * nbytes
    if machine.compression_bandwidth:
        return passes * nbytes / machine.compression_bandwidth
    return 0.0


def buckets(nbytes: float, bucket_cap_mb: float) -> int:
    """DDP's gradient buckets (one all-reduce each) of bucket_cap_mb MiB."""
    return max(1, math.ceil(nbytes / (bucket_cap_mb * 2**20)))


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


def overlapped(
    workload: Workload, machine: Machine, exchange: float | tuple[float, ...], bucket_cap_mb: float
) -> float:
    """The exchange's exposed part: with the workload's layer profile, its buckets' timeline
    (each bucket's exchange the total's share of its bytes: latency and compression spread
    with them); without, the machine's fixed share of compute hides it. `exchange`: its
    seconds, or a tuple of seconds per stage on separate links (wait_free_exposed's stages,
    e.g. a sum inside the node, then a push through the NIC)."""
    stages = exchange if isinstance(exchange, tuple) else (exchange,)
    layers = workload.layers
    if layers is None:
        return max(0.0, sum(stages) - machine.overlap * workload.compute_s)
    groups = layers.buckets(bucket_cap_mb * 2**20, workload.bytes_per_parameter)
    total = sum(size for size, _ in groups)
    backward = layers.backward_share * workload.compute_s
    return wait_free_exposed(
        [(ready * backward, *(stage * size / total for stage in stages)) for size, ready in groups], backward
    )


def overlap_used(overlaps_backward: bool, workload: Workload, machine: Machine) -> str:
    """What hid the exchange behind backward, for the tables."""
    if not overlaps_backward:
        return "none"
    if workload.layers is not None:
        return f"wait-free backprop ({workload.layers.name})"
    return f"fixed {machine.overlap:g} of compute"


# ----- all-reduce and all-gather, overlapped with backward -------------------------------


def allreduce_step(
    strategy: str,
    wire_bytes: float,
    compression_passes: float,
    workload,
    machine,
    workers,
    params,
    stragglers,
    messages_per_bucket: int = 1,
) -> Step:
    """The gradient (`wire_bytes` of it on the wire) all-reduced in DDP's buckets, overlapped
    with backward, plus the compression's own work where it has some."""
    compute = workload.compute_s
    if workers == 1:  # trains unwrapped: nothing to exchange
        return alone(strategy, workload, stragglers)
    messages = buckets(workload.model_bytes, params["bucket_cap_mb"]) * messages_per_bucket
    exchange = allreduce_time(wire_bytes, workers, machine, messages)
    if compression_passes:
        exchange += kernel_time(strategy, compression_passes, workload.model_bytes, machine)
    return finish(
        strategy,
        workload,
        workers,
        compute,
        exchange,
        overlapped(workload, machine, exchange, params["bucket_cap_mb"]),
        straggler=synchronous_wait(stragglers, workers),
    )


def onebit_level_bytes(workload: Workload, quantizer: str | None) -> float:
    """The reconstruction values in one worker's 1-bit message: `tensor`, one fp32 scale per
    tensor; `column` (the default), two fp32 means per column group. 0 where not counted."""
    if quantizer == "tensor":
        return 4.0 * workload.tensors
    return 8.0 * workload.column_groups


def onebit_step(strategy: str, compression_passes: float, workload, machine, workers, params, stragglers) -> Step:
    """Signs (1 bit per value) and fp32 levels (onebit_level_bytes). `exchange: allgather`: every
    worker's message all-gathered; each dequantises and sums the N messages (compression time
    grows with N). `reduce_scatter`: the message in N chunks, sent chunk j to worker j, and each
    owner's averaged chunk sent back to every worker: two all-to-alls of M/N (the second is one
    too, as the strategy sends it: gloo's all-gather wants equal sizes), N-1 messages each a
    worker, every pair's own bytes across the NICs; quantise the bucket, dequantise N chunks,
    quantise and dequantise one chunk again, dequantise the N gathered chunks."""
    compute = workload.compute_s
    if workers == 1:
        return alone(strategy, workload, stragglers)
    message = workload.parameters / 8.0 + onebit_level_bytes(workload, params["quantizer"])
    per_byte = kernel_time(strategy, compression_passes, workload.model_bytes, machine)
    messages = buckets(workload.model_bytes, params["bucket_cap_mb"])
    if params["exchange"] == "reduce_scatter":
        compression = per_byte * (1.5 + 1 / workers)  # half the passes each way, as below
        exchange = 2 * alltoall_time(message / workers, workers, machine, messages) + compression
    else:
        # quantise once, dequantise N messages: half the passes each way
        compression = per_byte / 2 + per_byte / 2 * workers
        exchange = allgather_time(message, workers, machine, messages) + compression
    return finish(
        strategy,
        workload,
        workers,
        compute,
        exchange,
        overlapped(workload, machine, exchange, params["bucket_cap_mb"]),
        straggler=synchronous_wait(stragglers, workers),
    )


def independent_step(strategy: str, workload, workers, stragglers) -> Step:
    """Every worker computes and updates alone: no exchange, no barrier (its mean delay)."""
    return finish(strategy, workload, workers, workload.compute_s, 0.0, 0.0, straggler=mean_delay(stragglers, workers))


# ----- hybrid: data-parallel convolutions, model-parallel fully connected layers -------------


def hybrid_exchanges(linear, batch: int, workers: int, bytes_per_value: float) -> list[tuple[str, float]]:
    """The activation exchanges of one forward pass of hybrid (Krizhevsky 2014), as (kind,
    bytes each worker contributes): the first fully connected layer's inputs all-gathered
    (b x in), each layer but the last's outputs all-gathered along the features (its N b rows
    by ceil(out/N) columns), the last one's outputs sent to the workers whose rows they are
    (an all-to-all of b x ceil(out/N) to each). Backward repeats each in reverse (a
    reduce-scatter, the reverse all-to-all) with as many bytes."""
    n, b = workers, batch
    exchanges = [("allgather", b * linear[0][0] * bytes_per_value)]
    exchanges += [("allgather", n * b * math.ceil(out / n) * bytes_per_value) for _, out in linear[:-1]]
    exchanges.append(("alltoall", b * math.ceil(linear[-1][1] / n) * bytes_per_value))
    return exchanges


def hybrid_bytes_per_step(linear, batch: int, workers: int, other_parameters: int, bytes_per_value: float) -> float:
    """Bytes one worker sends per step: each exchange of hybrid_exchanges twice (forward and
    backward), (N-1) times its bytes each way (a ring all-gather and reduce-scatter, or the
    N-1 messages of an all-to-all), plus the ring all-reduce of the other layers' gradient,
    2 (N-1)/N of its bytes."""
    if workers == 1:
        return 0.0
    activations = sum(
        2 * (workers - 1) * nbytes for _, nbytes in hybrid_exchanges(linear, batch, workers, bytes_per_value)
    )
    return activations + ring_allreduce_bytes(other_parameters * bytes_per_value, workers)


def hybrid_step(strategy, workload, machine, workers, params, stragglers) -> Step:
    """Hybrid parallelism: the layers before the fully connected ones data-parallel, their
    gradient all-reduced in DDP's buckets behind their backward (as allreduce's, without the
    fully connected layers' tensors); the activation exchanges (hybrid_exchanges) blocking, in
    forward and again in backward. Compute as one worker's: each fully connected layer does
    1/N of its outputs for N times the rows."""
    if workers == 1:
        return alone(strategy, workload, stragglers)
    if not workload.fully_connected:
        raise ValueError(
            "hybrid needs the model's fully connected layers (a layer profile of the model, "
            "or the 2-d weights of a run's model.pt)"
        )
    times = {"allgather": allgather_time, "alltoall": alltoall_time}
    activations = 2 * sum(
        times[kind](nbytes, workers, machine)
        for kind, nbytes in hybrid_exchanges(
            workload.fully_connected, workload.batch, workers, workload.bytes_per_parameter
        )
    )
    others = dataclasses.replace(
        workload,
        parameters=workload.parameters - workload.linear_parameters,
        layers=workload.layers.without_linear() if workload.layers else None,
    )
    cap = params["bucket_cap_mb"]
    gradient = allreduce_time(others.model_bytes, workers, machine, buckets(others.model_bytes, cap))
    exposed = overlapped(others, machine, gradient, cap) + activations
    return finish(
        strategy,
        workload,
        workers,
        workload.compute_s,
        gradient + activations,
        exposed,
        straggler=synchronous_wait(stragglers, workers),
    )


# ----- parameter servers ---------------------------------------------------------------


def ps_phase_time(workload: Workload, machine: Machine, workers: int, shards: int, placement: str) -> float:
    """One direction of a parameter-server exchange (all pushes, or all pulls): the busiest
    link carries its bytes. Each of the N workers sends M/S to each of the S shards.

    `dedicated` shards sit on nodes of their own, a NIC each (N M / S per shard NIC; a worker
    node's NIC carries its g workers' M each, even where the N workers fill one node).
    Colocated inside one node (N <= g): a shard's link takes the N slices (N M / S) and each
    worker's takes M. Across nodes, `colocated` shards sit on the worker
    nodes, ceil(S / nodes) on the busiest, whose NIC carries the other nodes' slices for its
    shards, (N - g) M s/S, and sends its workers' slices for remote shards, g M (1 - s/S);
    links are full duplex, so the larger of the two counts.

    One latency per phase, not one per message: the N workers send at once, so their
    messages' latencies overlap and the busiest link is busy only with their bytes, one after
    another (as an emulated run's links deliver them: dtstudy.emulation.clock.ExchangeCosts.deliver).
    A shard's own cost per message is the protocol's (Machine.ps_request_s), not the wire's."""
    m, n = workload.model_bytes, workers
    nodes, local = machine.nodes(n), machine.local(n)
    if nodes == 1 and placement == "colocated":
        link = machine.p2p_intra
        per_shard = n * m / shards
        return link.time(max(per_shard, m))
    if placement == "dedicated":  # on nodes of their own: across, even from one node of workers
        return machine.p2p_inter.time(max(n * m / shards, local * m))
    link = machine.p2p_inter
    on_busiest = math.ceil(shards / nodes)
    share = min(on_busiest / shards, 1.0)
    nic = max((n - local) * m * share, local * m * (1 - share))  # in and out: full duplex
    return link.time(nic)


def default_shards(nodes: int) -> int:
    """A parameter server's shard count when its `shards` knob is null: one per node of the run
    (dtstudy.strategies.specs.ParameterServerSpec.placed_params, what a run starts)."""
    return nodes


def shard_count(params: dict, machine: Machine, workers: int) -> int:
    """The S shards a modelled run has: its `shards` knob, or one per node of N workers on `machine`."""
    return params["shards"] if params["shards"] is not None else default_shards(machine.nodes(workers))


def memory_passes_time(passes: float, nbytes: float, bandwidth: float | None) -> float:
    """`passes` memory passes over `nbytes` at `bandwidth` bytes/s (None or 0: not modelled, 0 s)."""
    return passes * nbytes / bandwidth if bandwidth else 0.0


def shard_passes_time(workload: Workload, machine: Machine, shards: int, passes: float) -> float:
    """`passes` memory passes of a shard over its slice of M/S bytes (0: not modelled)."""
    return memory_passes_time(passes, workload.model_bytes / shards, machine.server_bandwidth)


def ps_round_step(strategy, workload, machine, workers, params, stragglers, quorum=None) -> Step:
    """Push to S shards, each takes the first `quorum` of the N gradients (all by default) as
    they arrive, updates, answers: 2 phases + the shard's work. The shard's serve loop takes
    each push on arrival, so its passes over the gradients start with the first to arrive
    (from a worker beside it, or across for a `dedicated` shard), one slice's time into the
    push phase, and go on while the rest arrive and while it waits for the slowest: what is
    left after the phase and the wait is the larger of one pass and all of them less that
    time, then the update."""
    shards, placement = shard_count(params, machine, workers), params["placement"]
    phase = ps_phase_time(workload, machine, workers, shards, placement)
    wait = synchronous_wait(stragglers, workers, waits_for=quorum)
    nearest = machine.p2p_inter if placement == "dedicated" else machine.p2p_intra
    hidden = wait + max(0.0, phase - nearest.time(workload.model_bytes / shards))
    one = shard_passes_time(workload, machine, shards, SERVER_PASSES_PER_GRADIENT)
    taking = one * (workers if quorum is None else quorum)
    server = max(one, taking - hidden) + shard_passes_time(workload, machine, shards, SERVER_PASSES_PER_UPDATE)
    # push, then the pull of the new parameters (no overlap: update() blocks); each worker's
    # round trip also pays the protocol's own cost, in parallel with the others'
    exchange = 2 * phase + machine.ps_request_s
    return finish(strategy, workload, workers, workload.compute_s, exchange, exchange, server=server, straggler=wait)


def shard_reply_time(workload: Workload, machine: Machine, workers: int, shards: int, placement: str) -> float:
    """A shard's answer to one worker, its slice M/S, on the link between them, averaged over the
    N workers: a `colocated` shard's node holds g of them (inside the node), the others are
    across; a `dedicated` shard's node holds none (an emulated run places it so:
    dtstudy.emulation.clock.ExchangeCosts.node)."""
    slice_bytes = workload.model_bytes / shards
    across = machine.p2p_inter.time(slice_bytes)
    if placement == "dedicated":
        return across
    near = machine.local(workers) / workers
    return near * machine.p2p_intra.time(slice_bytes) + (1 - near) * across


def ps_async_step(strategy, workload, machine, workers, params, stragglers, window: int | None = None) -> Step:
    """No barrier: each worker cycles pull -> compute -> push at its own pace (its own delay,
    its own unloaded round trip); the shards' links and service cap the sum. A shard serves
    one push at a time: its update, then its answer to that worker, which the serve loop
    waits for (shard.py `_reply`). `window` (SSP: s + 1 steps): no worker runs more than s
    steps ahead of the slowest, so each waits for the slowest's delays over such windows
    (synchronous_wait; a fixed straggler paces everybody), where without it each loses only
    its own. The step is the time of one round (N gradients applied)."""
    shards, placement = shard_count(params, machine, workers), params["placement"]
    across = placement == "dedicated" or machine.nodes(workers) > 1
    link = machine.p2p_inter if across else machine.p2p_intra
    # a push taken in and applied as an update of its own
    one_gradient = shard_passes_time(workload, machine, shards, SERVER_PASSES_PER_GRADIENT + SERVER_PASSES_PER_UPDATE)
    reply = shard_reply_time(workload, machine, workers, shards, placement)
    round_trip = 2 * link.time(workload.model_bytes) + machine.ps_request_s  # one worker's push and reply, unloaded
    cycle = workload.compute_s + round_trip + one_gradient
    if window is None:
        slow = stragglers.slow(workers)
        rate = (workers - slow) / cycle + slow / (cycle + stragglers.delay_s)  # gradients/s, all workers
        demand_round = workers / rate
    else:
        demand_round = cycle + synchronous_wait(stragglers, workers, window=window)
    link_round = ps_phase_time(workload, machine, workers, shards, placement)  # both directions overlap
    serve_round = workers * (one_gradient + reply)  # each shard serves N pushes, one after another
    round_s = max(demand_round, link_round, serve_round)
    if round_s > demand_round:
        bound = "server" if serve_round > link_round and one_gradient > reply else "network"
    else:
        parts = {
            "compute": workload.compute_s,
            "network": round_trip,
            "server": one_gradient,
            "straggler": demand_round - cycle,
        }
        bound = max(parts, key=parts.get)
    return Step(
        strategy,
        workers,
        round_s,
        workload.compute_s,
        round_trip,
        round_trip,
        one_gradient,
        max(0.0, demand_round - cycle),
        workers * workload.batch / round_s,
        bound,
    )


# ----- periodic averaging and gossip -----------------------------------------------------


def periodic_allreduce_step(
    strategy, averaged_bytes: float, period: int, workload, machine, workers, stragglers
) -> Step:
    """`period` local steps, then `averaged_bytes` all-reduced (blocking): 1/period of it per
    step (a warm-up phase is left out: steady state); the barrier waits over the window."""
    if workers == 1:
        return alone(strategy, workload, stragglers)
    exchange = allreduce_time(averaged_bytes, workers, machine) / period
    wait = synchronous_wait(stragglers, workers, window=period)
    return finish(strategy, workload, workers, workload.compute_s, exchange, exchange, straggler=wait)


def gossip_degree(topology: str, workers: int) -> int:
    if workers == 1:
        return 0
    if topology == "random_pairs":
        return 1
    return 1 if workers == 2 else 2


def mixing_time(strategy: str, passes: float, nbytes: float, degree: int, machine: Machine) -> float:
    """Seconds a gossip worker spends averaging its `nbytes` of parameters with `degree`
    neighbours' (the measured kernel is for one neighbour: 2 vectors; scaled by (1+d)/2)."""
    return kernel_time(strategy, passes, nbytes, machine) * (1 + degree) / 2


def gossip_step(strategy, mixing_passes: float, workload, machine, workers, params, stragglers) -> Step:
    """After each step, the parameters (M) to and from each of `degree` neighbours (ring: 2,
    1 at N=2; random pairs: 1), sent at once (one batch_isend_irecv: their latencies overlap,
    one is paid). Across nodes a ring crosses each node's NIC twice each way; random pairs
    cross it with probability (N-g)/(N-1) per worker; then the averaging (mixing_time). No
    global barrier: a worker waits for its neighbours (a fixed straggler paces the connected
    ring)."""
    topology = params["topology"]
    degree = gossip_degree(topology, workers)
    if degree == 0:
        return alone(strategy, workload, stragglers)
    m = workload.model_bytes
    nodes, local = machine.nodes(workers), machine.local(workers)
    exchange = machine.p2p_intra.time(degree * m) if local > 1 else 0.0
    if nodes > 1:
        crossing = 2 * m if topology == "ring" else local * m * (workers - local) / (workers - 1)
        exchange = max(exchange, machine.p2p_inter.time(crossing))
    exchange += mixing_time(strategy, mixing_passes, m, degree, machine)  # the averaging, after the messages
    if stragglers.distribution == "fixed":
        wait = synchronous_wait(stragglers, workers)
    else:
        neighbourhood = degree + 1
        slow_share = stragglers.slow(workers) / workers
        # expected max over the neighbourhood: on average slow_share of it is slow
        k = round(slow_share * neighbourhood)
        wait = expected_order_statistic(stragglers.distribution, stragglers.delay_s, k, k)
    return finish(strategy, workload, workers, workload.compute_s, exchange, exchange, straggler=wait)
