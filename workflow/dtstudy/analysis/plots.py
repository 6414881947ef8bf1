"""The study's plots: throughput, efficiency, accuracy, time to the target accuracy and convergence (`make_plots`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import matplotlib
import pandas as pd
from matplotlib import ticker
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from dtstudy.analysis.figures import DRAWN
from dtstudy.analysis.runs import runs_of_kind
from dtstudy.analysis.tables import BASELINE_STRATEGY, accuracy_table, scaling_table, sorted_by_strategy
from dtstudy.common import intervals
from dtstudy.common.atomic_files import atomic_write
from dtstudy.config.run_kinds import ACCURACY
from dtstudy.strategies.specs import FAMILIES, REFERENCE_STRATEGY

# One panel per strategy family (FAMILIES), so that no panel holds more than a handful of
# lines; allreduce (the baseline) and no_exchange (the machine's ceiling) on every panel.
# What is plotted and from which runs is the figure's title, once; a panel's title is its family.


def _family_panels(
    table: pd.DataFrame, name: str, source: str, drawn: Iterable[str] | None = None, ncols: int = 2
) -> tuple[Figure, list[tuple[str, object]]]:
    """The figure `name` (figures.DRAWN: its title) with a panel per family present in `table`;
    `drawn`: the kinds of interval its rows hold."""
    present = [f for f in FAMILIES if f != "reference" and (table["family"] == f).any()]
    present = present or ["all"]
    rows = math.ceil(len(present) / ncols)
    width = 6.0 * min(ncols, len(present))
    figure = Figure(figsize=(width, 4.0 * rows), layout="constrained")
    FigureCanvasAgg(figure)  # a bare Figure with an Agg canvas: no pyplot global state
    figure.suptitle(DRAWN[name].title(source, drawn), wrap=True)  # wrapped to the figure's width
    return figure, [
        (family, figure.add_subplot(rows, min(ncols, len(present)), i + 1)) for i, family in enumerate(present)
    ]


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
    ax.set_xlabel(DRAWN["throughput"].x_label)


def _colors(names: Sequence[str]) -> dict:
    colormap = matplotlib.colormaps["tab10"]
    return {name: colormap(i % colormap.N) for i, name in enumerate(names)}


def _yerr(rows: pd.DataFrame, column: str):
    """Asymmetric error bars from the interval columns (none where the interval is NaN)."""
    low = (rows[column] - rows[f"{column}_low"]).clip(lower=0).fillna(0)
    high = (rows[f"{column}_high"] - rows[column]).clip(lower=0).fillna(0)
    return [low.to_numpy(), high.to_numpy()]


def _finish(ax, family: str, ylabel: str, rows: pd.DataFrame | None = None) -> None:
    ax.set_title(family)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if rows is not None and "oversubscribed" in rows and rows["oversubscribed"].any():
        ax.annotate(
            "x = oversubscribed (more processes than cores)",
            (1, 1),
            xycoords="axes fraction",
            xytext=(-4, -4),
            textcoords="offset points",
            fontsize="x-small",
            ha="right",
            va="top",
        )


def _mark_oversubscribed(ax, rows: pd.DataFrame, column: str) -> None:
    marked = rows[rows["oversubscribed"].astype(bool)]
    ax.plot(marked["workers"], marked[column], "kx", markersize=9, label=None)


def _plot_strategies(ax, table: pd.DataFrame, family: str, column: str, colors: dict) -> pd.DataFrame:
    """The family's strategies with error bars, and allreduce (thin grey) on the other panels."""
    rows = _family_rows(table, family)
    baseline = table[table["strategy"] == BASELINE_STRATEGY]
    if family != "synchronous" and not baseline.empty:
        ax.errorbar(
            baseline["workers"],
            baseline[column],
            yerr=_yerr(baseline, column),
            color="grey",
            linewidth=1,
            capsize=2,
            alpha=0.7,
            label="allreduce",
        )
    for name, own in rows.groupby("strategy", sort=False):
        ax.errorbar(
            own["workers"], own[column], yerr=_yerr(own, column), color=colors[name], marker="o", capsize=3, label=name
        )
        if "oversubscribed" in own:
            _mark_oversubscribed(ax, own, column)
    return rows


def _plot_ceiling(ax, ceiling: pd.DataFrame, column: str) -> None:
    if not ceiling.empty:
        ax.errorbar(
            ceiling["workers"],
            ceiling[column],
            yerr=_yerr(ceiling, column),
            color="black",
            linestyle=":",
            capsize=2,
            label="ceiling (no_exchange)",
        )


def _source(table: pd.DataFrame) -> str:
    """The kind of run a table's figures come from, for a plot's title (tables' from_runs)."""
    return f"{table['from_runs'].iloc[0]} runs"


def _plot_ideals(ax, scaling: pd.DataFrame, rows: pd.DataFrame, colors: dict) -> None:
    """Each strategy of the panel's own ideal, its N=1 throughput times N (dashed, in its colour):
    a family's N=1 need not be allreduce's (a parameter server's N=1 sends every step to a shard)."""
    ns = sorted(scaling["workers"].unique())
    drawn = False
    for name, own in rows.groupby("strategy", sort=False):
        one = own[own["workers"] == 1]["throughput"]
        if not one.empty:
            ax.plot(ns, [one.iloc[0] * n for n in ns], color=colors[name], linestyle="--", linewidth=0.8, alpha=0.6)
            drawn = True
    if drawn:  # one legend entry for the dashed lines
        ax.add_line(Line2D([], [], color="grey", linestyle="--", linewidth=0.8, label="ideal: its own thr(1)·N"))


def plot_throughput(scaling: pd.DataFrame, path: Path) -> Path:
    figure, panels = _family_panels(scaling, "throughput", _source(scaling))
    colors = _colors(list(dict.fromkeys(scaling["strategy"])))
    ceiling = scaling[scaling["strategy"] == REFERENCE_STRATEGY]
    for family, ax in panels:
        rows = _plot_strategies(ax, scaling, family, "throughput", colors)
        _plot_ideals(ax, scaling, rows, colors)
        _plot_ceiling(ax, ceiling, "throughput")
        _log2_workers_axis(ax, scaling["workers"])
        _finish(ax, family, "images/s (all workers)", rows)
    return _save(figure, path)


def plot_efficiency(scaling: pd.DataFrame, path: Path) -> Path:
    figure, panels = _family_panels(scaling, "efficiency", _source(scaling))
    colors = _colors(list(dict.fromkeys(scaling["strategy"])))
    ceiling = scaling[scaling["strategy"] == REFERENCE_STRATEGY]
    for family, ax in panels:
        ax.axhline(1.0, color="grey", linestyle="--", label="ideal E = 1")
        rows = _plot_strategies(ax, scaling, family, "efficiency", colors)
        _plot_ceiling(ax, ceiling, "efficiency")
        _log2_workers_axis(ax, scaling["workers"])
        _finish(ax, family, "efficiency", rows)
    return _save(figure, path)


def plot_accuracy(accuracy: pd.DataFrame, path: Path) -> Path:
    figure, panels = _family_panels(accuracy, "accuracy", _source(accuracy), accuracy["top1_interval"])
    colors = _colors(list(dict.fromkeys(accuracy["strategy"])))
    for family, ax in panels:
        _plot_strategies(ax, accuracy, family, "top1", colors)
        _log2_workers_axis(ax, accuracy["workers"])
        _finish(ax, family, "test top-1")
    return _save(figure, path)


def plot_time_to_accuracy(accuracy: pd.DataFrame, path: Path, clock: str = "this machine's") -> Path:
    """Time to target_accuracy against N per family, the mean over the seeds that reached it with
    its interval (a log scale: it spans orders of magnitude from N=1 to the largest N); `clock`
    says whose seconds they are (an emulated study's are the cluster's)."""
    reached = accuracy["reached_target"].map(lambda fraction: int(fraction.split("/")[0]))
    figure, panels = _family_panels(
        accuracy, "time_to_accuracy", _source(accuracy), reached.map(intervals.mean_interval_kind)
    )
    colors = _colors(list(dict.fromkeys(accuracy["strategy"])))
    for family, ax in panels:
        rows = _plot_strategies(ax, accuracy, family, "time_to_accuracy_s", colors)
        _log2_workers_axis(ax, accuracy["workers"])
        if (_family_rows(accuracy, family)["time_to_accuracy_s"] > 0).any():  # a panel with no time stays linear
            ax.set_yscale("log")
            # plain seconds (3, 4, 6, 20) rather than 3x10^0 on the ticks of a range under a decade
            for axis_ticks in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                axis_ticks(ticker.FuncFormatter(lambda seconds, _position: f"{seconds:g}"))
        if _family_rows(accuracy, family)["time_to_accuracy_s"].isna().any():
            ax.annotate(
                "no point: no seed reached the target",
                (0, 0),
                xycoords="axes fraction",
                xytext=(4, 4),
                textcoords="offset points",
                fontsize="x-small",
                ha="left",
                va="bottom",
            )
        _finish(ax, family, f"seconds to target ({clock} clock)", rows)
    return _save(figure, path)


def with_oversubscribed(accuracy: pd.DataFrame, df: pd.DataFrame) -> pd.DataFrame:
    """The accuracy table with the column `oversubscribed` of its runs (any seed), for marking the
    times that ran more processes than cores (the table itself does not time anything)."""
    runs = runs_of_kind(df, ACCURACY)
    marked = runs.groupby(["strategy", "workers"])["oversubscribed"].any()
    keys = zip(accuracy["strategy"], accuracy["workers"])
    return accuracy.assign(oversubscribed=[bool(marked.get(key, False)) for key in keys])


def _representative_runs(df: pd.DataFrame) -> pd.DataFrame:
    """One run per (strategy, N): seed 0, else the lowest seed present."""
    return df.sort_values("seed").groupby(["strategy", "workers"], sort=False).head(1)


def plot_convergence(
    df: pd.DataFrame, run_metrics: Mapping[str, dict], path: Path, strategies_order: Sequence[str] | None = None
) -> Path:
    """Validation top-1 against training time, per family (the lowest seed of each run), of the accuracy runs."""
    df = runs_of_kind(df, ACCURACY)
    runs = sorted_by_strategy(_representative_runs(df[df["strategy"] != REFERENCE_STRATEGY]), strategies_order)
    figure, panels = _family_panels(runs, "convergence", f"{ACCURACY} runs")
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
            ax.plot(
                [v.get("train_s", v["wall_s"]) for v in val],
                [v["top1"] for v in val],
                color=colors[run.strategy],
                linestyle=style,
                marker=".",
                markersize=3,
                label=f"{run.strategy} N={run.workers}",
            )
        for target in sorted(targets - {None}):
            ax.axhline(target, color="grey", linewidth=0.8, linestyle=":", label=f"target_accuracy {target:g}")
        ax.set_xlabel(DRAWN["convergence"].x_label)
        _finish(ax, family, "validation top-1")
    return _save(figure, path)


def make_plots(
    df: pd.DataFrame,
    run_metrics: Mapping[str | Path, dict],
    plots_dir: str | Path,
    strategies_order: Sequence[str] | None = None,
    scaling: pd.DataFrame | None = None,
    accuracy: pd.DataFrame | None = None,
    clock: str = "this machine's",
) -> list[Path]:
    """throughput.png, efficiency.png, accuracy.png, time_to_accuracy.png, convergence.png from
    the per-run frame (and its tables, when the caller has them already: the scaling table's
    bootstraps are the step's largest cost); `clock`: whose seconds the runs' times are."""
    plots_dir = Path(plots_dir)
    metrics_by_dir = {str(Path(k)): v for k, v in run_metrics.items()}
    scaling = scaling_table(df, strategies_order) if scaling is None else scaling
    accuracy = accuracy_table(df, strategies_order, metrics_by_dir) if accuracy is None else accuracy
    return [
        plot_throughput(scaling, plots_dir / "throughput.png"),
        plot_efficiency(scaling, plots_dir / "efficiency.png"),
        plot_accuracy(accuracy, plots_dir / "accuracy.png"),
        plot_time_to_accuracy(with_oversubscribed(accuracy, df), plots_dir / "time_to_accuracy.png", clock),
        plot_convergence(df, metrics_by_dir, plots_dir / "convergence.png", strategies_order),
    ]
