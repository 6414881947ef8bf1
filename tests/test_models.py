"""The CNNs build for the study's image shapes and give one logit per class."""

from __future__ import annotations

import pytest
import torch

from dtstudy.models import build_model


@pytest.mark.parametrize(
    "name, channels, size, options",
    [("lenet5", 1, 28, {}), ("lenet5", 3, 32, {}), ("resnet18", 1, 28, {"small_input": True}),
     ("resnet18", 3, 64, {"small_input": False}), ("resnet50", 3, 32, {"small_input": True})],
)
def test_forward_shape(name, channels, size, options):
    model = build_model(name, channels, 7, size, options)
    assert model(torch.zeros(2, channels, size, size)).shape == (2, 7)


def test_small_input_stem_keeps_resolution():
    model = build_model("resnet18", 1, 10, 28, {"small_input": True})
    assert model.conv1.stride == (1, 1) and isinstance(model.maxpool, torch.nn.Identity)
    assert model.conv1.in_channels == 1


def test_unknown_model_names_allowed_ones():
    with pytest.raises(ValueError, match="'vgg99'; allowed: lenet5, resnet18, resnet50"):
        build_model("vgg99", 1, 10, 28)
