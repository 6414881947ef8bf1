"""Hardware profiles (config/hardware/*.yaml, their keys in config/hardware/README.md): links per
node class, checked against workflow/schemas/hardware.schema.yaml, with where each value came from."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import yaml

from dtstudy.config import schema
from dtstudy.errors import ConfigError
from dtstudy.perfmodel.collectives import ALLREDUCE_ALGORITHMS
from dtstudy.perfmodel.machine import Link, Machine
from dtstudy.strategies.specs import SPECS

PROFILES_DIR = Path(__file__).resolve().parents[3] / "config" / "hardware"
SCHEMA_NAME = "hardware.schema.yaml"  # in workflow/schemas/: every key a profile may have
PS_REQUEST_MEASURED = "measured"  # ps_request_us: calibrated on the study's N=1 parameter-server runs


@functools.lru_cache(maxsize=1)
def _schema() -> dict:
    """hardware.schema.yaml with its strategy_params filled in: the study config's knob schemas,
    with `placement` ($defs) among those of the parameter servers (the strategies with shards)."""
    profile_schema = schema.load_schema_file(SCHEMA_NAME)
    knobs = schema.knob_schemas()
    for knob_schema in knobs.values():
        if "shards" in knob_schema["properties"]:
            knob_schema["properties"]["placement"] = profile_schema["$defs"]["placement"]
    profile_schema["properties"]["strategy_params"]["properties"] = knobs
    algorithms = profile_schema["properties"]["allreduce_algorithm"]["enum"]
    if sorted(algorithms) != sorted(ALLREDUCE_ALGORITHMS):
        raise RuntimeError(
            f"{schema.SCHEMAS_DIR / SCHEMA_NAME}: allreduce_algorithm's enum {algorithms} is not the "
            f"performance model's {sorted(ALLREDUCE_ALGORITHMS)}"
        )
    return profile_schema


def profile_schema() -> dict:
    """The schema a profile is checked against (a copy)."""
    return copy.deepcopy(_schema())


def default(key: str):
    """The schema's default of a profile key left out: a top-level key (overlap,
    allreduce_algorithm, ps_request_us), a link's (latency_us, payload_fraction) or placement."""
    part = _schema()["properties"].get(key) or _schema()["$defs"][key]
    return part["default"]


def _where(profile: dict) -> str:
    return f"hardware profile {profile.get('path', profile.get('name'))}"


def check_profile(profile, where: str | None = None) -> None:
    """A profile against the schema: ConfigError naming the profile, each bad key, its value
    and what is allowed. Its `path` is load_profile's (where it was found), not the file's."""
    where = where or _where(profile)
    if isinstance(profile, dict):
        profile = {key: value for key, value in profile.items() if key != "path"}
    schema.check(profile, _schema(), subject=f"{where}: key", title=f"invalid {where}")


def profile_path(name_or_path: str) -> Path:
    """A profile by name (config/hardware/<name>.yaml) or by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    return PROFILES_DIR / f"{name_or_path}.yaml"


def profile_names(value: str | list[str]) -> list[str]:
    """projection.hardware: one profile, or a list of them."""
    return [value] if isinstance(value, str) else list(value)


def load_profile(name_or_path: str, key: str = "projection.hardware") -> dict:
    path = profile_path(name_or_path)
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")))
        raise ConfigError(
            f"config key '{key}': {name_or_path!r} is neither a file nor a profile "
            f"name; allowed: a YAML path or one of {known}"
        )
    data = yaml.safe_load(path.read_text())
    check_profile(data, f"hardware profile {path}")
    data.setdefault("name", path.stem)
    data["path"] = str(path)
    return data


def _link(section: dict) -> Link:
    """The link of a profile section (checked). A line rate with `payload_fraction` becomes the
    rate the exchange's bytes get: headers, encoding and the transport take the rest."""
    rate = (
        section["bandwidth_gbit_s"] * 1e9 / 8 if "bandwidth_gbit_s" in section else section["bandwidth_gbyte_s"] * 1e9
    )
    return Link(
        section.get("latency_us", default("latency_us")) * 1e-6,
        rate * section.get("payload_fraction", default("payload_fraction")),
    )


def _link_source(section: dict, link: Link) -> str:
    """What a profile's link section gave, for the provenance: the rate as the exchange gets it."""
    stated = (
        f"{section['bandwidth_gbit_s']:g} Gbit/s"
        if "bandwidth_gbit_s" in section
        else f"{section['bandwidth_gbyte_s']:g} GB/s"
    )
    share = f" x payload_fraction {section['payload_fraction']:g}" if "payload_fraction" in section else ""
    return f"profile: {stated}{share} = {link.bandwidth / 1e9:.4g} GB/s, {link.latency_s * 1e6:g} us"


def profile_strategy_params(profile: dict, strategies: list[str], defaults: dict[str, dict]) -> dict[str, dict]:
    """Each strategy's knobs: its spec's defaults, a loaded profile's strategy_params (checked
    by load_profile's schema, each knob as in a study's config), and a parameter server's placement."""
    given = profile.get("strategy_params", {})
    params = {}
    for name in strategies:
        knobs = {**defaults[name], **given.get(name, {})}
        if "shards" in knobs:
            knobs.setdefault("placement", default("placement"))
        params[name] = knobs
    return params


def profile_stragglers(profile: dict) -> dict:
    """A loaded profile's optional `stragglers`: slow workers on that cluster, with the study
    config's keys (ranks or fraction, delay_ms, distribution), checked by load_profile's schema
    as in a study's config; {} when there are none."""
    return profile.get("stragglers", {})


def machine_from_profile(profile: dict, commbench: dict | None = None) -> tuple[Machine, dict, bool]:
    """The Machine of a profile, what each value came from, and whether intra_node is still
    to be fitted (absent: from the throughput at N = gpus_per_node). `intra_node: measured`
    takes the links and kernels of this machine's communication benchmark."""
    check_profile(profile)
    where = _where(profile)
    inter = _link(profile["inter_node"])
    overlap = profile.get("overlap", default("overlap"))
    algorithm = profile.get("allreduce_algorithm", default("allreduce_algorithm"))
    source = {
        "gpus_per_node": "profile",
        "inter_node": _link_source(profile["inter_node"], inter),
        "overlap": "profile" if "overlap" in profile else f"default {overlap} (assumed, docs/performance-model.md)",
        "allreduce_algorithm": "profile" if "allreduce_algorithm" in profile else f"default {algorithm}",
    }
    kwargs = {"allreduce_algorithm": algorithm}
    for key, target in (("compression_gbyte_s", "compression_bandwidth"), ("server_gbyte_s", "server_bandwidth")):
        if key in profile:
            kwargs[target] = profile[key] * 1e9
            source[key] = "profile"
    request = profile.get("ps_request_us", default("ps_request_us"))
    if request == PS_REQUEST_MEASURED:
        source["ps_request"] = "measured: from the study's N=1 parameter-server runs (calibration.ps_request_from_runs)"
    else:
        kwargs["ps_request_s"] = request * 1e-6
        source["ps_request"] = (
            "profile" if "ps_request_us" in profile else f"{request:g}: not modelled (no key 'ps_request_us')"
        )
    intra_section = profile.get("intra_node")
    needs_fit = False
    if measured_here(profile):
        if commbench is None:
            raise ConfigError(
                f"{where}: key 'intra_node': 'measured' needs the communication benchmark's result "
                f"(python -m dtstudy commbench)"
            )
        fit = commbench["fit"]
        intra = Link(fit["allreduce"]["latency_s"], fit["allreduce"]["bandwidth"])
        kwargs["intra_p2p"] = Link(fit["p2p"]["latency_s"], fit["p2p"]["bandwidth"])
        kernels = commbench["kernels_s_per_byte"]
        kwargs["compression_s_per_byte"] = {k: v for k, v in kernels.items() if k in SPECS}  # strategies' own work
        kwargs["server_bandwidth"] = 1.0 / kernels["server_pass"]
        kwargs["skew_fraction"] = commbench["jitter"]["skew_fraction"]
        kwargs["compute_scale"] = {int(k): v for k, v in commbench["compute_scale"].items()}
        source.update(
            jitter="measured (identical conv-net bursts on 2 processes, this machine)",
            compute_scale="measured (conv-net burst time with 2 busy processes over 1 alone, the median of rounds "
            "timed seconds apart, this machine)",
        )
        source.update(
            intra_node="measured (gloo all-reduce and send/recv fits, this machine)",
            compression="measured (kernels, this machine)",
            server="measured (kernels, this machine)",
        )
    elif intra_section is None:
        intra = Link(0.0, float("inf"))
        needs_fit = True
        source["intra_node"] = "to be fitted to the measured throughput at N = gpus_per_node"
    else:
        intra = _link(intra_section)
        source["intra_node"] = _link_source(intra_section, intra)
    for key, target in (("inter_node_p2p", "inter_p2p"), ("intra_node_p2p", "intra_p2p")):
        if key in profile:
            kwargs[target] = _link(profile[key])
            source[key] = _link_source(profile[key], kwargs[target])
    machine = Machine(
        gpus_per_node=profile["gpus_per_node"], intra=intra, inter=inter, overlap=float(overlap), **kwargs
    )
    return machine, source, needs_fit


def measured_here(profile: dict) -> bool:
    """Whether a profile is the machine the study runs on: its links inside a node are this
    machine's communication benchmark (`intra_node: measured`)."""
    return profile.get("intra_node") == "measured"


def study_machine(profile: dict, commbench: dict | None = None) -> tuple[Machine, dict]:
    """machine_from_profile for a study's projection, whose profile must give intra_node (or
    `measured`): a study has no single-node throughput to fit it to. Without `commbench`
    (the study is starting; the benchmark runs later) `measured` links stand in as one, so
    that the rest of the profile is checked."""
    if commbench is None and measured_here(profile):
        profile = {**profile, "intra_node": {"bandwidth_gbyte_s": 1}}
    machine, source, needs_fit = machine_from_profile(profile, commbench)
    if needs_fit:
        raise ConfigError(
            f"{_where(profile)}: key 'intra_node' is missing; allowed: "
            f"{schema.allowed(_schema()['properties']['intra_node'])} (a study's projection has no "
            f"throughput at N = gpus_per_node to fit it to)"
        )
    return machine, source


def check_study_profiles(value: str | list[str], strategies: list[str]) -> None:
    """Every profile of a study's projection.hardware, checked when the study starts (the
    project rule reads them last, after the training): the file and every key against the
    schema, its knobs and stragglers included (load_profile), and its links (study_machine)."""
    names = profile_names(value)
    for i, name in enumerate(names):
        profile = load_profile(name, "projection.hardware" if isinstance(value, str) else f"projection.hardware[{i}]")
        study_machine(profile)


def load_commbench(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
