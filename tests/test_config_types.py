"""Strict config types (64.0 is no integer, true no number), refused before any job starts, and the
schema as the one source of the strategies' knobs."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO, run_snakemake, tiny_study, validated

from dtstudy.config import schema
from dtstudy.errors import ConfigError
from dtstudy.strategies import specs
from dtstudy.strategies.specs import SPECS

# (override of the tiny study, the key named, the value as the message shows it, what it is not)
TYPE_MATRIX = [
    ({"train": {"batch_size": 64.0}}, "train.batch_size", "64.0", "is not an integer"),
    ({"train": {"batch_size": True}}, "train.batch_size", "True", "is not an integer"),
    ({"train": {"batch_size": "64"}}, "train.batch_size", "'64'", "is not an integer"),
    ({"workers": [2.0]}, "workers[0]", "2.0", "is not an integer"),
    ({"workers": [True]}, "workers[0]", "True", "is not an integer"),
    ({"seeds": ["0"]}, "seeds[0]", "'0'", "is not an integer"),
    ({"train": {"base_lr": True}}, "train.base_lr", "True", "is not a number"),
    ({"train": {"base_lr": "0.1"}}, "train.base_lr", "'0.1'", "is not a number"),
    (
        {"strategy_params": {"allreduce": {"bucket_cap_mb": True}}},
        "strategy_params.allreduce.bucket_cap_mb",
        "True",
        "is not a number",
    ),
    (
        {"strategies": ["ps_sync"], "strategy_params": {"ps_sync": {"shards": 2.0}}},
        "strategy_params.ps_sync.shards",
        "2.0",
        "is not an integer",
    ),
    ({"dataset": {"subset": 100.0}}, "dataset.subset", "100.0", "is not an integer or null"),
    ({"strategies": "allreduce"}, "strategies", "'allreduce'", "is not a list"),
    ({"stragglers": {"ranks": [0.0]}}, "stragglers.ranks[0]", "0.0", "is not an integer"),
]


@pytest.mark.parametrize("override, key, value, words", TYPE_MATRIX)
def test_a_value_of_the_wrong_type_is_refused_naming_key_value_and_type(override, key, value, words):
    with pytest.raises(ConfigError) as err:
        validated(tiny_study(**override))
    assert f"config key '{key}': {value} {words}" in str(err.value)


def test_the_message_says_what_is_allowed():
    with pytest.raises(ConfigError) as err:
        validated(tiny_study(train={"batch_size": 64.0}))
    assert str(err.value) == "config key 'train.batch_size': 64.0 is not an integer; allowed: an integer >= 1"
    with pytest.raises(ConfigError) as err:
        validated(tiny_study(strategies=["ps_async"], strategy_params={"ps_async": {"momentum": 1}}))
    assert "allowed: a number in [0, 1) or null" in str(err.value)


def test_whole_floats_in_knobs_are_refused_by_the_knob_check_too():
    """check_params is what a run calls: it refuses 2.0 shards without the whole-config pass."""
    with pytest.raises(ConfigError, match=r"'strategy_params\.ps_sync\.shards': 2\.0 is not an integer"):
        SPECS["ps_sync"].check_params({"shards": 2.0}, workers=2)
    with pytest.raises(ConfigError, match=r"'strategy_params\.local_sgd\.period': True is not an integer"):
        SPECS["local_sgd"].check_params({"period": True}, workers=2)


def test_an_unknown_key_lists_the_allowed_ones():
    with pytest.raises(ConfigError) as err:
        validated(tiny_study(train={"batchsize": 64}))
    assert "config key 'train.batchsize': unknown key 'batchsize'; allowed: base_lr, batch_size," in str(err.value)


# ----- the schema is the one source of the knobs ----------------------------------------------


def test_every_strategy_has_its_knob_schema_with_no_other_knobs_allowed():
    knob_schemas = schema.knob_schemas()
    assert knob_schemas.keys() == SPECS.keys()
    for name, knob_schema in knob_schemas.items():
        assert knob_schema["additionalProperties"] is False, name
        assert SPECS[name].check_params({}, workers=2) == {
            knob: sub["default"] for knob, sub in knob_schema["properties"].items()
        }


def test_knobs_without_a_spec_fail_at_import(monkeypatch):
    knob_schemas = schema.knob_schemas()
    knob_schemas["gossipp"] = knob_schemas["gossip"]  # a misspelt strategy name in the schema
    monkeypatch.setattr(schema, "knob_schemas", lambda: knob_schemas)
    with pytest.raises(RuntimeError, match="gossipp"):
        specs._check_knob_schemas_have_specs()


def test_a_spec_the_schema_gives_no_knobs_takes_none():
    class NoKnobsSpec(specs.StrategySpec):
        name = "no_knobs"
        family = "synchronous"

    assert NoKnobsSpec.check_params({}, workers=2) == {}
    with pytest.raises(ConfigError, match=r"strategy_params\.no_knobs.*period"):
        NoKnobsSpec.check_params({"period": 4}, workers=2)


def test_a_knob_without_a_default_fails_at_import(monkeypatch):
    knob_schemas = schema.knob_schemas()
    del knob_schemas["gossip"]["properties"]["topology"]["default"]
    monkeypatch.setattr(schema, "knob_schemas", lambda: knob_schemas)
    with pytest.raises(RuntimeError, match="strategy_params.gossip"):

        class GossipAgainSpec(specs.GossipSpec):  # a spec takes its knobs when it is defined
            name = SPECS["gossip"].name

    assert SPECS["gossip"].defaults == {"topology": "ring"}  # the defined spec kept its own


def documented_knobs() -> dict[tuple[str, str], str]:
    """{(strategy, knob): default} of the knob table in config/README.md."""
    section = (REPO / "config" / "README.md").read_text().split("## `strategy_params`", 1)[1].split("\n## ", 1)[0]
    found, names = {}, []
    for row in re.findall(r"^\|(.*)\|$", section, flags=re.M):
        cells = [cell.strip() for cell in row.split("|")]
        if len(cells) != 4 or not cells[1].startswith("`"):
            continue  # the header and its rule
        names = re.findall(r"`(\w+)`", cells[0]) or names  # an empty first cell: the row above's strategies
        for name in names:
            found[(name, cells[1].strip("`"))] = cells[2].strip("`")
    return found


def test_the_knob_table_of_config_readme_follows_the_schema():
    in_schema = {
        (name, knob): "null" if sub["default"] is None else str(sub["default"]).lower()
        for name, knob_schema in schema.knob_schemas().items()
        for knob, sub in knob_schema["properties"].items()
    }
    assert documented_knobs() == in_schema


# ----- at the dry run, before any job, and from the command line ------------------------------


@pytest.mark.parametrize(
    "override, key, words",
    [
        ({"train": {"batch_size": 64.0}}, "train.batch_size", "64.0 is not an integer"),
        ({"workers": [2.0]}, "workers[0]", "2.0 is not an integer"),
        (
            {"strategy_params": {"allreduce": {"bucket_cap_mb": True}}},
            "strategy_params.allreduce.bucket_cap_mb",
            "True is not a number",
        ),
        # the profile is read by the last rule: a wrong name stops the study before the first
        ({"projection": {"hardware": "h100"}}, "projection.hardware", "'h100' is neither a file nor a profile name"),
    ],
)
@pytest.mark.slow
def test_the_dry_run_refuses_a_value_of_the_wrong_type(tmp_path, override, key, words):
    result = run_snakemake(tmp_path, tiny_study(**override), "--dry-run", "--cores", "1", timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert f"config key '{key}': {words}" in output
    assert not (tmp_path / "results").exists()


def test_a_malformed_yaml_is_one_line_naming_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model: lenet5\ntrain: {epochs: 1, batch_size: 8\nworkers: [1, 2]\n")
    result = subprocess.run(
        [sys.executable, "-m", "dtstudy", "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert str(path) in lines[0] and "line 3" in lines[0] and "malformed YAML" in lines[0]


def test_every_hardware_profile_of_the_projection_is_checked_when_the_study_starts(tmp_path):
    """projection.hardware is one profile or a list; each is read and checked up front (the
    project rule, which reads them, runs after all the training), naming the key."""
    assert validated(tiny_study())["projection"]["hardware"] == ["this_machine", "minotauro_k80", "h100_ib400"]
    assert validated(tiny_study(projection={"hardware": "h100_ib400"}))["projection"]["hardware"] == "h100_ib400"
    with pytest.raises(ConfigError, match=r"config key 'projection\.hardware\[1\]': 'h100' is neither"):
        validated(tiny_study(projection={"hardware": ["this_machine", "h100"]}))
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "gpus_per_node: 4\ninter_node: {bandwidth_gbit_s: -25, latency_us: 5}\nintra_node: {bandwidth_gbyte_s: 12}\n"
    )
    with pytest.raises(
        ConfigError, match=r"bad\.yaml: key 'inter_node\.bandwidth_gbit_s': -25 is .*; allowed: a number > 0"
    ):
        validated(tiny_study(projection={"hardware": [str(bad)]}))
    no_intra = tmp_path / "no_intra.yaml"  # a study has no single-node throughput to fit the link to
    no_intra.write_text("gpus_per_node: 4\ninter_node: {bandwidth_gbit_s: 25, latency_us: 5}\n")
    with pytest.raises(ConfigError, match=r"no_intra\.yaml: key 'intra_node' is missing"):
        validated(tiny_study(projection={"hardware": str(no_intra)}))
    knob = tmp_path / "knob.yaml"  # the profile's knobs of the study's strategies
    knob.write_text(
        "gpus_per_node: 4\ninter_node: {bandwidth_gbit_s: 25}\nintra_node: measured\n"
        "strategy_params: {ps_sync: {placement: everywhere}}\n"
    )
    with pytest.raises(ConfigError, match=r"strategy_params\.ps_sync\.placement': 'everywhere'"):
        validated(tiny_study(strategies=["ps_sync"], projection={"hardware": str(knob)}))
    with pytest.raises(ConfigError, match=r"'projection\.hardware': \[\] should be non-empty"):
        validated(tiny_study(projection={"hardware": []}))
    with pytest.raises(ConfigError, match=r"'projection\.hardware': 5 is not a string or a list"):
        validated(tiny_study(projection={"hardware": 5}))
