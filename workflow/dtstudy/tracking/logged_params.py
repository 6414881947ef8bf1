"""The config keys a training run logs to MLflow (`applicable_config`): those that apply to its
data set, model, strategy and launcher, so that MLflow's compare view (whose parallel
coordinates plot picks parameters) holds no key that is empty or means nothing for a run, such
as `dataset.synthetic.*` on Fashion-MNIST. metrics.json keeps the whole run config."""

from __future__ import annotations

import copy
from collections.abc import Callable

from dtstudy.launch_backends.registry import BACKENDS, launch_backend

IMAGE_FOLDER, SYNTHETIC = "imagefolder", "synthetic"
#: the launcher keys one launch backend reads alone (LaunchBackend.own_keys)
BACKEND_KEYS = tuple(key for backend in BACKENDS.values() for key in backend.own_keys)


def _dataset_is(*names: str) -> Callable[[dict], bool]:
    return lambda config: config["dataset"]["name"] in names


def _backend_reads(key: str) -> Callable[[dict], bool]:
    return lambda config: key in launch_backend(config).own_keys


def _has_stragglers(config: dict) -> bool:
    stragglers = config.get("stragglers") or {}
    return bool(stragglers.get("ranks")) or bool(stragglers.get("fraction"))


#: (section, key) or (section,) -> whether it applies to a run of that run config (config/README.md
#: says which keys apply where); every other key applies to every run
APPLIES: dict[tuple[str, ...], Callable[[dict], bool]] = {
    ("dataset", "root"): lambda config: config["dataset"]["name"] != SYNTHETIC,
    ("dataset", "download"): _dataset_is("fashion_mnist", "cifar10"),
    ("dataset", "test_fraction"): _dataset_is(IMAGE_FOLDER),
    ("dataset", "corrupt_images"): _dataset_is(IMAGE_FOLDER),
    ("dataset", "shard_mb"): _dataset_is(IMAGE_FOLDER),
    ("dataset", "image_size"): _dataset_is(IMAGE_FOLDER, SYNTHETIC),
    ("dataset", "synthetic"): _dataset_is(SYNTHETIC),
    ("loader",): _dataset_is(IMAGE_FOLDER),  # the in-memory data sets ignore it
    ("model_options",): lambda config: str(config["model"]).startswith("resnet"),
    # the strategy's knobs, defaults filled in, are logged beside as strategy_params.*
    ("strategy_params",): lambda config: False,
    **{("launcher", key): _backend_reads(key) for key in BACKEND_KEYS},
    **{("stragglers", key): _has_stragglers for key in ("delay_ms", "distribution", "seed")},
}


def applicable_config(config: dict) -> dict:
    """`config` (a run config) without the sections and keys that do not apply to its run (APPLIES)."""
    kept = copy.deepcopy(config)
    for where, applies in APPLIES.items():
        if applies(config):
            continue
        section = kept if len(where) == 1 else kept.get(where[0], {})
        section.pop(where[-1], None)
    return kept
