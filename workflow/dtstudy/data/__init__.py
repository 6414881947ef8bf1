"""Data sets of the study: config checks, one-off preparation, and fast batch loading.

`check_dataset` runs when the Snakefile is parsed, so this module imports torch only
inside the functions that need it.

Prepared forms (written by `prepare`, read by `load_split`):
- "tensors" (fashion_mnist, cifar10, synthetic): train.pt / val.pt / test.pt, each
  {"images": uint8 [n, C, H, W], "labels": int64 [n]}, plus meta.json.
- "imagefolder": index.json (relative paths + labels per split, class names, skipped
  files) plus meta.json; pixels stay in the files and are decoded per batch. `root` is
  root/<class>/<image> (test split held out per class) or root/train/<class>/ (+ test/ or val/).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from dtstudy.atomic_files import atomic_write, write_json
from dtstudy.errors import ConfigError

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
CORRUPT_IMAGE_POLICIES = ("error", "skip")
PICKLE_STOP = b"."  # the opcode that ends every pickle
SHOWN_PATHS = 5  # bad files named in an error or log line


class DataConfigError(ConfigError):
    """A dataset config value that cannot work; the message names the key and the fix."""


# ---------------------------------------------------------------------------- checks


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
    available = checks[cfg["name"]](cfg)
    subset = cfg.get("subset")
    if subset is not None and subset > available:
        raise DataConfigError(
            f"dataset.subset: {subset} is larger than the {available} training images of {cfg['name']}"
        )
    _check_val_split(available if subset is None else subset, cfg)
    return available


def _check_val_split(n: int, cfg: dict) -> None:
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
    files = _find_fashion_mnist_files(root)
    missing = [FASHION_MNIST_FILES[key] for key, path in files.items() if path is None]
    if missing:
        if cfg["download"]:
            return FASHION_MNIST_TRAIN_SIZE
        raise DataConfigError(
            f"dataset.root: '{root}' lacks {', '.join(missing)} (.gz or unpacked, flat or in "
            "torchvision's FashionMNIST/raw/; or set dataset.download: true)"
        )
    # torchvision's download keeps files that exist, so a damaged one is an error even with download
    dims = {key: _check_idx_file(path) for key, path in files.items()}
    for split in ("train", "test"):
        images, labels = dims[f"{split}_images"], dims[f"{split}_labels"]
        if len(images) != 3 or len(labels) != 1:
            raise DataConfigError(
                f"dataset.root: '{files[f'{split}_images']}' and '{files[f'{split}_labels']}' have "
                f"shapes {images} and {labels} (expected [n, height, width] images and [n] labels)"
            )
        if images[0] != labels[0]:
            raise DataConfigError(
                f"dataset.root: '{root}' has {images[0]} {split} images but {labels[0]} labels"
            )
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
    tree = _image_tree(cfg)
    if tree.test is not None:
        return sum(len(files) for files in tree.train.values())
    held_out = _held_out_counts(tree, cfg)
    return sum(len(files) - held_out[name] for name, files in tree.train.items())


# ------------------------------------------------------------------- image folders


@dataclass
class _ImageTree:
    """An imagefolder root as listed on disk: its classes, and where its test split comes from."""

    root: Path
    layout: str  # "plain" (root/<class>/<image>) or "split" (root/train/<class>/<image>)
    train: dict[str, list[str]]  # class -> image paths relative to root, as ImageFolder lists them
    test: dict[str, list[str]] | None  # from test/ (or else val/); None: held out of train
    test_source: str  # "test/", "val/" or "held out"


def _image_tree(cfg: dict) -> _ImageTree:
    """List an imagefolder root (names only, no image is opened); DataConfigError if it cannot work."""
    if cfg["root"] is None:
        raise DataConfigError(
            "dataset.root: null is not allowed for imagefolder (a folder of <class>/<image> "
            "folders, or one with train/<class>/ and optionally test/ or val/)"
        )
    root = Path(cfg["root"])
    if not root.is_dir():
        raise DataConfigError(
            f"dataset.root: '{root}' is not a folder (a folder of <class>/<image> folders, "
            "or one with train/<class>/ and optionally test/ or val/)"
        )
    if (root / "train").is_dir():
        layout, train_dir = "split", root / "train"
        test_dir = next((root / name for name in ("test", "val") if (root / name).is_dir()), None)
    else:
        for name in ("test", "val"):
            if (root / name).is_dir():
                raise DataConfigError(
                    f"dataset.root: '{root}' has a {name}/ folder but no train/ (give train/<class>/ "
                    f"beside {name}/, or a folder whose sub-folders are all classes)"
                )
        layout, train_dir, test_dir = "plain", root, None
    train = _class_files(train_dir, root)
    if len(train) < 2:
        raise DataConfigError(
            f"dataset.root: '{train_dir}' has one class folder ({next(iter(train))}/); a classifier "
            "needs at least 2 (one sub-folder per class)"
        )
    test = None
    if test_dir is not None:
        test = _class_files(test_dir, root)
        unknown = [name for name in test if name not in train]
        if unknown:
            raise DataConfigError(
                f"dataset.root: class folder '{test_dir / unknown[0]}' has no counterpart in "
                f"'{train_dir}' (the test classes must be training classes)"
            )
    test_source = "held out" if test_dir is None else f"{test_dir.name}/"
    return _ImageTree(root, layout, train, test, test_source)


def _class_files(folder: Path, root: Path) -> dict[str, list[str]]:
    """Class name -> sorted image paths relative to root, found as torchvision's ImageFolder finds them.

    Classes are the sorted sub-folder names (hidden ones too, as ImageFolder), files are
    walked recursively and kept by extension; a class without images is an error, as there.
    """
    classes = {}
    for name in sorted(entry.name for entry in os.scandir(folder) if entry.is_dir()):
        files = []
        for dirpath, _, filenames in sorted(os.walk(folder / name, followlinks=True)):
            files += [
                (Path(dirpath) / file).relative_to(root).as_posix()
                for file in sorted(filenames)
                if file.lower().endswith(IMAGE_EXTENSIONS)
            ]
        classes[name] = files
    if not classes:
        raise DataConfigError(
            f"dataset.root: '{folder}' has no class folders (expected {folder}/<class>/<image>)"
        )
    empty = [name for name, files in classes.items() if not files]
    if empty:
        raise DataConfigError(
            f"dataset.root: {len(empty)} class folder(s) hold no images, e.g. '{folder / empty[0]}' "
            f"(images are files ending in {', '.join(IMAGE_EXTENSIONS)}); add images or remove the folder"
        )
    return classes


def _held_out_counts(tree: _ImageTree, cfg: dict) -> dict[str, int]:
    """Class -> test images held out of it: round(test_fraction * class size) (a stratified split)."""
    fraction = cfg["test_fraction"]
    counts = {name: round(fraction * len(files)) for name, files in tree.train.items()}
    whole = [name for name, n in counts.items() if n == len(tree.train[name])]
    if whole:
        raise DataConfigError(
            f"dataset.test_fraction: {fraction} of the {len(tree.train[whole[0]])} images of "
            f"'{tree.root / whole[0]}' leaves none for training (lower it, or add a test/ folder)"
        )
    if sum(counts.values()) == 0:
        raise DataConfigError(
            f"dataset.test_fraction: {fraction} of each class of '{tree.root}' holds out no test "
            "image (raise it, add images, or add a test/ folder)"
        )
    return counts


def _hold_out_test(tree: _ImageTree, cfg: dict) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(train, test) files per class: each class's test files drawn by a split_seed permutation."""
    import torch

    counts = _held_out_counts(tree, cfg)
    generator = torch.Generator().manual_seed(cfg["split_seed"])
    train, test = {}, {}
    for name, files in tree.train.items():  # class order fixed, so the draws are too
        perm = torch.randperm(len(files), generator=generator).tolist()
        held = set(perm[: counts[name]])
        # both keep the listing's order, as a test/ folder would
        test[name] = [path for i, path in enumerate(files) if i in held]
        train[name] = [path for i, path in enumerate(files) if i not in held]
    return train, test


def _image_problem(path: Path) -> str | None:
    """Why the image at path cannot be used in training (the message of its error), or None."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.draft("RGB", (1, 1))  # JPEG: decode at 1/8 scale, still reading the whole stream
            image.load()
    except Exception as err:  # noqa: BLE001 - whatever PIL raises here, training would raise too
        return f"{type(err).__name__}: {err}"
    return None


def _decodable(root: Path, samples: list, limit: int | None = None) -> tuple[list, list[tuple[str, str]]]:
    """(the first `limit` (default all) samples whose image decodes, [(path, why)] of those that do not)."""
    from concurrent.futures import ThreadPoolExecutor

    good, bad = [], []
    chunk = 512  # decode in chunks, so that a small subset does not decode the whole tree
    # threads: PIL's decoders release the GIL
    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        for start in range(0, len(samples), chunk):
            part = samples[start : start + chunk]
            for sample, problem in zip(part, pool.map(lambda s: _image_problem(root / s[0]), part)):
                if limit is not None and len(good) == limit:
                    return good, bad
                if problem is None:
                    good.append(sample)
                else:
                    bad.append((sample[0], problem))
    return good, bad


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


def _read_idx_header(stream, path: Path) -> list[int]:
    magic = stream.read(4)
    if len(magic) != 4 or magic[:3] != b"\x00\x00\x08" or magic[3] == 0:
        raise DataConfigError(f"dataset.root: '{path}' is not a uint8 idx file")
    ndim = magic[3]
    raw = stream.read(4 * ndim)
    if len(raw) != 4 * ndim:
        raise DataConfigError(f"dataset.root: '{path}' is truncated inside its idx header")
    return list(struct.unpack(f">{ndim}I", raw))


def _idx_damaged(path: Path, what: str) -> DataConfigError:
    return DataConfigError(
        f"dataset.root: '{path}' is truncated or damaged ({what}); replace it with an intact "
        "copy (or delete it and set dataset.download: true)"
    )


def _idx_short(path: Path, dims: list[int], size: str) -> DataConfigError:
    expected = 4 + 4 * len(dims) + math.prod(dims)
    return _idx_damaged(path, f"its idx header announces {dims}, {expected} bytes unpacked, but it holds {size}")


def _check_idx_file(path: Path) -> list[int]:
    """The idx file's dims, once its size matches them (cheap: a stat, or gzip's size trailer)."""
    try:
        with _open_idx(path) as stream:
            dims = _read_idx_header(stream, path)
    except (EOFError, OSError, zlib.error) as err:  # a .gz cut inside its first block
        raise _idx_damaged(path, f"unreadable: {err}") from None
    expected = 4 + 4 * len(dims) + math.prod(dims)
    if path.suffix != ".gz":
        if path.stat().st_size != expected:
            raise _idx_short(path, dims, f"{path.stat().st_size} bytes")
        return dims
    with open(path, "rb") as raw:  # gzip's last 4 bytes: the unpacked size mod 2**32
        raw.seek(-4, os.SEEK_END)
        if int.from_bytes(raw.read(4), "little") == expected % 2**32:
            return dims
    # A mismatch: a cut file, or several gzip members; only reading it all tells which.
    try:
        with gzip.open(path, "rb") as stream:
            size = sum(len(block) for block in iter(lambda: stream.read(1 << 20), b""))
    except (EOFError, OSError, zlib.error) as err:
        raise _idx_short(path, dims, f"a gzip stream that ends early ({err})") from None
    if size != expected:
        raise _idx_short(path, dims, f"{size} bytes unpacked")
    return dims


def _read_idx(path: Path, limit: int | None = None):
    """The first `limit` (default all) items of a uint8 idx file as a numpy array."""
    import numpy as np

    try:
        with _open_idx(path) as stream:
            dims = _read_idx_header(stream, path)
            count = dims[0] if limit is None else min(limit, dims[0])
            item_size = math.prod(dims[1:])
            data = stream.read(count * item_size)
    except (EOFError, OSError, zlib.error) as err:
        raise _idx_damaged(path, f"unreadable: {err}") from None
    if len(data) != count * item_size:
        raise _idx_damaged(
            path, f"its first {count} items need {count * item_size} bytes after the header, it holds {len(data)}"
        )
    return np.frombuffer(data, dtype=np.uint8).reshape(count, *dims[1:])


def _read_cifar_batch(path: Path):
    """(images uint8 [n, 3, 32, 32], labels int64 [n]) of one CIFAR-10 python batch file."""
    import pickle

    import numpy as np

    try:
        with open(path, "rb") as stream:
            # CIFAR-10 ships as Python 2 pickles (torchvision unpickles them the same way)
            entry = pickle.load(stream, encoding="latin1")
    except Exception as err:  # noqa: BLE001 - a cut pickle fails in many ways (EOF, opcodes, numpy)
        raise DataConfigError(
            f"dataset.root: '{path}' cannot be unpickled ({type(err).__name__}: {err}); it is "
            "truncated or damaged: replace it with the file from cifar-10-python.tar.gz"
        ) from None
    data = entry.get("data") if isinstance(entry, dict) else None
    labels = entry.get("labels") if isinstance(entry, dict) else None
    ok = (
        isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2
        and data.shape[1] == 3 * 32 * 32 and labels is not None and len(labels) == len(data)
    )
    if not ok:
        raise DataConfigError(
            f"dataset.root: '{path}' is not a CIFAR-10 batch (expected a dict with 'data' uint8 "
            "[n, 3072] and n 'labels')"
        )
    labels = np.asarray(labels, dtype=np.int64)
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise DataConfigError(f"dataset.root: '{path}' has labels outside 0..9")
    return data.reshape(-1, 3, 32, 32), labels


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
    import numpy as np
    import torch

    if cfg["download"]:
        from torchvision.datasets import CIFAR10

        CIFAR10(cfg["root"], train=True, download=True)  # fetches what is missing or fails its md5
    folder = Path(cfg["root"]) / CIFAR10_DIR

    def read(names: list[str]):
        parts = [_read_cifar_batch(folder / name) for name in names]
        images = np.concatenate([images for images, _ in parts])
        labels = np.concatenate([labels for _, labels in parts])
        return torch.from_numpy(images), torch.from_numpy(labels)

    images, labels = read([name for name in CIFAR10_FILES if name.startswith("data_batch")])
    subset = cfg.get("subset")
    train = (images[:subset], labels[:subset])
    source_files = {f"{CIFAR10_DIR}/{name}": _sha256(folder / name) for name in CIFAR10_FILES}
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
    tree = _image_tree(cfg)
    root = tree.root.resolve()
    class_names = list(tree.train)
    train_files, test_files = (tree.train, tree.test) if tree.test is not None else _hold_out_test(tree, cfg)

    def labelled(files: dict[str, list[str]]) -> list[tuple[str, int]]:
        return [(path, label) for label, name in enumerate(class_names) for path in files.get(name, [])]

    # Every image kept is decoded once here, so that none fails half-way through a training run.
    samples, bad = _decodable(root, labelled(train_files), cfg.get("subset"))
    test, bad_test = _decodable(root, labelled(test_files))
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
            f"dataset.subset: {subset} is larger than the {len(samples)} decodable training images "
            f"under '{root}'"
        )
    if not test:
        raise DataConfigError(f"dataset.root: no decodable test image is left under '{root}'")
    _check_val_split(len(samples), cfg)
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
    }


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


# Evaluation's batch: on one CPU thread LeNet-5 scores Fashion-MNIST's test split in 0.54 s in
# batches of 256 against 0.85 s in batches of 1000 (whose activations spill out of the core's cache).
EVAL_BATCH = 256


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
