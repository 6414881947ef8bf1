"""A study config as data, torch-free: read a YAML file, merge overrides, validate it against
the JSON schema (workflow/schemas/config.schema.yaml, read by dtstudy.config.schema; strict
types, defaults filled in), and the slice of it that one run depends on. The checks a schema
cannot do, which need the other layers (strategy specs, data, hardware profiles), are
dtstudy.checks. Every error names the config key, the bad value and what is allowed.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from dtstudy.config import run_kinds, schema
from dtstudy.errors import ConfigError
from dtstudy.launch_backends.registry import launch_backend

__all__ = [
    "ConfigError",
    "OPERATIONAL_KEYS",
    "VARIANT_KEY",
    "deep_merge",
    "operational_part",
    "read_yaml",
    "results_part",
    "results_sha256",
    "retype_command_line",
    "run_config",
    "strategy_of",
    "strategy_study",
    "validate_schema",
    "variant_study",
]

#: the keys of a run's config that decide how it is launched, watched and paid for, not what it
#: computes: a longer time limit, more requeues, another MLflow server address or a budget must
#: neither retrain the finished runs (Snakemake reruns a job whose tracked params changed: the
#: rules pass these apart, untracked, common.smk) nor void an interrupted run's checkpoint
#: (dtstudy.training.checkpoint.run_identity hashes results_part)
OPERATIONAL_KEYS = {
    "launcher": (
        "timeout_min",
        "comm_timeout_s",
        "signal_delay_s",
        "max_requeues",
        "max_resubmits",
        "hardware",
        "time_limit_margin",
        "gpu_hour_budget",
        "budget_train_images",
        "mem_gb",
        "account",
        "qos",
    ),
    "tracking": ("uri", "wait_for_server_s"),
}


def validate_schema(config: dict) -> dict:
    """Validate against the JSON schema (strict types: 64.0 is no integer) and fill defaults,
    in place; returns the config. `strategy_params` keeps what was written: a run's knob
    defaults are filled by its strategy's check_params, so that a run's config (and what
    makes Snakemake rerun it) changes only with what the user changes."""
    knobs_as_written = copy.deepcopy(config.get("strategy_params", {}))
    schema.validate_config(config)
    config["strategy_params"] = knobs_as_written
    run_kinds.check(config)  # the scaling and accuracy runs' keys against each other and `workers`
    _check_variants(config)
    return config


# --- variants: named variants of a strategy, each a row of the tables --------------------

#: a variant's run config names it here ({"name": ..., "strategy": ...}); a strategy's has no such key
VARIANT_KEY = "variant"


def _check_variants(config: dict) -> None:
    """Each variant's train keys, and each strategy_train's, against the schema's `train`; a
    variant's N against `workers`; its name is not a registered strategy's, and a
    strategy_train's is (dtstudy.checks checks both with the strategy and its knobs)."""
    train_schema = schema.load_schema()["properties"]["train"]
    for name, train in config["strategy_train"].items():
        schema.check(train, {**train_schema, "default": None}, prefix=("strategy_train", name))
    for name, variant in config["variants"].items():
        schema.check(variant["train"], {**train_schema, "default": None}, prefix=("variants", name, "train"))
        for i, n in enumerate(variant["workers"] or []):
            if n not in config["workers"]:
                raise ConfigError(
                    f"config key 'variants.{name}.workers[{i}]': {n} is not in workers {config['workers']}; "
                    "allowed: N of workers (every N the study runs at), or null for the study's"
                )


def strategy_of(config: dict, name: str) -> str:
    """The registered strategy a name of `strategies` runs: its own, or its variant's."""
    variant = config.get("variants", {}).get(name)
    return name if variant is None else variant["strategy"]


def variant_study(config: dict, name: str) -> dict:
    """The study config a variant's runs train under: the study's, with its strategy's
    strategy_train and then the variant's train keys and knobs over it, its strategy as the
    only one and its N as `workers` (what dtstudy.checks checks it as)."""
    variant = config["variants"][name]
    study = deep_merge(
        strategy_study(config, variant["strategy"]),
        {"train": variant["train"], "strategy_params": {variant["strategy"]: variant["strategy_params"]}},
    )
    study["strategies"] = [variant["strategy"]]
    study["variants"], study["strategy_train"] = {}, {}  # merged: its own train keys stay over them
    if variant["workers"] is not None:
        study["workers"] = list(variant["workers"])
        for kind in run_kinds.KINDS:
            study[kind] = {**study[kind], "workers": None}
    return study


def strategy_study(config: dict, name: str) -> dict:
    """The study config a name of `strategies` trains under: a variant's variant_study; a
    registered strategy's, the study's with its strategy_train keys over `train` (the study
    itself when it has none)."""
    if name in config.get("variants", {}):
        return variant_study(config, name)
    own_train = config.get("strategy_train", {}).get(name)
    return config if not own_train else deep_merge(config, {"train": own_train})


#: the words YAML reads as null and as true or false, where Snakemake's --config left them text
_YAML_NULL, _YAML_BOOLEANS = ("null", "Null", "NULL", "~"), {"true": True, "True": True, "false": False, "False": False}


def retype_command_line(config: dict, command_line: Mapping) -> dict:
    """Give the values set with Snakemake's `--config` the types a config file would: it reads
    the items of a list or mapping (`workers=[1,2]`, `'train={epochs: 2}'`) and the words
    null, true and false as text, which the strict schema would refuse ("'1' is not an
    integer"). Only `command_line`'s values change, in `config` (where Snakemake merged them):
    a config file's "64" stays text and is refused. Returns `config`."""

    def typed(value):
        if isinstance(value, Mapping):
            return {key: typed(item) for key, item in value.items()}
        if isinstance(value, list):
            return [typed(item) for item in value]
        if not isinstance(value, str):
            return value
        if value in _YAML_NULL:
            return None
        if value in _YAML_BOOLEANS:
            return _YAML_BOOLEANS[value]
        for number in (int, float):
            try:
                return number(value)
            except ValueError:
                pass
        return value

    def apply(target: dict, overlay: Mapping) -> None:
        for key, value in overlay.items():
            if isinstance(value, Mapping) and isinstance(target.get(key), dict):
                apply(target[key], value)  # merged key by key: only the keys the command line gave
            else:
                target[key] = typed(value)

    apply(config, command_line)
    return config


def per_worker_batch(train: dict, workers: int) -> int:
    return train["batch_size"] // workers if train["scaling"] == "strong" else train["batch_size"]


def global_batch_size(train: dict, workers: int) -> int:
    return per_worker_batch(train, workers) * workers


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


def run_config(config: dict, strategy: str, kind: str = run_kinds.ACCURACY) -> dict:
    """The part of the study config that one training run of `strategy` depends on, as a run
    of `kind` (dtstudy.config.run_kinds: a scaling run's step limit and timing window).

    Rules pass exactly this to the training CLI, so that a change of, say, the list of
    workers does not make Snakemake rerun every finished training run. A variant's (`strategy`
    one of `variants`) is its strategy's under variant_study, naming the variant (VARIANT_KEY).
    """
    if strategy in config.get("variants", {}):
        variant = run_config(variant_study(config, strategy), strategy_of(config, strategy), kind)
        variant[VARIANT_KEY] = {"name": strategy, "strategy": strategy_of(config, strategy)}
        return variant
    keys = (
        "dataset",
        "loader",
        "model",
        "model_options",
        "train",
        "stragglers",
        "target_accuracy",
        "launcher",
        "tracking",
    )
    study = strategy_study(config, strategy)  # its strategy_train over `train`
    selected: dict[str, Any] = {key: copy.deepcopy(study[key]) for key in keys}
    selected["strategy_params"] = {strategy: copy.deepcopy(config["strategy_params"].get(strategy, {}))}
    if launch_backend(config).emulated:  # its clock's hardware (absent otherwise: no rerun of real runs)
        selected["emulate"] = copy.deepcopy(config["emulate"])
    return deep_merge(selected, run_kinds.run_config_changes(config, kind))


def results_part(run_cfg: dict) -> dict:
    """A run config without its OPERATIONAL_KEYS: what decides the run's numbers."""
    kept = copy.deepcopy(run_cfg)
    for section, keys in OPERATIONAL_KEYS.items():
        for key in keys:
            kept.get(section, {}).pop(key, None)
    return kept


def results_sha256(run_cfg: dict) -> str:
    """The sha256 of a run config's results_part: equal for two configs that give the same
    numbers (a checkpoint's identity, a SLURM job a launcher may wait on again)."""
    text = json.dumps(results_part(run_cfg), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def operational_part(run_cfg: dict) -> dict:
    """A run config's OPERATIONAL_KEYS alone; deep_merge(results_part(c), operational_part(c)) == c."""
    return {
        section: {key: copy.deepcopy(run_cfg[section][key]) for key in keys if key in run_cfg.get(section, {})}
        for section, keys in OPERATIONAL_KEYS.items()
        if section in run_cfg
    }


def tracking_uri(uri: str | None, results_dir: str | Path = "results") -> str:
    """The MLflow tracking URI to use: `uri` unchanged, or SQLite at <results_dir>/mlflow.db."""
    if uri is not None:
        return uri
    return f"sqlite:///{(Path(results_dir) / 'mlflow.db').resolve()}"


def to_json(config: dict) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))
