"""Calibration from measurements: alpha-beta fits, a measurement file (M.yaml), or a study's metrics.json files."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import yaml

from dtstudy.common import intervals
from dtstudy.errors import ConfigError
from dtstudy.perfmodel.collectives import ring_allreduce_bytes
from dtstudy.perfmodel.machine import LayerProfile, Link, Workload
from dtstudy.projection import hardware, layer_profiles
from dtstudy.strategies.specs import PARAMETER_SERVERS, SPECS, model_step


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


def p2p_link(intercept: float, slope: float) -> dict:
    """One-way message time t = alpha + m / B from the line t = intercept + slope m."""
    return {"latency_s": max(intercept, 0.0), "bandwidth": 1.0 / slope if slope > 0 else math.inf}


def allreduce_link(intercept: float, slope: float, participants: int) -> dict:
    """Per-link alpha and B of a ring all-reduce over p processes, t = 2 (p-1) alpha + 2 (p-1)/p m / B,
    from the line t = intercept + slope m."""
    p = participants
    return {
        "latency_s": max(intercept, 0.0) / (2 * (p - 1)),
        "bandwidth": 2 * (p - 1) / p / slope if slope > 0 else math.inf,
    }


def fit_p2p(points: list[list[float]]) -> dict:
    """One-way message time t = alpha + m / B: alpha (s) and B (bytes/s)."""
    return p2p_link(*least_squares_line(points))


def fit_allreduce(points: list[list[float]], participants: int) -> dict:
    """Ring all-reduce over p processes, t = 2 (p-1) alpha + 2 (p-1)/p m / B: per-link alpha and B."""
    return allreduce_link(*least_squares_line(points), participants)


def line_intervals(points: list[list[float]], level: float = intervals.LEVEL) -> tuple[tuple[float, float], ...] | None:
    """The least-squares line's intercept and slope, each as its (low, high) t interval with
    k - 2 degrees of freedom (scipy's standard errors); None below 3 points (no spread left
    to estimate)."""
    if len(points) < 3:
        return None
    from scipy import stats  # here: the train command imports this module, and scipy.stats costs it a second

    fit = stats.linregress([x for x, _ in points], [y for _, y in points])
    t = stats.t.ppf(0.5 + level / 2, len(points) - 2)
    return (
        (fit.intercept - t * fit.intercept_stderr, fit.intercept + t * fit.intercept_stderr),
        (fit.slope - t * fit.stderr, fit.slope + t * fit.stderr),
    )


def benchmark_link_ends(commbench: dict) -> tuple[dict, dict] | None:
    """This machine's links (Machine.intra from the all-reduce fit, intra_p2p from the send/recv
    fit) at the slow end (latency and time per byte at the top of their 95% intervals) and
    the fast end (both at the bottom), for the projection's band; None when the benchmark's
    points are not there (3 sizes or more each)."""
    ends = ({}, {})
    for key, field, link in (
        ("allreduce", "intra", lambda a, b: allreduce_link(a, b, commbench["processes"])),
        ("p2p", "intra_p2p", p2p_link),
    ):
        bounds = line_intervals(commbench.get(key) or [])
        if bounds is None:
            return None
        (low_a, high_a), (low_b, high_b) = bounds
        for end, (a, b) in zip(ends, ((high_a, high_b), (low_a, low_b))):
            fit = link(a, b)
            end[field] = Link(fit["latency_s"], fit["bandwidth"])
    return ends


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
        raise ConfigError(
            f"{where}: key 'throughput': {sorted(measured)} has no N=1; the images/s of one "
            f"worker is required (it calibrates the compute time)"
        )
    layers = None
    if "layer_profile" in model:
        layers = layer_profiles.load(model["layer_profile"], f"{where}: key 'model.layer_profile'")
        mismatch = profile_mismatch(layers, model["parameters"])
        if mismatch:
            raise ConfigError(
                f"{where}: key 'model.layer_profile': {mismatch} (key 'model.parameters'); allowed: "
                f"a profile within {PROFILE_PARAMETER_TOLERANCE:.0%} of the model's parameters"
            )
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


def as_matrices(matrices) -> tuple[tuple[int, int], ...]:
    """[[rows, columns], ...] (a measurement file's, a layer profile's or a checkpoint's) as
    Workload.matrices."""
    return tuple((int(n), int(m)) for n, m in matrices)


def workload_from_measured(measured: dict) -> Workload:
    model = measured["model"]
    batch = measured["per_worker_batch"]
    layers = measured.get("layers")
    tensors, groups = counts_for_onebit(layers)
    return Workload(
        parameters=int(model["parameters"]),
        bytes_per_parameter=int(model["bytes_per_parameter"]),
        batch=batch,
        compute_s=batch / measured["throughput"][1],
        tensors=int(model.get("tensors", tensors)),
        column_groups=int(model.get("column_groups", groups)),
        matrices=as_matrices(model["matrices"]) if model.get("matrices") else None,
        layers=layers,
    )


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
        runs.append(
            {
                "strategy": m["strategy"],
                "workers": m["workers"],
                "seed": m["seed"],
                "throughput": m["throughput"],
                "compute_s": st["compute_s"],
                "comm_s": st["comm_s"],
                "data_s": st["data_s"],
                "total_s": st["total_s"],
                "bytes_per_step": m["bytes_per_step"],
                "per_worker_batch": m["per_worker_batch"],
                "oversubscribed": m["environment"].get("oversubscribed", False),
                "strategy_params": m.get("strategy_params", {}),
                "variant": m.get("variant"),  # config `variants`: a strategy under its own recipe
            }
        )
    return runs


def compute_samples(runs: list[dict]) -> tuple[list[float], str]:
    """Each run's compute time per step that calibrates t_c, and what they are: the N=1 runs
    that train unwrapped (no exchange: their step is forward, backward, update and batch
    assembly), or without any, the per-worker compute (exchange excluded) at the smallest N
    that ran."""
    single = [r for r in runs if r["workers"] == 1 and r["comm_s"] == 0]
    if single:
        return [
            r["total_s"] + r["data_s"] for r in single
        ], f"step (total + data) of {len(single)} N=1 run(s) without exchange"
    smallest = min(r["workers"] for r in runs)
    single = [r for r in runs if r["workers"] == smallest]
    return (
        [r["compute_s"] + r["data_s"] for r in single],
        f"per-worker compute + data of {len(single)} run(s) at N={smallest} (no N=1 ran)",
    )


def workload_from_runs(runs: list[dict], parameters: int, tensors: int = 0) -> tuple[Workload, dict]:
    """Compute time per step: the mean of compute_samples (over strategies and seeds); the
    byte share of each strategy whose bytes depend on the model's shapes (needs_matrices)
    from its first run at N>1 (the fp32 gradient's ring all-reduce is 2 (N-1)/N x 4 bytes a
    parameter). Returns the workload and what it came from."""
    samples, what = compute_samples(runs)
    batch = min(runs, key=lambda r: r["workers"])["per_worker_batch"]
    shares = {}
    for r in runs:
        if SPECS[r["strategy"]].needs_matrices and r["workers"] > 1 and r["strategy"] not in shares:
            shares[r["strategy"]] = r["bytes_per_step"] / ring_allreduce_bytes(parameters * 4, r["workers"])
    workload = Workload(
        parameters=parameters,
        bytes_per_parameter=4,
        batch=batch,
        compute_s=sum(samples) / len(samples),
        tensors=tensors,
        measured_share=shares,
    )
    source = {"compute_s": "mean " + what}
    source.update(
        {f"{name} bytes": f"measured bytes_per_step: {share:.4g} of allreduce's" for name, share in shares.items()}
    )
    return workload, source


def matrices_from_checkpoint(path: str | Path) -> list[list[int]]:
    """The gradient's tensors of a run's model.pt as PowerSGD sees them: [shape[0], the rest]
    (vectors as [n, 1]): its floating tensors, batch-norm statistics left out, so that the
    products n x m sum to the model's parameter count; torch is imported here only."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return [
        [t.shape[0] if t.dim() else 1, t[0].numel() if t.dim() > 1 else 1]
        for k, t in state.items()
        if t.is_floating_point() and "running_" not in k
    ]


def linear_from_checkpoint(path: str | Path) -> tuple[tuple[int, int], ...]:
    """The fully connected layers of a run's model.pt, (inputs, outputs) in the checkpoint's
    order: its 2-d weights (convolutions' are 4-d), for hybrid where no layer profile fits."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return tuple((t.shape[1], t.shape[0]) for k, t in state.items() if k.endswith("weight") and t.dim() == 2)


def parameters_from_runs(runs: list[dict]) -> int | None:
    """The model's parameter count, from the bytes the first run whose strategy can say it
    sent (its spec's parameters_from_bytes: e.g. a plain all-reduce's 2 (N-1)/N x 4 P)."""
    for r in runs:
        parameters = SPECS[r["strategy"]].parameters_from_bytes(
            r["bytes_per_step"], r["workers"], r.get("strategy_params", {})
        )
        if parameters is not None:
            return parameters
    return None


def ps_request_samples(
    runs: list[dict], workload: Workload, machine, params: dict[str, dict]
) -> list[tuple[float, float]]:
    """(measured, modelled) exchange of each N=1 parameter-server run: a worker's comm_s (push,
    the shard's update, the reply) and what the model gives it from `machine`'s links and the
    shard's update; r is what the first has beyond the second."""
    bare = dataclasses.replace(machine, ps_request_s=0.0)
    pairs = []
    for r in runs:
        if r["workers"] == 1 and r["strategy"] in PARAMETER_SERVERS:
            step = model_step(
                r["strategy"], workload, bare, 1, {**params.get(r["strategy"], {}), **r["strategy_params"]}
            )
            pairs.append((r["comm_s"], step.step_s - step.compute_s))
    return pairs


def ps_request_from_runs(runs: list[dict], workload: Workload, machine, params: dict[str, dict]) -> tuple[float, str]:
    """The parameter-server protocol's own cost per round trip (Machine.ps_request_s): the
    mean over ps_request_samples of measured less modelled. Returns (seconds, what it came
    from); 0 when no N=1 parameter-server run is there."""
    pairs = ps_request_samples(runs, workload, machine, params)
    if not pairs:
        return 0.0, "not measured (no N=1 parameter-server run): 0"
    measured = sum(m for m, _ in pairs) / len(pairs)
    model = sum(x for _, x in pairs) / len(pairs)
    return max(0.0, measured - model), (
        f"measured: the mean exchange of {len(pairs)} N=1 parameter-server run(s), "
        f"{measured * 1e3:.3g} ms a step, less the {model * 1e3:.3g} ms the links "
        f"and the shard's update give it"
    )


def with_ps_request(machine, profile: dict, runs: list[dict], workload: Workload, params: dict[str, dict]):
    """The machine with the profile's `ps_request_us: measured` calibrated on the study's
    runs (ps_request_from_runs), and what it came from; any other value stands as given
    (None: nothing calibrated)."""
    if profile.get("ps_request_us") != hardware.PS_REQUEST_MEASURED:
        return machine, None
    seconds, source = ps_request_from_runs(runs, workload, machine, params)
    return dataclasses.replace(machine, ps_request_s=seconds), source


# ----- the projection's band: the model at the ends of its measured inputs' intervals ----------


def _ends(interval: intervals.Interval) -> tuple[float, ...]:
    """An interval's two ends, or its value alone when it has none (measured once)."""
    if math.isnan(interval.low):
        return (interval.value,)
    return interval.low, interval.high


def band_variants(
    workload: Workload, machine, profile: dict, runs: list[dict], params: dict[str, dict], commbench: dict | None
) -> tuple[list[tuple[Workload, object]], str]:
    """The (workload, machine) pairs at the corners of the measured inputs' 95% intervals:
    t_c over its runs (intervals.mean_interval of compute_samples: a t interval from 3
    runs, their range with 2), this machine's links (benchmark_link_ends) where the profile
    says `intra_node: measured`, and r where it says `ps_request_us: measured` (the interval
    of ps_request_samples, taken again at each end of the links, which r is measured beyond).
    Inputs a profile gives, and the benchmark's kernels, jitter and compute slowdown
    (medians of one benchmark), do not vary. Returns the variants and what they span."""
    samples, _ = compute_samples(runs)
    compute = intervals.mean_interval(samples)
    spans = [f"t_c {intervals.format_interval(compute, '.4g')} s ({compute.kind}, {compute.n} runs)"]
    links = [{}]
    if hardware.measured_here(profile) and commbench is not None:
        ends = benchmark_link_ends(commbench)
        if ends is not None:
            links = list(ends)
            slow, fast = ends
            spans.append(
                f"this machine's all-reduce link {fast['intra'].latency_s * 1e6:.3g}-"
                f"{slow['intra'].latency_s * 1e6:.3g} us, {slow['intra'].bandwidth / 1e9:.3g}-"
                f"{fast['intra'].bandwidth / 1e9:.3g} GB/s and send/recv link "
                f"{fast['intra_p2p'].latency_s * 1e6:.3g}-{slow['intra_p2p'].latency_s * 1e6:.3g} us, "
                f"{slow['intra_p2p'].bandwidth / 1e9:.3g}-{fast['intra_p2p'].bandwidth / 1e9:.3g} GB/s "
                f"(t intervals of the benchmark's least-squares fits)"
            )
    measured_request = profile.get("ps_request_us") == hardware.PS_REQUEST_MEASURED
    variants, request_varied = [], False
    for t_c, link in itertools.product(_ends(compute), links):
        trial_workload = dataclasses.replace(workload, compute_s=t_c)
        trial_machine = dataclasses.replace(machine, **link)
        requests = (trial_machine.ps_request_s,)
        pairs = ps_request_samples(runs, trial_workload, trial_machine, params) if measured_request else []
        if pairs:
            requests = tuple(max(0.0, x) for x in _ends(intervals.mean_interval([m - x for m, x in pairs])))
            request_varied = True
        variants += [(trial_workload, dataclasses.replace(trial_machine, ps_request_s=r)) for r in requests]
    if request_varied:
        spans.append("r over the N=1 parameter-server runs at each end of the links")
    return variants, "; ".join(spans)
