"""Calibration from measurements: alpha-beta fits, a measurement file (M.yaml), or a study's metrics.json files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml

from . import hardware, layer_profiles, perfmodel
from .config import ConfigError
from .perfmodel import LayerProfile, Workload


def least_squares_line(points: list[list[float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y) points."""
    if len(points) < 2:
        raise ValueError("a fit needs at least two (size, seconds) points")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    slope = sxy / sxx
    return my - slope * mx, slope


def fit_p2p(points: list[list[float]]) -> dict:
    """One-way message time t = alpha + m / B: alpha (s) and B (bytes/s)."""
    intercept, slope = least_squares_line(points)
    return {"latency_s": max(intercept, 0.0), "bandwidth": 1.0 / slope}


def fit_allreduce(points: list[list[float]], participants: int) -> dict:
    """Ring all-reduce over p processes, t = 2 (p-1) alpha + 2 (p-1)/p m / B: per-link alpha and B."""
    intercept, slope = least_squares_line(points)
    p = participants
    return {"latency_s": max(intercept, 0.0) / (2 * (p - 1)), "bandwidth": 2 * (p - 1) / p / slope}


# ----- a measurement file (what was measured on one node) ------------------------------


def _require(mapping: dict, key: str, where: str):
    if not isinstance(mapping, dict) or key not in mapping:
        raise ConfigError(f"{where}: key '{key}' is missing")
    return mapping[key]


def _positive(value, key: str, where: str, kind=(int, float)) -> float:
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        raise ConfigError(f"{where}: key '{key}': {value!r} is not allowed; a positive number is needed")
    return value


def load_measured(path: str | Path) -> dict:
    """Read and check M.yaml: model {name, parameters, bytes_per_parameter}, per_worker_batch,
    throughput {N: images/s} with N=1; optional model.tensors and model.column_groups (1-bit's
    levels; taken from the layer profile when not given), model.matrices [[n, m], ...],
    model.layer_profile (a shipped architecture: the wait-free-backprop overlap)."""
    where = f"measurement file {path}"
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping with keys model, per_worker_batch, throughput")
    model = _require(data, "model", where)
    for key in ("name", "parameters", "bytes_per_parameter"):
        _require(model, key, where + " model")
    _positive(model["parameters"], "model.parameters", where, int)
    _positive(model["bytes_per_parameter"], "model.bytes_per_parameter", where, int)
    batch = _positive(_require(data, "per_worker_batch", where), "per_worker_batch", where, int)
    throughput = _require(data, "throughput", where)
    if not isinstance(throughput, dict) or not throughput:
        raise ConfigError(f"{where}: key 'throughput': {throughput!r} is not allowed; a mapping N -> images/s")
    measured = {}
    for n, value in throughput.items():
        try:
            workers = int(n)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: key 'throughput.{n}': N must be a whole number") from None
        measured[workers] = float(_positive(value, f"throughput.{n}", where))
    if 1 not in measured:
        raise ConfigError(f"{where}: key 'throughput': {sorted(measured)} has no N=1; the images/s of one "
                          f"worker is required (it calibrates the compute time)")
    layers = None
    if "layer_profile" in model:
        layers = layer_profiles.load(model["layer_profile"], f"{where}: key 'model.layer_profile'")
        mismatch = profile_mismatch(layers, model["parameters"])
        if mismatch:
            raise ConfigError(f"{where}: key 'model.layer_profile': {mismatch} (key 'model.parameters'); allowed: "
                              f"a profile within {PROFILE_PARAMETER_TOLERANCE:.0%} of the model's parameters")
    return {"model": model, "per_worker_batch": batch, "throughput": measured, "source": str(path), "layers": layers}


#: how far model.parameters may be from its layer profile's count (other heads, class counts)
PROFILE_PARAMETER_TOLERANCE = 0.10


def profile_mismatch(layers, parameters: int) -> str:
    """Why `layers` is not the network of `parameters` values ('' when it is): the bytes come
    from the parameter count, the timeline's shares from the profile, so both must be one network."""
    values = sum(v for v, _ in layers.tensors)
    if abs(values / parameters - 1) > PROFILE_PARAMETER_TOLERANCE:
        return f"{layers.name!r} has {values} parameters, the model {parameters}"
    return ""


def study_layers(model_name: str, parameters: int) -> tuple[LayerProfile | None, str]:
    """The shipped layer profile of a study's model, or None with the reason (then the
    hardware profile's fixed overlap holds): its name not shipped, or another network by
    its parameter count (e.g. LeNet-5 on 3-channel images)."""
    if model_name not in layer_profiles.names():
        return None, f"no layer profile of {model_name!r} is shipped ({', '.join(layer_profiles.names())})"
    layers = layer_profiles.load(model_name, "config key 'model'")
    mismatch = profile_mismatch(layers, parameters)
    return (None, f"the shipped layer profile does not fit: {mismatch}") if mismatch else (layers, "")


POWERSGD_MIN_COMPRESSION_RATE = 2  # torch's PowerSGDState default, which the strategy keeps


def powersgd_ratio(matrices: list, rank: int, min_compression_rate: float = POWERSGD_MIN_COMPRESSION_RATE) -> float:
    """Share of the gradient's values PowerSGD all-reduces: a matrix n x m goes as rank-r P
    (n x r) and Q (m x r) when that is smaller by `min_compression_rate` (torch's
    `_should_compress`), whole otherwise; a vector [n, 1] always goes whole."""
    total = sent = 0
    for n, m in matrices:
        total += n * m
        sent += (n + m) * rank if (n + m) * rank * min_compression_rate < n * m else n * m
    return sent / total


def workload_from_measured(measured: dict, rank: int = 2) -> Workload:
    model = measured["model"]
    batch = measured["per_worker_batch"]
    ratio = powersgd_ratio(model["matrices"], rank) if model.get("matrices") else None
    layers = measured.get("layers")
    tensors, groups = counts_for_onebit(layers)
    return Workload(parameters=int(model["parameters"]), bytes_per_parameter=int(model["bytes_per_parameter"]),
                    batch=batch, compute_s=batch / measured["throughput"][1],
                    tensors=int(model.get("tensors", tensors)), column_groups=int(model.get("column_groups", groups)),
                    powersgd_ratio=ratio, layers=layers)


def counts_for_onebit(layers) -> tuple[int, int]:
    """(tensors, column groups) of a layer profile, for 1-bit's levels; (0, 0) without one."""
    return (len(layers.tensors), layers.column_groups) if layers is not None else (0, 0)


def with_study_layers(workload: Workload, model_name: str) -> tuple[Workload, str]:
    """`workload` with the shipped layer profile of the study's model (the wait-free overlap)
    and 1-bit's counts from it; unchanged, with the reason, where none fits (study_layers)."""
    layers, why_not = study_layers(model_name, workload.parameters)
    if layers is None:
        return workload, why_not
    tensors, groups = counts_for_onebit(layers)
    return dataclasses.replace(workload, layers=layers, tensors=tensors, column_groups=groups), ""


# ----- a study's runs ------------------------------------------------------------------


def read_runs(paths: list[str | Path]) -> list[dict]:
    """The fields of metrics.json the model uses, one dict per run."""
    runs = []
    for path in paths:
        m = json.loads(Path(path).read_text())
        st = m["step_time"]
        runs.append({
            "strategy": m["strategy"], "workers": m["workers"], "seed": m["seed"], "throughput": m["throughput"],
            "compute_s": st["compute_s"], "comm_s": st["comm_s"], "data_s": st["data_s"], "total_s": st["total_s"],
            "bytes_per_step": m["bytes_per_step"], "per_worker_batch": m["per_worker_batch"],
            "oversubscribed": m["environment"].get("oversubscribed", False),
            "strategy_params": m.get("strategy_params", {}),
        })
    return runs


def workload_from_runs(runs: list[dict], parameters: int, tensors: int = 0) -> tuple[Workload, dict]:
    """Compute time per step from the N=1 runs (mean over strategies and seeds that train
    unwrapped at N=1: their step is forward, backward, update and batch assembly); PowerSGD's
    byte share from its measured bytes at N>1. Returns the workload and what it came from."""
    single = [r for r in runs if r["workers"] == 1 and r["comm_s"] == 0]
    if single:
        compute = sum(r["total_s"] + r["data_s"] for r in single) / len(single)
        what = f"mean step (total + data) of {len(single)} N=1 run(s) without exchange"
    else:  # no N=1: the per-worker compute (exchange excluded) at the smallest N that ran
        smallest = min(r["workers"] for r in runs)
        single = [r for r in runs if r["workers"] == smallest]
        compute = sum(r["compute_s"] + r["data_s"] for r in single) / len(single)
        what = f"mean per-worker compute + data of {len(single)} run(s) at N={smallest} (no N=1 ran)"
    batch = single[0]["per_worker_batch"]
    ratio = None
    powersgd = [r for r in runs if r["strategy"] == "allreduce_powersgd" and r["workers"] > 1]
    if powersgd:
        r = powersgd[0]
        ring = 2 * (r["workers"] - 1) / r["workers"] * parameters * 4
        ratio = r["bytes_per_step"] / ring
    workload = Workload(parameters=parameters, bytes_per_parameter=4, batch=batch, compute_s=compute,
                        tensors=tensors, powersgd_ratio=ratio)
    source = {"compute_s": what,
              "powersgd_ratio": "measured bytes_per_step" if ratio is not None else "not measured"}
    return workload, source


def matrices_from_checkpoint(path: str | Path) -> list[list[int]]:
    """The gradient's tensors of a run's model.pt as PowerSGD sees them: [shape[0], the rest]
    (vectors as [n, 1]): its floating tensors, batch-norm statistics left out, so that the
    products n x m sum to the model's parameter count; torch is imported here only."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return [[t.shape[0] if t.dim() else 1, t[0].numel() if t.dim() > 1 else 1] for k, t in state.items()
            if t.is_floating_point() and "running_" not in k]


#: the request a worker sends each shard before its gradient (ps_protocol.request: 4 float64)
PS_REQUEST_BYTES = 32


def parameters_from_runs(runs: list[dict]) -> int | None:
    """The model's parameter count, from the bytes a plain all-reduce run sent (2 (N-1)/N x 4 P)."""
    for r in runs:
        if r["strategy"] in ("allreduce", "easgd") and r["workers"] > 1 and r["bytes_per_step"] > 0:
            return round(r["bytes_per_step"] / (2 * (r["workers"] - 1) / r["workers"]) / 4)
        if r["strategy"] in ("ps_sync", "ps_async", "ps_backup", "ssp") and r["bytes_per_step"] > 0:
            headers = PS_REQUEST_BYTES * r.get("strategy_params", {}).get("shards", 1)
            return round((r["bytes_per_step"] - headers) / 4)  # the gradient, after a request per shard
    return None


def ps_request_from_runs(runs: list[dict], workload: Workload, machine, params: dict[str, dict]) -> tuple[float, str]:
    """The parameter-server protocol's own cost per round trip (Machine.ps_request_s): what
    the N=1 parameter-server runs measured of their exchange (a worker's comm_s: push, the
    shard's update, the reply) beyond what the model gives it from the links and the shard's
    update, averaged over those runs. Returns (seconds, what it came from); 0 when no such
    run is there. A run is a parameter server's when its knobs name shards."""
    single = [r for r in runs if r["workers"] == 1 and "shards" in r.get("strategy_params", {})]
    if not single:
        return 0.0, "not measured (no N=1 parameter-server run): 0"
    bare = dataclasses.replace(machine, ps_request_s=0.0)
    modelled = []
    for r in single:
        step = perfmodel.step(r["strategy"], workload, bare, 1, {**params.get(r["strategy"], {}), **r["strategy_params"]})
        modelled.append(step.step_s - step.compute_s)
    measured = sum(r["comm_s"] for r in single) / len(single)
    model = sum(modelled) / len(modelled)
    seconds = max(0.0, measured - model)
    return seconds, (f"measured: the mean exchange of {len(single)} N=1 parameter-server run(s), "
                     f"{measured * 1e3:.3g} ms a step, less the {model * 1e3:.3g} ms the links and the shard's "
                     f"update give it")


def with_ps_request(machine, profile: dict, runs: list[dict], workload: Workload, params: dict[str, dict]):
    """The machine with the profile's `ps_request_us: measured` calibrated on the study's
    runs (ps_request_from_runs), and what it came from; any other value stands as given
    (None: nothing calibrated)."""
    if profile.get("ps_request_us") != hardware.PS_REQUEST_MEASURED:
        return machine, None
    seconds, source = ps_request_from_runs(runs, workload, machine, params)
    return dataclasses.replace(machine, ps_request_s=seconds), source
