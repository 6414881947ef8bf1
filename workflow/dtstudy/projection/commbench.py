"""Communication benchmark of this machine: gloo all-reduce and point-to-point time vs message size (2 processes)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from dtstudy.common.ports import free_port
from dtstudy.strategies.specs import SPECS, GossipSpec

DEFAULT_SIZES = [2**k for k in range(10, 22, 2)] + [2**21 + 2**20]  # 1 KiB .. 3 MiB
REPEATS = 20


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def _worker(rank: int, world: int, port: int, sizes: list[int], repeats: int, gloo_loop_nice: int | str, queue) -> None:
    import torch
    import torch.distributed as dist

    from dtstudy.gloo_loops import lower_gloo_event_loops

    torch.set_num_threads(1)  # as a training worker
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    lower_gloo_event_loops(gloo_loop_nice)  # as in a training run (launcher.gloo_loop_nice)
    results = {"allreduce": [], "p2p": []}
    # each collective timed right after a burst of compute, as a training step meets it after
    # its backward: timed back to back it runs warm, faster than a training step meets it
    burst = _burst_net()
    for size in sizes:
        buffer = torch.ones(size // 4, dtype=torch.float32)
        for _ in range(3):
            dist.all_reduce(buffer)
        times = []
        for _ in range(repeats):
            burst()
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            times.append(time.perf_counter() - start)
        results["allreduce"].append([size, _median(times)])
        # one-way point-to-point time: half a ping-pong between ranks 0 and 1
        times = []
        for i in range(repeats + 3):
            burst()
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            elif rank == 1:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            if i >= 3:
                times.append((time.perf_counter() - start) / 2)
        results["p2p"].append([size, _median(times)])
    results["bursts"] = _bursts(rank, world)
    alone = dist.new_group([0])  # every rank takes part in making it; only rank 0 is in it
    if rank == 0:
        results["exchange_s_per_byte"] = {name: exchange_seconds_per_byte(name, alone, repeats) for name in COMPRESSED}
    dist.destroy_process_group()
    if rank == 0:
        queue.put(results)


def _lenet_sized():
    """A LeNet-5-sized conv net (the study's default model's tensors) and a batch of 64 28x28 images."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(400, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, 10),
    )
    return net, torch.randn(64, 1, 28, 28)


def _burst_net():
    """A burst is one forward and backward of the LeNet-5-sized net on its batch: the kind of
    work (memory traffic, not only arithmetic) a training step does."""
    net, images = _lenet_sized()

    def burst() -> float:
        start = time.perf_counter()
        net(images).sum().backward()
        net.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return burst


def _bursts(rank: int, world: int, count: int = 40) -> dict:
    """The same burst on every process at once, between barriers: the mean gives the compute
    slowdown of `world` busy workers, the spread the natural jitter a barrier waits out.
    Each round also times rank 0 alone (the others wait at the barrier), right after the
    round together: this machine's speed moves by tens of percent from minute to minute, so
    the slowdown is the median of the rounds' ratios, alone and together seconds apart, not
    the ratio of two blocks timed at different moments."""
    import statistics

    import torch
    import torch.distributed as dist

    burst = _burst_net()
    samples, ratios, alone = [], [], []
    for i in range(count + 5):
        dist.barrier()
        elapsed = burst()
        dist.barrier()
        solo = burst() if rank == 0 else 0.0
        dist.barrier()
        if i >= 5:
            samples.append(elapsed)
            if rank == 0:
                alone.append(solo)
                ratios.append(elapsed / solo)
    mine = torch.tensor(samples, dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    every = torch.stack(gathered)  # world x count
    mean = every.mean().item()
    skew = (every.max(dim=0).values - every.mean(dim=0)).mean().item()
    result = {"mean_s": mean, "max_minus_mean_s": skew, "skew_fraction": skew / mean}
    if rank == 0:
        result.update(alone_s=sum(alone) / len(alone), slowdown=statistics.median(ratios))
    return result


class _OneBucket:
    """What the strategies' hooks read of a DDP bucket (buffer, gradients, parameters, index,
    is_last): every gradient of a model's `parameters` in one flat buffer, as DDP buckets
    LeNet-5 (1-bit keys its residuals by the parameters themselves)."""

    def __init__(self, parameters: list) -> None:
        import torch

        numels = [p.numel() for p in parameters]
        self._buffer = torch.zeros(sum(numels))
        self._gradients = [part.view(p.shape) for part, p in zip(self._buffer.split(numels), parameters)]
        self._parameters = parameters

    def parameters(self) -> list:
        return self._parameters

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._gradients

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


#: the strategies whose exchange does work of its own beyond moving bytes (their specs'
#: compression_passes): each is timed as it runs (exchange_seconds_per_byte), and the model
#: adds that to its communication
COMPRESSED = tuple(name for name, spec in SPECS.items() if spec.compression_passes)


def exchange_seconds_per_byte(name: str, group, repeats: int) -> float:
    """Seconds per gradient byte of a compressed strategy's own exchange (its DDP hook,
    `exchange`, with its default knobs) on the LeNet-5-sized net's gradients, in a `group`
    of one process, where its collectives move nothing: what is timed is the compression's
    own work. fp16/bf16: torch's hook, the casts there and back; PowerSGD: torch's hook
    compressing (past its start_powerSGD_iter), the factors' products, orthogonalisation,
    error feedback, decompression; 1-bit: quantising with error feedback over the column
    groups (241 for LeNet-5), the message encoded, gathered (one message: a copy), decoded,
    dequantised and averaged back. The model adds it to the exchange's communication (1-bit:
    half of it once and half per worker's message). The strategy's own code at the model's
    size, not kernels of the same operations on another size and grouping: those missed much
    of 1-bit's exchange on LeNet-5, and the model overpredicted its throughput."""
    import torch

    from dtstudy.strategies.base import DistContext
    from dtstudy.strategies.registry import STRATEGIES

    knobs = dict(SPECS[name].defaults)
    ctx = DistContext(
        rank=0, world_size=1, workers=1, local_rank=0, device=torch.device("cpu"), backend="gloo", worker_group=group
    )
    strategy = STRATEGIES[name](ctx, knobs)
    net, _ = _lenet_sized()
    strategy.model = net
    strategy.comm_hook()  # its state (residuals, PowerSGD's), as when DDP is set up
    bucket = _OneBucket(list(net.parameters()))
    gradient = torch.randn(bucket.buffer().numel())
    untimed = knobs.get("start_powerSGD_iter", 0) + 2  # PowerSGD's plain all-reduces first; a warm-up
    burst = _burst_net()  # before each exchange, as after a training step's backward (see _worker)
    samples = []
    for i in range(untimed + repeats):
        burst()
        bucket.buffer().copy_(gradient)
        start = time.perf_counter()
        strategy.exchange(bucket).wait()
        if i >= untimed:
            samples.append(time.perf_counter() - start)
    return _median(samples) / (bucket.buffer().numel() * 4)


def _spin(seconds: float, queue) -> None:
    start, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        pass
    queue.put((time.process_time() - cpu) / (time.perf_counter() - start))


def cpu_share(processes: int, seconds: float = 0.5) -> float:
    """The mean share of a core each of `processes` busy processes gets now (1.0: a core
    each; less: the cores are shared with other work)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    queue = context.SimpleQueue()
    spinners = [context.Process(target=_spin, args=(seconds, queue)) for _ in range(processes)]
    for spinner in spinners:
        spinner.start()
    shares = [queue.get() for _ in spinners]
    for spinner in spinners:
        spinner.join()
    return sum(shares) / len(shares)


def _kernel_seconds_per_byte(repeats: int) -> dict:
    """This machine's gossip-averaging and shard kernels, one thread, per fp32 parameter
    byte (the compressed strategies': exchange_seconds_per_byte, in a worker)."""
    import torch

    from dtstudy.strategies.gossip.strategy import average_into
    from dtstudy.strategies.local.strategy import flatten

    torch.set_num_threads(1)
    numel = 2**18
    nbytes = numel * 4
    gradient = torch.randn(numel)

    burst = _burst_net()  # before each timing, as a step meets the kernel (see _worker)

    def timed(fn, nbytes: int = nbytes) -> float:
        for _ in range(2):
            fn()
        samples = []
        for _ in range(repeats):
            burst()
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return _median(samples) / nbytes

    total = torch.zeros(numel)
    momentum = torch.zeros(numel)

    def server_pass():  # one accumulate pass of a shard
        total.add_(gradient)

    def sgd_update():
        momentum.mul_(0.9).add_(gradient)
        total.add_(momentum, alpha=-0.1)

    # gossip's averaging at about LeNet-5's size (61706 values in ten tensors): its per-byte
    # cost is not linear in the size (past malloc's mmap threshold each call maps fresh
    # pages), so it is timed at the size the study's model has
    mix_numel = 2**16
    parameters = [torch.randn(mix_numel // 10) for _ in range(9)] + [torch.randn(mix_numel - 9 * (mix_numel // 10))]
    peer = torch.randn(mix_numel)

    def gossip_mix():  # flatten, the mean with one neighbour's copy, back into the tensors
        average_into(parameters, flatten(parameters), [peer])

    return {
        GossipSpec.name: timed(gossip_mix, mix_numel * 4),  # its spec's kernel (mixing_passes)
        "server_pass": timed(server_pass),
        "server_update": timed(sgd_update),
    }


def _first_result(queue, workers, poll_s: float = 0.5):
    """Rank 0's result. A process that fails, or rank 0 ending without a result, fails the
    benchmark at once (the traceback is on stderr) instead of leaving the caller waiting on
    the queue for ever; the peers, blocked in a collective with it, are stopped."""
    import queue as queues

    while True:
        try:
            return queue.get(timeout=poll_s)
        except queues.Empty:
            ended = [(rank, w.exitcode) for rank, w in enumerate(workers) if w.exitcode not in (None, 0)]
            if workers[0].exitcode == 0:  # rank 0 is done: its result is in the pipe, or never came
                try:
                    return queue.get(timeout=5)
                except queues.Empty:
                    ended.insert(0, (0, 0))
            if ended:
                for worker in workers:
                    if worker.is_alive():
                        worker.kill()
                codes = ", ".join(f"rank {rank} exit code {code}" for rank, code in ended)
                # from None: the empty queue is how the loss shows, not its cause (that is on stderr)
                raise RuntimeError(
                    f"communication benchmark: a process ended without a result ({codes}); its error is above"
                ) from None


def measure(
    sizes: list[int] | None = None, repeats: int = REPEATS, processes: int = 2, gloo_loop_nice: int | str = 0
) -> dict:
    """Median gloo all-reduce and one-way send times per message size across `processes`
    local processes (gloo's event loops at `gloo_loop_nice`, as the study's runs have them),
    the fitted (alpha, beta) of each, and this machine's kernels."""
    import torch.multiprocessing as mp

    from dtstudy.projection.calibration import fit_allreduce, fit_p2p

    sizes = sizes or DEFAULT_SIZES
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    workers = [
        context.Process(target=_worker, args=(rank, processes, port, sizes, repeats, gloo_loop_nice, queue))
        for rank in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        results = _first_result(queue, workers)
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    return {
        "processes": processes,
        "backend": "gloo",
        "gloo_loop_nice": gloo_loop_nice,
        "repeats": repeats,
        "allreduce": results["allreduce"],
        "p2p": results["p2p"],
        "fit": {"allreduce": fit_allreduce(results["allreduce"], processes), "p2p": fit_p2p(results["p2p"])},
        "kernels_s_per_byte": {**_kernel_seconds_per_byte(repeats), **results["exchange_s_per_byte"]},
        "jitter": results["bursts"],
        "burst_alone_s": results["bursts"]["alone_s"],  # interleaved with the rounds together
        "compute_scale": {"1": 1.0, str(processes): results["bursts"]["slowdown"]},
        "cpu_share": {str(k): cpu_share(k) for k in range(1, processes + 1)},
        "host": socket.gethostname(),
        "cores": os.cpu_count(),
    }


def write(
    path: str | Path, sizes: list[int] | None = None, repeats: int = REPEATS, gloo_loop_nice: int | str = 0
) -> dict:
    result = measure(sizes, repeats, gloo_loop_nice=gloo_loop_nice)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))
    return result
