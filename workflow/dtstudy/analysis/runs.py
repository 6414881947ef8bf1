"""The finished runs as a frame (`load_runs`, `load_run_metrics`), and the arithmetic of speedup and efficiency.

Input: one folder per training run, results/runs/{strategy}/n{workers}/seed{seed}/ (accuracy
runs) or results/runs/scaling/{strategy}/... (scaling runs, dtstudy.config.run_kinds), holding
metrics.json (written by training) and, for the kinds whose final model is tested, eval.json
(written by evaluation). Each table takes its runs of one kind (`runs_of_kind`,
`throughput_kind`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from dtstudy.common.run_folder import RunFolder
from dtstudy.config import run_kinds
from dtstudy.strategies.specs import SPECS
from dtstudy.tracking.live_run import recorded_run

FAMILY_OF = {name: spec.family for name, spec in SPECS.items()}


# --- arithmetic -----------------------------------------------------------------------


def speedup(throughput: float, base_throughput: float | None) -> float:
    """S = thr / thr_base; NaN when there is no usable baseline."""
    if base_throughput is None or not base_throughput > 0:  # also catches NaN
        return math.nan
    return throughput / base_throughput


def efficiency(speedup_value: float, workers: int) -> float:
    """E(N) = S(N) / N."""
    return speedup_value / workers


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


def run_kind(metrics: Mapping, path: Path) -> str:
    """A run's kind from its metrics.json (runs recorded before kinds were accuracy runs)."""
    kind = metrics.get("kind") or run_kinds.kind_of_run_config(metrics.get("config") or {})
    if kind not in run_kinds.KINDS:
        raise ValueError(f"{path}: unknown run kind {kind!r}; allowed: {', '.join(run_kinds.KINDS)}")
    return kind


def _extra_processes(metrics: Mapping) -> float:
    """The processes the run had besides its N workers (a parameter server's shards), from the
    knobs its metrics.json records (defaults and the shard count per node filled in); NaN for a
    run recorded without them."""
    spec, params = SPECS.get(metrics.get("strategy")), metrics.get("strategy_params")
    if spec is None or params is None or "workers" not in metrics:
        return math.nan
    try:
        return float(spec.extra_processes({**spec.defaults, **params}, metrics["workers"]))
    except (KeyError, ValueError):  # knobs of an older version
        return math.nan


def _run_row(run_dir: Path) -> dict:
    folder = RunFolder(run_dir)
    metrics_path, eval_path = folder.metrics, folder.evaluation
    metrics = read_json(metrics_path)
    kind = run_kind(metrics, metrics_path)
    # an untested kind (scaling runs) has no eval.json: no accuracy to report
    evaluation = read_json(eval_path) if run_kinds.KINDS[kind].tested else {"top1": math.nan, "top5": math.nan}
    step_time = _field(metrics, "step_time", metrics_path, convert=dict)
    # a run whose MLflow record was delivered late (tracking.live_run.deliver_pending) has it in RunFolder.mlflow_run
    run_id = (
        (metrics.get("mlflow") or {}).get("run_id")
        or evaluation.get("mlflow_run_id")
        or (recorded_run(run_dir) or {}).get("run_id")
    )
    time_to_accuracy = metrics.get("time_to_accuracy_s")
    throughput = _field(metrics, "throughput_median" if "throughput_median" in metrics else "throughput", metrics_path)
    return {
        "kind": kind,
        # a variant's run is a row of its own (config `variants`), its strategy in `base_strategy`
        "strategy": metrics.get("variant") or _field(metrics, "strategy", metrics_path, convert=str),
        "base_strategy": _field(metrics, "strategy", metrics_path, convert=str),
        "workers": _field(metrics, "workers", metrics_path, convert=int),
        "seed": _field(metrics, "seed", metrics_path, convert=int),
        "family": FAMILY_OF.get(metrics.get("strategy"), "unknown"),
        "throughput": throughput,
        # runs recorded before timed windows count as one window: their mean
        "windows": [float(w) for w in metrics.get("throughput_windows") or [throughput]],
        "compute_s": _field(step_time, "compute_s", metrics_path),
        "comm_s": _field(step_time, "comm_s", metrics_path),
        "bytes_per_step": _field(metrics, "bytes_per_step", metrics_path),
        "extra_processes": _extra_processes(metrics),
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
    duplicated = df[df.duplicated(["kind", "strategy", "workers", "seed"], keep=False)]
    if not duplicated.empty:
        raise ValueError(
            "several folders hold the same (kind, strategy, workers, seed): " + ", ".join(duplicated["run_dir"])
        )
    return df


def throughput_kind(df: pd.DataFrame) -> str:
    """The kind the scaling table times: the scaling runs, or the accuracy runs of a study
    without scaling runs (scaling.steps: null)."""
    return run_kinds.SCALING if (df["kind"] == run_kinds.SCALING).any() else run_kinds.ACCURACY


def runs_of_kind(df: pd.DataFrame, kind: str) -> pd.DataFrame:
    return df[df["kind"] == kind].reset_index(drop=True)


def load_run_metrics(run_dirs: Iterable[str | Path]) -> dict[str, dict]:
    """{run folder: its metrics.json}, keyed like load_runs' run_dir column."""
    return {str(Path(d)): read_json(RunFolder(d).metrics) for d in run_dirs}
