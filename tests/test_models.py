"""The CNNs build for the study's image shapes and give one logit per class."""

from __future__ import annotations

import pytest
import torch

from dtstudy.training.models import build_model, inference_layout


@pytest.mark.parametrize(
    "name, channels, size, options",
    [
        ("lenet5", 1, 28, {}),
        ("lenet5", 3, 32, {}),
        ("resnet18", 1, 28, {"small_input": True}),
        ("resnet18", 3, 64, {"small_input": False}),
        ("resnet50", 3, 32, {"small_input": True}),
        ("alexnet_small", 3, 32, {}),
        ("alexnet_small", 1, 64, {}),
    ],
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


@pytest.mark.parametrize("name, channels", [("lenet5", 1), ("resnet18", 3)])
@pytest.mark.slow
def test_the_inference_pass_gives_the_eval_models_logits_and_leaves_the_model_alone(name, channels):
    """inference_layout: eval mode (BatchNorm's running statistics, not the batch's), the
    convolutions read channels-last weights, the same logits as the model itself in eval
    mode up to float rounding; the model comes back in its mode with its own tensors (the
    same storage: a strategy's views into it stay valid)."""
    torch.manual_seed(0)
    model = build_model(name, channels, 10, 28, {"small_input": True})
    for module in model.modules():  # running statistics far from any batch's
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
    read = []  # per convolution: were its weights' strides NHWC's (1-channel ones included)?

    def nhwc_strides(module, _):
        weight = module.weight
        read.append(weight.stride() == torch.empty_like(weight, memory_format=torch.channels_last).stride())

    convolutions = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    for conv in convolutions:
        conv.register_forward_pre_hook(nhwc_strides)
    inputs = torch.randn(8, channels, 28, 28)
    weights = [p.clone() for p in model.parameters()]
    storage = [p.data_ptr() for p in model.parameters()]
    with torch.no_grad():
        with inference_layout(model) as same_model:
            logits = same_model(inputs)
        assert read == [True] * len(convolutions)
        read.clear()
        assert model.training and all(p.is_contiguous() for p in model.parameters())
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
        assert [p.data_ptr() for p in model.parameters()] == storage
        expected = model.eval()(inputs)
        assert read == [False] * len(convolutions)  # teeth: the model's own weights are NCHW
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
        if name == "resnet18":  # teeth: in training mode BatchNorm uses the batch's statistics
            assert not torch.allclose(model.train()(inputs), expected, atol=1e-3)


def test_alexnet_small_is_mostly_fully_connected_and_wants_a_side_divisible_by_8():
    """The case hybrid is for (docs/strategies.md, "Hybrid parallelism"): at 32 pixels, 10
    classes, 2048 x 2048 + 2048 x 2048 + 2048 x 10 weights and their biases of 9027498."""
    model = build_model("alexnet_small", 3, 10, 32)
    linear = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    assert linear == 2049 * 2048 * 2 + 2049 * 10 and sum(p.numel() for p in model.parameters()) == 9027498
    with pytest.raises(ValueError, match="a multiple of 8 are needed, not 28"):
        build_model("alexnet_small", 1, 10, 28)


def test_a_model_that_cannot_take_the_data_sets_images_is_refused_before_any_work():
    from conftest import tiny_study, validated

    from dtstudy.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match="config key 'model': 'alexnet_small' needs images whose side is a "
        "multiple of 8, and dataset 'fashion_mnist' gives 28x28",
    ):
        validated(tiny_study(model="alexnet_small"))
    validated(tiny_study(model="alexnet_small", dataset={"name": "synthetic", "image_size": 32, "subset": None}))
    validated(tiny_study(model="lenet5"))  # the control: the same data for a model that takes it


def _last_batch_norms(model: torch.nn.Module) -> list[torch.nn.BatchNorm2d]:
    """The BatchNorm that ends each residual block's branch (bn3 of a Bottleneck, bn2 of a BasicBlock)."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    return [
        block.bn3 if isinstance(block, Bottleneck) else block.bn2
        for block in model.modules()
        if isinstance(block, (BasicBlock, Bottleneck))
    ]


@pytest.mark.parametrize("name, blocks", [("resnet18", 8), ("resnet50", 16)])
def test_zero_init_residual_starts_every_blocks_last_batch_norm_at_gamma_zero(name, blocks):
    """model_options.zero_init_residual (Goyal et al. 2017 section 5.1): gamma = 0 in the last
    BatchNorm of every residual block, and in no other; without it (torchvision's default) 1."""
    from dtstudy.config.study_config import validate_schema

    default = validate_schema({"model": name})["model_options"]
    assert default["zero_init_residual"] is False
    plain = build_model(name, 3, 10, 32, default)
    zeroed = build_model(name, 3, 10, 32, {**default, "zero_init_residual": True})
    assert len(_last_batch_norms(zeroed)) == blocks
    for bn in _last_batch_norms(plain):
        assert torch.equal(bn.weight, torch.ones_like(bn.weight))
    for bn in _last_batch_norms(zeroed):
        assert torch.equal(bn.weight, torch.zeros_like(bn.weight))
    last = {id(bn) for bn in _last_batch_norms(zeroed)}
    others = [m for m in zeroed.modules() if isinstance(m, torch.nn.BatchNorm2d) and id(m) not in last]
    assert others and all(torch.equal(bn.weight, torch.ones_like(bn.weight)) for bn in others)


def test_the_cluster_study_trains_resnet50_with_zero_gamma():
    """config/cluster.yaml follows Goyal et al.'s recipe: its model is built with zero gamma."""
    import yaml
    from conftest import REPO

    from dtstudy.config.study_config import deep_merge, validate_schema

    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cluster = validate_schema(deep_merge(base, yaml.safe_load((REPO / "config" / "cluster.yaml").read_text())))
    assert cluster["model"] == "resnet50" and cluster["model_options"]["zero_init_residual"] is True
    model = build_model(cluster["model"], 3, 1000, cluster["dataset"]["image_size"], cluster["model_options"])
    assert all(torch.equal(bn.weight, torch.zeros_like(bn.weight)) for bn in _last_batch_norms(model))
