"""The workers' SGD step, fused against torch's per-tensor loop (not a test: prints times
and their ratio, measured side by side in one run).

Every strategy's worker steps LeNet-5's 10 tensors with momentum, Nesterov and weight decay
(`training.loop.make_optimizer_factory`). torch's default on CPU runs ~5 small ops per tensor from
Python; `fused=True` does the whole update in one kernel. Rounds alternate the three
implementations (loop, foreach, fused) so that the machine's drift hits all of them; each
round times `--steps` steps after a warm-up. Prints the median [min - max] microseconds per
step and the median of the per-round ratios to the loop.

    python3 benchmarks/optimizer_step.py [--rounds 7] [--steps 1000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dtstudy.training.models import build_model

IMPLEMENTATIONS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def seconds_per_step(options: dict, steps: int) -> float:
    model = build_model("lenet5", 1, 10, 28)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4, nesterov=True, **options)
    for _ in range(20):
        optimizer.step()
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a worker
    times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    for _ in range(args.rounds):
        for name, options in IMPLEMENTATIONS.items():
            times[name].append(seconds_per_step(options, args.steps))
    print(
        f"SGD step of LeNet-5 (momentum 0.9, Nesterov, weight decay), one thread, {args.rounds} rounds of "
        f"{args.steps} steps: microseconds per step, median [min - max]; ratio to the loop, median of rounds"
    )
    for name, values in times.items():
        ratio = statistics.median(v / loop for v, loop in zip(values, times["loop"]))
        print(
            f"{name:>8}: {statistics.median(values) * 1e6:6.0f} [{min(values) * 1e6:.0f} - "
            f"{max(values) * 1e6:.0f}]  ratio {ratio:.2f}"
        )


if __name__ == "__main__":
    main()
