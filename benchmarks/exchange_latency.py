"""What one gradient exchange of the default study costs on this machine, and why it is more
than its bytes: gloo's all-reduce of LeNet-5's gradient (61706 fp32 values) between two
processes pinned to the two cores, timed as the study's runs meet it (right after each
process's own forward and backward of a batch of 32) and as the communication benchmark
times it (right after a barrier), beside the same bytes exchanged both ways over a plain TCP
socket after the same compute. Each gloo pattern runs twice: over a group whose event-loop
thread keeps its priority (gloo's default) and over a second group whose loop runs at nice
19 (launcher.gloo_loop_nice, the study's default; dtstudy.gloo_loops). Side by side in one
run, interleaved round by round; prints the median with the 10th and 90th percentiles of each.

    python3 benchmarks/exchange_latency.py [--rounds 300]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from dtstudy.gloo_loops import gloo_loop_threads, lower_gloo_event_loops
from dtstudy.training.models import build_model

NICE = 19
# (label, what comes before the exchange, the exchange: gloo over the default group or over
# the one whose loop is at nice 19, or plain TCP)
PATTERNS = (
    ("gloo all-reduce after compute", "compute", "gloo"),
    (f"  the same, gloo's loop at nice {NICE}", "compute", "gloo, quiet loop"),
    ("gloo all-reduce after a barrier", "barrier", "gloo"),
    (f"  the same, gloo's loop at nice {NICE}", "barrier", "gloo, quiet loop"),
    ("TCP exchange after compute", "compute", "tcp"),
)


def _recv_exactly(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        got += conn.recv_into(view[got:])


def _worker(rank: int, port: int, rounds: int, queue) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    default_loops = gloo_loop_threads()
    quiet = dist.new_group([0, 1])  # a second group: its own gloo device and event loop
    lower_gloo_event_loops(NICE, gloo_loop_threads() - default_loops)
    torch.manual_seed(rank)
    model, criterion = build_model("lenet5", 1, 10, 28), nn.CrossEntropyLoss()
    inputs, labels = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    gradient = torch.zeros(sum(p.numel() for p in model.parameters()))
    payload = gradient.numpy().tobytes()
    incoming = memoryview(bytearray(len(payload)))
    # a plain TCP connection between the two processes, rank 0 listening
    if rank == 0:
        server = socket.create_server(("127.0.0.1", port + 1))
        dist.barrier()
        conn, _ = server.accept()
    else:
        dist.barrier()
        conn = socket.create_connection(("127.0.0.1", port + 1))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def compute() -> None:
        model.zero_grad(set_to_none=True)
        criterion(model(inputs), labels).backward()

    def tcp_exchange() -> None:  # both directions, as the ring's two halves are
        if rank == 0:
            conn.sendall(payload)
            _recv_exactly(conn, incoming)
        else:
            _recv_exactly(conn, incoming)
            conn.sendall(payload)

    times = [[] for _ in PATTERNS]
    for round_ in range(rounds + 20):
        for index, (_, before, exchange) in enumerate(PATTERNS):
            group = quiet if exchange == "gloo, quiet loop" else None
            if before == "barrier":
                dist.barrier(group=group)
            else:
                compute()
            start = time.perf_counter()
            if exchange == "tcp":
                tcp_exchange()
            else:
                dist.all_reduce(gradient, group=group)
            if round_ >= 20:  # the first rounds warm up
                times[index].append(time.perf_counter() - start)
    conn.close()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(times)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--port", type=int, default=29640)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    processes = [context.Process(target=_worker, args=(rank, args.port, args.rounds, queue)) for rank in range(2)]
    for process in processes:
        process.start()
    times = queue.get()
    for process in processes:
        process.join()
    tcp = quantile(times[-1], 0.5)
    print(f"LeNet-5 gradient (61706 fp32 values, 247 KB), 2 processes on cores 0 and 1, {args.rounds} rounds each")
    print(f"{'exchange':36s} {'median':>9s} {'p10':>9s} {'p90':>9s} {'median / TCP':>13s}")
    for (label, _, _), values in zip(PATTERNS, times):
        median = quantile(values, 0.5)
        print(
            f"{label:36s} {median * 1e3:7.3f}ms {quantile(values, 0.1) * 1e3:7.3f}ms "
            f"{quantile(values, 0.9) * 1e3:7.3f}ms {median / tcp:12.1f}x"
        )


if __name__ == "__main__":
    main()
