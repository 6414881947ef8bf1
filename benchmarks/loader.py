"""Loader benchmark: images/s per loader core of the study's imagefolder training pipeline
(dtstudy.data.feed: torchvision.io decoding, RandomResizedCrop + flip on uint8 tensors, uint8
batches) against torchvision's reference pipeline (ImageFolder + PIL + RandomResizedCrop +
RandomHorizontalFlip + ToTensor + Normalize) at the same worker count, measured side by side
in one run on a generated ImageNet-like JPEG tree. Not a test: prints ratios.

Both read the same files with the same DataLoader settings (workers, batch, no pinning: the
CPU's work only). Each measurement starts a fresh DataLoader, lets its first batch go (the
workers' start) and times the next --batches batches; the pipelines alternate round by round
(A B, B A, ...) so that the machine's drift hits both, and the ratio is the median of the
per-round ratios with its range. The study's normalisation runs on the GPU in training and is
left out; the reference's ToTensor + Normalize run in its workers, as there.

From the median rate per core it prints how many loader cores one GPU needs at --gpu-rate
images/s (ResNet-50's training rate on the GPU you mean: an input, not a measurement).

    python3 benchmarks/loader.py [--workers 1] [--repeats 5] [--batches 12] [--record FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from dtstudy.data.feed import ImageFolderSplit  # noqa: E402
from dtstudy.data.prepare import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402

IMAGE_SIZE = 224


def make_tree(root: Path, classes: int, per_class: int, seed: int = 0) -> list[tuple[str, int]]:
    """An ImageNet-like tree: 500x375 JPEGs (quality 90) of random content, smooth shapes plus
    noise, about ImageNet's median file size; returns (relative path, label) of every file."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    samples = []
    for label in range(classes):
        folder = root / f"n{label:08d}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            coarse = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize((500, 375),
                                                                                                Image.BICUBIC)
            pixels = np.asarray(coarse, dtype=np.int16) + rng.normal(0, 12, (375, 500, 3)).astype(np.int16)
            path = folder / f"img{i:04d}.JPEG"
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=90)
            samples.append((path.relative_to(root).as_posix(), label))
    return samples


def study_loader(root: Path, samples, workers: int, batch: int, decoder: str) -> DataLoader:
    """The study's training pipeline as a training run builds it (ImageFolderSplit's DataLoader)."""
    meta = {"root": str(root), "classes": len({label for _, label in samples}), "image_size": IMAGE_SIZE,
            "mean": IMAGENET_MEAN, "std": IMAGENET_STD}
    loader = {"workers": workers, "decoder": decoder, "train_augment": "random_resized_crop_flip", "prefetch": 2}
    split = ImageFolderSplit(meta, samples, "train", loader, "cpu")
    order = torch.randperm(len(samples)).tolist()
    split.batches([])  # builds the feed
    feed = split._feed
    feed.batch_sampler.source = [order[i:i + batch] for i in range(0, len(order) - batch + 1, batch)]
    return feed.loader


def reference_loader(root: Path, workers: int, batch: int) -> DataLoader:
    """torchvision's references/classification training pipeline (PIL, v1 transforms)."""
    from torchvision import datasets, transforms

    transform = transforms.Compose([
        transforms.RandomResizedCrop(IMAGE_SIZE),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])
    dataset = datasets.ImageFolder(str(root), transform=transform)
    return DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True)


def rate(loader: DataLoader, batches: int) -> float:
    """images/s over `batches` batches after the first (the workers' start-up)."""
    iterator = iter(loader)
    next(iterator)
    start, images = time.perf_counter(), 0
    for _ in range(batches):
        inputs, _ = next(iterator)
        images += len(inputs)
    seconds = time.perf_counter() - start
    del iterator
    return images / seconds


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def provenance(command: str) -> dict:
    sys.path.insert(0, str(REPO / "workflow"))
    from dtstudy.tracking.provenance import cpu_model

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    return {"command": command, "commit": commit, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count()}, "python": platform.python_version(),
            "torch": torch.__version__, "first_reported": "docs/benchmarks.md (loader.py)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers of both pipelines")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=12, help="timed batches per measurement")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--per-class", type=int, default=120)
    parser.add_argument("--decoder", default="torchvision", choices=["torchvision", "pil"],
                        help="the study pipeline's loader.decoder (CPU decoders)")
    parser.add_argument("--gpu-rate", type=float, default=2500.0,
                        help="ResNet-50 training images/s of one GPU, for the cores-per-GPU line")
    parser.add_argument("--record", default=None, help="write the rounds and the summary to this JSON file")
    args = parser.parse_args()
    if (args.batches + 1) * args.batch_size > args.classes * args.per_class:
        parser.error("--batches + 1 batches of --batch-size need more images (--classes x --per-class)")

    tmp = Path(tempfile.mkdtemp(prefix="loader-bench-"))
    try:
        samples = make_tree(tmp / "tree", args.classes, args.per_class)
        sizes = [os.path.getsize(tmp / "tree" / path) for path, _ in samples]
        print(f"{len(samples)} JPEGs of 500x375, median {statistics.median(sizes) / 1024:.0f} KiB; "
              f"{args.workers} worker(s), batches of {args.batch_size}, {args.batches} timed batches, "
              f"{args.repeats} rounds", flush=True)
        pipelines = {
            "study": lambda: study_loader(tmp / "tree", samples, args.workers, args.batch_size, args.decoder),
            "reference": lambda: reference_loader(tmp / "tree", args.workers, args.batch_size),
        }
        rounds = []
        for r in range(args.repeats):
            order = list(pipelines) if r % 2 == 0 else list(reversed(pipelines))
            measured = {}
            for name in order:
                torch.manual_seed(r)
                measured[name] = rate(pipelines[name](), args.batches)
            measured["ratio"] = measured["study"] / measured["reference"]
            rounds.append(measured)
            print(f"round {r + 1}: study {measured['study']:.1f} images/s, reference "
                  f"{measured['reference']:.1f} images/s, ratio {measured['ratio']:.3f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    per_core = {name: summary([m[name] / max(args.workers, 1) for m in rounds]) for name in pipelines}
    ratio = summary([m["ratio"] for m in rounds])
    cores = {name: args.gpu_rate / per_core[name]["median"] for name in pipelines}
    print(f"images/s per loader core, median [min - max] over {args.repeats} rounds:")
    for name in pipelines:
        s = per_core[name]
        print(f"  {name:9s} {s['median']:.1f} [{s['min']:.1f} - {s['max']:.1f}]")
    print(f"ratio study / reference: {ratio['median']:.3f} [{ratio['min']:.3f} - {ratio['max']:.3f}] "
          "(target >= 1.0, aim >= 1.5)")
    print(f"loader cores per GPU to feed ResNet-50 at {args.gpu_rate:.0f} images/s: study "
          f"{cores['study']:.1f}, reference {cores['reference']:.1f}")
    if args.record:
        record = {
            "what": "images/s per loader core of the study's imagefolder training pipeline against "
                    "torchvision's reference pipeline, same workers, interleaved rounds",
            "provenance": provenance("python3 benchmarks/loader.py " + " ".join(sys.argv[1:])),
            "config": {key: getattr(args, key) for key in ("workers", "repeats", "batches", "batch_size",
                                                             "classes", "per_class", "decoder", "gpu_rate")},
            "rounds": rounds,
            "summary": {"per_core_images_per_s": per_core, "ratio": ratio, "cores_per_gpu": cores},
        }
        Path(args.record).write_text(json.dumps(record, indent=1) + "\n")
        print(f"record: {args.record}")


if __name__ == "__main__":
    main()
