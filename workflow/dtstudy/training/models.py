"""The CNNs every strategy trains, found by name."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn


def fully_connected(in_features: int, hidden: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """Flatten, then Linear + ReLU per hidden width, then the Linear to the classes: the
    fully connected chain `hybrid` splits across its workers."""
    layers: list[nn.Module] = [nn.Flatten()]
    for width in hidden:
        layers += [nn.Linear(in_features, width), nn.ReLU(inplace=True)]
        in_features = width
    return nn.Sequential(*layers, nn.Linear(in_features, num_classes))


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
        self.classifier = fully_connected(16 * side * side, (120, 84), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class AlexNetSmall(nn.Module):
    """AlexNet's layout (Krizhevsky, Sutskever, Hinton 2012: five convolutions, three
    max-pools, three fully connected layers) at about half its widths, for 32-pixel images:
    the fully connected layers hold most of the parameters (about 8.4 M of 9.0 M at 32 pixels,
    10 classes), as in AlexNet, the case `hybrid` is for (Krizhevsky 2014). Without dropout
    (a different mask on each worker's copy of the activations would change hybrid's maths)
    and local response normalisation. Any side that is a multiple of 8."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int):
        super().__init__()
        if image_size % 8:
            raise ValueError(
                f"model alexnet_small: images of a side that is a multiple of 8 are needed, not {image_size}"
            )
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 96, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(96, 192, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(192, 128, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(128, 128, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        side = image_size // 8
        self.classifier = fully_connected(128 * side * side, (2048, 2048), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _torchvision_resnet(factory: Callable[..., nn.Module]):
    def build(
        in_channels: int, num_classes: int, image_size: int, small_input: bool = True, zero_init_residual: bool = False
    ) -> nn.Module:
        # zero_init_residual: each residual block's last BatchNorm starts at gamma = 0, so that
        # every block starts as the identity (Goyal et al. 2017, section 5.1: large batches)
        model = factory(weights=None, num_classes=num_classes, zero_init_residual=zero_init_residual)
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
    "alexnet_small": lambda in_channels, num_classes, image_size, **_: AlexNetSmall(
        in_channels, num_classes, image_size
    ),
}


def build_model(
    name: str, in_channels: int, num_classes: int, image_size: int, options: dict | None = None
) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"model: unknown model {name!r}; allowed: {', '.join(MODELS)}")
    return MODELS[name](in_channels, num_classes, image_size, **(options or {}))


@contextlib.contextmanager
def inference_layout(model: nn.Module) -> Iterator[nn.Module]:
    """`model` for a test or validation pass: eval mode, its 4-d weights swapped for NHWC
    (channels-last) copies, so that oneDNN's convolutions and max-pooling keep that layout
    (LeNet-5 on one core: 0.7 of the time, benchmarks/inference_layout.py). Training
    keeps the contiguous layout: there the backward passes of ReLU and max-pooling lose more
    than the forward gains. On leaving, every parameter gets its own tensor back (views into
    it, e.g. a strategy's flat buffers, stay valid) and the model its mode."""
    was_training = model.training
    originals = [(parameter, parameter.data) for parameter in model.parameters() if parameter.dim() == 4]
    try:
        for parameter, data in originals:
            # .to, not .contiguous: a 1-channel weight counts as channels last already and
            # .contiguous would keep its strides, which would set oneDNN on the NCHW path
            parameter.data = data.to(memory_format=torch.channels_last)
        yield model.eval()
    finally:
        for parameter, data in originals:
            parameter.data = data
        model.train(was_training)
