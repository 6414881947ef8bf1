"""The source files' formats: Fashion-MNIST's idx files and CIFAR-10's python batches (finding,
checking and reading them), and the sha256 of a source file."""

from __future__ import annotations

import gzip
import hashlib
import math
import os
import struct
import zlib
from pathlib import Path

from dtstudy.data.errors import DataConfigError

DEFAULT_FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
CIFAR10_DIR = "cifar-10-batches-py"
CIFAR10_FILES = [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"]


def find_fashion_mnist_files(root: Path) -> dict[str, Path | None]:
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


def check_idx_file(path: Path) -> list[int]:
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


def read_idx(path: Path, limit: int | None = None):
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


def read_cifar_batch(path: Path):
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
        isinstance(data, np.ndarray)
        and data.dtype == np.uint8
        and data.ndim == 2
        and data.shape[1] == 3 * 32 * 32
        and labels is not None
        and len(labels) == len(data)
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


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
