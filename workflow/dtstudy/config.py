"""Load, validate and check a study config.

Validation has two layers, both run before any job starts:
1. the JSON schema (workflow/schemas/config.schema.yaml), which also fills in defaults;
2. `check_config`, the checks a schema cannot do (strategy names against the registry,
   strategy knobs, the data set on disk, batch sizes against the data).
Every error names the config key, the bad value and what is allowed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from . import data, stragglers
from .errors import ConfigError
from .runspec import RunSpec
from .strategy_specs import SPECS as STRATEGIES

__all__ = ["ConfigError", "check_config", "load_config", "run_config", "validate_schema"]

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "schemas" / "config.schema.yaml"


def _validator_filling_defaults(validator_class):
    """jsonschema's documented recipe: a validator that also writes `default`s into the instance."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema:
                    instance.setdefault(name, copy.deepcopy(subschema["default"]))
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_DefaultFillingValidator = _validator_filling_defaults(jsonschema.Draft202012Validator)


def load_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _key_path(error: jsonschema.ValidationError) -> str:
    parts = []
    for part in error.absolute_path:
        parts.append(f"[{part}]" if isinstance(part, int) else f".{part}")
    return "".join(parts).lstrip(".") or "<top level>"


def validate_schema(config: dict) -> dict:
    """Validate against the JSON schema and fill defaults, in place; returns the config."""
    validator = _DefaultFillingValidator(load_schema())
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"config key '{_key_path(e)}': {e.message}" for e in errors]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines))
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
    for name in config["strategy_params"]:
        if name not in STRATEGIES:
            raise ConfigError(
                f"config key 'strategy_params.{name}': unknown strategy {name!r}; "
                f"allowed: {', '.join(sorted(STRATEGIES))}"
            )
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

    try:
        stragglers.check(config["stragglers"], config["workers"])
    except ValueError as err:
        raise ConfigError(str(err)) from None
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
    config = yaml.safe_load(Path(path).read_text()) or {}
    if overrides:
        config = deep_merge(config, overrides)
    validate_schema(config)
    check_config(config)
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

