"""The input pipeline of an imagefolder split (`ImageFolderSplit`), built to keep a GPU busy as
torchvision's references/classification, DALI and FFCV do: one persistent DataLoader per split
(`loader.workers` processes, each `loader.prefetch` batches ahead, pinned memory on a GPU),
uint8 batches to the device, and the float conversion and normalisation there (`Feed`).

The `loader` config section picks the decoder (data.decoding), the training split's
augmentation (data.augment; the other splits get Resize + CenterCrop) and the worker count.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from dtstudy.data.augment import Draws, ResizeCenterCrop, split_transform
from dtstudy.data.decoding import DECODERS, CpuDecoder, decode_torchvision
from dtstudy.data.storage import FileStore

#: the most loader processes `loader.workers: null` starts per training process: torchvision's
#: references/classification default (`--workers 16`), which keeps a GPU fed with ResNet-50
MAX_LOADER_WORKERS = 16


def loader_workers(setting: int | None) -> int:
    """`loader.workers`, with null resolved to this process's share of the CPUs minus one (the
    training process's own), at most MAX_LOADER_WORKERS: 7 loader processes per GPU in a SLURM
    task of 8 CPUs, 0 (load in the training process) in a local run's rank pinned to one core.
    The share is the CPUs this process may use, but no more than SLURM_CPUS_PER_TASK where SLURM
    set it: a site that does not bind tasks to cores lets every rank use the whole node, and
    every rank of the node would start a loader process per core."""
    if setting is not None:
        return setting
    cpus = len(os.sched_getaffinity(0))
    per_task = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit() and int(per_task) > 0:
        cpus = min(cpus, int(per_task))
    return min(max(cpus - 1, 0), MAX_LOADER_WORKERS)


class ImageFolderSplit(Dataset):
    """A split of image files: item i is (the transformed image as the decoder hands it to the
    batch, label); `batches` feeds a device, `batch` gives the same pixels on the CPU. The
    training transform's random plans come from `draws` (data.augment.Draws; None: seed 0's
    first epoch): the same draws give the same pixels.

    `loader`: the config's `loader` section, or None for a plain reader (the evaluation
    transform on every split, torchvision's decoder, no worker process). `store`: where the
    encoded images are read (data.storage: a split's shards; None for the tree's files)."""

    is_in_memory = False

    def __init__(
        self,
        meta: dict,
        samples: list,
        split: str,
        loader: dict | None = None,
        device: torch.device | str = "cpu",
        store=None,
    ):
        self.root = Path(meta["root"])
        self.samples = [(path, int(label)) for path, label in samples]
        self.store = store if store is not None else FileStore(self.root, [path for path, _ in self.samples])
        self.num_classes = meta["classes"]
        self.channels = 3
        self.size = meta["image_size"]
        self.mean, self.std = meta["mean"], meta["std"]
        self.device = torch.device(device)
        self.loader = loader
        if loader is None:
            self.transform, self.workers, self.prefetch = ResizeCenterCrop(self.size), 0, 2
        else:
            self.transform = split_transform(split, loader["train_augment"], self.size)
            self.workers, self.prefetch = loader_workers(loader["workers"]), loader["prefetch"]
        self.decoder_name = loader["decoder"] if loader is not None else "torchvision"  # loader.decoder's value
        self.decoder = DECODERS[self.decoder_name]()
        self._feed = None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        return _Items(self)[(i, Draws(0))]

    def batch(self, indices, draws: Draws | None = None):
        """(float inputs normalised [B, 3, S, S], int64 labels) on the CPU, decoded in this process
        with torchvision's decoder and this split's transform, plans from `draws`: the pixels
        `batches` gives for the same draws (the decoders agree), in any process. An averaged
        model's BatchNorm statistics are recomputed on such batches of the training split."""
        draws = draws or Draws(0)
        chosen = torch.as_tensor(indices, dtype=torch.long).tolist()
        decoder = CpuDecoder(decode_torchvision)
        pixels = torch.stack([decoder.load(self.store.read(i), self.transform, draws.generator(i)) for i in chosen])
        normalise = Normalise(self.mean, self.std, torch.device("cpu"))
        return normalise(pixels), torch.tensor([self.samples[i][1] for i in chosen], dtype=torch.int64)

    def batches(self, index_batches, draws: Draws | None = None):
        """(inputs, labels) on this split's device for each list of indices, in order: inputs
        float32, normalised; the training transform's plans from `draws`. One DataLoader serves
        every call (its workers persist)."""
        if self._feed is None:
            self._feed = Feed(self)
        return self._feed(index_batches, draws or Draws(0))

    def describe(self) -> dict:
        """What this split's pipeline does, for the run's log."""
        return {
            "transform": self.transform.name,
            "decoder": self.decoder_name,
            "workers": self.workers,
            "prefetch": self.prefetch if self.workers else 0,
            "pin_memory": self.device.type == "cuda",
        }


class Normalise:
    """uint8 pixels -> float32 (x / 255 - mean) / std, as one multiply-add on the batch's device."""

    def __init__(self, mean, std, device: torch.device):
        std_t = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.scale = 1 / (255 * std_t)
        self.shift = -torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1) / std_t

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels.to(torch.float32).mul_(self.scale).add_(self.shift)


class _Items(Dataset):
    """What the loader workers read: the store, labels, decoder and transform of a split,
    without the split itself, so that no reference cycle keeps a dropped split's workers
    alive until a garbage collection, possibly inside a forked child."""

    def __init__(self, split: ImageFolderSplit):
        self.store, self.samples = split.store, split.samples
        self.decoder, self.transform = split.decoder, split.transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: tuple[int, Draws]):
        i, draws = key
        return self.decoder.load(self.store.read(i), self.transform, draws.generator(i)), self.samples[i][1]


class _SwappableBatches:
    """The persistent DataLoader's batch sampler: each pass iterates whatever `source` is then
    (an epoch's batches, a resumed epoch's remainder, an evaluation's shard)."""

    def __init__(self):
        self.source = []

    def __iter__(self):
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)


class _Collate:
    """Worker-side: the decoder's batch of the items, and their labels."""

    def __init__(self, decoder, transform):
        self.decoder, self.transform = decoder, transform

    def __call__(self, items):
        return (
            self.decoder.collate([item for item, _ in items], self.transform),
            torch.tensor([label for _, label in items]),
        )


class Feed:
    """One split's DataLoader and its device-side finish (decode on the GPU where the decoder
    does, then normalise)."""

    def __init__(self, split: ImageFolderSplit):
        self.device, self.decoder, self.transform = split.device, split.decoder, split.transform
        self.batch_sampler = _SwappableBatches()
        workers = split.workers
        options = (
            {
                "persistent_workers": True,
                "prefetch_factor": split.prefetch,
                "multiprocessing_context": split.decoder.worker_start_method,
            }
            if workers
            else {}
        )
        self.loader = DataLoader(
            _Items(split),
            batch_sampler=self.batch_sampler,
            num_workers=workers,
            collate_fn=_Collate(split.decoder, split.transform),
            pin_memory=split.device.type == "cuda",
            **options,
        )
        self.normalise = Normalise(split.mean, split.std, split.device)

    def __call__(self, index_batches, draws: Draws):
        # the draws travel with each index: a worker draws image i's plan from its own generator
        self.batch_sampler.source = [[(int(i), draws) for i in indices] for indices in index_batches]
        for batch, labels in self.loader:
            pixels = self.decoder.finish(batch, self.transform, self.device)
            yield self.normalise(pixels), labels.to(self.device, non_blocking=True)
