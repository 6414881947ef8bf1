"""One-off preparation of a data set (`prepare`) and the files it writes (`prepared_files`).

Prepared forms (written by `prepare`, read by dtstudy.data.loading.load_split):
- "tensors" (fashion_mnist, cifar10, synthetic): train.pt / val.pt / test.pt, each
  {"images": uint8 [n, C, H, W], "labels": int64 [n]}, plus meta.json.
- "imagefolder": index.json (relative paths + labels per split, class names, skipped
  files) plus meta.json; pixels stay in the files and are decoded per batch, or, with
  `dataset.shard_mb`, the files are packed into tar shards (data.storage, shards.json). `root` is
  root/<class>/<image> (test split held out per class) or root/train/<class>/ (+ test/ or val/).
"""

from __future__ import annotations

import functools
from pathlib import Path

from dtstudy.common.atomic_files import atomic_write, write_json
from dtstudy.data.checks import check_dataset, check_val_split
from dtstudy.data.errors import DataConfigError
from dtstudy.data.formats import (
    CIFAR10_DIR,
    CIFAR10_FILES,
    DEFAULT_FASHION_MNIST_ROOT,
    find_fashion_mnist_files,
    read_cifar_batch,
    read_idx,
    sha256,
)
from dtstudy.data.image_folder import decodable, hold_out_test, image_tree
from dtstudy.data.storage import SHARDS_INDEX, remove_shards, write_shards

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
SPLITS = ("train", "val", "test")
CORRUPT_IMAGE_POLICIES = ("error", "skip")
SHOWN_PATHS = 5  # bad files named in an error or log line


def prepared_files(cfg: dict) -> list[str]:
    """The files `prepare` writes for this dataset config (the prepare_data rule's outputs)."""
    if cfg["name"] == "imagefolder":
        return ["meta.json", "index.json", *([SHARDS_INDEX] if cfg.get("shard_mb") is not None else [])]
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
    subset = cfg.get("subset")
    if subset is not None and len(train_labels) < subset:  # files smaller than the header check assumed
        raise DataConfigError(
            f"dataset.subset: {subset} is larger than the {len(train_labels)} training images read "
            f"from dataset.root '{cfg['root']}'"
        )
    train_idx, val_idx = _split_permutation(len(train_labels), cfg)
    splits = {
        "train": (train_images[train_idx], train_labels[train_idx]),
        "val": (train_images[val_idx], train_labels[val_idx]),
        "test": test,
    }
    for split, (images, labels) in splits.items():
        blob = {"images": images.contiguous(), "labels": labels.to(torch.int64).contiguous()}
        # Saving through a stream (not a path) keeps the archive name, hence the bytes, fixed.
        atomic_write(out_dir / f"{split}.pt", functools.partial(torch.save, blob))
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
    files = find_fashion_mnist_files(root)
    if any(path is None for path in files.values()):
        from torchvision.datasets import FashionMNIST

        FashionMNIST(str(root), train=True, download=True)
        files = find_fashion_mnist_files(root)

    def read(key: str, limit: int | None = None):
        array = read_idx(files[key], limit)
        return torch.from_numpy(array.copy())

    subset = cfg.get("subset")
    train = (read("train_images", subset).unsqueeze(1), read("train_labels", subset))
    test = (read("test_images").unsqueeze(1), read("test_labels"))
    source_files = {path.relative_to(root).as_posix(): sha256(path) for path in files.values()}
    return train, test, source_files


def _load_cifar10(cfg: dict):
    import numpy as np
    import torch

    if cfg["download"]:
        from torchvision.datasets import CIFAR10

        CIFAR10(cfg["root"], train=True, download=True)  # fetches what is missing or fails its md5
    folder = Path(cfg["root"]) / CIFAR10_DIR

    def read(names: list[str]):
        parts = [read_cifar_batch(folder / name) for name in names]
        images = np.concatenate([images for images, _ in parts])
        labels = np.concatenate([labels for _, labels in parts])
        return torch.from_numpy(images), torch.from_numpy(labels)

    images, labels = read([name for name in CIFAR10_FILES if name.startswith("data_batch")])
    subset = cfg.get("subset")
    train = (images[:subset], labels[:subset])
    source_files = {f"{CIFAR10_DIR}/{name}": sha256(folder / name) for name in CIFAR10_FILES}
    return train, read(["test_batch"]), source_files


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
    tree = image_tree(cfg)
    root = tree.root.resolve()
    class_names = list(tree.train)
    train_files, test_files = (tree.train, tree.test) if tree.test is not None else hold_out_test(tree, cfg)

    def labelled(files: dict[str, list[str]]) -> list[tuple[str, int]]:
        return [(path, label) for label, name in enumerate(class_names) for path in files.get(name, [])]

    # Every image kept is decoded once here, so that none fails half-way through a training run.
    samples, bad = decodable(root, labelled(train_files), cfg.get("subset"))
    test, bad_test = decodable(root, labelled(test_files))
    bad += bad_test
    if bad:
        shown = "; ".join(f"{path} ({why})" for path, why in bad[:SHOWN_PATHS])
        if cfg["corrupt_images"] == "error":
            raise DataConfigError(
                f"dataset.root: {len(bad)} image(s) under '{root}' cannot be read or decoded: {shown}; "
                "repair or remove them, or set dataset.corrupt_images: skip to leave them out"
            )
        print(
            f"prepare imagefolder: WARNING skipped {len(bad)} unreadable or corrupt image(s) "
            f"(dataset.corrupt_images: skip; all listed in {out_dir}/index.json): {shown}",
            flush=True,
        )
    subset = cfg.get("subset")
    if subset is not None and len(samples) < subset:
        raise DataConfigError(
            f"dataset.subset: {subset} is larger than the {len(samples)} decodable training images under '{root}'"
        )
    if not test:
        raise DataConfigError(f"dataset.root: no decodable test image is left under '{root}'")
    check_val_split(len(samples), cfg)
    train_idx, val_idx = _split_permutation(len(samples), cfg)
    index = {
        "classes": class_names,
        "train": [samples[i] for i in train_idx.tolist()],
        "val": [samples[i] for i in val_idx.tolist()],
        "test": test,
        "skipped": bad,
    }
    for split in SPLITS:
        print(f"prepare imagefolder: {split} {len(index[split])} files", flush=True)
    shards = None
    if cfg.get("shard_mb") is not None:
        shards = write_shards(root, {split: index[split] for split in SPLITS}, out_dir, cfg["shard_mb"])
    else:  # a previous preparation's shards would only take space
        remove_shards(out_dir)
    write_json(out_dir / "index.json", index)
    return {
        "name": "imagefolder",
        "format": "imagefolder",
        "root": str(root),
        "layout": tree.layout,
        "image_size": cfg["image_size"],
        "channels": 3,
        "height": cfg["image_size"],
        "width": cfg["image_size"],
        "classes": len(class_names),
        "sizes": {split: len(index[split]) for split in SPLITS},
        "mean": IMAGENET_MEAN,
        "std": IMAGENET_STD,
        "subset": subset,
        "val_fraction": cfg["val_fraction"],
        "test_source": tree.test_source,
        "test_fraction": cfg["test_fraction"] if tree.test is None else None,
        "split_seed": cfg["split_seed"],
        "corrupt_images": cfg["corrupt_images"],
        "skipped_images": len(bad),
        "skipped_examples": [path for path, _ in bad[:SHOWN_PATHS]],
        "shards": shards,
    }
