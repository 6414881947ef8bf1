"""Throughput benchmark, measured side by side in one run (not a test: prints ratios).

1. images/s of the study's training loop at N=1 (submitit job, DDP allreduce, all the
   measuring) against a plain PyTorch loop on the same model, data, batch and one thread;
   target: within 2%.
2. allreduce efficiency at N=2 against N=1: thr(2) / (2 thr(1)).

Both loops run in a submitit job (a fresh single-threaded process each), and runs alternate
(plain, study N=1, study N=2, plain, ...) so that drift of the machine hits all of them;
the ratio is the median of the per-repeat ratios.

    python3 benchmarks/throughput.py [--steps 400] [--repeats 3] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from dtstudy.config.study_config import run_config, validate_schema
from dtstudy.data.loading import load_split
from dtstudy.data.prepare import prepare
from dtstudy.launch.launcher import run_training_job
from dtstudy.runspec import RunSpec
from dtstudy.training.models import build_model


def plain_loop(data_dir: Path, batch_size: int, steps: int, skip: int) -> float:
    """The reference: the simplest correct single-process training loop, images/s."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train = load_split(data_dir, "train")
    model = build_model("lenet5", 1, 10, 28)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    criterion = nn.CrossEntropyLoss()
    order = torch.randperm(len(train))
    images, start = 0, None
    for step in range(steps):
        if step == skip:
            start, images = time.perf_counter(), 0
        first = (step * batch_size) % (len(train) - batch_size)
        inputs, labels = train.batch(order[first : first + batch_size])
        loss = criterion(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        images += len(labels)
    return images / (time.perf_counter() - start)


def plain_job(data_dir: Path, batch_size: int, steps: int, skip: int, job_dir: Path) -> float:
    import submitit

    executor = submitit.AutoExecutor(folder=job_dir, cluster="local")
    executor.update_parameters(timeout_min=30, nodes=1, tasks_per_node=1)
    return executor.submit(plain_loop, data_dir, batch_size, steps, skip).result()


def study_loop(study: dict, data_dir: Path, workers: int, out: Path) -> float:
    spec = RunSpec("allreduce", workers, 0, run_config(study, "allreduce"), str(data_dir), str(out))
    return run_training_job(spec, out / "submitit")["throughput"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--skip", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    study = validate_schema(
        {
            "train": {
                "batch_size": args.batch_size,
                "max_steps": args.steps,
                "epochs": 1,
                "steady_state_skip": args.skip,
                "log_every": 10**6,
            }
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data_dir = tmp / "data"
        prepare(study["dataset"], data_dir)
        plain, ours, pair = [], [], []
        for repeat in range(args.repeats):
            plain.append(plain_job(data_dir, args.batch_size, args.steps, args.skip, tmp / f"plain-{repeat}"))
            ours.append(study_loop(study, data_dir, 1, tmp / f"n1-{repeat}"))
            pair.append(study_loop(study, data_dir, 2, tmp / f"n2-{repeat}"))
            print(
                f"repeat {repeat + 1}: plain {plain[-1]:.0f} img/s, study N=1 {ours[-1]:.0f} img/s, "
                f"study N=2 {pair[-1]:.0f} img/s",
                flush=True,
            )

    plain_m, ours_m, pair_m = (statistics.median(v) for v in (plain, ours, pair))
    loop_ratio = statistics.median(o / p for o, p in zip(ours, plain))
    efficiency = statistics.median(two / (2 * one) for two, one in zip(pair, ours))
    print(
        f"\nLeNet-5, Fashion-MNIST, batch {args.batch_size}, {args.steps} steps ({args.skip} skipped), "
        f"median of {args.repeats}"
    )
    print(
        f"study loop N=1 / plain loop:      median ratio {loop_ratio:.3f} (target >= 0.98); "
        f"medians {ours_m:.0f} / {plain_m:.0f} img/s"
    )
    print(f"allreduce efficiency N=2 vs N=1:  median {efficiency:.3f}; medians {pair_m:.0f} / (2 x {ours_m:.0f}) img/s")


if __name__ == "__main__":
    main()
