"""The aggregate step (`aggregate_study`): tables, findings, plots and the MLflow study run, from the finished runs."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import pandas as pd

from dtstudy.analysis.claims import study_facts, verdicts
from dtstudy.analysis.findings import accuracy_markdown, findings_markdown, scaling_markdown
from dtstudy.analysis.pages import write_page
from dtstudy.analysis.plots import make_plots
from dtstudy.analysis.runs import load_run_metrics, load_runs
from dtstudy.analysis.tables import accuracy_table, noise_summary, scaling_table, write_table
from dtstudy.common.atomic_files import write_text
from dtstudy.common.run_folder import EVALUATION, MLFLOW_PENDING
from dtstudy.tracking import mlflow_store
from dtstudy.tracking.live_run import deliver_pending


def log(message: str) -> None:
    print(f"[aggregate] {message}", flush=True)


def deliver_kept_results(run_dirs: Iterable[Path], wait_for_server_s: float = 300.0, retry_s: float = 5.0) -> None:
    """Runs that ended while the MLflow server was away kept their results (RunFolder.mlflow_pending,
    or test metrics in RunFolder.evaluation): deliver them now, before the study run adopts its runs,
    trying again every `retry_s` for `wait_for_server_s` (tracking.wait_for_server_s) while
    the server is still away."""
    deadline = time.monotonic() + wait_for_server_s
    for run_dir in run_dirs:
        while True:
            try:
                record = deliver_pending(run_dir)
                break
            except Exception as error:
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"{run_dir}: the results this run kept while MLflow was away ({MLFLOW_PENDING}, {EVALUATION}) "
                        f"could not be delivered in {wait_for_server_s:.0f} s (tracking.wait_for_server_s; "
                        f"{type(error).__name__}: {str(error).splitlines()[0][:300]}); start the tracking server "
                        "and run the study again"
                    ) from error
                log(f"{run_dir}: MLflow still away ({type(error).__name__}); trying again in {retry_s:.0f} s")
                time.sleep(retry_s)
        if record is not None:
            log(f"{run_dir}: results kept while MLflow was away delivered to run {record['run_id']}")


def emulated_cluster(run_metrics: Mapping[str, Mapping]) -> str | None:
    """The hardware profile(s) the study's runs were emulated on (metrics.json's `emulation`),
    in words; None for a study of real runs (launcher.cluster local or slurm)."""
    profiles = sorted({(m.get("emulation") or {}).get("hardware") for m in run_metrics.values()})
    if not profiles or None in profiles:
        return None
    return f"emulated on {', '.join(profiles)}"


def host_facts_off_the_clock(df: pd.DataFrame, run_metrics: Mapping[str, Mapping]) -> pd.DataFrame:
    """An emulated run's times are read on the cluster's clock, so this machine's cores do not
    enter them: its logical workers are neither oversubscribed nor unpinned processes (the
    flags the tables and plots mark real runs with)."""
    emulated = df["run_dir"].map(lambda run_dir: "emulation" in run_metrics.get(run_dir, {}))
    return df.assign(oversubscribed=df["oversubscribed"] & ~emulated, pinned=df["pinned"] | emulated)


#: the scaling table's columns each run it pools gets in MLflow (under the table's names)
RUN_TABLE_FIGURES = ("efficiency", "efficiency_low", "efficiency_high")


def efficiency_by_run(scaling: pd.DataFrame, df: pd.DataFrame) -> dict[str, dict[str, float]]:
    """{MLflow run id: RUN_TABLE_FIGURES of its scaling-table cell}, for the runs the table pools
    (those of its from_runs kind); figures the table has not (NaN) left out."""
    cells = scaling.set_index(["strategy", "workers"])
    figures = {}
    for run in df[df["kind"] == scaling["from_runs"].iloc[0]].itertuples():
        if run.mlflow_run_id and (run.strategy, run.workers) in cells.index:
            cell = cells.loc[(run.strategy, run.workers)]
            figures[run.mlflow_run_id] = {key: float(cell[key]) for key in RUN_TABLE_FIGURES if not pd.isna(cell[key])}
    return figures


def aggregate_study(
    run_dirs: Iterable[str | Path],
    tables_dir: str | Path,
    plots_dir: str | Path,
    tracking_uri: str | None,
    experiment: str,
    strategies_order: Sequence[str] | None = None,
    study_params: Mapping | None = None,
    wait_for_server_s: float = 300.0,
) -> dict:
    """Tables + plots from the run folders, then the MLflow study run that adopts them."""
    run_dirs = [Path(d) for d in run_dirs]
    tables_dir, plots_dir = Path(tables_dir), Path(plots_dir)

    deliver_kept_results(run_dirs, wait_for_server_s)
    run_metrics = load_run_metrics(run_dirs)
    df = host_facts_off_the_clock(load_runs(run_dirs), run_metrics)
    runs_by_kind = {f"{kind}_runs": int(count) for kind, count in df["kind"].value_counts().items()}
    log(
        f"loaded {len(df)} runs ({df['strategy'].nunique()} strategies; "
        + ", ".join(f"{count} {name.replace('_', ' ')}" for name, count in runs_by_kind.items())
        + ")"
    )

    scaling, noise = scaling_table(df, strategies_order), noise_summary(df)
    accuracy = accuracy_table(df, strategies_order, run_metrics)
    tables = {
        "scaling": (scaling, scaling_markdown(scaling, noise)),
        "accuracy": (accuracy, accuracy_markdown(accuracy)),
    }
    table_paths = []
    for name, (table, markdown) in tables.items():
        csv_path, md_path = tables_dir / f"{name}.csv", tables_dir / f"{name}.md"
        write_table(table, csv_path, md_path, markdown=markdown)
        table_paths += [csv_path, md_path]
    findings_path = tables_dir / "findings.md"
    # an emulated study tests the published claims at scale (dtstudy.analysis.claims)
    cluster = emulated_cluster(run_metrics)
    claims = None if cluster is None else (verdicts(accuracy, study_facts(df, run_metrics)), cluster)
    write_text(findings_path, findings_markdown(scaling, accuracy, noise, claims))
    table_paths.append(findings_path)
    # the report shows HTML as a page, Markdown only as a download
    pages = [write_page(path) for path in table_paths if path.suffix == ".md"]
    log(f"wrote {len(table_paths)} tables and {len(pages)} pages of them to {tables_dir}")

    plot_paths = make_plots(
        df,
        run_metrics,
        plots_dir,
        strategies_order,
        scaling,
        accuracy,
        clock="emulated cluster's" if cluster else "this machine's",
    )
    log(f"wrote {len(plot_paths)} plots to {plots_dir}")

    uri = mlflow_store.resolve_uri(tracking_uri)
    mlflow_store.log_table_figures(uri, efficiency_by_run(scaling, df))
    child_run_ids = [run_id for run_id in df["mlflow_run_id"] if run_id]
    artifacts = {**{p: "tables" for p in table_paths}, **{p: "plots" for p in plot_paths}}
    # the study run adopts the runs of both kinds and counts each (scaling_runs, accuracy_runs)
    parent_run_id = mlflow_store.log_study_run(
        uri, experiment, child_run_ids, artifacts, params=study_params or {}, metrics=runs_by_kind
    )
    log(f"study run {parent_run_id} logged to {uri} with {len(child_run_ids)} child runs")
    view = mlflow_store.publish_runs_view(uri, mlflow_store.init_store(uri, experiment))
    log(f"in the MLflow UI (mlflow ui --backend-store-uri {uri}): open http://localhost:5000/{view}")
    return {
        "runs": len(df),
        "tables": table_paths,
        "plots": plot_paths,
        "parent_run_id": parent_run_id,
        "tracking_uri": uri,
    }
