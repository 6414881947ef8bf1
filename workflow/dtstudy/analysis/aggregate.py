"""Scaling and accuracy tables, plots and the MLflow study run, from the finished runs.

Input: one folder per training run, results/runs/{strategy}/n{workers}/seed{seed}/,
holding metrics.json (written by training) and eval.json (written by evaluation).

Every cell comes with its uncertainty (dtstudy.analysis.intervals): throughput, speedup and
efficiency with a bootstrap 95% CI over the timed windows of every seed; accuracy with a
t 95% CI over seeds (3 or more), or the range of 2 seeds, and the paired difference to
allreduce at the same N and seed. The machine's own noise (the N=1 rows are identical
work) and its ceiling (no_exchange: N loops that exchange nothing) are reported beside.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dtstudy.analysis import intervals
from dtstudy.tracking import mlflow_store
from dtstudy.atomic_files import atomic_write, write_text
from dtstudy.analysis.intervals import Interval
from dtstudy.strategies.specs import FAMILIES, REFERENCE_STRATEGY, SPECS

BASELINE_STRATEGY = "allreduce"
FAMILY_OF = {name: spec.family for name, spec in SPECS.items()}
GAP_POINTS = 3  # a strategy more than this many points of top-1 below allreduce is marked
SCALING_COLUMNS = ["strategy", "family", "workers", "seeds", "windows",
                   "throughput", "throughput_low", "throughput_high",
                   "speedup", "speedup_low", "speedup_high",
                   "efficiency", "efficiency_low", "efficiency_high", "ceiling_efficiency",
                   "efficiency_vs_ceiling", "efficiency_vs_ceiling_low", "efficiency_vs_ceiling_high",
                   "speedup_vs_allreduce_1", "compute_s", "comm_s", "bytes_per_step", "oversubscribed", "pinned"]
ACCURACY_COLUMNS = ["strategy", "family", "workers", "seeds", "top1", "top1_low", "top1_high", "top1_interval",
                    "top5", "top5_low", "top5_high",
                    "top1_vs_allreduce", "top1_vs_allreduce_low", "top1_vs_allreduce_high", "paired_seeds",
                    "below_allreduce", "time_to_accuracy_s", "reached_target"]
OVERSUBSCRIBED_NOTE = ("Note: rows marked oversubscribed ran more workers than CPU cores, "
                       "so their throughput (and timings) are not meaningful.")
_FLOAT_FORMATS = {"throughput": ".1f", "throughput_low": ".1f", "throughput_high": ".1f", "bytes_per_step": ".0f",
                  "compute_s": ".5f", "comm_s": ".5f", "time_to_accuracy_s": ".1f"}
_DEFAULT_FLOAT_FORMAT = ".4f"


def log(message: str) -> None:
    print(f"[aggregate] {message}", flush=True)


# --- arithmetic -----------------------------------------------------------------------

def speedup(throughput: float, base_throughput: float | None) -> float:
    """S = thr / thr_base; NaN when there is no usable baseline."""
    if base_throughput is None or not base_throughput > 0:  # also catches NaN
        return math.nan
    return throughput / base_throughput


def efficiency(speedup_value: float, workers: int) -> float:
    """E(N) = S(N) / N."""
    return speedup_value / workers


def sample_std(values: Iterable[float]) -> float:
    """Standard deviation with ddof=1; 0.0 for a single value (no spread to estimate)."""
    values = [float(v) for v in values]
    if len(values) < 2:
        return 0.0
    return float(np.std(values, ddof=1))


def mean_of_reached(times: Iterable[float | None]) -> float:
    """Mean time-to-accuracy over the runs that reached the target; NaN if none did."""
    reached = [float(t) for t in times if t is not None and not pd.isna(t)]
    return float(np.mean(reached)) if reached else math.nan


# --- loading --------------------------------------------------------------------------

def read_json(path: str | Path) -> dict:
    """A JSON object from `path`; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"missing run file: {path}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"unreadable JSON in {path}: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _field(data: Mapping, key: str, path: Path, convert=float):
    """data[key] converted; a missing key or a bad value is an error naming the file."""
    if key not in data:
        raise ValueError(f"{path}: missing key {key!r}")
    try:
        return convert(data[key])
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: bad value for {key!r}: {data[key]!r}") from error


def _run_row(run_dir: Path) -> dict:
    metrics_path, eval_path = run_dir / "metrics.json", run_dir / "eval.json"
    metrics, evaluation = read_json(metrics_path), read_json(eval_path)
    step_time = _field(metrics, "step_time", metrics_path, convert=dict)
    run_id = (metrics.get("mlflow") or {}).get("run_id") or evaluation.get("mlflow_run_id")
    time_to_accuracy = metrics.get("time_to_accuracy_s")
    throughput = _field(metrics, "throughput_median" if "throughput_median" in metrics else "throughput", metrics_path)
    return {
        "strategy": _field(metrics, "strategy", metrics_path, convert=str),
        "workers": _field(metrics, "workers", metrics_path, convert=int),
        "seed": _field(metrics, "seed", metrics_path, convert=int),
        "family": FAMILY_OF.get(metrics.get("strategy"), "unknown"),
        "throughput": throughput,
        # runs recorded before timed windows count as one window: their mean
        "windows": [float(w) for w in metrics.get("throughput_windows") or [throughput]],
        "compute_s": _field(step_time, "compute_s", metrics_path),
        "comm_s": _field(step_time, "comm_s", metrics_path),
        "bytes_per_step": _field(metrics, "bytes_per_step", metrics_path),
        "top1": _field(evaluation, "top1", eval_path),
        "top5": _field(evaluation, "top5", eval_path),
        "time_to_accuracy_s": math.nan if time_to_accuracy is None else float(time_to_accuracy),
        "wall_time_s": _field(metrics, "wall_time_s", metrics_path),
        "oversubscribed": bool((metrics.get("environment") or {}).get("oversubscribed", False)),
        "pinned": bool((metrics.get("environment") or {}).get("pinned_cores")),
        "mlflow_run_id": run_id,
        "run_dir": str(run_dir),
    }


def load_runs(run_dirs: Iterable[str | Path]) -> pd.DataFrame:
    """One row per run folder (metrics.json + eval.json)."""
    rows = [_run_row(Path(run_dir)) for run_dir in run_dirs]
    if not rows:
        raise ValueError("no run folders to aggregate")
    df = pd.DataFrame(rows)
    duplicated = df[df.duplicated(["strategy", "workers", "seed"], keep=False)]
    if not duplicated.empty:
        raise ValueError("several folders hold the same (strategy, workers, seed): "
                         + ", ".join(duplicated["run_dir"]))
    return df


def load_run_metrics(run_dirs: Iterable[str | Path]) -> dict[str, dict]:
    """{run folder: its metrics.json}, keyed like load_runs' run_dir column."""
    return {str(Path(d)): read_json(Path(d) / "metrics.json") for d in run_dirs}


# --- tables ---------------------------------------------------------------------------

def _sorted(table: pd.DataFrame, strategies_order: Sequence[str] | None) -> pd.DataFrame:
    """Rows by strategy (config order, then unlisted ones alphabetically), then workers."""
    listed = list(strategies_order or [])
    unlisted = sorted(set(table["strategy"]) - set(listed))
    rank = {name: i for i, name in enumerate(listed + unlisted)}
    order = table["strategy"].map(rank)
    return (table.assign(_rank=order).sort_values(["_rank", "workers"])
            .drop(columns="_rank").reset_index(drop=True))


def _per_config(df: pd.DataFrame):
    return df.groupby(["strategy", "workers"], sort=False)


def _windows(df: pd.DataFrame, strategy: str, workers: int) -> list[list[float]]:
    """The timed windows of (strategy, N), one list per seed; [] when that run is absent."""
    rows = df[(df["strategy"] == strategy) & (df["workers"] == workers)]
    return [list(w) for w in rows["windows"]]


def _columns(prefix: str, interval: Interval) -> dict:
    return {prefix: interval.value, f"{prefix}_low": interval.low, f"{prefix}_high": interval.high}


def scaling_table(df: pd.DataFrame, strategies_order: Sequence[str] | None = None) -> pd.DataFrame:
    """Throughput (median of the timed windows, bootstrap 95% CI over the windows of every
    seed), speedup and efficiency against the strategy's own N=1 (their CIs from the same
    bootstrap), and efficiency against the machine's ceiling (no_exchange at the same N)."""
    rows = []
    for (name, workers), runs in _per_config(df):
        here = _windows(df, name, workers)
        one = _windows(df, name, 1)
        base = _windows(df, BASELINE_STRATEGY, 1)
        ceiling, ceiling_one = _windows(df, REFERENCE_STRATEGY, workers), _windows(df, REFERENCE_STRATEGY, 1)
        if workers == 1:  # S(1) = 1 by definition: no interval
            unit = intervals.Interval(1.0, 1.0, 1.0, sum(len(w) for w in here), "bootstrap95")
            speedup_ci = unit if here else intervals.NAN_INTERVAL
            vs_ceiling = ceiling_efficiency = unit if ceiling and here else intervals.NAN_INTERVAL
        else:
            speedup_ci = intervals.bootstrap({"n": here, "one": one}, lambda m: speedup(m["n"], m["one"]))
            vs_ceiling = intervals.bootstrap(
                {"n": here, "one": one, "c": ceiling, "c1": ceiling_one},
                lambda m: speedup(m["n"], m["one"]) / speedup(m["c"], m["c1"]))
            ceiling_efficiency = intervals.bootstrap({"c": ceiling, "c1": ceiling_one},
                                                     lambda m: efficiency(speedup(m["c"], m["c1"]), workers))
        # E = S / N: the speedup's interval, divided (a quantile commutes with the scaling)
        efficiency_ci = intervals.scaled(speedup_ci, 1 / workers)
        rows.append({
            "strategy": name, "family": FAMILY_OF.get(name, "unknown"), "workers": workers,
            "seeds": runs["seed"].nunique(), "windows": sum(len(w) for w in here),
            **_columns("throughput", intervals.median_interval(here)),
            **_columns("speedup", speedup_ci),
            **_columns("efficiency", efficiency_ci),
            "ceiling_efficiency": ceiling_efficiency.value,
            **_columns("efficiency_vs_ceiling", vs_ceiling),
            "speedup_vs_allreduce_1": speedup(intervals.pooled_median(here), intervals.pooled_median(base)),
            "compute_s": runs["compute_s"].mean(),
            "comm_s": runs["comm_s"].mean(),
            "bytes_per_step": runs["bytes_per_step"].mean(),
            "oversubscribed": bool(runs["oversubscribed"].any()),
            "pinned": bool(runs["pinned"].all()),
        })
    return _sorted(pd.DataFrame(rows), strategies_order)[SCALING_COLUMNS]


def _reached_fraction(times: pd.Series) -> str:
    return f"{int(times.notna().sum())}/{len(times)}"


def accuracy_table(df: pd.DataFrame, strategies_order: Sequence[str] | None = None) -> pd.DataFrame:
    """Final test top-1/top-5 per (strategy, N): the mean over seeds with its interval
    (dtstudy.analysis.intervals: t 95% CI from 3 seeds, the range of 2), and the paired difference
    to allreduce at the same N and seed. The reference (no_exchange) has no accuracy to
    report: its rank 0 trained alone on 1/N of the data."""
    rows = []
    base = df[df["strategy"] == BASELINE_STRATEGY].set_index(["workers", "seed"])["top1"]
    for (name, workers), runs in _per_config(df[df["strategy"] != REFERENCE_STRATEGY]):
        top1 = intervals.mean_interval(runs["top1"])
        paired = [top1_seed - base[(workers, seed)] for seed, top1_seed in zip(runs["seed"], runs["top1"])
                  if (workers, seed) in base.index]
        difference = intervals.mean_interval(paired) if name != BASELINE_STRATEGY else intervals.NAN_INTERVAL
        rows.append({
            "strategy": name, "family": FAMILY_OF.get(name, "unknown"), "workers": workers,
            "seeds": runs["seed"].nunique(),
            **_columns("top1", top1), "top1_interval": top1.kind,
            **_columns("top5", intervals.mean_interval(runs["top5"])),
            **_columns("top1_vs_allreduce", difference), "paired_seeds": difference.n,
            "below_allreduce": bool(difference.value < -GAP_POINTS / 100),
            "time_to_accuracy_s": mean_of_reached(runs["time_to_accuracy_s"]),
            "reached_target": _reached_fraction(runs["time_to_accuracy_s"]),
        })
    return _sorted(pd.DataFrame(rows), strategies_order)[ACCURACY_COLUMNS]


def noise_summary(df: pd.DataFrame) -> dict:
    """The machine's noise, from the study itself: at N=1 every strategy runs the same plain
    SGD loop, so the spread of their throughputs is noise; and the spread of the timed
    windows inside a run (coefficient of variation, median over the runs)."""
    single = df[df["workers"] == 1]
    medians = [float(np.median(w)) for w in single["windows"] if len(w)]
    window_cvs = [float(np.std(w, ddof=1) / np.mean(w)) for w in df["windows"] if len(w) > 1]
    noise = {"n1_runs": len(medians), "window_cv": float(np.median(window_cvs)) if window_cvs else math.nan}
    if len(medians) >= 2:
        noise.update(n1_min=min(medians), n1_max=max(medians), n1_ratio=max(medians) / min(medians),
                     n1_cv=float(np.std(medians, ddof=1) / np.mean(medians)))
    return noise


# --- writing --------------------------------------------------------------------------

def to_markdown(df: pd.DataFrame, title: str, notes: Sequence[str] = (), formatted: bool = False) -> str:
    """A one-line title, notes (and the oversubscription note if needed), then the table;
    `formatted`: the cells are already strings, printed as they are."""
    floatfmt = tuple(_FLOAT_FORMATS.get(c, _DEFAULT_FLOAT_FORMAT) for c in df.columns)
    lines = [f"# {title}", ""]
    for note in notes:
        lines += [note, ""]
    if "oversubscribed" in df.columns and df["oversubscribed"].any():
        lines += [OVERSUBSCRIBED_NOTE, ""]
    lines.append(df.to_markdown(index=False, disable_numparse=True) if formatted
                 else df.to_markdown(index=False, floatfmt=floatfmt))
    return "\n".join(lines) + "\n"


def write_table(df: pd.DataFrame, csv_path: str | Path, md_path: str | Path,
                title: str | None = None, markdown: str | None = None) -> None:
    """CSV + Markdown twin, each written atomically. Title defaults to the file's stem;
    `markdown` replaces the plain rendering of the CSV's columns."""
    csv_path, md_path = Path(csv_path), Path(md_path)
    write_text(csv_path, df.to_csv(index=False))
    write_text(md_path, markdown or to_markdown(df, title or f"{md_path.stem} table"))


def _interval(table_row, prefix: str, kind: str = "bootstrap95") -> Interval:
    """The interval that the columns prefix, prefix_low, prefix_high of a table row hold."""
    return Interval(table_row[prefix], table_row[f"{prefix}_low"], table_row[f"{prefix}_high"], 0, kind)


def _cell(table_row, prefix: str, fmt: str, kind: str = "bootstrap95") -> str:
    return intervals.format_interval(_interval(table_row, prefix, kind), fmt)


def _difference_cell(table_row) -> str:
    """The paired difference to allreduce: a t interval or a range, as its top-1 is."""
    return _cell(table_row, "top1_vs_allreduce", "+.4f", table_row["top1_interval"])


def noise_note(noise: Mapping) -> str:
    if noise.get("n1_runs", 0) < 2:
        return "Noise: fewer than two N=1 runs, so the machine's noise is not measured in this study."
    return (f"Noise of this machine: at N=1 every strategy runs the same plain SGD loop, and their "
            f"{noise['n1_runs']} runs measured {noise['n1_min']:.0f} to {noise['n1_max']:.0f} images/s "
            f"(max/min {noise['n1_ratio']:.2f}, CV {100 * noise['n1_cv']:.1f}%); inside one run the timed windows "
            f"vary by {100 * noise['window_cv']:.1f}% (CV, median over runs). A difference between two rows smaller "
            "than this spread is noise.")


def scaling_markdown(table: pd.DataFrame, noise: Mapping) -> str:
    rows = [{
        "strategy": r["strategy"], "N": r["workers"], "seeds × windows": f"{r['seeds']} × {r['windows'] // max(1, r['seeds'])}",
        "images/s [95% CI]": _cell(r, "throughput", ".0f"),
        "speedup [95% CI]": _cell(r, "speedup", ".2f"),
        "E(N) [95% CI]": _cell(r, "efficiency", ".2f"),
        "ceiling E(N)": "n/a" if pd.isna(r["ceiling_efficiency"]) else f"{r['ceiling_efficiency']:.2f}",
        "E / ceiling [95% CI]": _cell(r, "efficiency_vs_ceiling", ".2f"),
        "compute s": f"{r['compute_s']:.5f}", "exchange s": f"{r['comm_s']:.5f}",
        "bytes/step": f"{r['bytes_per_step']:.0f}",
        "notes": ", ".join(n for n, on in (("oversubscribed", r["oversubscribed"]), ("not pinned", not r["pinned"])) if on),
    } for _, r in table.iterrows()]
    notes = [
        "Throughput: median of the run's timed windows (train.timing_window_steps steps each, after the "
        "warm-up steps), pooled over seeds, with a bootstrap 95% CI over the windows. Speedup and E(N) = S(N)/N "
        "are against the same strategy at N=1. The ceiling is no_exchange: N workers that train alone and "
        "exchange nothing, i.e. what this machine gives N processes; E / ceiling compares a strategy with it.",
        noise_note(noise),
    ] + ([OVERSUBSCRIBED_NOTE] if table["oversubscribed"].any() else [])
    return to_markdown(pd.DataFrame(rows), "Scaling table", notes, formatted=True)


def accuracy_markdown(table: pd.DataFrame) -> str:
    rows = [{
        "strategy": r["strategy"], "N": r["workers"], "seeds": r["seeds"],
        "test top-1": _cell(r, "top1", ".4f", r["top1_interval"]),
        "test top-5": _cell(r, "top5", ".4f", r["top1_interval"]) if r["seeds"] else "",  # same seeds
        "top-1 − allreduce (paired)": "" if r["strategy"] == BASELINE_STRATEGY else _difference_cell(r),
        "time to target s": "n/a" if pd.isna(r["time_to_accuracy_s"]) else f"{r['time_to_accuracy_s']:.1f}",
        "reached": r["reached_target"],
        "mark": f"> {GAP_POINTS} points below allreduce" if r["below_allreduce"] else "",
    } for _, r in table.iterrows()]
    notes = [
        "Test top-1/top-5: the mean over seeds; [a, b] is a t 95% CI (3 or more seeds), (a–b) the range of "
        "2 seeds, too few for a CI. The difference to allreduce is paired: the same N and seed (same data "
        "order and initial weights), then averaged. Time to target: validation top-1 reaching target_accuracy, "
        "in training seconds (evaluation passes left out), mean over the seeds that reached it.",
        f"Marked: more than {GAP_POINTS} points of top-1 below allreduce at the same N (README: Accuracy, for "
        "the measured causes).",
    ]
    return to_markdown(pd.DataFrame(rows), "Accuracy table", notes, formatted=True)


def _largest_timed_n(scaling: pd.DataFrame) -> int | None:
    """The largest N whose runs were not oversubscribed (their throughput means something)."""
    timed = scaling[(scaling["workers"] > 1) & ~scaling["oversubscribed"]]
    return int(timed["workers"].max()) if not timed.empty else None


def findings_markdown(scaling: pd.DataFrame, accuracy: pd.DataFrame, noise: Mapping) -> str:
    """What the tables say, per question, written from the numbers (findings.md)."""
    lines = ["# Findings", "", "Written by the aggregate step from the tables beside this file; every figure "
             "carries its 95% CI (or the range of 2 seeds).", "", "## Scaling: how does throughput scale with N?", "",
             f"- {noise_note(noise)}"]
    ceiling = scaling[scaling["strategy"] == REFERENCE_STRATEGY]
    for _, r in ceiling[ceiling["workers"] > 1].iterrows():
        lines.append(f"- Ceiling of this machine (no_exchange) at N={r['workers']}: E = {_cell(r, 'efficiency', '.2f')}"
                     + (" (oversubscribed)" if r["oversubscribed"] else "") + ".")
    n_timed = _largest_timed_n(scaling)
    if n_timed is None:
        lines.append("- No N > 1 ran without oversubscription: no scaling result on this machine.")
    else:
        rows = scaling[(scaling["workers"] == n_timed) & (scaling["strategy"] != REFERENCE_STRATEGY)]
        rows = rows.sort_values("efficiency", ascending=False)
        lines.append(f"- Efficiency at N={n_timed} (the largest N not oversubscribed), best first:")
        base = rows[rows["strategy"] == BASELINE_STRATEGY]
        base_ci = None if base.empty else _interval(base.iloc[0], "efficiency")
        for _, r in rows.iterrows():
            interval = _interval(r, "efficiency")
            versus = ""
            if base_ci is not None and r["strategy"] != BASELINE_STRATEGY:
                versus = ("; within the noise of allreduce (CIs overlap)" if intervals.overlaps(interval, base_ci)
                          else ("; above" if interval.low > base_ci.high else "; below") + " allreduce (CIs apart)")
            ceiling_part = ("" if pd.isna(r["efficiency_vs_ceiling"])
                            else f", {_cell(r, 'efficiency_vs_ceiling', '.2f')} of the ceiling")
            lines.append(f"  - {r['strategy']}: E = {_cell(r, 'efficiency', '.2f')}{ceiling_part}{versus}")
    whole_n = [n for n, rows in scaling.groupby("workers") if rows["oversubscribed"].all()]
    if whole_n:
        lines.append(f"- N = {', '.join(map(str, whole_n))} ran more processes than cores: their throughput says "
                     "nothing about scaling (the accuracy still does).")
    partly = scaling[scaling["oversubscribed"] & ~scaling["workers"].isin(whole_n)]
    if not partly.empty:
        lines.append("- Also oversubscribed (a strategy's extra processes, e.g. parameter-server shards, beside "
                     "the N workers): " + ", ".join(f"{r['strategy']} N={r['workers']}" for _, r in partly.iterrows())
                     + "; their efficiency above is not a scaling result.")
    ceiling_above = ceiling[(ceiling["workers"] > 1) & (ceiling["efficiency_low"] > 1)]
    for _, r in ceiling_above.iterrows():
        lines.append(f"- The ceiling's E at N={r['workers']} is above 1 with its whole interval: the N=1 runs it is "
                     "measured against ran slower than one worker of an N-worker run, i.e. what ran beside the N=1 "
                     "runs (another run, an evaluation) slowed them; every speedup at this N is inflated by as much.")
    lines += ["", "## Accuracy: what does each strategy do to the final accuracy?", ""]
    base = accuracy[accuracy["strategy"] == BASELINE_STRATEGY]
    for _, r in base.iterrows():
        lines.append(f"- allreduce at N={r['workers']}: test top-1 {_cell(r, 'top1', '.4f', r['top1_interval'])} "
                     f"({r['seeds']} seeds).")
    others = accuracy[accuracy["strategy"] != BASELINE_STRATEGY]
    marked = others[others["below_allreduce"]]
    if not marked.empty:
        lines.append(f"- More than {GAP_POINTS} points below allreduce (paired difference):")
        for _, r in marked.iterrows():
            lines.append(f"  - {r['strategy']} N={r['workers']}: {_difference_cell(r)}")
    within = others[~others["below_allreduce"] & others["top1_vs_allreduce"].notna()]
    if not within.empty:
        lines.append(f"- Within {GAP_POINTS} points of allreduce: "
                     + ", ".join(f"{r['strategy']} N={r['workers']}" for _, r in within.iterrows()) + ".")
    return "\n".join(lines) + "\n"


# --- plots ----------------------------------------------------------------------------
# One panel per strategy family (FAMILIES), so that no panel holds more than a handful of
# lines; allreduce (the baseline) and no_exchange (the machine's ceiling) on every panel.

def _family_panels(table: pd.DataFrame, ncols: int = 2) -> tuple[Figure, list[tuple[str, object]]]:
    present = [f for f in FAMILIES if f != "reference" and (table["family"] == f).any()]
    present = present or ["all"]
    rows = math.ceil(len(present) / ncols)
    figure = Figure(figsize=(6.0 * min(ncols, len(present)), 4.0 * rows), layout="constrained")
    FigureCanvasAgg(figure)  # a bare Figure with an Agg canvas: no pyplot global state
    return figure, [(family, figure.add_subplot(rows, min(ncols, len(present)), i + 1))
                    for i, family in enumerate(present)]


def _family_rows(table: pd.DataFrame, family: str) -> pd.DataFrame:
    return table if family == "all" else table[table["family"] == family]


def _save(figure: Figure, path: Path) -> Path:
    for ax in figure.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    atomic_write(path, lambda stream: figure.savefig(stream, format="png", dpi=110))
    return path


def _log2_workers_axis(ax, workers: Iterable[int]) -> None:
    ticks = sorted(set(int(n) for n in workers))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.minorticks_off()
    ax.set_xlabel("workers N")


def _colors(names: Sequence[str]) -> dict:
    colormap = matplotlib.colormaps["tab10"]
    return {name: colormap(i % colormap.N) for i, name in enumerate(names)}


def _yerr(rows: pd.DataFrame, column: str):
    """Asymmetric error bars from the interval columns (none where the interval is NaN)."""
    low = (rows[column] - rows[f"{column}_low"]).clip(lower=0).fillna(0)
    high = (rows[f"{column}_high"] - rows[column]).clip(lower=0).fillna(0)
    return [low.to_numpy(), high.to_numpy()]


def _finish(ax, title: str, ylabel: str, rows: pd.DataFrame | None = None) -> None:
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if rows is not None and "oversubscribed" in rows and rows["oversubscribed"].any():
        ax.annotate("x = oversubscribed (more processes than cores)", (1, 1), xycoords="axes fraction",
                    xytext=(-4, -4), textcoords="offset points", fontsize="x-small", ha="right", va="top")


def _mark_oversubscribed(ax, rows: pd.DataFrame, column: str) -> None:
    marked = rows[rows["oversubscribed"]]
    ax.plot(marked["workers"], marked[column], "kx", markersize=9, label=None)


def _plot_strategies(ax, table: pd.DataFrame, family: str, column: str, colors: dict) -> pd.DataFrame:
    """The family's strategies with error bars, and allreduce (thin grey) on the other panels."""
    rows = _family_rows(table, family)
    baseline = table[table["strategy"] == BASELINE_STRATEGY]
    if family != "synchronous" and not baseline.empty:
        ax.errorbar(baseline["workers"], baseline[column], yerr=_yerr(baseline, column), color="grey",
                    linewidth=1, capsize=2, alpha=0.7, label="allreduce")
    for name, own in rows.groupby("strategy", sort=False):
        ax.errorbar(own["workers"], own[column], yerr=_yerr(own, column), color=colors[name],
                    marker="o", capsize=3, label=name)
        if "oversubscribed" in own:
            _mark_oversubscribed(ax, own, column)
    return rows


def _plot_ceiling(ax, ceiling: pd.DataFrame, column: str) -> None:
    if not ceiling.empty:
        ax.errorbar(ceiling["workers"], ceiling[column], yerr=_yerr(ceiling, column), color="black",
                    linestyle=":", capsize=2, label="ceiling (no_exchange)")


def plot_throughput(scaling: pd.DataFrame, path: Path) -> Path:
    figure, panels = _family_panels(scaling)
    colors = _colors(list(dict.fromkeys(scaling["strategy"])))
    ceiling = scaling[scaling["strategy"] == REFERENCE_STRATEGY]
    base_one = scaling[(scaling["strategy"] == BASELINE_STRATEGY) & (scaling["workers"] == 1)]["throughput"]
    for family, ax in panels:
        rows = _plot_strategies(ax, scaling, family, "throughput", colors)
        ns = sorted(scaling["workers"].unique())
        if not base_one.empty:
            ax.plot(ns, [base_one.iloc[0] * n for n in ns], color="grey", linestyle="--", label="ideal thr(1)·N")
        _plot_ceiling(ax, ceiling, "throughput")
        _log2_workers_axis(ax, scaling["workers"])
        _finish(ax, f"{family}: throughput (95% CI)", "images/s (all workers)", rows)
    return _save(figure, path)


def plot_efficiency(scaling: pd.DataFrame, path: Path) -> Path:
    figure, panels = _family_panels(scaling)
    colors = _colors(list(dict.fromkeys(scaling["strategy"])))
    ceiling = scaling[scaling["strategy"] == REFERENCE_STRATEGY]
    for family, ax in panels:
        ax.axhline(1.0, color="grey", linestyle="--", label="ideal E = 1")
        rows = _plot_strategies(ax, scaling, family, "efficiency", colors)
        _plot_ceiling(ax, ceiling, "efficiency")
        _log2_workers_axis(ax, scaling["workers"])
        _finish(ax, f"{family}: efficiency E(N) = S(N)/N (95% CI)", "efficiency", rows)
    return _save(figure, path)


def plot_accuracy(accuracy: pd.DataFrame, path: Path) -> Path:
    figure, panels = _family_panels(accuracy)
    colors = _colors(list(dict.fromkeys(accuracy["strategy"])))
    for family, ax in panels:
        _plot_strategies(ax, accuracy, family, "top1", colors)
        _log2_workers_axis(ax, accuracy["workers"])
        _finish(ax, f"{family}: test top-1 (mean over seeds, CI or range)", "test top-1")
    return _save(figure, path)


def _representative_runs(df: pd.DataFrame) -> pd.DataFrame:
    """One run per (strategy, N): seed 0, else the lowest seed present."""
    return df.sort_values("seed").groupby(["strategy", "workers"], sort=False).head(1)


def plot_convergence(df: pd.DataFrame, run_metrics: Mapping[str, dict], path: Path,
                     strategies_order: Sequence[str] | None = None) -> Path:
    """Validation top-1 against training time, per family (the lowest seed of each run)."""
    runs = _sorted(_representative_runs(df[df["strategy"] != REFERENCE_STRATEGY]), strategies_order)
    figure, panels = _family_panels(runs)
    colors = _colors(list(dict.fromkeys(runs["strategy"])))
    linestyles = ["-", "--", ":", "-."]
    worker_counts = sorted(runs["workers"].unique())
    for family, ax in panels:
        targets = set()
        for run in _family_rows(runs, family).itertuples():
            metrics = run_metrics[run.run_dir]
            targets.add(metrics.get("target_accuracy"))
            val = metrics.get("val_grid") or metrics.get("val") or []
            style = linestyles[worker_counts.index(run.workers) % len(linestyles)]
            ax.plot([v.get("train_s", v["wall_s"]) for v in val], [v["top1"] for v in val], color=colors[run.strategy],
                    linestyle=style, marker=".", markersize=3, label=f"{run.strategy} N={run.workers}")
        for target in targets - {None}:
            ax.axhline(target, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("training time (s, evaluation left out)")
        _finish(ax, f"{family}: validation top-1 vs time", "validation top-1")
    return _save(figure, path)


def make_plots(df: pd.DataFrame, run_metrics: Mapping[str | Path, dict], plots_dir: str | Path,
               strategies_order: Sequence[str] | None = None, scaling: pd.DataFrame | None = None,
               accuracy: pd.DataFrame | None = None) -> list[Path]:
    """throughput.png, efficiency.png, accuracy.png, convergence.png from the per-run frame
    (and its tables, when the caller has them already: the scaling table's bootstraps are
    the step's largest cost)."""
    plots_dir = Path(plots_dir)
    metrics_by_dir = {str(Path(k)): v for k, v in run_metrics.items()}
    scaling = scaling_table(df, strategies_order) if scaling is None else scaling
    accuracy = accuracy_table(df, strategies_order) if accuracy is None else accuracy
    return [
        plot_throughput(scaling, plots_dir / "throughput.png"),
        plot_efficiency(scaling, plots_dir / "efficiency.png"),
        plot_accuracy(accuracy, plots_dir / "accuracy.png"),
        plot_convergence(df, metrics_by_dir, plots_dir / "convergence.png", strategies_order),
    ]


# --- the whole step -------------------------------------------------------------------

def aggregate_study(run_dirs: Iterable[str | Path], tables_dir: str | Path, plots_dir: str | Path,
        tracking_uri: str | None, experiment: str,
        strategies_order: Sequence[str] | None = None,
        study_params: Mapping | None = None) -> dict:
    """Tables + plots from the run folders, then the MLflow study run that adopts them."""
    run_dirs = [Path(d) for d in run_dirs]
    tables_dir, plots_dir = Path(tables_dir), Path(plots_dir)

    df = load_runs(run_dirs)
    run_metrics = load_run_metrics(run_dirs)
    log(f"loaded {len(df)} runs ({df['strategy'].nunique()} strategies)")

    scaling, accuracy, noise = scaling_table(df, strategies_order), accuracy_table(df, strategies_order), noise_summary(df)
    tables = {"scaling": (scaling, scaling_markdown(scaling, noise)), "accuracy": (accuracy, accuracy_markdown(accuracy))}
    table_paths = []
    for name, (table, markdown) in tables.items():
        csv_path, md_path = tables_dir / f"{name}.csv", tables_dir / f"{name}.md"
        write_table(table, csv_path, md_path, markdown=markdown)
        table_paths += [csv_path, md_path]
    findings_path = tables_dir / "findings.md"
    write_text(findings_path, findings_markdown(scaling, accuracy, noise))
    table_paths.append(findings_path)
    log(f"wrote {len(table_paths)} tables to {tables_dir}")

    plot_paths = make_plots(df, run_metrics, plots_dir, strategies_order, scaling, accuracy)
    log(f"wrote {len(plot_paths)} plots to {plots_dir}")

    uri = mlflow_store.resolve_uri(tracking_uri)
    child_run_ids = [run_id for run_id in df["mlflow_run_id"] if run_id]
    artifacts = {**{p: "tables" for p in table_paths}, **{p: "plots" for p in plot_paths}}
    parent_run_id = mlflow_store.log_study_run(uri, experiment, child_run_ids, artifacts,
                                           params=study_params or {})
    log(f"study run {parent_run_id} logged to {uri} with {len(child_run_ids)} child runs")
    view = mlflow_store.publish_runs_view(uri, mlflow_store.init_store(uri, experiment), parent_run_id)
    log(f"in the MLflow UI (mlflow ui --backend-store-uri {uri}): open http://localhost:5000/{view}")
    return {"runs": len(df), "tables": table_paths, "plots": plot_paths,
            "parent_run_id": parent_run_id, "tracking_uri": uri}
