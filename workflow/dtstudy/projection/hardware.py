"""Hardware profiles (config/hardware/*.yaml): links per node class, checked, with where each value came from."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from dtstudy.config import schema
from dtstudy.errors import ConfigError
from dtstudy.perfmodel import ALLREDUCE_ALGORITHMS, knob_defaults, Link, Machine
from dtstudy.strategies.specs import SPECS

PROFILES_DIR = Path(__file__).resolve().parents[3] / "config" / "hardware"
PLACEMENTS = ("colocated", "dedicated")
PS_REQUEST_MEASURED = "measured"  # ps_request_us: calibrated on the study's N=1 parameter-server runs
#: the default share of compute the all-reduce hides behind (see README "Projection"):
#: none; a profile may state its own, applied to every strategy that overlaps (DDP, Horovod)
DEFAULT_OVERLAP = 0.0


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
        raise ConfigError(f"config key '{key}': {name_or_path!r} is neither a file nor a profile "
                          f"name; allowed: a YAML path or one of {known}")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ConfigError(f"hardware profile {path}: expected a mapping")
    data.setdefault("name", path.stem)
    data["path"] = str(path)
    return data


def _number(section: dict, key: str, where: str, minimum_exclusive: float = 0.0) -> float:
    if key not in section:
        raise ConfigError(f"{where}: key '{key}' is missing")
    value = section[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= minimum_exclusive:
        allowed = "a positive number" if minimum_exclusive == 0 else f"a number > {minimum_exclusive}"
        raise ConfigError(f"{where}: key '{key}': {value!r} is not allowed; {allowed} is needed")
    return float(value)


def _latency(section: dict, where: str) -> float:
    value = section.get("latency_us", 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{where}: key 'latency_us': {value!r} is not allowed; a number >= 0 (microseconds)")
    return value * 1e-6


def _payload_fraction(section: dict, where: str) -> float:
    value = section.get("payload_fraction", 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{where}: key 'payload_fraction': {value!r} is not allowed; a number in (0, 1] (the share "
                          f"of the stated bandwidth that carries gradient bytes: framing and the transport's own "
                          f"losses; default 1)")
    return float(value)


def _link(section, where: str, unit: str) -> Link:
    """The link of a profile section. A line rate with `payload_fraction` becomes the rate
    the exchange's bytes get: headers, encoding and the transport take the rest."""
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: {section!r} is not allowed; a mapping with {unit} and latency_us "
                          f"(and optional payload_fraction)")
    allowed = (unit, "latency_us", "payload_fraction")
    for key in section:
        if key not in allowed:
            raise ConfigError(f"{where}: key {key!r} is not allowed here; allowed: {', '.join(allowed)}")
    bandwidth = _number(section, unit, where)
    scale = 1e9 / 8 if unit == "bandwidth_gbit_s" else 1e9
    return Link(_latency(section, where), bandwidth * scale * _payload_fraction(section, where))


def _link_source(section: dict, link: Link) -> str:
    """What a profile's link section gave, for the provenance: the rate as the exchange gets it."""
    stated = (f"{section['bandwidth_gbit_s']:g} Gbit/s" if "bandwidth_gbit_s" in section
              else f"{section['bandwidth_gbyte_s']:g} GB/s")
    share = f" x payload_fraction {section['payload_fraction']:g}" if "payload_fraction" in section else ""
    return f"profile: {stated}{share} = {link.bandwidth / 1e9:.4g} GB/s, {link.latency_s * 1e6:g} us"


def _link_any_unit(section, where: str) -> Link:
    unit = "bandwidth_gbit_s" if isinstance(section, dict) and "bandwidth_gbit_s" in section else "bandwidth_gbyte_s"
    return _link(section, where, unit)


def check_strategy_params(profile: dict, strategies: list[str], defaults: dict[str, dict]) -> dict[str, dict]:
    """Each strategy's knobs: its class's defaults, the profile's strategy_params, placement."""
    where = f"hardware profile {profile.get('path', profile.get('name'))}"
    given = profile.get("strategy_params") or {}
    if not isinstance(given, dict):
        raise ConfigError(f"{where}: key 'strategy_params': {given!r} is not allowed; a mapping strategy -> knobs")
    for name in given:
        if name not in defaults:
            raise ConfigError(f"{where}: key 'strategy_params.{name}': unknown strategy {name!r}; "
                              f"allowed: {', '.join(sorted(defaults))}")
    params = {}
    for name in strategies:
        knobs = {**defaults[name], **(given.get(name) or {})}
        placement = knobs.pop("placement", None)
        # the knobs' types and ranges: the strategy's own schema, as a study's config is checked
        problem = _first_problem(knobs, SPECS[name].knob_schema, ("strategy_params", name), where)
        if problem:
            raise ConfigError(problem + (", placement" if "unknown knob" in problem and "shards" in knobs else ""))
        if "shards" in knobs:
            placement = placement if placement is not None else "colocated"
            if placement not in PLACEMENTS:
                raise ConfigError(f"{where}: key 'strategy_params.{name}.placement': {placement!r} is not allowed; "
                                  f"allowed: {' or '.join(PLACEMENTS)}")
            knobs["placement"] = placement
        elif placement is not None:
            raise ConfigError(f"{where}: key 'strategy_params.{name}.placement': only parameter-server strategies "
                              f"have shards to place")
        params[name] = knobs
    return params


def check_stragglers(profile: dict) -> dict:
    """The profile's optional `stragglers`: slow workers on that cluster, with the study
    config's keys (ranks or fraction, delay_ms, distribution), checked against the config's
    schema; {} when there are none."""
    given = profile.get("stragglers")
    if given is None:
        return {}
    where = f"hardware profile {profile.get('path', profile.get('name'))}"
    problem = _first_problem(given, schema.load_schema()["properties"]["stragglers"], ("stragglers",), where)
    if problem:
        raise ConfigError(problem)
    return given


def _first_problem(value, part: dict, prefix: tuple, where: str) -> str:
    """The first problem of a profile's `value` against `part` of the config's schema, worded
    for the profile (its file, then the key), or ""."""
    problems = schema.problems(value, part, prefix=prefix)
    return problems[0].replace("config key", f"{where}: key", 1) if problems else ""


def machine_from_profile(profile: dict, commbench: dict | None = None) -> tuple[Machine, dict, bool]:
    """The Machine of a profile, what each value came from, and whether intra_node is still
    to be fitted (absent: from the throughput at N = gpus_per_node). `intra_node: measured`
    takes the links and kernels of this machine's communication benchmark."""
    where = f"hardware profile {profile.get('path', profile.get('name'))}"
    gpus = profile.get("gpus_per_node")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"{where}: key 'gpus_per_node': {gpus!r} is not allowed; a whole number >= 1")
    if "inter_node" not in profile:
        raise ConfigError(f"{where}: key 'inter_node' is missing (bandwidth_gbit_s and latency_us between nodes)")
    inter = _link(profile["inter_node"], where + " inter_node", "bandwidth_gbit_s")
    overlap = profile.get("overlap", DEFAULT_OVERLAP)
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not 0 <= overlap <= 1:
        raise ConfigError(f"{where}: key 'overlap': {overlap!r} is not allowed; a number in [0, 1]")
    source = {"gpus_per_node": "profile", "inter_node": _link_source(profile["inter_node"], inter),
              "overlap": "profile" if "overlap" in profile else f"default {DEFAULT_OVERLAP} (assumed, README 'Projection')"}
    kwargs = {}
    if "allreduce_algorithm" in profile:
        algorithm = profile["allreduce_algorithm"]
        if algorithm not in ALLREDUCE_ALGORITHMS:
            raise ConfigError(f"{where}: key 'allreduce_algorithm': {algorithm!r} is not allowed; allowed: "
                              f"{' or '.join(ALLREDUCE_ALGORITHMS)}")
        kwargs["allreduce_algorithm"] = algorithm
    source["allreduce_algorithm"] = "profile" if "allreduce_algorithm" in profile else "default hierarchical"
    for key, target in (("compression_gbyte_s", "compression_bandwidth"), ("server_gbyte_s", "server_bandwidth")):
        if key in profile:
            kwargs[target] = _number(profile, key, where) * 1e9
            source[key] = "profile"
    request = profile.get("ps_request_us", 0)
    if request == PS_REQUEST_MEASURED:
        source["ps_request"] = "measured: from the study's N=1 parameter-server runs (calibration.ps_request_from_runs)"
    elif isinstance(request, bool) or not isinstance(request, (int, float)) or request < 0:
        raise ConfigError(f"{where}: key 'ps_request_us': {request!r} is not allowed; a number >= 0 (microseconds "
                          f"a parameter-server round trip costs beyond its links and the shard's update) or "
                          f"'{PS_REQUEST_MEASURED}' (from a study's N=1 parameter-server runs)")
    else:
        kwargs["ps_request_s"] = request * 1e-6
        source["ps_request"] = "profile" if "ps_request_us" in profile else "0: not modelled (no key 'ps_request_us')"
    intra_section = profile.get("intra_node")
    needs_fit = False
    if measured_here(profile):
        if commbench is None:
            raise ConfigError(f"{where}: key 'intra_node': 'measured' needs the communication benchmark's result "
                              f"(python -m dtstudy commbench)")
        fit = commbench["fit"]
        intra = Link(fit["allreduce"]["latency_s"], fit["allreduce"]["bandwidth"])
        kwargs["intra_p2p"] = Link(fit["p2p"]["latency_s"], fit["p2p"]["bandwidth"])
        kernels = commbench["kernels_s_per_byte"]
        kwargs["compression_s_per_byte"] = {k: v for k, v in kernels.items()
                                            if k.startswith("allreduce_") or k == "gossip"}
        kwargs["server_bandwidth"] = 1.0 / kernels["server_pass"]
        kwargs["skew_fraction"] = commbench["jitter"]["skew_fraction"]
        kwargs["compute_scale"] = {int(k): v for k, v in commbench["compute_scale"].items()}
        source.update(jitter="measured (identical conv-net bursts on 2 processes, this machine)",
                      compute_scale="measured (conv-net burst time with 2 busy processes over 1 alone, the median of rounds timed seconds apart, this machine)")
        source.update(intra_node="measured (gloo all-reduce and send/recv fits, this machine)",
                      compression="measured (kernels, this machine)", server="measured (kernels, this machine)")
    elif intra_section is None:
        intra = Link(0.0, float("inf"))
        needs_fit = True
        source["intra_node"] = "to be fitted to the measured throughput at N = gpus_per_node"
    else:
        intra = _link_any_unit(intra_section, where + " intra_node")
        source["intra_node"] = _link_source(intra_section, intra)
    for key, target in (("inter_node_p2p", "inter_p2p"), ("intra_node_p2p", "intra_p2p")):
        if key in profile:
            kwargs[target] = _link_any_unit(profile[key], f"{where} {key}")
            source[key] = _link_source(profile[key], kwargs[target])
    return Machine(gpus_per_node=gpus, intra=intra, inter=inter, overlap=float(overlap), **kwargs), source, needs_fit


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
        raise ConfigError(f"hardware profile {profile['path']}: key 'intra_node' is missing (a study projection "
                          f"needs it, or 'measured')")
    return machine, source


def check_study_profiles(value: str | list[str], strategies: list[str]) -> None:
    """Every profile of a study's projection.hardware, checked when the study starts (the
    project rule reads them last, after the training): the file, its links and keys
    (study_machine), and its knobs of the study's strategies."""
    names = profile_names(value)
    for i, name in enumerate(names):
        profile = load_profile(name, "projection.hardware" if isinstance(value, str) else f"projection.hardware[{i}]")
        study_machine(profile)
        check_strategy_params(profile, strategies, knob_defaults())
        check_stragglers(profile)


def load_commbench(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
