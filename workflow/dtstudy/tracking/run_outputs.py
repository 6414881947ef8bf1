"""The files a finished training run leaves in its folder (dtstudy.common.run_folder): the
final model and its metrics."""

from __future__ import annotations

import torch
from torch import nn

from dtstudy.common.atomic_files import atomic_write, write_json
from dtstudy.runspec import RunSpec


def write_checkpoint(spec: RunSpec, eval_model: nn.Module, meta: dict) -> None:
    checkpoint = {
        "model": spec.config["model"],
        "model_options": spec.config["model_options"],
        "in_channels": meta["channels"],
        "num_classes": meta["classes"],
        "image_size": meta["height"],
        "state_dict": {k: v.detach().cpu() for k, v in eval_model.state_dict().items()},
        "run_name": spec.run_name,
    }
    atomic_write(spec.folder.model, lambda stream: torch.save(checkpoint, stream))


def write_metrics(spec: RunSpec, metrics: dict) -> None:
    """The run's metrics, the train rule's output: written last, whole or not at all."""
    write_json(spec.folder.metrics, metrics)
