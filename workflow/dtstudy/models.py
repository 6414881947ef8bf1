"""The CNNs every strategy trains, found by name."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class LeNet5(nn.Module):
    """LeCun's LeNet-5 layout (two conv + pool stages, three fully connected layers) with
    ReLU and max-pooling, for small images (28x28 or 32x32, any channel count)."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        side = ((image_size // 2) - 4) // 2
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * side * side, 120),
            nn.ReLU(inplace=True),
            nn.Linear(120, 84),
            nn.ReLU(inplace=True),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _torchvision_resnet(factory: Callable[..., nn.Module]):
    def build(in_channels: int, num_classes: int, image_size: int, small_input: bool = True) -> nn.Module:
        model = factory(weights=None, num_classes=num_classes)
        if small_input:
            # CIFAR-style stem: a 7x7/2 conv and a max-pool would shrink 28x28 inputs to 7x7
            # before the first block.
            model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
            model.maxpool = nn.Identity()
        elif in_channels != 3:
            model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        return model

    return build


def _resnet(name: str):
    import torchvision.models as tvm

    return _torchvision_resnet(getattr(tvm, name))


MODELS: dict[str, Callable[..., nn.Module]] = {
    "lenet5": lambda in_channels, num_classes, image_size, **_: LeNet5(in_channels, num_classes, image_size),
    "resnet18": lambda *args, **kwargs: _resnet("resnet18")(*args, **kwargs),
    "resnet50": lambda *args, **kwargs: _resnet("resnet50")(*args, **kwargs),
}


def build_model(name: str, in_channels: int, num_classes: int, image_size: int, options: dict | None = None) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"model: unknown model {name!r}; allowed: {', '.join(MODELS)}")
    return MODELS[name](in_channels, num_classes, image_size, **(options or {}))
