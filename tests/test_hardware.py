"""Hardware profiles against their schema (workflow/schemas/hardware.schema.yaml): every shipped
profile validates, each kind of bad value is one line naming the profile, the key, the value
and what is allowed, the code takes its defaults from the schema, and the key tables of
config/hardware/README.md follow it. Torch-free and quick."""

from __future__ import annotations

import re
import subprocess
import sys

import jsonschema
import pytest
import yaml
from conftest import REPO, tiny_study

from dtstudy import checks
from dtstudy.config.study_config import validate_schema
from dtstudy.errors import ConfigError
from dtstudy.projection import hardware
from dtstudy.strategies.specs import knob_defaults

HARDWARE_README = REPO / "config" / "hardware" / "README.md"
SHIPPED = sorted(hardware.PROFILES_DIR.glob("*.yaml"))
GOOD = {
    "gpus_per_node": 4,
    "intra_node": {"bandwidth_gbyte_s": 12, "latency_us": 10},
    "inter_node": {"bandwidth_gbit_s": 56, "latency_us": 2},
}


def write_profile(tmp_path, **changes) -> str:
    """A good profile with `changes` (a key set to None is left out), as a file."""
    profile = {**GOOD, **changes}
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump({key: value for key, value in profile.items() if value is not None}))
    return str(path)


# ----- the shipped profiles and the schema itself ----------------------------------------------


def test_the_three_profiles_are_shipped():
    assert [path.stem for path in SHIPPED] == ["h100_ib400", "minotauro_k80", "this_machine"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.stem)
def test_every_shipped_profile_validates(path):
    hardware.check_profile(yaml.safe_load(path.read_text()), str(path))
    profile = hardware.load_profile(path.stem)
    machine, _ = hardware.study_machine(profile)  # `measured` stands in as a link before the benchmark
    assert machine.gpus_per_node == profile["gpus_per_node"]
    params = hardware.profile_strategy_params(profile, ["ps_sync", "allreduce"], knob_defaults())
    assert params["ps_sync"]["placement"] == "colocated" and "placement" not in params["allreduce"]


def test_the_schema_is_a_valid_draft_2020_12_schema_with_every_key_described():
    profile_schema = hardware.profile_schema()
    jsonschema.Draft202012Validator.check_schema(profile_schema)
    parts = {**profile_schema["properties"], **profile_schema["$defs"]}
    assert sorted(key for key, part in parts.items() if not part.get("description")) == []


def test_the_schema_and_the_model_agree_on_the_allreduce_algorithms(monkeypatch):
    assert sorted(hardware.profile_schema()["properties"]["allreduce_algorithm"]["enum"]) == sorted(
        hardware.ALLREDUCE_ALGORITHMS
    )
    monkeypatch.setattr(hardware, "ALLREDUCE_ALGORITHMS", {"ring": None})
    hardware._schema.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="allreduce_algorithm"):
            hardware.profile_schema()
    finally:
        monkeypatch.undo()
        hardware._schema.cache_clear()


# ----- each kind of bad value: one line, naming the profile, key, value and what is allowed ---

# (changes to a good profile, the key named, the value as the message shows it, what is allowed)
BAD = [
    pytest.param(
        {"gpus_per_node": 4.0},
        "gpus_per_node",
        "4.0 is not an integer",
        "allowed: an integer >= 1",
        id="wrong_type_whole_float",
    ),
    pytest.param(
        {"gpus_per_node": True},
        "gpus_per_node",
        "True is not an integer",
        "allowed: an integer >= 1",
        id="wrong_type_bool",
    ),
    pytest.param(
        {"overlap": "0.5"}, "overlap", "'0.5' is not a number", "allowed: a number in [0, 1]", id="wrong_type_string"
    ),
    pytest.param(
        {"inter_node": 10},
        "inter_node",
        "10 is not a mapping",
        "allowed: a mapping with bandwidth_gbit_s",
        id="wrong_type_link",
    ),
    pytest.param(
        {"gpus_per_node": 0},
        "gpus_per_node",
        "0 is less than the minimum of 1",
        "allowed: an integer >= 1",
        id="out_of_range",
    ),
    pytest.param(
        {"inter_node": {"bandwidth_gbit_s": -25}},
        "inter_node.bandwidth_gbit_s",
        "-25",
        "allowed: a number > 0",
        id="out_of_range_link",
    ),
    pytest.param(
        {"intra_node": {"bandwidth_gbyte_s": 12, "payload_fraction": 1.5}},
        "intra_node.payload_fraction",
        "1.5",
        "allowed: a number in (0, 1]",
        id="out_of_range_payload_fraction",
    ),
    pytest.param(
        {"ps_request_us": -5},
        "ps_request_us",
        "-5",
        "allowed: a number >= 0 or 'measured'",
        id="out_of_range_ps_request",
    ),
    pytest.param(
        {"nodes": 16},
        "nodes",
        "unknown key 'nodes'",
        "allowed: allreduce_algorithm, compression_gbyte_s,",
        id="unknown_key",
    ),
    pytest.param(
        {"inter_node": {"bandwidth_gbit_s": 56, "latncy_us": 2}},
        "inter_node.latncy_us",
        "unknown key 'latncy_us'",
        "allowed: bandwidth_gbit_s, latency_us, payload_fraction",
        id="misspelt_link_key",
    ),
    pytest.param(
        {"inter_node": {"bandwith_gbit_s": 56}},
        "inter_node.bandwith_gbit_s",
        "unknown key 'bandwith_gbit_s'",
        "allowed: bandwidth_gbit_s, latency_us, payload_fraction",
        id="misspelt_required_link_key",
    ),
    pytest.param(
        {"inter_node": {"bandwidth_gbyte_s": 7}},
        "inter_node.bandwidth_gbyte_s",
        "unknown key 'bandwidth_gbyte_s'",
        "allowed: bandwidth_gbit_s, latency_us, payload_fraction",
        id="inter_node_in_gbyte",
    ),
    pytest.param(
        {"inter_node": None}, "inter_node", "is missing", "allowed: a mapping with bandwidth_gbit_s", id="missing_key"
    ),
    pytest.param(
        {"intra_node": {"bandwidth_gbit_s": 96, "bandwidth_gbyte_s": 12}},
        "intra_node",
        "{'bandwidth_gbit_s': 96, 'bandwidth_gbyte_s': 12} is not allowed",
        "allowed: 'measured' or a mapping with bandwidth_gbit_s or a mapping with bandwidth_gbyte_s, only one of them",
        id="both_units",
    ),
    pytest.param(
        {"intra_node": "measure"},
        "intra_node",
        "'measure' is not allowed",
        "allowed: 'measured' or a mapping with",
        id="misspelt_measured",
    ),
    pytest.param(
        {"allreduce_algorithm": "tree"}, "allreduce_algorithm", "'tree'", "['hierarchical', 'ring']", id="bad_enum"
    ),
    pytest.param(
        {"strategy_params": {"ps_sync": {"placement": "everywhere"}}},
        "strategy_params.ps_sync.placement",
        "'everywhere'",
        "['colocated', 'dedicated']",
        id="bad_enum_placement",
    ),
    pytest.param(
        {"strategy_params": {"allreduce": {"placement": "colocated"}}},
        "strategy_params.allreduce.placement",
        "unknown knob for strategy 'allreduce'",
        "allowed: bucket_cap_mb",
        id="placement_without_shards",
    ),
    pytest.param(
        {"strategy_params": {"ps_sync": {"shards": 2.0}}},
        "strategy_params.ps_sync.shards",
        "2.0 is not an integer",
        "allowed: an integer >= 1",
        id="knob_of_wrong_type",
    ),
    pytest.param(
        {"strategy_params": {"allreduse": {}}},
        "strategy_params.allreduse",
        "unknown strategy 'allreduse'",
        "allowed: allreduce, allreduce_bf16,",
        id="unknown_strategy",
    ),
    pytest.param(
        {"stragglers": {"fraction": 0.1, "distribution": "gamma"}},
        "stragglers.distribution",
        "'gamma'",
        "['fixed', 'uniform', 'exponential']",
        id="bad_enum_stragglers",
    ),
]


@pytest.mark.parametrize("changes, key, value, allowed", BAD)
def test_a_bad_value_is_one_line_naming_profile_key_value_and_allowed(tmp_path, changes, key, value, allowed):
    path = write_profile(tmp_path, **changes)
    with pytest.raises(ConfigError) as err:
        hardware.load_profile(path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"hardware profile {path}: key '{key}'")
    assert value in message and allowed in message


def test_several_bad_values_are_each_a_line(tmp_path):
    path = write_profile(tmp_path, gpus_per_node=0, overlap=2)
    with pytest.raises(ConfigError) as err:
        hardware.load_profile(path)
    assert str(err.value).splitlines() == [
        f"invalid hardware profile {path}:",
        f"  hardware profile {path}: key 'gpus_per_node': 0 is less than the minimum of 1; allowed: an integer >= 1",
        f"  hardware profile {path}: key 'overlap': 2 is greater than the maximum of 1; allowed: a number in [0, 1]",
    ]


def test_a_profile_that_is_no_mapping_is_refused(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- gpus_per_node: 4\n")
    with pytest.raises(
        ConfigError, match=r"list\.yaml: key '<top level>': \[.*\] is not a mapping; allowed: a mapping"
    ):
        hardware.load_profile(str(path))


def test_a_profile_given_as_a_mapping_is_checked_too():
    """machine_from_profile takes a profile that no file holds (the tests', a caller's own)."""
    with pytest.raises(ConfigError, match=r"^hardware profile p: key 'overlap': -0\.1 is less than the minimum of 0"):
        hardware.machine_from_profile({**GOOD, "name": "p", "overlap": -0.1})


# ----- what the schema cannot say: in Python -------------------------------------------------


def test_measured_values_need_the_studys_measurements(tmp_path):
    profile = hardware.load_profile(write_profile(tmp_path, intra_node="measured", ps_request_us="measured"))
    with pytest.raises(ConfigError, match=r"key 'intra_node': 'measured' needs the communication benchmark"):
        hardware.machine_from_profile(profile)
    assert hardware.study_machine(profile)[1]["ps_request"].startswith("measured")
    no_intra = hardware.load_profile(write_profile(tmp_path, intra_node=None))
    assert hardware.machine_from_profile(no_intra)[2]  # the command fits it; a study cannot
    with pytest.raises(ConfigError, match=r"key 'intra_node' is missing; allowed: 'measured' or a mapping"):
        hardware.study_machine(no_intra)


def test_a_bad_profile_stops_the_study_at_its_check_without_torch(tmp_path):
    """checks.check_config (at the Snakefile's parse, before any job) refuses the profile; the
    check imports no torch."""
    path = write_profile(tmp_path, inter_node={"bandwidth_gbit_s": 56, "payload_fracton": 0.9})
    config = validate_schema(tiny_study(projection={"hardware": ["this_machine", path]}))
    with pytest.raises(ConfigError, match=r"key 'inter_node\.payload_fracton': unknown key"):
        checks.check_config(config, check_data=False)
    code = (
        "import sys; from dtstudy.projection import hardware; "
        "hardware.check_study_profiles(['this_machine', 'minotauro_k80', 'h100_ib400'], ['allreduce', 'ps_sync']); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr


# ----- the defaults are the schema's ---------------------------------------------------------


def test_the_code_takes_its_defaults_from_the_schema(monkeypatch):
    profile = {
        "name": "p",
        "gpus_per_node": 4,
        "inter_node": {"bandwidth_gbit_s": 8},
        "intra_node": {"bandwidth_gbyte_s": 1},
        "strategy_params": {},
    }
    machine, source, _ = hardware.machine_from_profile(profile)
    assert (machine.overlap, machine.allreduce_algorithm, machine.ps_request_s) == (0.0, "hierarchical", 0.0)
    assert (machine.inter.latency_s, machine.inter.bandwidth) == (0.0, 1e9)  # latency 0, payload_fraction 1
    assert source["overlap"].startswith("default 0.0") and source["allreduce_algorithm"] == "default hierarchical"
    changed = hardware.profile_schema()
    changed["properties"]["overlap"]["default"] = 0.25
    changed["properties"]["allreduce_algorithm"]["default"] = "ring"
    changed["$defs"]["latency_us"]["default"] = 7
    changed["$defs"]["payload_fraction"]["default"] = 0.5
    changed["$defs"]["placement"]["default"] = "dedicated"
    monkeypatch.setattr(hardware, "_schema", lambda: changed)
    machine, source, _ = hardware.machine_from_profile(profile)
    assert (machine.overlap, machine.allreduce_algorithm) == (0.25, "ring")
    assert (machine.inter.latency_s, machine.inter.bandwidth) == (pytest.approx(7e-6), 0.5e9)
    assert source["overlap"].startswith("default 0.25")
    params = hardware.profile_strategy_params(profile, ["ps_sync"], knob_defaults())
    assert params["ps_sync"]["placement"] == "dedicated"


# ----- config/hardware/README.md follows the schema ----------------------------------------------


def documented_keys(text: str) -> dict[str, dict[str, object]]:
    """{table: {key: default}} of the key tables of config/hardware/README.md: the profile's keys
    ("Keys"), a link's ("A link's keys") and the profile-only knob ("The knob only a profile
    has"). A default in backticks is a value (YAML); any other text ("required", "none") is no
    default."""
    section = text.split("\n## Keys\n", 1)[1].split("\n## ", 1)[0]
    tables = {}
    for title, body in re.findall(r"^#*\s*(.+)\n((?:.*\n)*?)(?=^#|\Z)", "## Keys\n" + section, flags=re.M):
        rows = {}
        for row in re.findall(r"^\|(.*)\|$", body, flags=re.M):
            cells = [cell.strip() for cell in row.split("|")]
            if len(cells) != 4 or not re.fullmatch(r"`\w+`", cells[0]):
                continue  # the header and its rule
            default = re.fullmatch(r"`([^`]*)`", cells[2])
            rows[cells[0].strip("`")] = yaml.safe_load(default.group(1)) if default else None
        if rows:
            tables[title.strip()] = rows
    return tables


def schema_keys() -> dict[str, dict[str, object]]:
    """The same, from the schema."""
    profile_schema = hardware.profile_schema()
    link = profile_schema["$defs"]["link"]["properties"]
    assert profile_schema["properties"]["inter_node"]["properties"].keys() <= link.keys()
    return {
        "Keys": {key: part.get("default") for key, part in profile_schema["properties"].items()},
        "A link's keys": {key: part.get("default") for key, part in link.items()},
        "The knob only a profile has": {"placement": profile_schema["$defs"]["placement"]["default"]},
    }


def test_the_key_tables_of_the_readme_follow_the_schema():
    assert documented_keys(HARDWARE_README.read_text()) == schema_keys()


@pytest.mark.parametrize(
    "before, after",
    [
        ("| `overlap` | number in [0, 1] | `0.0` |", "| `overlap` | number in [0, 1] | `0.5` |"),  # a wrong default
        ("| `latency_us` | number ≥ 0, µs | `0` |", "| `latncy_us` | number ≥ 0, µs | `0` |"),  # a misspelt key
        ("| `server_gbyte_s` |", "| `server_gbytes` |"),
    ],
)
def test_the_readme_check_fails_on_a_wrong_table(before, after):
    text = HARDWARE_README.read_text()
    assert before in text
    assert documented_keys(text.replace(before, after)) != schema_keys()


def test_the_readme_check_fails_on_a_missing_row():
    lines = HARDWARE_README.read_text().splitlines()
    without = "\n".join(line for line in lines if not line.startswith("| `compression_gbyte_s` |"))
    assert documented_keys(without) != schema_keys()
