"""Recipe search for the embedded studies: allreduce at N workers, replayed in one process.

Synchronous all-reduce at N workers of batch b is, step for step, plain SGD on the union of
the N workers' batches (the average of N batch means of b images is the mean over N*b; the
same momentum, weight decay and rate then act on it). This script replays exactly that:
the workers' DistributedSampler order (seed, epoch), the study's initial weights
(seed_everything(seed), then build_model), the study's schedule for the global batch
(dtstudy.training.lr_schedule.make_schedule), and scores test top-1 on the prepared test split. One
process and one thread, so a 3-epoch run of the whole training set costs ~30 s instead of a
study's minutes, and several recipes x seeds x N fit in one sitting. The replay agrees with
the study's own allreduce runs step for step until float rounding (the all-reduce sums in
another order) grows into a different trajectory, as a different seed would: `--check RUN`
prints where the two training losses part and both test top-1.

    python3 benchmarks/recipe_search.py --data results/data/fashion_mnist \\
        --epochs 3 --workers 1 4 --seeds 0 1 2 \\
        --variant base --variant label_smoothing=0.1 --variant nesterov=true

A variant is `base` (config/config.yaml's train section) or comma-separated key=value overrides of
the `train` section (e.g. `base_lr=0.3,warmup_epochs=0.5`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, DistributedSampler

from dtstudy.checks import load_config
from dtstudy.config.study_config import validate_schema
from dtstudy.data.loading import load_split
from dtstudy.training.evaluate import topk_accuracy
from dtstudy.training.loop import make_criterion, make_optimizer_factory, seed_everything
from dtstudy.training.lr_schedule import make_schedule
from dtstudy.training.models import build_model

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "config" / "config.yaml"  # its train section is "base"


def parse_variant(text: str) -> tuple[str, dict]:
    if text == "base":
        return text, {}
    overrides = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:  # a bare word (lr_scaling=sqrt) is a string
            overrides[key] = value
    return text, overrides


def worker_batch_samplers(train_set, workers: int, batch_size: int, seed: int) -> list[BatchSampler]:
    """Each worker's batches, as the study's workers draw them (training.loop.set_up)."""
    return [
        BatchSampler(
            DistributedSampler(train_set, num_replicas=workers, rank=rank, shuffle=True, seed=seed),
            batch_size,
            drop_last=True,
        )
        for rank in range(workers)
    ]


def global_batches(samplers: list[BatchSampler], epoch: int):
    """The indices each synchronous step averages: the N workers' batches of that step."""
    for sampler in samplers:
        sampler.sampler.set_epoch(epoch)
    for per_rank in zip(*samplers):
        yield torch.as_tensor([index for batch in per_rank for index in batch])


def replay(data_dir: str, train: dict, workers: int, seed: int, model_name: str = "lenet5") -> dict:
    torch.set_num_threads(1)
    seed_everything(seed)
    train_set, test_set = load_split(data_dir, "train"), load_split(data_dir, "test")
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    model = build_model(model_name, meta["channels"], meta["classes"], meta["height"], {})
    optimizer = make_optimizer_factory(train)(model.parameters())
    criterion = make_criterion(train)
    samplers = worker_batch_samplers(train_set, workers, train["batch_size"], seed)
    schedule = make_schedule(train, workers * train["batch_size"], len(samplers[0]))
    step, start, losses = 0, time.perf_counter(), []
    for epoch in range(train["epochs"]):
        for indices in global_batches(samplers, epoch):
            for group in optimizer.param_groups:
                group["lr"] = schedule(step)
            inputs, labels = train_set.batch(indices)
            optimizer.zero_grad(set_to_none=True)
            loss = criterion(model(inputs), labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            step += 1
    return {
        "test_top1": topk_accuracy(model, test_set, ks=(1,))[1],
        "steps": step,
        "seconds": time.perf_counter() - start,
        "train_loss": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="results/data/fashion_mnist", help="a prepared data folder")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variant", action="append", default=None, help="base, or key=value[,key=value]")
    parser.add_argument(
        "--check", default=None, help="a study run's metrics.json + eval.json folder: replay it and print both"
    )
    args = parser.parse_args()

    if args.check:
        folder = Path(args.check)
        metrics = json.loads((folder / "metrics.json").read_text())
        study_top1 = json.loads((folder / "eval.json").read_text())["top1"]
        config = metrics["config"]
        train = validate_schema({"train": config["train"]})["train"]  # keys added since: their defaults
        result = replay(args.data, train, metrics["workers"], metrics["seed"], config["model"])
        gaps = [abs(a - b) for a, b in zip(metrics["train_loss"], result["train_loss"])]
        first = next((i for i, gap in enumerate(gaps) if gap > 1e-4), None)
        print(
            f"{folder}: test top-1 study {study_top1:.4f}, replay {result['test_top1']:.4f}; train loss "
            f"(mean over the global batch) equal to 1e-4 for the first {len(gaps) if first is None else first} "
            f"of {len(gaps)} steps (largest gap before: {max(gaps[:first] or [0]):.1e}), then apart as float "
            "rounding grows (the study's all-reduce sums in another order)"
        )
        return

    variants = [parse_variant(text) for text in (args.variant or ["base"])]
    base = load_config(DEFAULT_CONFIG)["train"]
    rows = []
    for name, overrides in variants:
        config = validate_schema({"train": {**base, "epochs": args.epochs, **overrides}})
        for workers in args.workers:
            values = []
            for seed in args.seeds:
                result = replay(args.data, config["train"], workers, seed)
                values.append(result["test_top1"])
                print(
                    f"{name:40s} N={workers} seed {seed}: test top-1 {result['test_top1']:.4f} "
                    f"({result['steps']} steps, {result['seconds']:.0f} s)",
                    flush=True,
                )
            rows.append((name, workers, values))
    print("\nvariant | N | test top-1 per seed | mean | min")
    for name, workers, values in rows:
        print(
            f"{name} | {workers} | {' '.join(f'{v:.4f}' for v in values)} | "
            f"{statistics.mean(values):.4f} | {min(values):.4f}"
        )


if __name__ == "__main__":
    main()
