"""The study config's checks that a schema cannot do, across every layer: strategy names and
knobs for every N (strategy specs), the job layout over nodes, stragglers, the projection's
hardware profiles, the data set on disk against the batch sizes and the scaling runs' steps,
and a SLURM study's predicted cost (dtstudy.projection.budget: time limits against requeues,
the GPU-hour budget). They run when the Snakefile is parsed, before any job starts
(torch-free); every error names the config key, the bad value and what is allowed.
`load_config` reads, validates and checks a config file.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from dtstudy.config import run_kinds
from dtstudy.config.study_config import (
    deep_merge,
    global_batch_size,
    read_yaml,
    run_config,
    strategy_of,
    strategy_study,
    validate_schema,
)
from dtstudy.data.checks import check_dataset, check_loader
from dtstudy.data.errors import DataConfigError
from dtstudy.emulation.settings import check_emulate
from dtstudy.errors import ConfigError
from dtstudy.launch_backends.registry import launch_backend
from dtstudy.projection import budget, hardware
from dtstudy.runspec import RunSpec
from dtstudy.strategies.specs import SPECS
from dtstudy.training import stragglers

__all__ = ["check_config", "check_data_against_batches", "count_training_images", "load_config"]

EARLY_SIGNAL_S = 60  # how early SLURM may send a job's --signal (its time-limit checks are 30 s apart)
#: the image side of the data sets of a fixed size; the others' is dataset.image_size
DATASET_SIDES = {"fashion_mnist": 28, "cifar10": 32}
#: models whose image side must be a multiple of this (alexnet_small: three 2x2 max-pools)
MODEL_SIDE_MULTIPLE = {"alexnet_small": 8}


def check_config(config: dict, check_data: bool = True) -> int | None:
    """The checks a schema cannot do; raises ConfigError naming the key. `check_data`: also
    look at the data set on disk (Snakemake's main process does; the jobs it starts, which
    parse the Snakefile again, need not walk the data set again) and return its training
    images (count_training_images; None without `check_data`). A variant listed in
    `strategies`, and a strategy with strategy_train, is checked as the study it runs under
    (strategy_study); the data set is counted once, and the GPU-hour budget is the whole
    study's, every variant's runs included."""
    variants = config["variants"]
    for i, name in enumerate(config["strategies"]):
        if name not in SPECS and name not in variants:
            raise ConfigError(
                f"config key 'strategies[{i}]': unknown strategy {name!r}; allowed: {', '.join(sorted(SPECS))}"
                + (f", or a variant: {', '.join(sorted(variants))}" if variants else "")
            )
    for name, variant in variants.items():
        if name in SPECS:
            raise ConfigError(
                f"config key 'variants.{name}': {name!r} is a registered strategy's name; allowed: another name"
            )
        if variant["strategy"] not in SPECS:
            raise ConfigError(
                f"config key 'variants.{name}.strategy': unknown strategy {variant['strategy']!r}; "
                f"allowed: {', '.join(sorted(SPECS))}"
            )
    for name in config["strategy_train"]:
        if name not in SPECS:
            raise ConfigError(
                f"config key 'strategy_train.{name}': unknown strategy {name!r}; allowed: {', '.join(sorted(SPECS))}"
            )
    # each study whose runs the config makes: the strategies' that train under the study's own
    # keys, then each one's with its strategy_train and each listed variant's
    own_keys = variants.keys() | config["strategy_train"].keys()
    studies = {None: {**config, "strategies": [name for name in config["strategies"] if name not in own_keys]}}
    studies.update(
        {
            name: {**strategy_study(config, name), "strategies": [strategy_of(config, name)]}
            for name in config["strategies"]
            if name in own_keys
        }
    )
    for name, study in studies.items():
        with _as_own_study(name):
            check_study_layers(study)
    if not check_data:
        return None
    counted = count_training_images(config)  # a variant shares the study's data set
    for name, study in studies.items():
        if name is None and not study["strategies"]:
            continue  # a study of variants alone: no run takes the study's own batch
        with _as_own_study(name):
            check_data_against_batches(study, counted)
            check_scaling_steps_fit(study, budget.study_images(study, counted))
    # before any job: each run's time limit fits its requeues, the study (its variants' runs
    # too) its GPU-hour budget
    budget.check_study(config, budget.study_images(config, counted))
    return counted


@contextlib.contextmanager
def _as_own_study(name: str | None):
    """A variant's study's errors say which variant, and a strategy_train's which strategy,
    since the key they name is that study's (its train keys and knobs merged over the
    study's); the study's own pass through."""
    if name is None:
        yield
        return
    try:
        yield
    except ConfigError as err:
        section = "strategy_train" if name in SPECS else "variants"
        raise ConfigError(
            f"config key '{section}.{name}' (checked as its own study, its keys over the study's): {err}"
        ) from None


def check_study_layers(config: dict) -> None:
    """The checks across the other layers of one study's strategies (no data set): knobs for
    every N, the job layout over nodes, the optimizer, the model's input, stragglers, the
    projection's hardware, the emulated cluster, the loader."""
    # strategy_params' names are the schema's (dtstudy.strategies.specs checks they match SPECS)
    for name in config["strategies"]:
        for workers in config["workers"]:
            SPECS[name].check_params(config["strategy_params"].get(name, {}), workers)
    launcher = config["launcher"]
    signal_after_s = launcher["timeout_min"] * 60 - launcher["signal_delay_s"]
    if signal_after_s <= EARLY_SIGNAL_S:
        # a signal that comes before submitit's handler is installed kills the task
        raise ConfigError(
            f"config key 'launcher.signal_delay_s': {launcher['signal_delay_s']} s before a time limit of "
            f"{launcher['timeout_min']} min comes {signal_after_s} s after the job starts; SLURM may send it "
            f"up to {EARLY_SIGNAL_S} s early, so it must be due more than {EARLY_SIGNAL_S} s after the start: "
            "lower signal_delay_s or raise launcher.timeout_min"
        )
    if launch_backend(config).spans_nodes:  # the job layout must fit the nodes
        for name in config["strategies"]:
            for workers in config["workers"]:
                RunSpec(name, workers, 0, run_config(config, name), "", "").layout()

    train = config["train"]
    if train["nesterov"] and train["momentum"] == 0:
        raise ConfigError(
            "config key 'train.nesterov': true needs momentum, but train.momentum is 0 "
            "(Nesterov's look-ahead is along the momentum); set train.momentum > 0 or nesterov: false"
        )
    if train["precision"] == "fp16":  # a GradScaler the strategy's update must step through
        for name in config["strategies"]:
            if SPECS[name].no_fp16_because:
                raise ConfigError(
                    f"config key 'train.precision': 'fp16' is not allowed with strategy {name!r} in strategies: "
                    f"{SPECS[name].no_fp16_because}; allowed with it: fp32, bf16"
                )
    check_model_input(config)
    try:
        stragglers.check(config["stragglers"], config["workers"])
    except ValueError as err:
        raise ConfigError(str(err)) from None
    hardware.check_study_profiles(config["projection"]["hardware"], config["strategies"])
    check_emulate(config)  # launcher.cluster emulate: its strategies and its cluster's clock
    check_loader(config["loader"], config["launcher"]["device"])


def check_model_input(config: dict) -> None:
    """The model takes the data set's images (before data are prepared and a run fails on them)."""
    multiple = MODEL_SIDE_MULTIPLE.get(config["model"])
    dataset = config["dataset"]
    side = DATASET_SIDES.get(dataset["name"], dataset["image_size"])
    if multiple and side % multiple:
        raise ConfigError(
            f"config key 'model': {config['model']!r} needs images whose side is a multiple of {multiple}, and "
            f"dataset {dataset['name']!r} gives {side}x{side}; allowed: another model, or a dataset.image_size "
            f"that is a multiple of {multiple} (imagefolder, synthetic)"
        )


def count_training_images(config: dict) -> int:
    """The data set's training images on disk (before dataset.subset and the validation split);
    ConfigError naming the dataset key when it is not there."""
    try:
        return check_dataset(config["dataset"])
    except DataConfigError as err:
        raise ConfigError(str(err)) from None


def check_data_against_batches(config: dict, train_images: int | None = None) -> int:
    """The data set exists and holds enough training images for every N's global batch;
    returns its training images (count_training_images, unless `train_images` already counted them)."""
    if train_images is None:
        train_images = count_training_images(config)
    train = config["train"]
    usable = train_images if config["dataset"]["subset"] is None else config["dataset"]["subset"]
    usable = int(usable * (1 - config["dataset"]["val_fraction"]))
    for workers in config["workers"]:
        global_batch = global_batch_size(train, workers)
        if train["scaling"] == "strong" and train["batch_size"] % workers:
            raise ConfigError(
                f"config key 'train.batch_size': {train['batch_size']} does not divide over "
                f"{workers} workers with train.scaling 'strong'; use a multiple of every N in 'workers'"
            )
        if global_batch > usable:
            raise ConfigError(
                f"config key 'train.batch_size': a global batch of {global_batch} "
                f"(N={workers} of workers) is larger than the {usable} training images; "
                "lower the batch size or raise dataset.subset"
            )
    return train_images


def check_scaling_steps_fit(config: dict, images: budget.Images) -> None:
    """A scaling run's warm-up and timed steps fit in train.epochs at every N of scaling.workers:
    the loop stops at the epochs' end, and a run cut short would time fewer steps than asked
    (or leave half of its few steps out as warm-up) without a word."""
    if not run_kinds.has_scaling_runs(config):
        return
    scaling, epochs = config[run_kinds.SCALING], config["train"]["epochs"]
    wanted = scaling["warmup_steps"] + scaling["steps"]
    per_epoch = {n: budget.steps_per_epoch(config, images, n) for n in run_kinds.workers(config, run_kinds.SCALING)}
    workers = min(per_epoch, key=per_epoch.get)  # the largest N, unless train.scaling is strong
    steps, fits = per_epoch[workers], per_epoch[workers] * epochs
    if fits < wanted:
        raise ConfigError(
            f"config key 'scaling.steps': {scaling['steps']} timed steps after scaling.warmup_steps "
            f"{scaling['warmup_steps']} make a scaling run of {wanted} steps, but at N={workers} a worker has "
            f"{steps} step{'' if steps == 1 else 's'} an epoch ({images.train} training images, {images.source}) "
            f"and train.epochs {epochs} stops it after {fits}; allowed: warmup_steps + steps of at most {fits}, "
            "or more train.epochs or training images"
        )


def load_config(path: str | Path, overrides: dict | None = None) -> dict:
    """Read a YAML config (plus optional nested overrides), validate it and check it."""
    config = read_yaml(path)
    if overrides:
        config = deep_merge(config, overrides)
    validate_schema(config)
    check_config(config)
    return config
