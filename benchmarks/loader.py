"""Loader benchmark: images/s per loader core of the study's imagefolder training pipeline
(dtstudy.data.feed: RandomResizedCrop + flip on uint8 tensors, uint8 batches), once per
`loader.decoder` given (default: torchvision.io decoding whole files, and DALI's fused
decode-and-crop of the crop's region alone), against torchvision's reference pipeline
(ImageFolder + PIL + RandomResizedCrop + RandomHorizontalFlip + ToTensor + Normalize) at the
same worker count, measured side by side in one run on a generated ImageNet-like JPEG tree.
Not a test: prints ratios.

All read the same files with the same DataLoader settings (workers, batch, no pinning: the
CPU's work only). Each measurement starts a fresh DataLoader, lets its first --warmup
batches go (the workers' start; a DALI pipeline's first runs, its own start-up, a
one-off in a training run whose workers persist) and times the next --batches batches; the
pipelines take turns in an order that rotates round by round, so that the machine's drift
hits all of them, and each ratio is the median of the per-round ratios with its range: every
decoder's to the reference, and every decoder's to the first one given (whether decoding
only the crop's region pays). The study's normalisation runs on the GPU in training and is
left out; the reference's ToTensor + Normalize run in its workers, as there.

From the median rate per core it prints how many loader cores one GPU needs at --gpu-rate
images/s (ResNet-50's training rate on the GPU you mean: an input, not a measurement).

    python3 benchmarks/loader.py [--workers 1] [--repeats 5] [--batches 12] [--warmup 4]
                                 [--decoders torchvision dali_cpu] [--image-size 500x375]
                                 [--record FILE]
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


def make_tree(
    root: Path, classes: int, per_class: int, seed: int = 0, size: tuple[int, int] = (500, 375)
) -> list[tuple[str, int]]:
    """An ImageNet-like tree: JPEGs (quality 90) of `size` (width, height; ImageNet's typical
    500x375 by default) of random content, smooth shapes plus noise, at 500x375 about
    ImageNet's median file size; returns (relative path, label) of every file."""
    width, height = size
    from PIL import Image

    rng = np.random.default_rng(seed)
    samples = []
    for label in range(classes):
        folder = root / f"n{label:08d}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            coarse = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize(
                (width, height), Image.BICUBIC
            )
            pixels = np.asarray(coarse, dtype=np.int16) + rng.normal(0, 12, (height, width, 3)).astype(np.int16)
            path = folder / f"img{i:04d}.JPEG"
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=90)
            samples.append((path.relative_to(root).as_posix(), label))
    return samples


def study_loader(root: Path, samples, workers: int, batch: int, decoder: str) -> DataLoader:
    """The study's training pipeline as a training run builds it (ImageFolderSplit's DataLoader)."""
    meta = {
        "root": str(root),
        "classes": len({label for _, label in samples}),
        "image_size": IMAGE_SIZE,
        "mean": IMAGENET_MEAN,
        "std": IMAGENET_STD,
    }
    loader = {"workers": workers, "decoder": decoder, "train_augment": "random_resized_crop_flip", "prefetch": 2}
    split = ImageFolderSplit(meta, samples, "train", loader, "cpu")
    order = torch.randperm(len(samples)).tolist()
    split.batches([])  # builds the feed
    feed = split._feed
    feed.batch_sampler.source = [order[i : i + batch] for i in range(0, len(order) - batch + 1, batch)]
    return feed.loader


def reference_loader(root: Path, workers: int, batch: int) -> DataLoader:
    """torchvision's references/classification training pipeline (PIL, v1 transforms)."""
    from torchvision import datasets, transforms

    transform = transforms.Compose(
        [
            transforms.RandomResizedCrop(IMAGE_SIZE),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    dataset = datasets.ImageFolder(str(root), transform=transform)
    return DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True)


def image_size(text: str) -> tuple[int, int]:
    """'500x375' -> (500, 375), for --image-size."""
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT (e.g. 500x375)") from None
    if width < 32 or height < 32:
        raise argparse.ArgumentTypeError(f"{text!r}: both sides must be at least 32 pixels")
    return width, height


def rate(loader: DataLoader, batches: int, warmup: int) -> float:
    """images/s over `batches` batches after the first `warmup` (the workers' start-up, and a
    DALI pipeline's first, slower runs)."""
    iterator = iter(loader)
    for _ in range(warmup):
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

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    if changed:  # the code measured is not the commit's
        commit += "+uncommitted"
    return {
        "command": command,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "first_reported": "docs/benchmarks.md (loader.py)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers of both pipelines")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=12, help="timed batches per measurement")
    parser.add_argument(
        "--warmup", type=int, default=4, help="batches let go before the timed ones (workers' start, DALI's first runs)"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--per-class", type=int, default=130)
    parser.add_argument(
        "--decoders",
        nargs="+",
        default=["torchvision", "dali_cpu"],
        choices=["torchvision", "pil", "dali_cpu"],
        help="the study pipeline's loader.decoder values to time (CPU decoders); each is also compared with the first",
    )
    parser.add_argument(
        "--image-size",
        default="500x375",
        type=image_size,
        help="WIDTHxHEIGHT of the generated JPEGs (ImageNet's typical 500x375 by default)",
    )
    parser.add_argument(
        "--gpu-rate",
        type=float,
        default=2500.0,
        help="ResNet-50 training images/s of one GPU, for the cores-per-GPU line",
    )
    parser.add_argument("--record", default=None, help="write the rounds and the summary to this JSON file")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error(f"--warmup: {args.warmup} must be at least 1 (the first batch waits for the workers' start)")
    if (args.batches + args.warmup) * args.batch_size > args.classes * args.per_class:
        parser.error("--batches + --warmup batches of --batch-size need more images (--classes x --per-class)")
    if len(set(args.decoders)) != len(args.decoders):
        parser.error(f"--decoders: {' '.join(args.decoders)} names a decoder twice")

    tmp = Path(tempfile.mkdtemp(prefix="loader-bench-"))
    try:
        samples = make_tree(tmp / "tree", args.classes, args.per_class, size=args.image_size)
        sizes = [os.path.getsize(tmp / "tree" / path) for path, _ in samples]
        width, height = args.image_size
        print(
            f"{len(samples)} JPEGs of {width}x{height}, median {statistics.median(sizes) / 1024:.0f} KiB; "
            f"{args.workers} worker(s), batches of {args.batch_size}, {args.batches} timed batches, "
            f"{args.repeats} rounds",
            flush=True,
        )
        pipelines = {
            decoder: (
                lambda decoder=decoder: study_loader(tmp / "tree", samples, args.workers, args.batch_size, decoder)
            )
            for decoder in args.decoders
        }
        pipelines["reference"] = lambda: reference_loader(tmp / "tree", args.workers, args.batch_size)
        names = list(pipelines)
        rounds = []
        for r in range(args.repeats):
            order = names[r % len(names) :] + names[: r % len(names)]
            measured = {}
            for name in order:
                torch.manual_seed(r)  # the same crops for every study decoder
                measured[name] = rate(pipelines[name](), args.batches, args.warmup)
            rounds.append(measured)
            print(
                f"round {r + 1}: " + ", ".join(f"{name} {measured[name]:.1f}" for name in names) + " images/s",
                flush=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    first = args.decoders[0]
    per_core = {name: summary([m[name] / max(args.workers, 1) for m in rounds]) for name in names}
    to_reference = {name: summary([m[name] / m["reference"] for m in rounds]) for name in args.decoders}
    to_first = {name: summary([m[name] / m[first] for m in rounds]) for name in args.decoders[1:]}
    cores = {name: args.gpu_rate / per_core[name]["median"] for name in names}
    print(f"images/s per loader core, median [min - max] over {args.repeats} rounds:")
    for name in names:
        s = per_core[name]
        print(f"  {name:11s} {s['median']:.1f} [{s['min']:.1f} - {s['max']:.1f}]")
    for name, ratio in to_reference.items():
        print(
            f"ratio {name} / reference: {ratio['median']:.3f} [{ratio['min']:.3f} - {ratio['max']:.3f}] "
            "(target >= 1.0, aim >= 1.5)"
        )
    for name, ratio in to_first.items():
        print(f"ratio {name} / {first}: {ratio['median']:.3f} [{ratio['min']:.3f} - {ratio['max']:.3f}]")
    print(
        f"loader cores per GPU to feed ResNet-50 at {args.gpu_rate:.0f} images/s: "
        + ", ".join(f"{name} {cores[name]:.1f}" for name in names)
    )
    if args.record:
        record = {
            "what": "images/s per loader core of the study's imagefolder training pipeline, per decoder, "
            "against torchvision's reference pipeline, same workers, interleaved rounds",
            "provenance": provenance("python3 benchmarks/loader.py " + " ".join(sys.argv[1:])),
            "config": {
                key: getattr(args, key)
                for key in (
                    "workers",
                    "repeats",
                    "batches",
                    "warmup",
                    "batch_size",
                    "classes",
                    "per_class",
                    "image_size",
                    "decoders",
                    "gpu_rate",
                )
            },
            "rounds": rounds,
            "summary": {
                "per_core_images_per_s": per_core,
                "ratio_to_reference": to_reference,
                "ratio_to_first_decoder": to_first,
                "cores_per_gpu": cores,
            },
        }
        Path(args.record).write_text(json.dumps(record, indent=1) + "\n")
        print(f"record: {args.record}")


if __name__ == "__main__":
    main()
