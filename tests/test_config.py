"""Config validation: schema defaults, and bad input rejected with the key, value and what is allowed."""

from __future__ import annotations

import pytest
from conftest import tiny_study, validated

from dtstudy.checks import load_config
from dtstudy.config.study_config import deep_merge, run_config, validate_schema
from dtstudy.errors import ConfigError


def test_schema_fills_every_default():
    config = validate_schema({})
    assert config["dataset"] == {
        "name": "fashion_mnist",
        "root": None,
        "download": False,
        "subset": None,
        "val_fraction": 0.1,
        "split_seed": 0,
        "test_fraction": 0.1,
        "corrupt_images": "error",
        "image_size": 224,
        "shard_mb": None,
        "synthetic": {"train_size": 4096, "test_size": 512, "channels": 3, "classes": 10},
    }
    assert config["strategies"] == ["allreduce"] and config["workers"] == [1, 2, 4]
    assert config["train"]["lr_scaling"] == "linear" and config["train"]["batch_size"] == 64
    assert config["tracking"] == {"uri": None, "experiment": "distributed-training-study", "wait_for_server_s": 300}


@pytest.mark.parametrize("path", ["config/config.yaml", "config/allreduce.yaml"])
def test_shipped_configs_are_valid(path):
    config = load_config(path)
    assert config["model"] == "lenet5" and config["workers"] == [1, 2, 4]


@pytest.mark.parametrize(
    "override, words",
    [
        ({"model": "vgg99"}, ["model", "vgg99", "lenet5", "resnet18"]),
        ({"dataset": {"name": "mnist3d"}}, ["dataset.name", "mnist3d", "fashion_mnist", "cifar10"]),
        ({"workers": [1, 0]}, ["workers[1]", "0", "minimum of 1"]),
        ({"train": {"batch_size": 0}}, ["train.batch_size", "0", "minimum of 1"]),
        ({"train": {"lr_scaling": "cubic"}}, ["train.lr_scaling", "cubic", "linear", "sqrt", "none"]),
        ({"train": {"label_smoothing": 1.0}}, ["train.label_smoothing", "1.0"]),
        ({"train": {"nesterov": "yes"}}, ["train.nesterov", "'yes'"]),
        ({"tracking": {"experiment": ""}}, ["tracking.experiment"]),
        ({"launcher": {"gloo_loop_nice": 20}}, ["launcher.gloo_loop_nice", "20", "maximum of 19"]),
        (
            {"launcher": {"gloo_loop_nice": "fast"}},
            ["launcher.gloo_loop_nice", "'fast'", "an integer in [0, 19] or 'idle'"],
        ),
        ({"launcher": {"max_resubmits": -1}}, ["launcher.max_resubmits", "-1", "minimum of 0"]),
    ],
)
def test_schema_errors_name_key_value_and_allowed(override, words):
    with pytest.raises(ConfigError) as err:
        validate_schema(deep_merge(tiny_study(), override))
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    "override, words",
    [
        ({"strategies": ["allreduce", "telepathy"]}, ["strategies[1]", "telepathy", "allowed: ", "allreduce"]),
        ({"strategy_params": {"telepathy": {}}}, ["strategy_params.telepathy", "allowed: ", "allreduce"]),
        (
            {"strategy_params": {"allreduce": {"bucket_cap": 1}}},
            ["strategy_params.allreduce.bucket_cap", "bucket_cap_mb"],
        ),
        ({"strategy_params": {"allreduce": {"bucket_cap_mb": -1}}}, ["strategy_params.allreduce.bucket_cap_mb", "-1"]),
        ({"strategy_params": {"no_exchange": {"steps": 10}}}, ["strategy_params.no_exchange.steps", "10", "50"]),
        ({"dataset": {"root": "/no/such/folder"}}, ["dataset.root", "/no/such/folder"]),
        ({"dataset": {"subset": 70000}}, ["dataset.subset", "70000", "60000"]),
        ({"dataset": {"name": "cifar10"}}, ["dataset.root", "cifar10"]),
        ({"train": {"batch_size": 1500}}, ["train.batch_size", "3000", "1800"]),
        ({"train": {"scaling": "strong", "batch_size": 63}}, ["train.batch_size", "63", "strong"]),
        ({"train": {"nesterov": True, "momentum": 0}}, ["train.nesterov", "train.momentum is 0"]),
        (
            {"launcher": {"timeout_min": 2, "signal_delay_s": 60}},
            ["launcher.signal_delay_s", "60 s after", "timeout_min"],
        ),
    ],
)
def test_checks_beyond_the_schema(override, words):
    with pytest.raises(ConfigError) as err:
        validated(deep_merge(tiny_study(), override))
    for word in words:
        assert word in str(err.value)


def test_a_run_configs_operational_keys_are_schema_keys_and_split_off_whole():
    """The keys the rules pass apart (untracked) exist in the schema, so a rename cannot leave one
    tracked by mistake; the two parts merge back into the run config."""
    from dtstudy.config import schema
    from dtstudy.config.study_config import OPERATIONAL_KEYS, operational_part, results_part

    properties = schema.load_schema()["properties"]
    for section, keys in OPERATIONAL_KEYS.items():
        assert set(keys) <= set(properties[section]["properties"]), section
    run = run_config(validated(tiny_study(tracking={"uri": "http://login1:5000"})), "allreduce")
    kept, apart = results_part(run), operational_part(run)
    assert "timeout_min" not in kept["launcher"] and "uri" not in kept["tracking"]
    assert kept["launcher"]["cluster"] == "local" and kept["tracking"]["experiment"] == run["tracking"]["experiment"]
    assert apart["tracking"] == {"uri": "http://login1:5000", "wait_for_server_s": run["tracking"]["wait_for_server_s"]}
    assert deep_merge(kept, apart) == run


def test_run_config_keeps_only_what_a_run_depends_on():
    config = validated(tiny_study(strategy_params={"allreduce": {"bucket_cap_mb": 5}}))
    selected = run_config(config, "allreduce")
    assert "workers" not in selected and "seeds" not in selected and "strategies" not in selected
    assert selected["strategy_params"] == {"allreduce": {"bucket_cap_mb": 5}}
    assert selected["train"] == config["train"]


@pytest.mark.parametrize(
    "stragglers, words",
    [
        ({"ranks": [1], "delay_ms": 5}, ["stragglers.ranks", "rank 1", "N=1"]),
        ({"ranks": [0], "fraction": 0.5}, ["stragglers", "not both"]),
        ({"distribution": "gamma"}, ["stragglers.distribution", "gamma", "exponential"]),
        ({"delay_ms": -1}, ["stragglers.delay_ms", "-1"]),
    ],
)
def test_bad_straggler_settings(stragglers, words):
    with pytest.raises(ConfigError) as err:
        validated(tiny_study(stragglers=stragglers))
    for word in words:
        assert word in str(err.value)


def test_command_line_values_are_typed_and_a_config_files_text_is_not():
    """What Snakemake's --config left as text becomes what YAML would read; the rest of the
    config (a file's "64", a model name, an address) is untouched, so the schema refuses it."""
    from dtstudy.config.study_config import retype_command_line

    config = deep_merge(tiny_study(), {"train": {"batch_size": "64"}})  # as a config file wrote it
    command_line = {
        "workers": ["1", "2"],
        "target_accuracy": "null",
        "model": "lenet5",
        "train": {"epochs": "2", "base_lr": "0.05", "nesterov": "true", "max_steps": "~"},
        "tracking": {"uri": "http://login1:5000"},
    }
    config = deep_merge(config, command_line)  # as Snakemake merges --config over the files
    retype_command_line(config, command_line)
    assert config["workers"] == [1, 2] and config["target_accuracy"] is None and config["model"] == "lenet5"
    assert {key: config["train"][key] for key in command_line["train"]} == {
        "epochs": 2,
        "base_lr": 0.05,
        "nesterov": True,
        "max_steps": None,
    }
    assert config["tracking"]["uri"] == "http://login1:5000"
    assert config["train"]["batch_size"] == "64"  # not the command line's: still refused
    with pytest.raises(ConfigError, match=r"'train.batch_size': '64' is not an integer"):
        validate_schema(config)
