"""The dataset config's checks a JSON schema cannot do (`check_dataset`), per data source.

`check_dataset` runs when the Snakefile is parsed, so this module and the ones it imports
import torch only inside the functions that need it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from dtstudy.data.errors import DataConfigError
from dtstudy.data.formats import (
    CIFAR10_DIR,
    CIFAR10_FILES,
    DEFAULT_FASHION_MNIST_ROOT,
    FASHION_MNIST_FILES,
    check_idx_file,
    find_fashion_mnist_files,
)
from dtstudy.data.image_folder import held_out_counts, image_tree

FASHION_MNIST_TRAIN_SIZE = 60000
CIFAR10_TRAIN_SIZE = 50000
PICKLE_STOP = b"."  # the opcode that ends every pickle


def check_dataset(cfg: dict) -> int:
    """Cheap checks a JSON schema cannot do; returns the number of training images available.

    Cheap means structure and sizes (file headers, folder listings), never pixels: it runs
    every time the Snakefile is parsed. `prepare` reads every byte it keeps (and decodes
    every image of an imagefolder) and raises DataConfigError on what this cannot see.
    """
    checks = {
        "fashion_mnist": _check_fashion_mnist,
        "cifar10": _check_cifar10,
        "imagefolder": _check_imagefolder,
        "synthetic": lambda c: c["synthetic"]["train_size"],
    }
    if cfg["name"] not in checks:
        raise DataConfigError(f"dataset.name: {cfg['name']!r} is unknown (one of {', '.join(checks)})")
    if cfg.get("shard_mb") is not None and cfg["name"] != "imagefolder":
        raise DataConfigError(
            f"dataset.shard_mb: {cfg['shard_mb']} applies to imagefolder only ({cfg['name']} is prepared "
            "into tensors held in memory); set it to null"
        )
    available = checks[cfg["name"]](cfg)
    subset = cfg.get("subset")
    if subset is not None and subset > available:
        raise DataConfigError(
            f"dataset.subset: {subset} is larger than the {available} training images of {cfg['name']}"
        )
    check_val_split(available if subset is None else subset, cfg)
    return available


def check_loader(loader: dict, device: str) -> None:
    """The `loader` section against the device the run trains on ("cpu", "cuda" or "auto":
    the config's launcher.device at parse time, the device a worker got at run time)."""
    if loader["decoder"] == "nvjpeg" and device == "cpu":
        raise DataConfigError(
            "loader.decoder: 'nvjpeg' decodes on a GPU, but the run trains on the CPU (launcher.device "
            "cpu, or auto without a visible GPU); use loader.decoder torchvision or pil, or train on cuda"
        )
    if loader["decoder"] == "dali_cpu" and not _installed("nvidia.dali"):
        raise DataConfigError(
            "loader.decoder: 'dali_cpu' needs NVIDIA DALI, which is not installed here (envs/requirements.txt "
            "pins nvidia-dali-cuda130); install it, or use loader.decoder torchvision (the same pixels)"
        )


def _installed(module: str) -> bool:
    """Whether `module` can be imported, found without importing it (its parents excepted)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def check_val_split(n: int, cfg: dict) -> None:
    n_val = round(cfg["val_fraction"] * n)
    if n_val == 0 or n_val == n:
        raise DataConfigError(
            f"dataset.val_fraction: {cfg['val_fraction']} of {n} training images leaves an empty "
            "train or validation split (use more images or a fraction nearer 0.1)"
        )


def _check_fashion_mnist(cfg: dict) -> int:
    root = Path(cfg["root"] or DEFAULT_FASHION_MNIST_ROOT)
    if not root.is_dir():
        if cfg["download"]:
            return FASHION_MNIST_TRAIN_SIZE
        raise DataConfigError(
            f"dataset.root: '{root}' does not exist (a folder with fashion_mnist's idx files, "
            f"or null for {DEFAULT_FASHION_MNIST_ROOT})"
        )
    files = find_fashion_mnist_files(root)
    missing = [FASHION_MNIST_FILES[key] for key, path in files.items() if path is None]
    if missing:
        if cfg["download"]:
            return FASHION_MNIST_TRAIN_SIZE
        raise DataConfigError(
            f"dataset.root: '{root}' lacks {', '.join(missing)} (.gz or unpacked, flat or in "
            "torchvision's FashionMNIST/raw/; or set dataset.download: true)"
        )
    # torchvision's download keeps files that exist, so a damaged one is an error even with download
    dims = {key: check_idx_file(path) for key, path in files.items()}
    for split in ("train", "test"):
        images, labels = dims[f"{split}_images"], dims[f"{split}_labels"]
        if len(images) != 3 or len(labels) != 1:
            raise DataConfigError(
                f"dataset.root: '{files[f'{split}_images']}' and '{files[f'{split}_labels']}' have "
                f"shapes {images} and {labels} (expected [n, height, width] images and [n] labels)"
            )
        if images[0] != labels[0]:
            raise DataConfigError(f"dataset.root: '{root}' has {images[0]} {split} images but {labels[0]} labels")
    return dims["train_images"][0]


def _check_cifar10(cfg: dict) -> int:
    if cfg["root"] is None:
        raise DataConfigError(
            "dataset.root: null is not allowed for cifar10 (give the folder that holds "
            f"torchvision's {CIFAR10_DIR}/, or a writable folder with dataset.download: true)"
        )
    if cfg["download"]:  # torchvision checks its md5 sums and fetches again what is missing or damaged
        return CIFAR10_TRAIN_SIZE
    folder = Path(cfg["root"]) / CIFAR10_DIR
    missing = [name for name in CIFAR10_FILES if not (folder / name).is_file()]
    if missing:
        raise DataConfigError(
            f"dataset.root: '{cfg['root']}' lacks {CIFAR10_DIR}/{missing[0]} (torchvision's "
            "CIFAR-10 python layout; or set dataset.download: true)"
        )
    for name in CIFAR10_FILES:
        # One byte, not the 30 MB pickle: a pickle ends with its STOP opcode, a cut file almost
        # never does; prepare unpickles every batch and catches the rest.
        path = folder / name
        with open(path, "rb") as stream:
            stream.seek(0, os.SEEK_END)
            size = stream.tell()
            stream.seek(max(size - 1, 0))
            if stream.read(1) != PICKLE_STOP:
                raise DataConfigError(
                    f"dataset.root: '{path}' is truncated or not a pickle ({size} bytes, no pickle "
                    "end marker); replace it with the file from cifar-10-python.tar.gz, or delete "
                    "it and set dataset.download: true"
                )
    return CIFAR10_TRAIN_SIZE


def _check_imagefolder(cfg: dict) -> int:
    tree = image_tree(cfg)
    if tree.test is not None:
        return sum(len(files) for files in tree.train.values())
    held_out = held_out_counts(tree, cfg)
    return sum(len(files) - held_out[name] for name, files in tree.train.items())
