"""The scaling and accuracy tables, the machine's noise, and their CSV and Markdown files.

Each table takes its runs of one kind (dtstudy.config.run_kinds) and says which in its
`from_runs` column: the scaling table the scaling runs (the accuracy runs in a study without
them), the accuracy table the accuracy runs.

Every cell comes with its uncertainty (dtstudy.common.intervals): throughput, speedup and
efficiency with a bootstrap 95% CI over the timed windows of every seed; accuracy with a
t 95% CI over seeds (3 or more), or the range of 2 seeds, and the paired difference to
allreduce at the same N and seed. The machine's own noise (the N=1 rows without extra
processes are identical work) and its ceiling (no_exchange: N loops that exchange nothing) are reported beside.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from dtstudy.analysis.runs import FAMILY_OF, efficiency, runs_of_kind, speedup, throughput_kind
from dtstudy.common import intervals
from dtstudy.common.atomic_files import write_text
from dtstudy.common.intervals import Interval
from dtstudy.config.run_kinds import ACCURACY
from dtstudy.strategies.specs import REFERENCE_STRATEGY

BASELINE_STRATEGY = "allreduce"
GAP_POINTS = 3  # a strategy more than this many points of top-1 below allreduce is marked
SCALING_COLUMNS = [
    "from_runs",
    "strategy",
    "family",
    "workers",
    "extra_processes",
    "seeds",
    "windows",
    "throughput",
    "throughput_low",
    "throughput_high",
    "speedup",
    "speedup_low",
    "speedup_high",
    "efficiency",
    "efficiency_low",
    "efficiency_high",
    "ceiling_efficiency",
    "efficiency_vs_ceiling",
    "efficiency_vs_ceiling_low",
    "efficiency_vs_ceiling_high",
    "speedup_vs_allreduce_1",
    "compute_s",
    "comm_s",
    "bytes_per_step",
    "oversubscribed",
    "pinned",
]
ACCURACY_COLUMNS = [
    "from_runs",
    "strategy",
    "family",
    "workers",
    "global_batch",
    "seeds",
    "top1",
    "top1_low",
    "top1_high",
    "top1_interval",
    "top5",
    "top5_low",
    "top5_high",
    "top1_vs_allreduce",
    "top1_vs_allreduce_low",
    "top1_vs_allreduce_high",
    "paired_seeds",
    "below_allreduce",
    "time_to_accuracy_s",
    "time_to_accuracy_s_low",
    "time_to_accuracy_s_high",
    "reached_target",
    "steps_to_accuracy",
    "steps_to_accuracy_low",
    "steps_to_accuracy_high",
    "staleness",
    "staleness_low",
    "staleness_high",
    # what tells a strategy's variants apart (config `variants`): the claims read them
    "base_strategy",
    "lr_rule",
    "peak_lr",
    "val_top1",
    "staleness_bound",
]
#: what accuracy_table reads from each run's metrics.json beyond the runs frame (NaN when absent)
RUN_EXTRAS = (
    "global_batch",
    "steps_to_accuracy",
    "staleness",
    "lr_rule",
    "peak_lr",
    "val_top1",
    "staleness_bound",
    "step_compute_s",
)
OVERSUBSCRIBED_NOTE = (
    "Note: rows marked oversubscribed ran more workers than CPU cores, "
    "so their throughput (and timings) are not meaningful."
)
_FLOAT_FORMATS = {
    "throughput": ".1f",
    "throughput_low": ".1f",
    "throughput_high": ".1f",
    "bytes_per_step": ".0f",
    "compute_s": ".5f",
    "comm_s": ".5f",
    "time_to_accuracy_s": ".1f",
}
_DEFAULT_FLOAT_FORMAT = ".4f"


# --- tables ---------------------------------------------------------------------------


def sorted_by_strategy(table: pd.DataFrame, strategies_order: Sequence[str] | None) -> pd.DataFrame:
    """Rows by strategy (config order, then unlisted ones alphabetically), then workers."""
    listed = list(strategies_order or [])
    unlisted = sorted(set(table["strategy"]) - set(listed))
    rank = {name: i for i, name in enumerate(listed + unlisted)}
    order = table["strategy"].map(rank)
    return table.assign(_rank=order).sort_values(["_rank", "workers"]).drop(columns="_rank").reset_index(drop=True)


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
    bootstrap), and efficiency against the machine's ceiling (no_exchange at the same N); from
    the runs of throughput_kind only."""
    kind = throughput_kind(df)
    df = runs_of_kind(df, kind)
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
                lambda m: speedup(m["n"], m["one"]) / speedup(m["c"], m["c1"]),
            )
            ceiling_efficiency = intervals.bootstrap(
                {"c": ceiling, "c1": ceiling_one}, lambda m, n=workers: efficiency(speedup(m["c"], m["c1"]), n)
            )
        # E = S / N: the speedup's interval, divided (a quantile commutes with the scaling)
        efficiency_ci = intervals.scaled(speedup_ci, 1 / workers)
        rows.append(
            {
                "from_runs": kind,
                "strategy": name,
                "family": FAMILY_OF.get(runs["base_strategy"].iloc[0] if "base_strategy" in runs else name, "unknown"),
                "workers": workers,
                # a parameter server's shards (one per node by default): part of what is being scaled
                "extra_processes": runs["extra_processes"].max(),
                "seeds": runs["seed"].nunique(),
                "windows": sum(len(w) for w in here),
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
            }
        )
    return sorted_by_strategy(pd.DataFrame(rows), strategies_order)[SCALING_COLUMNS]


def _reached_fraction(times: pd.Series) -> str:
    return f"{int(times.notna().sum())}/{len(times)}"


def steps_to_accuracy(metrics: Mapping) -> float:
    """A run's steps (per worker) to its first validation point at or above target_accuracy, on
    the points time_to_accuracy_s is read from (the grid when there is one); NaN if never."""
    target = metrics.get("target_accuracy")
    points = metrics.get("val_grid") or metrics.get("val") or []
    reached = [p["step"] for p in points if target is not None and "step" in p and p["top1"] >= target]
    return float(reached[0]) if reached else math.nan


def _number(value) -> float:
    return math.nan if value is None else float(value)


def run_extras(metrics: Mapping) -> dict:
    """RUN_EXTRAS of one run's metrics.json: its global batch, its steps to the target, and the
    mean staleness of the gradients it applied (the asynchronous parameter servers record it,
    strategy_metrics.staleness_mean); NaN for what the run does not record."""
    staleness = (metrics.get("strategy_metrics") or {}).get("staleness_mean")
    schedule, knobs = metrics.get("lr_schedule") or {}, metrics.get("strategy_params") or {}
    return {
        "global_batch": float(metrics.get("global_batch") or math.nan),
        "steps_to_accuracy": steps_to_accuracy(metrics),
        "staleness": _number(staleness),
        "lr_rule": schedule.get("rule"),
        "peak_lr": _number(schedule.get("peak_lr")),
        "val_top1": _number(metrics.get("final_val_top1")),
        # ssp's bound s (its knob `staleness`; null: unbounded); NaN for a strategy without one
        "staleness_bound": (math.inf if knobs["staleness"] is None else float(knobs["staleness"]))
        if "staleness" in knobs
        else math.nan,
        # an emulated step's compute, what the claims rescale to try another compute rate
        "step_compute_s": _number((metrics.get("emulation") or {}).get("step_compute_s")),
    }


def with_run_extras(df: pd.DataFrame, run_metrics: Mapping[str, Mapping] | None) -> pd.DataFrame:
    """The runs frame with RUN_EXTRAS columns from each run's metrics.json (keyed by run_dir),
    all NaN without run_metrics."""
    extras = [run_extras((run_metrics or {}).get(run_dir, {})) for run_dir in df["run_dir"]]
    return df.assign(**{key: [e[key] for e in extras] for key in RUN_EXTRAS})


def accuracy_table(
    df: pd.DataFrame, strategies_order: Sequence[str] | None = None, run_metrics: Mapping[str, Mapping] | None = None
) -> pd.DataFrame:
    """Final test top-1/top-5 per (strategy, N): the mean over seeds with its interval
    (dtstudy.common.intervals: t 95% CI from 3 seeds, the range of 2), and the paired difference
    to allreduce at the same N and seed. The reference (no_exchange) has no accuracy to
    report: its rank 0 trained alone on 1/N of the data. From the accuracy runs only.
    Time and steps to the target: the mean over the seeds that reached it, with the same kind
    of interval; with `run_metrics` ({run_dir: metrics.json}) also the global batch, the steps
    to the target and the staleness of asynchronous strategies (RUN_EXTRAS; NaN without)."""
    df = with_run_extras(runs_of_kind(df, ACCURACY), run_metrics)
    rows = []
    base = df[df["strategy"] == BASELINE_STRATEGY].set_index(["workers", "seed"])["top1"]
    for (name, workers), runs in _per_config(df[df["strategy"] != REFERENCE_STRATEGY]):
        top1 = intervals.mean_interval(runs["top1"])
        paired = [
            top1_seed - base[(workers, seed)]
            for seed, top1_seed in zip(runs["seed"], runs["top1"])
            if (workers, seed) in base.index
        ]
        difference = intervals.mean_interval(paired) if name != BASELINE_STRATEGY else intervals.NAN_INTERVAL
        batches = runs["global_batch"].dropna()
        base_strategy = runs["base_strategy"].iloc[0] if "base_strategy" in runs.columns else name
        rows.append(
            {
                "from_runs": ACCURACY,
                "strategy": name,
                "family": FAMILY_OF.get(base_strategy, "unknown"),
                "workers": workers,
                "global_batch": batches.iloc[0] if len(batches) else math.nan,
                "seeds": runs["seed"].nunique(),
                **_columns("top1", top1),
                "top1_interval": top1.kind,
                **_columns("top5", intervals.mean_interval(runs["top5"])),
                **_columns("top1_vs_allreduce", difference),
                "paired_seeds": difference.n,
                "below_allreduce": bool(difference.value < -GAP_POINTS / 100),
                # the mean over the seeds that reached the target, with its interval
                **_columns("time_to_accuracy_s", intervals.mean_interval(runs["time_to_accuracy_s"].dropna())),
                "reached_target": _reached_fraction(runs["time_to_accuracy_s"]),
                **_columns("steps_to_accuracy", intervals.mean_interval(runs["steps_to_accuracy"].dropna())),
                **_columns("staleness", intervals.mean_interval(runs["staleness"].dropna())),
                "base_strategy": base_strategy,
                "lr_rule": runs["lr_rule"].iloc[0],
                "peak_lr": runs["peak_lr"].iloc[0],
                "val_top1": runs["val_top1"].mean(),
                "staleness_bound": runs["staleness_bound"].iloc[0],
            }
        )
    return sorted_by_strategy(pd.DataFrame(rows), strategies_order)[ACCURACY_COLUMNS]


def noise_summary(df: pd.DataFrame) -> dict:
    """The machine's noise, from the study itself: at N=1 every strategy without extra
    processes runs the same plain SGD loop, so the spread of their throughputs is noise (a
    parameter server's N=1 sends every step to its shard: a systematic gap, not noise, so it is
    left out); and the spread of the timed windows inside a run (coefficient of variation,
    median over the runs); of the runs the scaling table times."""
    df = runs_of_kind(df, throughput_kind(df))
    single = df[(df["workers"] == 1) & ~(df["extra_processes"] > 0)]  # NaN (not recorded): kept
    medians = [float(np.median(w)) for w in single["windows"] if len(w)]
    window_cvs = [float(np.std(w, ddof=1) / np.mean(w)) for w in df["windows"] if len(w) > 1]
    noise = {"n1_runs": len(medians), "window_cv": float(np.median(window_cvs)) if window_cvs else math.nan}
    if len(medians) >= 2:
        noise.update(
            n1_min=min(medians),
            n1_max=max(medians),
            n1_ratio=max(medians) / min(medians),
            n1_cv=float(np.std(medians, ddof=1) / np.mean(medians)),
        )
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
    lines.append(
        df.to_markdown(index=False, disable_numparse=True)
        if formatted
        else df.to_markdown(index=False, floatfmt=floatfmt)
    )
    return "\n".join(lines) + "\n"


def write_table(
    df: pd.DataFrame, csv_path: str | Path, md_path: str | Path, title: str | None = None, markdown: str | None = None
) -> None:
    """CSV + Markdown twin, each written atomically. Title defaults to the file's stem;
    `markdown` replaces the plain rendering of the CSV's columns."""
    csv_path, md_path = Path(csv_path), Path(md_path)
    write_text(csv_path, df.to_csv(index=False))
    write_text(md_path, markdown or to_markdown(df, title or f"{md_path.stem} table"))
