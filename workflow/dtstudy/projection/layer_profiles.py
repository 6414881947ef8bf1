"""Layer profiles of architectures (layer_profiles.json): each parameter tensor in backprop
order with the share of backward done when its gradient is ready, and its 1-bit column
groups; and the fully connected layers in forward order (hybrid's model-parallel part).

The performance model's wait-free-backprop overlap (dtstudy.perfmodel.machine.LayerProfile) reads them; they
are computed once, by torch's own FLOP counter on meta tensors (shapes only: nothing is
initialised, trained or downloaded), and shipped as data so that a projection needs no torch:

    PYTHONPATH=workflow python3 -m dtstudy.projection.layer_profiles    # rewrites layer_profiles.json
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

from dtstudy.errors import ConfigError
from dtstudy.perfmodel.machine import LayerProfile

DATA = Path(__file__).with_name("layer_profiles.json")

#: name -> (the function that builds the model, its arguments, the input of one image
#: (C, H, W)); the ImageNet models as torchvision builds them (Inception V3 without its
#: auxiliary head, as tf_cnn_benchmarks trains it), LeNet-5 as the study trains it on
#: Fashion-MNIST, alexnet_small on 32-pixel RGB images (config/hybrid.yaml). `_build` calls
#: them; the JSON records them as text (`_describe`).
ARCHITECTURES = {
    "lenet5": ("dtstudy.training.models.build_model", ("lenet5", 1, 10, 28), {}, (1, 28, 28)),
    "alexnet_small": ("dtstudy.training.models.build_model", ("alexnet_small", 3, 10, 32), {}, (3, 32, 32)),
    **{
        name: (f"torchvision.models.{name}", (), {"weights": None}, (3, 224, 224))
        for name in ("resnet50", "resnet101", "resnet152", "vgg16")
    },
    "inception_v3": (
        "torchvision.models.inception_v3",
        (),
        {"weights": None, "aux_logits": False, "init_weights": False},
        (3, 299, 299),
    ),
}


@functools.lru_cache(maxsize=1)
def _shipped() -> dict:
    return json.loads(DATA.read_text())["architectures"]


def names() -> list[str]:
    return sorted(_shipped())


def load(name, where: str) -> LayerProfile:
    """The shipped profile `name`; `where` names the file and key it came from (for the error)."""
    profiles = _shipped()
    if not isinstance(name, str) or name not in profiles:
        raise ConfigError(
            f"{where}: {name!r} is not allowed; allowed: {', '.join(names())} "
            f"(the architectures of {DATA.name}; regenerate with python -m dtstudy.projection.layer_profiles)"
        )
    entry = profiles[name]
    backward_share = entry["backward_flops"] / (entry["forward_flops"] + entry["backward_flops"])
    linear = entry.get("linear", [])
    labels = {f"{layer}.{leaf}" for layer, *_ in linear for leaf in ("weight", "bias")}
    return LayerProfile(
        name=name,
        tensors=tuple((values, ready) for _, values, ready, _ in entry["tensors"]),
        backward_share=backward_share,
        column_groups=sum(groups for *_, groups in entry["tensors"]),
        linear=tuple((n_in, n_out) for _, n_in, n_out in linear),
        linear_tensors=frozenset(i for i, (label, *_) in enumerate(entry["tensors"]) if label in labels),
    )


def matrices(name, where: str) -> list[list[int]]:
    """The shipped profile's tensors as PowerSGD sees a gradient (calibration.matrices_from_checkpoint's
    form): [first dimension, the rest]; the profile's 1-bit column groups are that first
    dimension (1 for a vector, which goes as [n, 1])."""
    load(name, where)  # the same error for an unknown name
    return [
        [groups, values // groups] if groups > 1 else [values, 1]
        for _, values, _, groups in _shipped()[name]["tensors"]
    ]


# ----- the generator (imports torch) -----------------------------------------------------


def _build(name: str):
    """The model of ARCHITECTURES[name] (no weights)."""
    import importlib

    function, args, kwargs, _ = ARCHITECTURES[name]
    module, _, attribute = function.rpartition(".")
    return getattr(importlib.import_module(module), attribute)(*args, **kwargs)


def _describe(name: str) -> str:
    function, args, kwargs, _ = ARCHITECTURES[name]
    return f"{function}({', '.join([*map(repr, args), *(f'{k}={v!r}' for k, v in kwargs.items())])})"


def measure(name: str) -> dict:
    """One step's forward and backward of `name` on meta tensors under FlopCounterMode; each
    parameter's gradient-accumulated hook notes the backward FLOPs counted so far, which
    gives both the order backprop produces the gradients in and when (in FLOPs) each is ready;
    with each tensor's groups of 1-bit's `column` quantiser (its first dimension, a vector one:
    strategies.compressed.onebit_codec.quantization_groups)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    shape = ARCHITECTURES[name][-1]
    with torch.device("meta"):
        model = _build(name)
        images = torch.empty(2, *shape)  # the shares do not depend on the batch
    model.train()
    linear = []  # the fully connected layers in the order the forward runs them
    for label, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(
                lambda m, *_, label=label: linear.append([label, m.in_features, m.out_features])
            )
    counter = FlopCounterMode(display=False)
    ready = []
    for label, parameter in model.named_parameters():
        parameter.register_post_accumulate_grad_hook(
            lambda p, label=label: ready.append(
                (label, p.numel(), counter.get_total_flops(), p.shape[0] if p.dim() >= 2 else 1)
            )
        )
    with counter:
        loss = model(images).sum()
        forward = counter.get_total_flops()
        loss.backward()
        total = counter.get_total_flops()
    backward = total - forward
    return {
        "model": _describe(name),
        "input": list(shape),
        "parameters": sum(p.numel() for p in model.parameters()),
        "forward_flops": forward,
        "backward_flops": backward,
        "tensors": [
            [label, values, round((done - forward) / backward, 6), groups] for label, values, done, groups in ready
        ],
        "linear": linear,
    }


def main() -> int:
    import torch
    import torchvision

    data = {
        "generated_by": f"PYTHONPATH=workflow python3 -m dtstudy.projection.layer_profiles (torch {torch.__version__}, "
        f"torchvision {torchvision.__version__}, torch.utils.flop_counter.FlopCounterMode)",
        "fields": "tensors: [name, values, share of backward FLOPs done when its gradient is ready, "
        "groups of 1-bit's column quantiser], in the order backprop produces them; "
        "linear: [name, in_features, out_features] of each nn.Linear, in the order forward runs them",
        "architectures": {name: measure(name) for name in ARCHITECTURES},
    }
    DATA.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(ARCHITECTURES)} profiles written to {DATA}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
