"""Projected throughput and efficiency per strategy and N: tables, plot, the `project` command and rule."""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
from collections.abc import Iterable
from pathlib import Path

from dtstudy.analysis.pages import write_page
from dtstudy.common import intervals
from dtstudy.common.run_folder import RunFolder
from dtstudy.errors import ConfigError
from dtstudy.perfmodel.machine import NO_STRAGGLERS, Link, Machine, Stragglers, Workload
from dtstudy.projection import calibration, hardware, layer_profiles
from dtstudy.strategies.specs import REFERENCE_STRATEGY, SPECS, knob_defaults, model_step

COLUMNS = [
    "strategy",
    "workers",
    "throughput",
    "efficiency",
    "speedup",
    "step_compute_s",
    "step_exchange_s",
    "bound",
    "profile",
    "step_s",
    "exchange_total_s",
    "server_s",
    "straggler_s",
    "measured_throughput",
    "measured_exchange_s",
    "overlap",
    "throughput_low",
    "throughput_high",
    "efficiency_low",
    "efficiency_high",
    "measured_throughput_low",
    "measured_throughput_high",
]


def parse_list(text: str, what: str, allowed: list[str] | None = None, kind=str) -> list:
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise ConfigError(f"--{what}: {text!r} is empty")
    out = []
    for item in items:
        if allowed is not None and item not in allowed:
            raise ConfigError(f"--{what}: unknown strategy {item!r}; allowed: {', '.join(sorted(allowed))}")
        try:
            value = kind(item)
        except ValueError:
            raise ConfigError(f"--{what}: {item!r} is not a whole number") from None
        if kind is int and value < 1:
            raise ConfigError(f"--{what}: {value} is not allowed; worker counts are whole numbers >= 1")
        out.append(value)
    return out


def fit_intra(workload: Workload, machine: Machine, strategy: str, params: dict, throughput: float) -> Link:
    """The intra-node bandwidth with which `strategy` at N = gpus_per_node runs at the measured
    `throughput` (bisection on log bandwidth; latency 0). Faster than the model without any
    exchange cost: an unlimited link."""
    g = machine.gpus_per_node

    def modelled(bandwidth: float) -> float:
        trial = dataclasses.replace(machine, intra=Link(0.0, bandwidth), intra_p2p=None)
        return model_step(strategy, workload, trial, g, params).throughput

    low, high = 1e6, 1e14
    if modelled(high) <= throughput:
        return Link(0.0, float("inf"))
    if modelled(low) >= throughput:
        return Link(0.0, low)
    for _ in range(100):
        mid = math.sqrt(low * high)
        if modelled(mid) < throughput:
            low = mid
        else:
            high = mid
    return Link(0.0, high)


def project(
    workload: Workload,
    machine: Machine,
    strategies: list[str],
    workers: list[int],
    params: dict,
    profile: str,
    stragglers: Stragglers = NO_STRAGGLERS,
    measured: dict | None = None,
    measured_exchange: dict | None = None,
    band: list[tuple[Workload, Machine]] | None = None,
) -> list[dict]:
    """One row per strategy and N (COLUMNS); efficiency and speedup against the same strategy's
    modelled N=1. `measured`: {(strategy, N): images/s, or an intervals.Interval over the
    runs}, `measured_exchange`: {(strategy, N): comm seconds per step}, to put beside.
    `band`: (workload, machine) variants (calibration.band_variants); each row's
    throughput and efficiency low/high are the least and the most of them over the variants
    and the row itself ('' without a band)."""
    rows = []
    measured = measured or {}
    measured_exchange = measured_exchange or {}
    for name in strategies:
        single = model_step(name, workload, machine, 1, params[name], stragglers).throughput
        singles = [model_step(name, w, m, 1, params[name], stragglers).throughput for w, m in band or []]
        for n in workers:
            s = model_step(name, workload, machine, n, params[name], stragglers)
            seen = measured.get((name, n), "")
            spread = seen if isinstance(seen, intervals.Interval) else None
            row = {
                "strategy": name,
                "workers": n,
                "throughput": s.throughput,
                "efficiency": s.throughput / (n * single),
                "speedup": s.throughput / single,
                "step_compute_s": s.compute_s,
                "step_exchange_s": s.exposed_s,
                "bound": s.bound,
                "profile": profile,
                "step_s": s.step_s,
                "exchange_total_s": s.exchange_s,
                "server_s": s.server_s,
                "straggler_s": s.straggler_s,
                "measured_throughput": spread.value if spread else seen,
                "measured_exchange_s": measured_exchange.get((name, n), ""),
                "overlap": s.overlap,
                "measured_throughput_low": spread.low if spread and spread.kind != "none" else "",
                "measured_throughput_high": spread.high if spread and spread.kind != "none" else "",
            }
            if band:
                throughputs = [s.throughput] + [
                    model_step(name, w, m, n, params[name], stragglers).throughput for w, m in band
                ]
                efficiencies = [row["efficiency"]] + [t / (n * one) for t, one in zip(throughputs[1:], singles)]
                row.update(
                    throughput_low=min(throughputs),
                    throughput_high=max(throughputs),
                    efficiency_low=min(efficiencies),
                    efficiency_high=max(efficiencies),
                )
            else:
                row.update(throughput_low="", throughput_high="", efficiency_low="", efficiency_high="")
            rows.append(row)
    return rows


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_csv(rows: list[dict], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _fmt(row[k]) for k in COLUMNS})


def _number(value: float) -> str:
    """Four significant digits, but whole numbers of images/s in full (14640, not 1.464e+04)."""
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _bounds(row: dict, key: str, fmt) -> str:
    """' [low, high]' of a projected value's band, ' (low-high)' of a measured one's spread, or ''
    (none, or no width at this precision)."""
    low, high = row.get(f"{key}_low", ""), row.get(f"{key}_high", "")
    if low == "" or fmt(low) == fmt(high):
        return ""
    return f" ({fmt(low)}–{fmt(high)})" if key.startswith("measured") else f" [{fmt(low)}, {fmt(high)}]"


def write_markdown(rows: list[dict], path: str | Path, provenances: dict[str, dict]) -> None:
    """A section per profile: its rows, then where each of its parameters came from."""
    shown = [
        "strategy",
        "workers",
        "throughput",
        "efficiency",
        "speedup",
        "step_compute_s",
        "step_exchange_s",
        "bound",
        "overlap",
        "measured_throughput",
        "measured_exchange_s",
    ]
    lines = ["# Projected throughput (alpha-beta model)", ""]
    for profile, provenance in provenances.items():
        lines += [f"## Profile: {profile}", "", "| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
        for row in (r for r in rows if r["profile"] == profile):
            cells = []
            for key in shown:
                value = row[key]
                if key == "efficiency" and isinstance(value, float):
                    cells.append(f"{100 * value:.1f}%" + _bounds(row, key, lambda x: f"{100 * x:.1f}%"))
                elif isinstance(value, float):
                    cells.append(_number(value) + _bounds(row, key, _number))
                else:
                    cells.append(str(value))
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", f"Where each parameter of {profile} came from:", ""]
        lines += [f"- {key}: {value}" for key, value in provenance.items()]
        lines.append("")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines))


def _measured_errors(points: list[dict]) -> list[list[float]]:
    """Error bars below and above each measured point: its runs' spread (0 for a single run)."""

    def side(row: dict, which: str) -> float:
        if row["measured_throughput_low"] == "":
            return 0.0
        return abs(row[f"measured_throughput_{which}"] - row["measured_throughput"])

    return [[side(r, "low") for r in points], [side(r, "high") for r in points]]


# a panel's strategies told apart where their lines coincide (fp16 and bf16 often do): each its
# marker, line style and a smaller marker than the one drawn before it
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
LINESTYLES = ("-", "--", "-.", ":")


def _family_of(name: str) -> str:
    return SPECS[name].family if name in SPECS else "unknown"


def _projection_panels(strategies: list[str]) -> tuple[list[str], list[str]]:
    """The families of `strategies` with a panel each (the reference, no_exchange, is drawn on
    every panel as the ceiling), and the strategies drawn on every panel beside their own."""
    from dtstudy.analysis.tables import BASELINE_STRATEGY

    families = list(dict.fromkeys(_family_of(name) for name in strategies if name != REFERENCE_STRATEGY))
    shared = [name for name in (BASELINE_STRATEGY, REFERENCE_STRATEGY) if name in strategies]
    return families or ["reference"], shared


def _draw_strategy(ax_thr, ax_eff, mine: list[dict], style: dict) -> None:
    """One strategy's projected lines (and band), its measured points on top."""
    n = [r["workers"] for r in mine]
    ax_thr.plot(n, [r["throughput"] for r in mine], **style)
    ax_eff.plot(n, [100 * r["efficiency"] for r in mine], **style)
    color = style["color"]
    if mine[0]["throughput_low"] != "":  # the band: the model over its inputs' intervals
        ax_thr.fill_between(
            n,
            [r["throughput_low"] for r in mine],
            [r["throughput_high"] for r in mine],
            color=color,
            alpha=0.12,
            linewidth=0,
        )
        ax_eff.fill_between(
            n,
            [100 * r["efficiency_low"] for r in mine],
            [100 * r["efficiency_high"] for r in mine],
            color=color,
            alpha=0.12,
            linewidth=0,
        )
    points = [r for r in mine if r["measured_throughput"] != ""]
    if not points:
        return
    x, y = [r["workers"] for r in points], [r["measured_throughput"] for r in points]
    spread = _measured_errors(points)
    marker = style.get("marker", "o")
    ax_thr.errorbar(x, y, yerr=spread, fmt=marker, color=color, mfc="white", capsize=3)
    single = next(
        (r["measured_throughput"] for r in mine if r["workers"] == 1 and r["measured_throughput"] != ""), None
    )
    if single:  # the measured efficiency; its bars: the runs' spread at N over the mean at N=1
        scale = [100 / (k * single) for k in x]
        ax_eff.errorbar(
            x,
            [v * f for v, f in zip(y, scale)],
            yerr=[[e * f for e, f in zip(side, scale)] for side in spread],
            fmt=marker,
            color=color,
            mfc="white",
            capsize=3,
        )


def plot(
    rows: list[dict], path: str | Path, units: dict[str, str] | None = None, measured_kinds: Iterable[str] = ()
) -> None:
    """Throughput and efficiency vs N (log N): two rows per profile, a panel per strategy family
    (allreduce grey and the ceiling dotted on every panel), the projected lines with distinct
    markers, the measured points on top (open markers). `units`: {profile: what its N counts,
    e.g. "GPUs"}; `measured_kinds`: the kinds of interval of the measured points (t95, range)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dtstudy.analysis.figures import DRAWN

    units = units or {}
    profiles = list(dict.fromkeys(r["profile"] for r in rows)) or [""]
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    families, shared = _projection_panels(strategies)
    fig, axes = plt.subplots(
        2 * len(profiles),
        len(families),
        figsize=(4.6 * len(families), 3.6 * 2 * len(profiles)),
        squeeze=False,
        layout="constrained",
    )
    for p, profile in enumerate(profiles):
        for f, family in enumerate(families):
            ax_thr, ax_eff = axes[2 * p][f], axes[2 * p + 1][f]
            own = [name for name in strategies if _family_of(name) == family and name != REFERENCE_STRATEGY]
            drawn = own + [name for name in shared if name not in own]
            for i, name in enumerate(drawn):
                mine = [r for r in rows if r["strategy"] == name and r["profile"] == profile]
                if not mine:
                    continue
                if name in own:
                    style = {
                        "color": plt.cm.tab10(i % 10),
                        "marker": MARKERS[i % len(MARKERS)],
                        "markersize": max(2.5, 6 - 1.5 * i),
                        "linestyle": LINESTYLES[i % len(LINESTYLES)],
                        "label": name,
                    }
                elif name == REFERENCE_STRATEGY:
                    style = {"color": "black", "linestyle": ":", "label": "ceiling (no_exchange)"}
                else:
                    style = {"color": "grey", "linestyle": "-", "linewidth": 1, "label": name}
                _draw_strategy(ax_thr, ax_eff, mine, style)
            for ax in (ax_thr, ax_eff):
                ax.set_xscale("log", base=2)
                ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda n, _position: f"{n:g}"))
                ax.set_xlabel(f"{DRAWN['projection'].x_label} ({units.get(profile, 'GPUs')})")
                ax.grid(True, which="both", alpha=0.3)
            ax_thr.set_yscale("log")
            ax_thr.set_ylabel("images/s (all workers)")
            ax_eff.set_ylabel("efficiency S(N)/N (%)")
            ax_thr.set_title(f"{profile}: {family}", fontsize=10)
            ax_eff.set_title(f"{profile}: {family}, efficiency", fontsize=10)
            ax_thr.legend(fontsize=7, loc="upper left")
    banded = ["band"] if any(r["throughput_low"] != "" for r in rows) else []
    fig.suptitle(
        DRAWN["projection"].title(
            "open markers: measured on the machine the runs ran on", banded + list(measured_kinds)
        ),
        wrap=True,
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----- the command: a measurement file and a hardware file, no study -------------------------


def run_command(
    measured_path: str, hardware_path: str, strategies_text: str, workers_text: str, out: str
) -> list[dict]:
    """`python -m dtstudy project`: every input checked before any work."""
    defaults = knob_defaults()
    strategies = parse_list(strategies_text, "strategies", allowed=sorted(SPECS))
    workers = parse_list(workers_text, "workers", kind=int)
    measured = calibration.load_measured(measured_path)
    profile = hardware.load_profile(hardware_path)
    params = hardware.profile_strategy_params(profile, strategies, defaults)
    stragglers = hardware.profile_stragglers(profile)
    machine, provenance, needs_fit = hardware.machine_from_profile(profile)
    if profile.get("ps_request_us") == hardware.PS_REQUEST_MEASURED:
        raise ConfigError(
            f"hardware profile {hardware_path}: key 'ps_request_us': 'measured' needs a study's N=1 "
            f"parameter-server runs; give a number of microseconds (0: not modelled)"
        )
    measured, layers_from = with_named_profile(measured)
    workload = calibration.workload_from_measured(measured)
    needing = [name for name in strategies if SPECS[name].needs_matrices]
    if needing and workload.matrices is None:
        raise ConfigError(
            f"measurement file {measured_path}: key 'model.matrices' is missing; {', '.join(needing)} "
            f"need(s) the model's weight matrices [[rows, columns], ...] for its bytes"
        )
    needing = [name for name in strategies if SPECS[name].needs_fully_connected]
    if needing and not workload.fully_connected:
        raise ConfigError(
            f"measurement file {measured_path}: key 'model.layer_profile' is missing; "
            f"{', '.join(needing)} need(s) the model's fully connected layers, which a layer profile "
            f"lists (allowed: {', '.join(layer_profiles.names())})"
        )
    g = machine.gpus_per_node
    measured_strategy = measured.get("strategy", "allreduce")
    if needs_fit:
        if g not in measured["throughput"]:
            raise ConfigError(
                f"hardware profile {hardware_path}: key 'intra_node' is missing and measurement file "
                f"{measured_path} has no throughput at N = gpus_per_node = {g}; give one of them"
            )
        knobs = hardware.profile_strategy_params(profile, [measured_strategy], defaults)[measured_strategy]
        fitted = fit_intra(workload, machine, measured_strategy, knobs, measured["throughput"][g])
        machine = dataclasses.replace(machine, intra=fitted)
        provenance["intra_node"] = (
            f"fitted: {fitted.bandwidth / 1e9:.4g} GB/s per GPU makes {measured_strategy} "
            f"at N={g} run at the measured {measured['throughput'][g]:g} images/s"
        )
    provenance["compute_s"] = (
        f"measured: per_worker_batch / throughput at N=1 = {workload.compute_s:.4g} s ({measured_path})"
    )
    provenance["overlap"] = overlap_source(workload, machine, layers_from, layers_from)
    observed = {(measured_strategy, n): thr for n, thr in measured["throughput"].items()}
    provenance["stragglers"] = (
        f"profile: {stragglers}; the expected wait over the slow workers' delays"
        if stragglers
        else "none (no key 'stragglers' in the hardware profile)"
    )
    rows = project(
        workload,
        machine,
        strategies,
        workers,
        params,
        profile["name"],
        Stragglers.from_config(stragglers),
        measured=observed,
    )
    write_csv(rows, out)
    md = Path(out).with_suffix(".md")
    write_markdown(rows, md, {profile["name"]: provenance})
    return rows


def with_named_profile(measured: dict) -> tuple[dict, str]:
    """A measurement file (calibration.load_measured) with its layer profile: model.layer_profile,
    or else the shipped profile its model's name names (resnet152) where its parameter count
    fits; and where the profile came from, or why there is none (then the fixed overlap holds)."""
    if measured["layers"] is not None:
        return measured, "model.layer_profile"
    name = measured["model"]["name"]
    layers, why_not = calibration.study_layers(name, int(measured["model"]["parameters"]))
    if layers is None:
        return measured, f"model.layer_profile not given and model.name names none: {why_not}"
    return {**measured, "layers": layers}, (
        f"model.name {name!r}, a shipped layer profile; model.layer_profile not given"
    )


def overlap_source(workload, machine, key: str, without: str) -> str:
    """Where the overlap of the exchange behind backward came from, for the provenance."""
    layers = workload.layers
    if layers is None:
        return f"the hardware profile's fixed overlap, {machine.overlap:g} of compute: {without}"
    return (
        f"wait-free backprop on the layer profile {layers.name!r} ({key}; dtstudy/layer_profiles.json, "
        f"FLOPs by torch.utils.flop_counter): backward {layers.backward_share:.3g} of t_c, each bucket's "
        f"exchange starts when backprop has produced it; the hardware profile's fixed overlap is unused; "
        f"1-bit's levels: {len(layers.tensors)} tensors, {layers.column_groups} column groups"
    )


# ----- the workflow rule: the study's runs, this machine's benchmark, a profile -----------------


def run_study(
    metrics: list[str], commbench_path: str, config: dict, table: str, table_md: str, plot_path: str
) -> list[dict]:
    """The `project` rule: calibrate on the study's runs and this machine's benchmark, project
    every strategy of the study to projection.workers on each profile of projection.hardware.
    A variant (config `variants`: a strategy under its own recipe) is neither projected nor
    calibrated on: the projection is of the study's strategies under the study's recipe."""
    settings = config["projection"]
    variants = config.get("variants", {})
    config = {**config, "strategies": [name for name in config["strategies"] if name not in variants]}
    runs = [run for run in calibration.read_runs(metrics) if not run["variant"]]

    def model() -> Path:  # a run's final model: its weights where the runs' bytes do not say
        return RunFolder(Path(metrics[0]).parent).model

    matrices = functools.cache(lambda: calibration.matrices_from_checkpoint(model()))

    parameters = calibration.parameters_from_runs(runs)
    counted = "from the bytes a run sent per step"
    if parameters is None:  # no plain exchange ran: count the checkpoint's values
        parameters = sum(n * m for n, m in matrices())
        counted = "counted in a run's model.pt"
    workload, provenance = calibration.workload_from_runs(runs, parameters)
    workload, why_not = calibration.with_study_layers(workload, config["model"])
    provenance["model_parameters"] = f"{parameters} ({counted})"
    if any(SPECS[name].needs_fully_connected for name in config["strategies"]):
        if not workload.fully_connected:  # no layer profile fits: the 2-d weights of a run's model.pt
            workload = dataclasses.replace(workload, linear=calibration.linear_from_checkpoint(model()))
        source = "the layer profile" if workload.linear is None else "the 2-d weights of a run's model.pt"
        provenance["fully_connected"] = (
            f"the fully connected layers, (inputs, outputs): "
            f"{[list(layer) for layer in workload.fully_connected]} ({source})"
        )
    commbench = hardware.load_commbench(commbench_path)
    by_run: dict[tuple, list[dict]] = {}
    for r in runs:
        by_run.setdefault((r["strategy"], r["workers"]), []).append(r)
    measured = {key: intervals.mean_interval([r["throughput"] for r in v]) for key, v in by_run.items()}
    measured_exchange = {key: sum(r["comm_s"] for r in v) / len(v) for key, v in by_run.items()}
    rows, provenances = [], {}
    for name in hardware.profile_names(settings["hardware"]):
        profile = hardware.load_profile(name)
        profile_rows, provenances[profile["name"]] = _project_study_on(
            profile, workload, dict(provenance), why_not, runs, matrices, commbench, config, measured, measured_exchange
        )
        rows += profile_rows
    write_csv(rows, table)
    write_markdown(rows, table_md, provenances)
    write_page(table_md)  # the report's page of it
    units = {
        profile["name"]: "processes on this machine" if hardware.measured_here(profile) else "GPUs"
        for profile in map(hardware.load_profile, hardware.profile_names(settings["hardware"]))
    }
    plot(rows, plot_path, units, sorted({interval.kind for interval in measured.values()} & {"t95", "range"}))
    return rows


def _project_study_on(
    profile: dict,
    workload: Workload,
    provenance: dict,
    why_not: str,
    runs: list[dict],
    matrices,
    commbench: dict,
    config: dict,
    measured: dict,
    measured_exchange: dict,
) -> tuple[list[dict], dict]:
    """One profile of the `project` rule: its rows and where each parameter came from."""
    strategies = list(config["strategies"])
    params = hardware.profile_strategy_params(profile, strategies, knob_defaults())
    for name in strategies:  # the study's own knobs win over the profile's
        params[name].update(config.get("strategy_params", {}).get(name, {}))
    unmeasured = [name for name in strategies if SPECS[name].needs_matrices and name not in workload.measured_share]
    if unmeasured and workload.matrices is None:
        # none of their runs exchanged anything (N=1 only): their bytes from the model's matrices
        workload = dataclasses.replace(workload, matrices=calibration.as_matrices(matrices()))
        provenance["matrices"] = (
            "the model's matrices in a run's model.pt, for "
            + "; ".join(f"{name} at its knobs {params[name]}" for name in unmeasured)
            + " (none of their runs at N > 1)"
        )
    machine, machine_source = hardware.study_machine(profile, commbench)
    provenance.update(machine_source)
    machine, request_source = calibration.with_ps_request(machine, profile, runs, workload, params)
    if request_source:
        provenance["ps_request"] = request_source
    provenance["overlap"] = overlap_source(workload, machine, "config key 'model'", why_not)
    band, spans = calibration.band_variants(workload, machine, profile, runs, params, commbench)
    provenance["band"] = (
        f"throughput and efficiency [low, high]: the least and the most the model gives over "
        f"the corners of its measured inputs' 95% intervals: {spans}; the profile's given values "
        f"and the benchmark's kernels, jitter and compute slowdown held; measured (low-high): "
        f"the runs' mean with its t interval (3 seeds or more) or range (2)"
    )
    # the runs compare only with the machine they ran on, and only up to its cores: more
    # workers than cores ran oversubscribed here, while the projection spreads them over nodes
    here = hardware.measured_here(profile)
    largest = machine.gpus_per_node if here else 0
    measured = {key: value for key, value in measured.items() if key[1] <= largest}
    measured_exchange = {key: value for key, value in measured_exchange.items() if key[1] <= largest}
    provenance["measured"] = (
        f"the study's runs at N <= {largest}, beside the profile measured on the machine that ran them"
        if here
        else "none: this profile is another machine than the one the runs ran on"
    )
    workers = sorted(set(config["projection"]["workers"]))
    rows = project(
        workload,
        machine,
        strategies,
        workers,
        params,
        profile["name"],
        Stragglers.from_config(config.get("stragglers")),
        measured,
        measured_exchange,
        band,
    )
    return rows, provenance
