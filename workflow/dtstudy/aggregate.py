"""Scaling and accuracy tables, plots and the MLflow study run, from the finished runs.

Input: one folder per training run, results/runs/{strategy}/n{workers}/seed{seed}/,
holding metrics.json (written by training) and eval.json (written by evaluation).

Spread over seeds is the sample standard deviation (ddof=1); with a single seed there is
no spread to estimate and it is reported as 0.0 rather than NaN.
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
from matplotlib.ticker import MaxNLocator

from . import tracking
from .atomic_files import atomic_write, write_text

BASELINE_STRATEGY = "allreduce"
SCALING_COLUMNS = ["strategy", "workers", "seeds", "throughput", "throughput_std", "speedup",
                   "efficiency", "speedup_vs_allreduce_1",
                   "compute_s", "comm_s", "bytes_per_step", "oversubscribed"]
ACCURACY_COLUMNS = ["strategy", "workers", "seeds", "top1_mean", "top1_std", "top5_mean",
                    "time_to_accuracy_s", "top5_std", "reached_target"]
OVERSUBSCRIBED_NOTE = ("Note: rows marked oversubscribed ran more workers than CPU cores, "
                       "so their throughput (and timings) are not meaningful.")
_FLOAT_FORMATS = {"throughput": ".1f", "throughput_std": ".1f", "bytes_per_step": ".0f",
                  "compute_s": ".5f", "comm_s": ".5f", "time_to_accuracy_s": ".1f"}
_DEFAULT_FLOAT_FORMAT = ".4f"
_LEGEND_ROWS = 18  # what fits beside a 4.5-inch-high plot


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
    return {
        "strategy": _field(metrics, "strategy", metrics_path, convert=str),
        "workers": _field(metrics, "workers", metrics_path, convert=int),
        "seed": _field(metrics, "seed", metrics_path, convert=int),
        "throughput": _field(metrics, "throughput", metrics_path),
        "compute_s": _field(step_time, "compute_s", metrics_path),
        "comm_s": _field(step_time, "comm_s", metrics_path),
        "bytes_per_step": _field(metrics, "bytes_per_step", metrics_path),
        "top1": _field(evaluation, "top1", eval_path),
        "top5": _field(evaluation, "top5", eval_path),
        "time_to_accuracy_s": math.nan if time_to_accuracy is None else float(time_to_accuracy),
        "wall_time_s": _field(metrics, "wall_time_s", metrics_path),
        "oversubscribed": bool((metrics.get("environment") or {}).get("oversubscribed", False)),
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


def scaling_table(df: pd.DataFrame, strategies_order: Sequence[str] | None = None) -> pd.DataFrame:
    """Throughput, speedup and efficiency per (strategy, N), over seeds."""
    table = _per_config(df).agg(
        seeds=("seed", "nunique"),
        throughput=("throughput", "mean"),
        throughput_std=("throughput", sample_std),
        compute_s=("compute_s", "mean"),
        comm_s=("comm_s", "mean"),
        bytes_per_step=("bytes_per_step", "mean"),
        oversubscribed=("oversubscribed", "any"),
    ).reset_index()
    single_worker = table[table["workers"] == 1].set_index("strategy")["throughput"]
    baseline = single_worker.get(BASELINE_STRATEGY)
    table["speedup"] = [speedup(thr, single_worker.get(name))
                        for name, thr in zip(table["strategy"], table["throughput"])]
    table["efficiency"] = [efficiency(s, n) for s, n in zip(table["speedup"], table["workers"])]
    table["speedup_vs_allreduce_1"] = [speedup(thr, baseline) for thr in table["throughput"]]
    return _sorted(table, strategies_order)[SCALING_COLUMNS]


def _reached_fraction(times: pd.Series) -> str:
    return f"{int(times.notna().sum())}/{len(times)}"


def accuracy_table(df: pd.DataFrame, strategies_order: Sequence[str] | None = None) -> pd.DataFrame:
    """Final test top-1/top-5 and time-to-accuracy per (strategy, N), over seeds."""
    table = _per_config(df).agg(
        seeds=("seed", "nunique"),
        top1_mean=("top1", "mean"),
        top1_std=("top1", sample_std),
        top5_mean=("top5", "mean"),
        time_to_accuracy_s=("time_to_accuracy_s", mean_of_reached),
        top5_std=("top5", sample_std),
        reached_target=("time_to_accuracy_s", _reached_fraction),
    ).reset_index()
    return _sorted(table, strategies_order)[ACCURACY_COLUMNS]


# --- writing --------------------------------------------------------------------------

def to_markdown(df: pd.DataFrame, title: str) -> str:
    """A one-line title, the oversubscription note if needed, then the table."""
    floatfmt = tuple(_FLOAT_FORMATS.get(c, _DEFAULT_FLOAT_FORMAT) for c in df.columns)
    lines = [f"# {title}", ""]
    if "oversubscribed" in df.columns and df["oversubscribed"].any():
        lines += [OVERSUBSCRIBED_NOTE, ""]
    lines.append(df.to_markdown(index=False, floatfmt=floatfmt))
    return "\n".join(lines) + "\n"


def write_table(df: pd.DataFrame, csv_path: str | Path, md_path: str | Path,
                title: str | None = None) -> None:
    """CSV + Markdown twin, each written atomically. Title defaults to the file's stem."""
    csv_path, md_path = Path(csv_path), Path(md_path)
    markdown = to_markdown(df, title or f"{md_path.stem} table")
    write_text(csv_path, df.to_csv(index=False))
    write_text(md_path, markdown)


# --- plots ----------------------------------------------------------------------------

def _new_figure(ncols: int = 1) -> tuple[Figure, list]:
    # A bare Figure with an Agg canvas: no pyplot, so no global backend state is touched.
    figure = Figure(figsize=(5.5 * ncols + 2.5, 4.5), layout="constrained")  # + legend
    FigureCanvasAgg(figure)
    return figure, [figure.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _save(figure: Figure, path: Path) -> Path:
    # One legend outside the axes: with many strategies an in-plot legend hides the lines.
    handles, labels = figure.axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside right upper", fontsize="small",
                  ncols=math.ceil(len(labels) / _LEGEND_ROWS) or 1)
    atomic_write(path, lambda stream: figure.savefig(stream, format="png", dpi=120))
    return path


def _log2_workers_axis(ax, workers: Iterable[int]) -> None:
    ticks = sorted(set(int(n) for n in workers))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.minorticks_off()
    ax.set_xlabel("workers N")


def _by_strategy(table: pd.DataFrame):
    """(colour, strategy, its rows); a 20-colour map once there are more than 10 strategies."""
    groups = list(table.groupby("strategy", sort=False))
    colormap = matplotlib.colormaps["tab10" if len(groups) <= 10 else "tab20"]
    for index, (name, rows) in enumerate(groups):
        yield colormap(index % colormap.N), name, rows


def _finish(ax, title: str, ylabel: str, footnote: bool = False) -> None:
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if footnote:
        ax.annotate("x = oversubscribed (more workers than cores)", (0, 0),
                    xycoords="axes fraction", xytext=(4, 4), textcoords="offset points",
                    fontsize="x-small")


def _mark_oversubscribed(ax, rows: pd.DataFrame, column: str) -> None:
    marked = rows[rows["oversubscribed"]]
    ax.plot(marked["workers"], marked[column], "kx", markersize=9, label=None)


def plot_throughput(scaling: pd.DataFrame, path: Path) -> Path:
    figure, (ax,) = _new_figure()
    for color, name, rows in _by_strategy(scaling):
        ax.errorbar(rows["workers"], rows["throughput"], yerr=rows["throughput_std"],
                    color=color, marker="o", capsize=3, label=name)
        single = rows.loc[rows["workers"] == 1, "throughput"]
        if not single.empty:
            ax.plot(rows["workers"], single.iloc[0] * rows["workers"], color=color,
                    linestyle="--", alpha=0.6)
        _mark_oversubscribed(ax, rows, "throughput")
    _log2_workers_axis(ax, scaling["workers"])
    _finish(ax, "Throughput vs workers (dashed: ideal thr(1)*N)", "images/s (all workers)",
            footnote=scaling["oversubscribed"].any())
    return _save(figure, path)


def plot_efficiency(scaling: pd.DataFrame, path: Path) -> Path:
    figure, (ax,) = _new_figure()
    ax.axhline(1.0, color="grey", linestyle="--", label="ideal")
    for color, name, rows in _by_strategy(scaling):
        ax.plot(rows["workers"], rows["efficiency"], color=color, marker="o", label=name)
        _mark_oversubscribed(ax, rows, "efficiency")
    _log2_workers_axis(ax, scaling["workers"])
    _finish(ax, "Scaling efficiency E(N) = S(N)/N", "efficiency",
            footnote=scaling["oversubscribed"].any())
    return _save(figure, path)


def plot_accuracy(accuracy: pd.DataFrame, path: Path) -> Path:
    figure, (ax,) = _new_figure()
    for color, name, rows in _by_strategy(accuracy):
        ax.errorbar(rows["workers"], rows["top1_mean"], yerr=rows["top1_std"],
                    color=color, marker="o", capsize=3, label=name)
    _log2_workers_axis(ax, accuracy["workers"])
    _finish(ax, "Test top-1 vs workers (mean ± std over seeds)", "test top-1")
    return _save(figure, path)


def _representative_runs(df: pd.DataFrame) -> pd.DataFrame:
    """One run per (strategy, N): seed 0, else the lowest seed present."""
    return df.sort_values("seed").groupby(["strategy", "workers"], sort=False).head(1)


def plot_convergence(df: pd.DataFrame, run_metrics: Mapping[str, dict], path: Path,
                     strategies_order: Sequence[str] | None = None) -> Path:
    figure, (by_epoch, by_time) = _new_figure(ncols=2)
    runs = _sorted(_representative_runs(df), strategies_order)
    linestyles = ["-", "--", ":", "-."]
    worker_counts = sorted(runs["workers"].unique())
    targets = set()
    for color, name, rows in _by_strategy(runs):
        for run in rows.itertuples():
            metrics = run_metrics[run.run_dir]
            targets.add(metrics.get("target_accuracy"))
            val = metrics.get("val") or []
            style = linestyles[worker_counts.index(run.workers) % len(linestyles)]
            label = f"{name} N={run.workers}"
            top1 = [v["top1"] for v in val]
            by_epoch.plot([v["epoch"] for v in val], top1, color=color, linestyle=style,
                          marker=".", label=label)
            by_time.plot([v["wall_s"] for v in val], top1, color=color, linestyle=style,
                         marker=".", label=label)
    for target in targets - {None}:
        for ax in (by_epoch, by_time):
            ax.axhline(target, color="grey", linewidth=0.8, linestyle=":")
    by_epoch.set_xlabel("epoch")
    by_epoch.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_time.set_xlabel("wall time (s)")
    _finish(by_epoch, "Validation top-1 vs epoch", "validation top-1")
    _finish(by_time, "Validation top-1 vs wall time", "validation top-1")
    return _save(figure, path)


def make_plots(df: pd.DataFrame, run_metrics: Mapping[str | Path, dict], plots_dir: str | Path,
               strategies_order: Sequence[str] | None = None) -> list[Path]:
    """throughput.png, efficiency.png, accuracy.png, convergence.png from the per-run frame."""
    plots_dir = Path(plots_dir)
    metrics_by_dir = {str(Path(k)): v for k, v in run_metrics.items()}
    scaling = scaling_table(df, strategies_order)
    accuracy = accuracy_table(df, strategies_order)
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

    tables = {"scaling": scaling_table(df, strategies_order),
              "accuracy": accuracy_table(df, strategies_order)}
    table_paths = []
    for name, table in tables.items():
        csv_path, md_path = tables_dir / f"{name}.csv", tables_dir / f"{name}.md"
        write_table(table, csv_path, md_path, title=f"{name.capitalize()} table")
        table_paths += [csv_path, md_path]
    log(f"wrote {len(table_paths)} tables to {tables_dir}")

    plot_paths = make_plots(df, run_metrics, plots_dir, strategies_order)
    log(f"wrote {len(plot_paths)} plots to {plots_dir}")

    uri = tracking.resolve_uri(tracking_uri)
    child_run_ids = [run_id for run_id in df["mlflow_run_id"] if run_id]
    artifacts = {**{p: "tables" for p in table_paths}, **{p: "plots" for p in plot_paths}}
    parent_run_id = tracking.log_study_run(uri, experiment, child_run_ids, artifacts,
                                           params=study_params or {})
    log(f"study run {parent_run_id} logged to {uri} with {len(child_run_ids)} child runs")
    view = tracking.publish_runs_view(uri, tracking.init_store(uri, experiment), parent_run_id)
    log(f"in the MLflow UI (mlflow ui --backend-store-uri {uri}): open http://localhost:5000/{view}")
    return {"runs": len(df), "tables": table_paths, "plots": plot_paths,
            "parent_run_id": parent_run_id, "tracking_uri": uri}
