"""The image transforms of an imagefolder split on uint8 tensors (torchvision transforms v2's
functions): training's `loader.train_augment` (`TRAIN_AUGMENTS`) and evaluation's Resize +
CenterCrop, as torchvision's references/classification use them.

Each transform is split in two: `plan` draws the random parameters from the image's size
alone and `apply` does the pixel work, so that a decoder may draw the crop from a JPEG's
header in a loader worker and crop on the GPU after nvJPEG has decoded it, or decode only
the crop's region (`reads_a_region`, `apply_to_region`; data.decoding).

Where the random parameters come from (`Draws`): each image's plan from a generator of its
own, seeded by (run seed, purpose, epoch, image index), never from torch's global generator,
which every rank seeds alike (the model's initialisation must be the same on every rank) and
every DataLoader worker inherits: the same seed reproduces a run whatever the worker count,
a resumed epoch draws what the interrupted one would have, and the ranks, which see distinct
images of an epoch (DistributedSampler), draw distinct crops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# torchvision's RandomResizedCrop defaults (Szegedy et al. 2015's "Inception" crop)
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
CROP_TRIES = 10
EVAL_RESIZE = 256 / 224  # resize the shorter side to 256 for a 224 crop


def _v2():
    """torchvision's transforms v2 functions and its interpolation modes, imported at the first
    transform: importing torchvision (its models and ops, torch._dynamo) costs every run's
    process seconds of start-up, and a tensor data set's runs never transform an image."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional

    return functional, InterpolationMode


#: what a pass's draws are for: one stream of draws each, for the same seed and epoch
TRAINING, BATCH_NORM = 0, 1


@dataclass(frozen=True)
class Draws:
    """Where a pass over a split draws its random augmentation: image i's plan comes from
    `generator(i)`, seeded by (seed, purpose, epoch, i), so it depends on nothing else (not the
    rank, the loader worker, the batch or what was drawn before). `purpose` BATCH_NORM: the
    batches an averaged model's BatchNorm statistics are recomputed on (the same on every rank)."""

    seed: int
    epoch: int = 0
    purpose: int = TRAINING

    def generator(self, index: int) -> torch.Generator:
        # SeedSequence hashes the four numbers into well-mixed state: nearby keys (image i and
        # i + 1, epoch e and e + 1) give unrelated streams
        words = np.random.SeedSequence([self.seed, self.purpose, self.epoch, int(index)]).generate_state(2)
        return torch.Generator().manual_seed(int(words[0]) << 32 | int(words[1]))


class RandomResizedCropFlip:
    """RandomResizedCrop(size) (area 8-100%, aspect 3/4-4/3, bilinear, antialiased) and a
    horizontal flip with probability 1/2: torchvision's reference training transform."""

    name = "random_resized_crop_flip"
    reads_a_region = True  # only the crop's pixels matter: a decoder may decode that region alone

    def __init__(self, size: int):
        self.size = size

    def plan(self, height: int, width: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """(top, left, crop height, crop width, flip), drawn as RandomResizedCrop.get_params draws them."""
        area = height * width
        log_ratio = (math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]))
        box = None
        for _ in range(CROP_TRIES):
            target = area * torch.empty(1).uniform_(*CROP_SCALE, generator=generator).item()
            ratio = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator).item())
            w = round(math.sqrt(target * ratio))
            h = round(math.sqrt(target / ratio))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, (1,), generator=generator))
                left = int(torch.randint(0, width - w + 1, (1,), generator=generator))
                box = (top, left, h, w)
                break
        if box is None:  # the central crop of the allowed aspect nearest the image's
            in_ratio = width / height
            if in_ratio < CROP_RATIO[0]:
                w, h = width, round(width / CROP_RATIO[0])
            elif in_ratio > CROP_RATIO[1]:
                h, w = height, round(height * CROP_RATIO[1])
            else:
                w, h = width, height
            box = ((height - h) // 2, (width - w) // 2, h, w)
        flip = int(torch.rand(1, generator=generator).item() < 0.5)
        return torch.tensor([*box, flip], dtype=torch.int64)

    def apply(self, image: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
        top, left, h, w, flip = plan.tolist()
        F, InterpolationMode = _v2()
        out = F.resized_crop(
            image, top, left, h, w, [self.size, self.size], interpolation=InterpolationMode.BILINEAR, antialias=True
        )
        return F.horizontal_flip(out) if flip else out

    def apply_to_region(self, region: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
        """`apply` on the plan's crop region alone (decoded by itself): the same pixels."""
        return self.apply(region, torch.tensor([0, 0, *plan[2:].tolist()], dtype=torch.int64))


class ResizeCenterCrop:
    """Resize the shorter side to size * 256/224, then the central size x size crop: evaluation's
    transform (and training's with `loader.train_augment: center_crop`); no randomness."""

    name = "center_crop"
    reads_a_region = False  # the resize reads the whole image

    def __init__(self, size: int):
        self.size = size

    def plan(self, height: int, width: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64)

    def apply(self, image: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
        F, InterpolationMode = _v2()
        image = F.resize(
            image, [int(self.size * EVAL_RESIZE)], interpolation=InterpolationMode.BILINEAR, antialias=True
        )
        return F.center_crop(image, [self.size, self.size])


TRAIN_AUGMENTS = {cls.name: cls for cls in (RandomResizedCropFlip, ResizeCenterCrop)}


def split_transform(split: str, train_augment: str, size: int):
    """The transform of `split`: the training split's augmentation, the others' Resize + CenterCrop."""
    return TRAIN_AUGMENTS[train_augment](size) if split == "train" else ResizeCenterCrop(size)
