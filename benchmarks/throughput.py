"""Throughput benchmark, measured side by side in one run (not a test: prints ratios).

1. images/s of the study's training loop at N=1 (submitit job, DDP allreduce, all the
   measuring) against a plain PyTorch loop on the same model, data, batch and one thread;
   target: within 2%.
2. allreduce efficiency at N=2 against N=1: thr(2) / (2 thr(1)).

Runs alternate (plain, study, plain, study, ...) so that drift of the machine hits both.

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

from dtstudy.config import run_config, validate_schema
from dtstudy.data import load_split, prepare
from dtstudy.launcher import run
from dtstudy.models import build_model
from dtstudy.train import RunSpec


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
        inputs, labels = train.batch(order[first:first + batch_size])
        loss = criterion(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        images += len(labels)
    return images / (time.perf_counter() - start)


def study_loop(study: dict, data_dir: Path, workers: int, out: Path) -> float:
    spec = RunSpec("allreduce", workers, 0, run_config(study, "allreduce"), str(data_dir), str(out))
    return run(spec, out / "submitit", poll_s=0.2)["throughput"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--skip", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    study = validate_schema({"train": {"batch_size": args.batch_size, "max_steps": args.steps, "epochs": 1,
                                       "steady_state_skip": args.skip, "log_every": 10**6}})
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data_dir = tmp / "data"
        prepare(study["dataset"], data_dir)
        plain, ours, pair = [], [], []
        for repeat in range(args.repeats):
            plain.append(plain_loop(data_dir, args.batch_size, args.steps, args.skip))
            ours.append(study_loop(study, data_dir, 1, tmp / f"n1-{repeat}"))
            pair.append(study_loop(study, data_dir, 2, tmp / f"n2-{repeat}"))
            print(f"repeat {repeat + 1}: plain {plain[-1]:.0f} img/s, study N=1 {ours[-1]:.0f} img/s, "
                  f"study N=2 {pair[-1]:.0f} img/s", flush=True)

    plain_m, ours_m, pair_m = (statistics.median(v) for v in (plain, ours, pair))
    print(f"\nLeNet-5, Fashion-MNIST, batch {args.batch_size}, {args.steps} steps ({args.skip} skipped), "
          f"median of {args.repeats}")
    print(f"study loop N=1 / plain loop:      {ours_m:.0f} / {plain_m:.0f} img/s = {ours_m / plain_m:.3f} "
          "(target >= 0.98)")
    print(f"allreduce efficiency N=2 vs N=1:  {pair_m:.0f} / (2 x {ours_m:.0f}) = {pair_m / (2 * ours_m):.3f}")


if __name__ == "__main__":
    main()
