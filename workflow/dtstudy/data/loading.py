"""Fast batch loading of a prepared split (`load_split`): in-memory tensors, or image files through
the input pipeline of dtstudy.data.feed."""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path

from dtstudy.data.prepare import SPLITS

_shared: dict | None = None  # (data_dir, split) -> in-memory split, while `shared_splits` is on
_shared_lock = threading.Lock()


@contextlib.contextmanager
def shared_splits():
    """While on, `load_split` reads each in-memory split once and hands every caller the same
    object (read-only after loading): an emulated run's N logical workers, threads of one
    process, then hold one copy of the data set, not N."""
    global _shared
    _shared = {}
    try:
        yield
    finally:
        _shared = None


def load_split(data_dir: str | Path, split: str, loader: dict | None = None, device="cpu"):
    """A prepared split: len(), num_classes, channels, is_in_memory and batch(indices); an
    image split also batches(index_batches) on `device`, as the config's `loader` section
    says (None: a plain reader, dtstudy.data.feed.ImageFolderSplit). In-memory splits ignore both."""
    if _shared is not None:
        with _shared_lock:
            key = (str(Path(data_dir).resolve()), split)
            if key not in _shared:
                _shared[key] = _load_split(data_dir, split, loader, device)
            return _shared[key]
    return _load_split(data_dir, split, loader, device)


def _load_split(data_dir: str | Path, split: str, loader: dict | None, device):
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not one of {', '.join(SPLITS)}")
    data_dir = Path(data_dir)
    meta = json.loads((data_dir / "meta.json").read_text())
    if meta["format"] == "imagefolder":
        from dtstudy.data.feed import ImageFolderSplit
        from dtstudy.data.storage import shard_store

        index = json.loads((data_dir / "index.json").read_text())
        return ImageFolderSplit(meta, index[split], split, loader, device, shard_store(data_dir, meta, split))
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

    def batch(self, indices, draws=None):
        """(inputs, labels) of `indices`; `draws` changes nothing (in-memory data are not augmented)."""
        import torch

        indices = torch.as_tensor(indices, dtype=torch.long)
        inputs = self.images[indices].to(torch.float32).mul_(self._scale).add_(self._shift)
        return inputs, self.labels[indices]


# Evaluation's batch: small enough that LeNet-5's activations stay in a core's cache on one CPU
# thread (larger batches score the test split more slowly there).
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
