"""Load, validate and check a study config.

Validation has two layers, both run before any job starts:
1. the JSON schema (workflow/schemas/config.schema.yaml, read by dtstudy.schema), which also
   fills in defaults; its types are strict (64.0 is not an integer, true is not a number);
2. `check_config`, the checks a schema cannot do (strategy names against the registry,
   strategy knobs, the data set on disk, batch sizes against the data).
Every error names the config key, the bad value and what is allowed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

from . import data, hardware, schema, stragglers
from .errors import ConfigError
from .runspec import RunSpec
from .strategy_specs import SPECS as STRATEGIES

__all__ = ["ConfigError", "check_config", "load_config", "run_config", "validate_schema"]

def validate_schema(config: dict) -> dict:
    """Validate against the JSON schema (strict types: 64.0 is no integer) and fill defaults,
    in place; returns the config. `strategy_params` keeps what was written: a run's knob
    defaults are filled by its strategy's check_params, so that a run's config (and what
    makes Snakemake rerun it) changes only with what the user changes."""
    knobs_as_written = copy.deepcopy(config.get("strategy_params", {}))
    schema.validate_config(config)
    config["strategy_params"] = knobs_as_written
    return config


EARLY_SIGNAL_S = 60  # how early SLURM may send a job's --signal (its time-limit checks are 30 s apart)


def check_config(config: dict, check_data: bool = True) -> None:
    """The checks a schema cannot do; raises ConfigError naming the key. `check_data`: also
    look at the data set on disk (Snakemake's main process does; the jobs it starts, which
    parse the Snakefile again, need not walk the data set again)."""
    for i, name in enumerate(config["strategies"]):
        if name not in STRATEGIES:
            raise ConfigError(
                f"config key 'strategies[{i}]': unknown strategy {name!r}; "
                f"allowed: {', '.join(sorted(STRATEGIES))}"
            )
    # strategy_params' names are the schema's (dtstudy.strategy_specs checks they match SPECS)
    for name in config["strategies"]:
        for workers in config["workers"]:
            STRATEGIES[name].check_params(config["strategy_params"].get(name, {}), workers)
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
    if launcher["cluster"] != "local":  # the job layout must fit the nodes
        for name in config["strategies"]:
            for workers in config["workers"]:
                RunSpec(name, workers, 0, run_config(config, name), "", "").layout()

    train = config["train"]
    if train["nesterov"] and train["momentum"] == 0:
        raise ConfigError(
            "config key 'train.nesterov': true needs momentum, but train.momentum is 0 "
            "(Nesterov's look-ahead is along the momentum); set train.momentum > 0 or nesterov: false"
        )
    try:
        stragglers.check(config["stragglers"], config["workers"])
    except ValueError as err:
        raise ConfigError(str(err)) from None
    hardware.check_study_profiles(config["projection"]["hardware"], config["strategies"])
    if check_data:
        check_data_against_batches(config)


def check_data_against_batches(config: dict) -> None:
    """The data set exists and holds enough training images for every N's global batch."""
    try:
        train_images = data.check_dataset(config["dataset"])
    except data.DataConfigError as err:
        raise ConfigError(str(err)) from None
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
                f"({workers} workers) is larger than the {usable} training images; "
                "lower the batch size or raise dataset.subset"
            )


def per_worker_batch(train: dict, workers: int) -> int:
    return train["batch_size"] // workers if train["scaling"] == "strong" else train["batch_size"]


def global_batch_size(train: dict, workers: int) -> int:
    return per_worker_batch(train, workers) * workers


def load_config(path: str | Path, overrides: dict | None = None) -> dict:
    """Read a YAML config (plus optional nested overrides), validate it and check it."""
    config = read_yaml(path)
    if overrides:
        config = deep_merge(config, overrides)
    validate_schema(config)
    check_config(config)
    return config


def read_yaml(path: str | Path) -> dict:
    """A config file's YAML; ConfigError (one line: the file, the line and column) if it cannot be read."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"config file {path}: cannot be read ({err.strerror or err})") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"config file {path}: malformed YAML{where}: {problem}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ConfigError(f"config file {path}: a mapping of config keys is needed, not {type(config).__name__}")
    return config


def deep_merge(base: dict, extra: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def run_config(config: dict, strategy: str) -> dict:
    """The part of the study config that one training run of `strategy` depends on.

    Rules pass exactly this to the training CLI, so that a change of, say, the list of
    workers does not make Snakemake rerun every finished training run.
    """
    keys = ("dataset", "model", "model_options", "train", "stragglers", "target_accuracy", "launcher", "tracking")
    selected: dict[str, Any] = {key: copy.deepcopy(config[key]) for key in keys}
    selected["strategy_params"] = {strategy: copy.deepcopy(config["strategy_params"].get(strategy, {}))}
    return selected


def tracking_uri(uri: str | None, results_dir: str | Path = "results") -> str:
    """The MLflow tracking URI to use: `uri` unchanged, or SQLite at <results_dir>/mlflow.db."""
    if uri is not None:
        return uri
    return f"sqlite:///{(Path(results_dir) / 'mlflow.db').resolve()}"


def to_json(config: dict) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))

