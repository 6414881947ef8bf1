"""Data sets of the study: config checks, one-off preparation, and fast batch loading.

`check_dataset` runs when the Snakefile is parsed, so this module imports torch only
inside the functions that need it.

Prepared forms (written by `prepare`, read by `load_split`):
- "tensors" (fashion_mnist, cifar10, synthetic): train.pt / val.pt / test.pt, each
  {"images": uint8 [n, C, H, W], "labels": int64 [n]}, plus meta.json.
- "imagefolder": index.json (relative paths + labels per split, class names) plus
  meta.json; pixels stay in the files and are decoded per batch.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import struct
from pathlib import Path

from .atomic_files import atomic_write, write_json

DEFAULT_FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
FASHION_MNIST_TRAIN_SIZE = 60000
CIFAR10_DIR = "cifar-10-batches-py"
CIFAR10_FILES = [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"]
CIFAR10_TRAIN_SIZE = 50000
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
SPLITS = ("train", "val", "test")


class DataConfigError(ValueError):
    """A dataset config value that cannot work; the message names the key and the fix."""


# ---------------------------------------------------------------------------- checks


def check_dataset(cfg: dict) -> int:
    """Cheap checks a JSON schema cannot do; returns the number of training images available."""
    checks = {
        "fashion_mnist": _check_fashion_mnist,
        "cifar10": _check_cifar10,
        "imagefolder": _check_imagefolder,
        "synthetic": lambda c: c["synthetic"]["train_size"],
    }
    if cfg["name"] not in checks:
        raise DataConfigError(f"dataset.name: {cfg['name']!r} is unknown (one of {', '.join(checks)})")
    available = checks[cfg["name"]](cfg)
    subset = cfg.get("subset")
    if subset is not None and subset > available:
        raise DataConfigError(
            f"dataset.subset: {subset} is larger than the {available} training images of {cfg['name']}"
        )
    n = available if subset is None else subset
    n_val = round(cfg["val_fraction"] * n)
    if n_val == 0 or n_val == n:
        raise DataConfigError(
            f"dataset.val_fraction: {cfg['val_fraction']} of {n} training images leaves an empty "
            "train or validation split (use more images or a fraction nearer 0.1)"
        )
    return available


def _check_fashion_mnist(cfg: dict) -> int:
    root = Path(cfg["root"] or DEFAULT_FASHION_MNIST_ROOT)
    if not root.is_dir():
        if cfg["download"]:
            return FASHION_MNIST_TRAIN_SIZE
        raise DataConfigError(
            f"dataset.root: '{root}' does not exist (a folder with fashion_mnist's idx files, "
            f"or null for {DEFAULT_FASHION_MNIST_ROOT})"
        )
    files = _find_fashion_mnist_files(root)
    missing = [FASHION_MNIST_FILES[key] for key, path in files.items() if path is None]
    if missing:
        if cfg["download"]:
            return FASHION_MNIST_TRAIN_SIZE
        raise DataConfigError(
            f"dataset.root: '{root}' lacks {', '.join(missing)} (.gz or unpacked, flat or in "
            "torchvision's FashionMNIST/raw/; or set dataset.download: true)"
        )
    n_images = _idx_count(files["train_images"])
    n_labels = _idx_count(files["train_labels"])
    if n_images != n_labels:
        raise DataConfigError(
            f"dataset.root: '{root}' has {n_images} training images but {n_labels} labels"
        )
    return n_images


def _check_cifar10(cfg: dict) -> int:
    if cfg["root"] is None:
        raise DataConfigError(
            "dataset.root: null is not allowed for cifar10 (give the folder that holds "
            f"torchvision's {CIFAR10_DIR}/, or a writable folder with dataset.download: true)"
        )
    folder = Path(cfg["root"]) / CIFAR10_DIR
    missing = [name for name in CIFAR10_FILES if not (folder / name).is_file()]
    if missing and not cfg["download"]:
        raise DataConfigError(
            f"dataset.root: '{cfg['root']}' lacks {CIFAR10_DIR}/{missing[0]} (torchvision's "
            "CIFAR-10 python layout; or set dataset.download: true)"
        )
    return CIFAR10_TRAIN_SIZE


def _check_imagefolder(cfg: dict) -> int:
    if cfg["root"] is None:
        raise DataConfigError(
            "dataset.root: null is not allowed for imagefolder (a folder with train/<class>/ "
            "image folders and optionally test/ or val/)"
        )
    train = Path(cfg["root"]) / "train"
    if not train.is_dir():
        raise DataConfigError(
            f"dataset.root: '{cfg['root']}' has no train/ folder (expected train/<class>/ "
            "image folders and optionally test/ or val/)"
        )
    n = sum(len(files) for files in _scan_class_folders(train).values())
    if n == 0:
        raise DataConfigError(
            f"dataset.root: '{train}' holds no images in class folders "
            f"(expected train/<class>/*{{{','.join(IMAGE_EXTENSIONS)}}})"
        )
    return n


# ------------------------------------------------------------------- file formats


def _find_fashion_mnist_files(root: Path) -> dict[str, Path | None]:
    """Each idx file, flat (Debian) or in torchvision's FashionMNIST/raw/, .gz or unpacked."""
    folders = [root, root / "FashionMNIST" / "raw"]
    found = {}
    for key, name in FASHION_MNIST_FILES.items():
        candidates = [folder / (name + suffix) for folder in folders for suffix in ("", ".gz")]
        found[key] = next((path for path in candidates if path.is_file()), None)
    return found


def _open_idx(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _read_idx_header(stream) -> list[int]:
    magic = stream.read(4)
    if len(magic) != 4 or magic[:3] != b"\x00\x00\x08":
        raise DataConfigError(f"dataset.root: {stream.name!r} is not a uint8 idx file")
    ndim = magic[3]
    return list(struct.unpack(f">{ndim}I", stream.read(4 * ndim)))


def _idx_count(path: Path) -> int:
    with _open_idx(path) as stream:
        return _read_idx_header(stream)[0]


def _read_idx(path: Path, limit: int | None = None):
    """The first `limit` (default all) items of a uint8 idx file as a numpy array."""
    import numpy as np

    with _open_idx(path) as stream:
        dims = _read_idx_header(stream)
        count = dims[0] if limit is None else min(limit, dims[0])
        item_size = int(np.prod(dims[1:], dtype=np.int64))
        data = stream.read(count * item_size)
    return np.frombuffer(data, dtype=np.uint8).reshape(count, *dims[1:])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _scan_class_folders(folder: Path) -> dict[str, list[str]]:
    """Class name -> sorted image paths relative to the root (folder's parent), as torchvision finds them."""
    classes = {}
    for class_dir in sorted(entry for entry in folder.iterdir() if entry.is_dir()):
        files = []
        for dirpath, _, filenames in sorted(os.walk(class_dir, followlinks=True)):
            files += [
                (Path(dirpath) / name).relative_to(folder.parent).as_posix()
                for name in sorted(filenames)
                if name.lower().endswith(IMAGE_EXTENSIONS)
            ]
        classes[class_dir.name] = files
    return classes


# ------------------------------------------------------------------------- prepare


def prepared_files(cfg: dict) -> list[str]:
    """The files `prepare` writes for this dataset config (the prepare_data rule's outputs)."""
    if cfg["name"] == "imagefolder":
        return ["meta.json", "index.json"]
    return ["meta.json", *(f"{split}.pt" for split in SPLITS)]


def prepare(cfg: dict, out_dir: str | Path) -> dict:
    """Write the prepared form of the dataset to out_dir; returns the meta dict (meta.json)."""
    check_dataset(cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # meta.json marks a complete preparation: drop the old one before replacing any file.
    (out_dir / "meta.json").unlink(missing_ok=True)
    if cfg["name"] == "imagefolder":
        meta = _prepare_imagefolder(cfg, out_dir)
    else:
        meta = _prepare_tensors(cfg, out_dir)
    write_json(out_dir / "meta.json", meta)
    return meta


def _split_permutation(n: int, cfg: dict):
    """(train, val) index tensors: val is the first round(val_fraction * n) of a seeded permutation."""
    import torch

    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg["split_seed"]))
    n_val = round(cfg["val_fraction"] * n)
    return perm[n_val:], perm[:n_val]


def _prepare_tensors(cfg: dict, out_dir: Path) -> dict:
    import torch

    loaders = {"fashion_mnist": _load_fashion_mnist, "cifar10": _load_cifar10, "synthetic": _load_synthetic}
    (train_images, train_labels), test, source_files = loaders[cfg["name"]](cfg)
    train_idx, val_idx = _split_permutation(len(train_labels), cfg)
    splits = {
        "train": (train_images[train_idx], train_labels[train_idx]),
        "val": (train_images[val_idx], train_labels[val_idx]),
        "test": test,
    }
    for split, (images, labels) in splits.items():
        blob = {"images": images.contiguous(), "labels": labels.to(torch.int64).contiguous()}
        # Saving through a stream (not a path) keeps the archive name, hence the bytes, fixed.
        atomic_write(out_dir / f"{split}.pt", lambda stream: torch.save(blob, stream))
        print(f"prepare {cfg['name']}: {split} {tuple(images.shape)} -> {out_dir}/{split}.pt", flush=True)
    mean, std = _channel_stats(splits["train"][0])
    _, channels, height, width = train_images.shape
    return {
        "name": cfg["name"],
        "format": "tensors",
        "channels": channels,
        "height": height,
        "width": width,
        "classes": _num_classes(cfg),
        "sizes": {split: len(labels) for split, (_, labels) in splits.items()},
        "mean": mean,
        "std": std,
        "subset": cfg.get("subset"),
        "val_fraction": cfg["val_fraction"],
        "split_seed": cfg["split_seed"],
        "source_files": source_files,
    }


def _num_classes(cfg: dict) -> int:
    return cfg["synthetic"]["classes"] if cfg["name"] == "synthetic" else 10


def _channel_stats(images) -> tuple[list[float], list[float]]:
    """Per-channel mean and std in [0, 1] pixel scale, exact via 256-bin histograms."""
    import torch

    values = torch.arange(256, dtype=torch.float64) / 255
    mean, std = [], []
    for c in range(images.shape[1]):
        counts = torch.bincount(images[:, c].reshape(-1), minlength=256).to(torch.float64)
        m = float((counts * values).sum() / counts.sum())
        var = float((counts * (values - m) ** 2).sum() / counts.sum())
        mean.append(m)
        std.append(var**0.5)
    return mean, std


def _load_fashion_mnist(cfg: dict):
    import torch

    root = Path(cfg["root"] or DEFAULT_FASHION_MNIST_ROOT)
    files = _find_fashion_mnist_files(root)
    if any(path is None for path in files.values()):
        from torchvision.datasets import FashionMNIST

        FashionMNIST(str(root), train=True, download=True)
        files = _find_fashion_mnist_files(root)

    def read(key: str, limit: int | None = None):
        array = _read_idx(files[key], limit)
        return torch.from_numpy(array.copy())

    subset = cfg.get("subset")
    train = (read("train_images", subset).unsqueeze(1), read("train_labels", subset))
    test = (read("test_images").unsqueeze(1), read("test_labels"))
    source_files = {path.relative_to(root).as_posix(): _sha256(path) for path in files.values()}
    return train, test, source_files


def _load_cifar10(cfg: dict):
    import torch
    from torchvision.datasets import CIFAR10

    def read(train: bool):
        data = CIFAR10(cfg["root"], train=train, download=cfg["download"])
        images = torch.from_numpy(data.data).permute(0, 3, 1, 2).contiguous()
        return images, torch.tensor(data.targets, dtype=torch.int64)

    images, labels = read(train=True)
    subset = cfg.get("subset")
    train = (images[:subset], labels[:subset])
    folder = Path(cfg["root"]) / CIFAR10_DIR
    source_files = {f"{CIFAR10_DIR}/{name}": _sha256(folder / name) for name in CIFAR10_FILES}
    return train, read(train=False), source_files


def _load_synthetic(cfg: dict):
    import torch

    syn, size = cfg["synthetic"], cfg["image_size"]
    generator = torch.Generator().manual_seed(cfg["split_seed"])

    def make(n: int):
        shape = (n, syn["channels"], size, size)
        images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
        return images, torch.randint(0, syn["classes"], (n,), generator=generator)

    train_images, train_labels = make(syn["train_size"])
    subset = cfg.get("subset")
    return (train_images[:subset], train_labels[:subset]), make(syn["test_size"]), {}


def _prepare_imagefolder(cfg: dict, out_dir: Path) -> dict:
    root = Path(cfg["root"]).resolve()
    train_classes = _scan_class_folders(root / "train")
    class_names = list(train_classes)
    samples = [(path, label) for label, name in enumerate(class_names) for path in train_classes[name]]
    samples = samples[: cfg.get("subset")]
    train_idx, val_idx = _split_permutation(len(samples), cfg)
    index = {
        "classes": class_names,
        "train": [samples[i] for i in train_idx.tolist()],
        "val": [samples[i] for i in val_idx.tolist()],
        "test": _imagefolder_test_samples(root, class_names),
    }
    for split in SPLITS:
        print(f"prepare imagefolder: {split} {len(index[split])} files", flush=True)
    write_json(out_dir / "index.json", index)
    return {
        "name": "imagefolder",
        "format": "imagefolder",
        "root": str(root),
        "image_size": cfg["image_size"],
        "channels": 3,
        "height": cfg["image_size"],
        "width": cfg["image_size"],
        "classes": len(class_names),
        "sizes": {split: len(index[split]) for split in SPLITS},
        "mean": IMAGENET_MEAN,
        "std": IMAGENET_STD,
        "subset": cfg.get("subset"),
        "val_fraction": cfg["val_fraction"],
        "split_seed": cfg["split_seed"],
    }


def _imagefolder_test_samples(root: Path, class_names: list[str]) -> list[tuple[str, int]]:
    """(path relative to root, label) of test/ (or else val/), labelled with train/'s classes."""
    folder = next((root / name for name in ("test", "val") if (root / name).is_dir()), None)
    if folder is None:
        return []
    samples = []
    for name, files in _scan_class_folders(folder).items():
        if name not in class_names:
            raise DataConfigError(
                f"dataset.root: class folder '{folder / name}' has no counterpart in '{root / 'train'}'"
            )
        samples += [(path, class_names.index(name)) for path in files]
    return samples


# ---------------------------------------------------------------------------- load


def load_split(data_dir: str | Path, split: str):
    """A prepared split: len(), num_classes, channels, is_in_memory and batch(indices)."""
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not one of {', '.join(SPLITS)}")
    data_dir = Path(data_dir)
    meta = json.loads((data_dir / "meta.json").read_text())
    if meta["format"] == "imagefolder":
        index = json.loads((data_dir / "index.json").read_text())
        return _image_folder_split_class()(meta, index[split])
    return TensorSplit(meta, data_dir / f"{split}.pt")


class TensorSplit:
    """A split held as one uint8 tensor; batches are indexed, converted and normalised at once."""

    is_in_memory = True

    def __init__(self, meta: dict, path: Path):
        import torch

        blob = torch.load(path, weights_only=True)
        self.images, self.labels = blob["images"], blob["labels"]
        self.num_classes = meta["classes"]
        self.channels = meta["channels"]
        mean = torch.tensor(meta["mean"], dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(meta["std"], dtype=torch.float32).view(1, -1, 1, 1)
        # (x / 255 - mean) / std == x * scale + shift
        self._scale = 1 / (255 * std)
        self._shift = -mean / std

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        inputs, labels = self.batch([i])
        return inputs[0], labels[0]

    def batch(self, indices):
        import torch

        indices = torch.as_tensor(indices, dtype=torch.long)
        inputs = self.images[indices].to(torch.float32).mul_(self._scale).add_(self._shift)
        return inputs, self.labels[indices]


class _ImageFolderSplitBase:
    """A split of image files, decoded, resized and normalised per item (see _image_folder_split_class)."""

    is_in_memory = False

    def __init__(self, meta: dict, samples: list[tuple[str, int]]):
        from torchvision import transforms

        self.root = Path(meta["root"])
        self.samples = samples
        self.num_classes = meta["classes"]
        self.channels = 3
        size = meta["image_size"]
        self.transform = transforms.Compose([
            transforms.Resize(int(size * 256 / 224)),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            transforms.Normalize(meta["mean"], meta["std"]),
        ])

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image

        path, label = self.samples[i]
        with Image.open(self.root / path) as image:
            return self.transform(image.convert("RGB")), label

    def batch(self, indices):
        import torch

        items = [self[i] for i in torch.as_tensor(indices, dtype=torch.long).tolist()]
        inputs = torch.stack([inputs for inputs, _ in items])
        return inputs, torch.tensor([label for _, label in items], dtype=torch.int64)


@functools.cache
def _image_folder_split_class():
    """ImageFolderSplit as a torch Dataset, built on first use to keep this module's import torch-free."""
    from torch.utils.data import Dataset

    return type("ImageFolderSplit", (_ImageFolderSplitBase, Dataset), {})


def iterate_batches(dataset, indices, batch_size: int, drop_last: bool):
    """Yield dataset.batch(chunk) for consecutive chunks of `indices`, in order."""
    import torch

    if batch_size < 1:
        raise ValueError(f"batch_size: {batch_size} must be at least 1")
    indices = torch.as_tensor(indices, dtype=torch.long)
    for start in range(0, len(indices), batch_size):
        chunk = indices[start : start + batch_size]
        if drop_last and len(chunk) < batch_size:
            return
        yield dataset.batch(chunk)
