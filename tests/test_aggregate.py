"""Tables, Markdown twins and plots from hand-made run folders with hand-chosen numbers."""

import json
import math
import re

import numpy as np
import pandas as pd
import pytest

from dtstudy.analysis.aggregate import aggregate_study
from dtstudy.analysis.findings import accuracy_markdown, findings_markdown, noise_note, scaling_markdown
from dtstudy.analysis.plots import make_plots
from dtstudy.analysis.runs import efficiency, load_run_metrics, load_runs, mean_of_reached, speedup
from dtstudy.analysis.tables import (
    ACCURACY_COLUMNS,
    OVERSUBSCRIBED_NOTE,
    SCALING_COLUMNS,
    accuracy_table,
    noise_summary,
    scaling_table,
    write_table,
)

# Throughput (images/s) per (strategy, workers) for seeds 0 and 1.
THROUGHPUT = {
    ("allreduce", 1): (100.0, 110.0),  # mean 105
    ("allreduce", 2): (200.0, 210.0),  # mean 205
    ("allreduce", 4): (380.0, 400.0),  # mean 390
    ("ps_sync", 1): (80.0, 90.0),  # mean 85
    ("ps_sync", 2): (150.0, 160.0),  # mean 155
    ("ps_sync", 4): (260.0, 280.0),  # mean 270
}
# Test top-1 per (strategy, workers) for seeds 0 and 1.
TOP1 = {
    ("allreduce", 1): (0.90, 0.92),
    ("allreduce", 2): (0.89, 0.91),
    ("allreduce", 4): (0.88, 0.90),
    ("ps_sync", 1): (0.90, 0.90),
    ("ps_sync", 2): (0.87, 0.89),
    ("ps_sync", 4): (0.80, 0.84),
}
# Time to reach the target accuracy per seed; None = never reached.
TIME_TO_ACCURACY = {("ps_sync", 4): (30.0, None), ("ps_sync", 2): (None, None)}
SEEDS = (0, 1)


def write_run(root, strategy, workers, seed, *, oversubscribed=False, windows=None, top1=None, kind=None):
    """An accuracy run's folder (metrics.json, eval.json); kind="scaling": a scaling run's
    (results/runs/scaling/..., metrics.json only, its kind in it)."""
    run_dir = root / "runs" / ("scaling" if kind == "scaling" else "") / strategy / f"n{workers}" / f"seed{seed}"
    run_dir.mkdir(parents=True)
    run_id = f"{strategy}-{workers}-{seed}" + (f"-{kind}" if kind else "")
    reach = TIME_TO_ACCURACY.get((strategy, workers), (10.0 * workers, 12.0 * workers, 14.0 * workers))[seed]
    metrics = {
        "strategy": strategy,
        "workers": workers,
        "seed": seed,
        "throughput": THROUGHPUT[strategy, workers][seed] if windows is None else sum(windows) / len(windows),
        # five equal windows: the pooled median of two seeds is then their mean
        "throughput_windows": windows or [THROUGHPUT[strategy, workers][seed]] * 5,
        "step_time": {"total_s": 0.05, "compute_s": 0.04 + seed * 0.01, "comm_s": 0.01, "data_s": 0.001},
        "bytes_per_step": 1000.0 * workers,
        # the knobs as the run recorded them: ps_sync with a shard per "node" of 2 workers
        "strategy_params": {"shards": max(1, workers // 2)} if strategy == "ps_sync" else {},
        "train_loss": [2.3, 2.1, 1.9],
        "val": [{"epoch": e, "step": 100 * e, "top1": 0.6 + 0.1 * e, "wall_s": 5.0 * e / workers} for e in (1, 2, 3)],
        "target_accuracy": 0.85,
        "time_to_accuracy_s": reach,
        "wall_time_s": 40.0,
        "environment": {
            "host": "test",
            "cores": 2,
            "oversubscribed": oversubscribed,
            "pinned_cores": [0],
            "device_type": "cpu",
            "backend": "gloo",
        },
        "mlflow": {"run_id": run_id, "experiment_id": "1", "tracking_uri": "sqlite:///x.db"},
    }
    if kind is not None:
        metrics["kind"] = kind
    if kind == "scaling":  # not tested: no eval.json
        (run_dir / "metrics.json").write_text(json.dumps(metrics))
        return run_dir
    evaluation = {
        "top1": TOP1.get((strategy, workers), (0.5, 0.5))[seed] if top1 is None else top1,
        "top5": 0.99,
        "test_images": 10000,
        "mlflow_run_id": run_id,
    }
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    (run_dir / "eval.json").write_text(json.dumps(evaluation))
    return run_dir


@pytest.fixture
def run_dirs(tmp_path):
    # Written in a scrambled order, so that row order comes from the sorting.
    return [
        write_run(tmp_path, strategy, workers, seed)
        for (strategy, workers) in sorted(THROUGHPUT, reverse=True)
        for seed in SEEDS
    ]


@pytest.fixture
def runs(run_dirs):
    return load_runs(run_dirs)


def row(table, strategy, workers):
    match = table[(table["strategy"] == strategy) & (table["workers"] == workers)]
    assert len(match) == 1
    return match.iloc[0]


# --- arithmetic -----------------------------------------------------------------------


def test_speedup_and_efficiency_by_hand():
    assert speedup(205.0, 105.0) == pytest.approx(1.952381, rel=1e-6)
    assert efficiency(3.714286, 4) == pytest.approx(0.928571, rel=1e-6)
    assert math.isnan(speedup(205.0, None))
    assert math.isnan(speedup(205.0, float("nan")))


def test_mean_of_reached_ignores_runs_that_never_reached():
    assert mean_of_reached([30.0, None, 50.0]) == 40.0
    assert math.isnan(mean_of_reached([None, float("nan")]))


# --- loading --------------------------------------------------------------------------


def test_load_runs_one_row_per_run(runs, run_dirs):
    assert len(runs) == 12
    first = runs[runs["run_dir"] == str(run_dirs[0])].iloc[0]
    assert (first["strategy"], first["workers"], first["seed"]) == ("ps_sync", 4, 0)
    assert first["throughput"] == 260.0
    assert first["top1"] == 0.80
    assert first["mlflow_run_id"] == "ps_sync-4-0"
    assert not first["oversubscribed"]


def test_missing_metrics_names_the_path(run_dirs):
    missing = run_dirs[3] / "metrics.json"
    missing.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_runs(run_dirs)


def test_invalid_eval_names_the_path(run_dirs):
    broken = run_dirs[5] / "eval.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(str(broken))):
        load_runs(run_dirs)


def test_missing_key_names_the_path(run_dirs):
    path = run_dirs[0] / "metrics.json"
    metrics = json.loads(path.read_text())
    del metrics["throughput"]
    path.write_text(json.dumps(metrics))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*throughput"):
        load_runs(run_dirs)


def test_null_value_names_the_path(run_dirs):
    path = run_dirs[0] / "metrics.json"
    metrics = json.loads(path.read_text())
    metrics["step_time"]["comm_s"] = None
    path.write_text(json.dumps(metrics))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*comm_s"):
        load_runs(run_dirs)


def test_duplicate_runs_are_an_error(tmp_path, run_dirs):
    copy = write_run(tmp_path / "elsewhere", "ps_sync", 4, 0)
    with pytest.raises(ValueError, match="same"):
        load_runs(run_dirs + [copy])


# --- scaling table --------------------------------------------------------------------


def test_scaling_columns_and_alphabetical_order(runs):
    table = scaling_table(runs)
    assert list(table.columns) == SCALING_COLUMNS
    assert list(zip(table["strategy"], table["workers"])) == [
        ("allreduce", 1),
        ("allreduce", 2),
        ("allreduce", 4),
        ("ps_sync", 1),
        ("ps_sync", 2),
        ("ps_sync", 4),
    ]
    assert list(table["family"]) == ["synchronous"] * 3 + ["parameter server"] * 3


def test_the_scaling_table_states_each_runs_extra_processes(runs, run_dirs, tmp_path):
    """A parameter server's shards are part of what is scaled (one per node by default): the
    table has the count each run had, from its metrics.json's knobs, and its Markdown says it."""
    table = scaling_table(runs)
    assert [row(table, "ps_sync", n)["extra_processes"] for n in (1, 2, 4)] == [1, 1, 2]
    assert [row(table, "allreduce", n)["extra_processes"] for n in (1, 2, 4)] == [0, 0, 0]
    markdown = scaling_markdown(table, noise_summary(runs))
    header = next(line for line in markdown.splitlines() if line.startswith("| strategy"))
    cells = lambda line: [cell.strip() for cell in line.strip("|").split("|")]  # noqa: E731
    assert cells(header)[:3] == ["strategy", "N", "shards"], header
    rows = [
        cells(line)[:3]
        for line in markdown.splitlines()
        if line.startswith("| ps_sync") or line.startswith("| allreduce")
    ]
    assert ["ps_sync", "4", "2"] in rows and ["allreduce", "4", ""] in rows, rows
    # a run recorded without its knobs (an older metrics.json): unknown, not zero
    old = json.loads((run_dirs[0] / "metrics.json").read_text())
    del old["strategy_params"]
    (run_dirs[0] / "metrics.json").write_text(json.dumps(old))
    assert load_runs(run_dirs[:1])["extra_processes"].isna().all()


def test_scaling_follows_config_order(runs):
    table = scaling_table(runs, strategies_order=["ps_sync", "allreduce"])
    assert list(table["strategy"]) == ["ps_sync"] * 3 + ["allreduce"] * 3
    assert list(table["workers"]) == [1, 2, 4, 1, 2, 4]


@pytest.mark.parametrize(
    "strategy, workers, throughput, speedup, efficiency, vs_allreduce",
    [
        ("allreduce", 1, 105.0, 1.0, 1.0, 1.0),
        ("allreduce", 2, 205.0, 205 / 105, 205 / 105 / 2, 205 / 105),
        ("allreduce", 4, 390.0, 3.714286, 0.928571, 3.714286),
        ("ps_sync", 1, 85.0, 1.0, 1.0, 0.809524),
        ("ps_sync", 2, 155.0, 1.823529, 0.911765, 1.476190),
        ("ps_sync", 4, 270.0, 3.176471, 0.794118, 2.571429),
    ],
)
def test_scaling_numbers_by_hand(runs, strategy, workers, throughput, speedup, efficiency, vs_allreduce):
    r = row(scaling_table(runs), strategy, workers)
    assert r["seeds"] == 2 and r["windows"] == 10
    assert r["throughput"] == pytest.approx(throughput)
    assert r["speedup"] == pytest.approx(speedup, rel=1e-5)
    assert r["efficiency"] == pytest.approx(efficiency, rel=1e-5)
    assert r["speedup_vs_allreduce_1"] == pytest.approx(vs_allreduce, rel=1e-5)


def test_scaling_intervals_come_from_the_windows_of_every_seed(tmp_path):
    # seed 0 runs at 95..105, seed 1 at 195..205 images/s: the pooled median sits between the
    # two and its interval spans the seeds' gap, which one seed's windows alone would not show
    narrow = [95.0, 97.0, 100.0, 103.0, 105.0]
    run_dirs = [
        write_run(tmp_path, "allreduce", 1, 0, windows=[w * 2 for w in narrow]),
        write_run(tmp_path, "allreduce", 1, 1, windows=[w * 2 for w in narrow]),
        write_run(tmp_path, "allreduce", 2, 0, windows=narrow),
        write_run(tmp_path, "allreduce", 2, 1, windows=[w + 100 for w in narrow]),
    ]
    r = row(scaling_table(load_runs(run_dirs)), "allreduce", 2)
    assert r["throughput"] == pytest.approx((105.0 + 195.0) / 2)
    assert r["throughput_low"] < 150.0 < r["throughput_high"]
    assert r["throughput_high"] - r["throughput_low"] > 50.0
    assert r["speedup_low"] < r["speedup"] < r["speedup_high"]
    assert r["efficiency_high"] == pytest.approx(r["speedup_high"] / 2)


def test_efficiency_against_the_ceiling(tmp_path):
    run_dirs = [
        write_run(tmp_path, name, workers, 0, windows=[thr] * 5)
        for name, workers, thr in (
            ("allreduce", 1, 100.0),
            ("allreduce", 2, 150.0),
            ("no_exchange", 1, 100.0),
            ("no_exchange", 2, 170.0),
        )
    ]
    df = load_runs(run_dirs)
    table = scaling_table(df)
    r = row(table, "allreduce", 2)
    assert r["ceiling_efficiency"] == pytest.approx(0.85)
    assert r["efficiency_vs_ceiling"] == pytest.approx(150 / 170)
    assert row(table, "no_exchange", 2)["efficiency_vs_ceiling"] == pytest.approx(1.0)
    assert "no_exchange" not in set(accuracy_table(df)["strategy"])


def test_noise_is_the_spread_of_the_identical_single_worker_runs(runs, tmp_path):
    """Only the loops that are the same at N=1: ps_sync's N=1 sends every step to its shard
    (a slower loop, 80 and 90 images/s here), a systematic gap that is no noise."""
    noise = noise_summary(runs)
    single = [100.0, 110.0]  # allreduce at N=1, two seeds; ps_sync's N=1 has a shard
    assert noise["n1_runs"] == 2
    assert (noise["n1_min"], noise["n1_max"]) == (100.0, 110.0)
    assert noise["n1_ratio"] == pytest.approx(110 / 100)
    assert noise["n1_cv"] == pytest.approx(np.std(single, ddof=1) / np.mean(single))
    assert "100 to 110 images/s" in noise_note(noise) and "parameter server" in noise_note(noise)
    # a plain loop beside it (easgd has no extra process at N=1) counts
    THROUGHPUT[("easgd", 1)] = (95.0, 105.0)
    try:
        more = noise_summary(
            load_runs([write_run(tmp_path, "easgd", 1, seed) for seed in SEEDS] + list(runs["run_dir"]))
        )
    finally:
        del THROUGHPUT[("easgd", 1)]
    assert (more["n1_runs"], more["n1_min"], more["n1_max"]) == (4, 95.0, 110.0)


def test_speedup_is_nan_without_single_worker_run(runs):
    without = runs[~((runs["strategy"] == "ps_sync") & (runs["workers"] == 1))]
    table = scaling_table(without)
    assert math.isnan(row(table, "ps_sync", 2)["speedup"])
    assert math.isnan(row(table, "ps_sync", 4)["efficiency"])
    assert row(table, "ps_sync", 2)["speedup_vs_allreduce_1"] == pytest.approx(155 / 105)


def test_speedup_vs_allreduce_is_nan_without_allreduce(runs):
    table = scaling_table(runs[runs["strategy"] == "ps_sync"])
    assert table["speedup_vs_allreduce_1"].isna().all()
    assert row(table, "ps_sync", 4)["speedup"] == pytest.approx(270 / 85)


# --- accuracy table -------------------------------------------------------------------


def test_accuracy_columns_and_numbers(runs):
    table = accuracy_table(runs)
    assert list(table.columns) == ACCURACY_COLUMNS
    r = row(table, "ps_sync", 4)
    assert r["top1"] == pytest.approx(0.82)
    assert (r["top1_low"], r["top1_high"], r["top1_interval"]) == (0.80, 0.84, "range")  # 2 seeds
    assert r["top5"] == pytest.approx(0.99)
    # paired with allreduce N=4: 0.80 - 0.88 and 0.84 - 0.90
    assert r["top1_vs_allreduce"] == pytest.approx(-0.07)
    assert (r["top1_vs_allreduce_low"], r["top1_vs_allreduce_high"]) == (pytest.approx(-0.08), pytest.approx(-0.06))
    assert r["below_allreduce"]
    assert not row(table, "ps_sync", 2)["below_allreduce"]  # -0.02
    assert math.isnan(row(table, "allreduce", 2)["top1_vs_allreduce"])


def test_three_seeds_give_a_t_interval_of_the_paired_difference(tmp_path):
    base, other = (0.90, 0.91, 0.92), (0.88, 0.90, 0.90)  # differences -0.02, -0.01, -0.02
    run_dirs = [
        write_run(tmp_path, name, 1, seed, top1=values[seed], windows=[100.0] * 5)
        for name, values in (("allreduce", base), ("ps_sync", other))
        for seed in range(3)
    ]
    r = row(accuracy_table(load_runs(run_dirs)), "ps_sync", 1)
    differences = np.array([-0.02, -0.01, -0.02])
    half = 4.302653 * differences.std(ddof=1) / math.sqrt(3)
    assert r["top1_interval"] == "t95" and r["paired_seeds"] == 3
    assert r["top1_vs_allreduce"] == pytest.approx(differences.mean())
    assert r["top1_vs_allreduce_high"] - r["top1_vs_allreduce"] == pytest.approx(half, rel=1e-4)


def test_time_to_accuracy_only_over_seeds_that_reached(runs):
    table = accuracy_table(runs)
    some = row(table, "ps_sync", 4)
    assert some["time_to_accuracy_s"] == 30.0
    assert some["reached_target"] == "1/2"
    none = row(table, "ps_sync", 2)
    assert math.isnan(none["time_to_accuracy_s"])
    assert none["reached_target"] == "0/2"
    both = row(table, "allreduce", 2)
    assert both["time_to_accuracy_s"] == pytest.approx((20.0 + 24.0) / 2)
    assert both["reached_target"] == "2/2"


# --- writing --------------------------------------------------------------------------


def test_write_table_csv_and_markdown(runs, tmp_path):
    table = scaling_table(runs)
    noise = noise_summary(runs)
    csv_path, md_path = tmp_path / "out" / "scaling.csv", tmp_path / "out" / "scaling.md"
    write_table(table, csv_path, md_path, markdown=scaling_markdown(table, noise))
    pd.testing.assert_frame_equal(pd.read_csv(csv_path), table, check_dtype=False)
    markdown = md_path.read_text()
    assert markdown.startswith("# Scaling table")
    assert "| allreduce" in markdown and "| ps_sync" in markdown
    assert "| 390 [380, 400]" in markdown  # allreduce N=4: seeds at 380 and 400, equal windows
    assert "| 0.04500 " in markdown
    assert noise_note(noise) in markdown
    assert OVERSUBSCRIBED_NOTE not in markdown
    assert sorted(p.name for p in csv_path.parent.iterdir()) == ["scaling.csv", "scaling.md"]


def test_accuracy_markdown_marks_the_strategies_below_allreduce(runs):
    markdown = accuracy_markdown(accuracy_table(runs))
    marked = [line for line in markdown.splitlines() if "points below allreduce" in line and line.startswith("| ")]
    assert [line.split("|")[1].strip() + line.split("|")[2].strip() for line in marked] == ["ps_sync4"]
    assert "0.8200 (0.8000–0.8400)" in markdown
    # top-5 of 2 seeds is a range too, not written as a CI
    assert "| 0.9900 (0.9900–0.9900) |" in markdown and "0.9900 [0.9900, 0.9900]" not in markdown


def test_markdown_notes_oversubscribed_rows(tmp_path):
    run_dirs = [
        write_run(tmp_path, "allreduce", workers, seed, oversubscribed=(workers == 4))
        for workers in (1, 2, 4)
        for seed in SEEDS
    ]
    table = scaling_table(load_runs(run_dirs))
    assert list(table["oversubscribed"]) == [False, False, True]
    md_path = tmp_path / "scaling.md"
    write_table(
        table, tmp_path / "scaling.csv", md_path, markdown=scaling_markdown(table, noise_summary(load_runs(run_dirs)))
    )
    assert OVERSUBSCRIBED_NOTE in md_path.read_text()


def test_findings_state_the_noise_the_ranking_and_the_gaps(runs):
    scaling, accuracy, noise = scaling_table(runs), accuracy_table(runs), noise_summary(runs)
    findings = findings_markdown(scaling, accuracy, noise)
    assert "## Scaling" in findings and "## Accuracy" in findings
    assert noise_note(noise) in findings
    assert "Efficiency at N=4" in findings
    # allreduce N=4 E = 0.93, ps_sync 0.79, but two seeds each 5% apart: the intervals overlap, too
    # wide to call them level (claims.read)
    assert "  - allreduce: E = 0.93 [0.86, 1.00]\n  - ps_sync: E = 0.79 [0.72, 0.88]; undecided (wide CI)" in findings
    assert "ps_sync N=4: -0.0700 (-0.0800–-0.0600)" in findings
    # ps_sync N=1: seeds 0.00 and -0.02 apart from allreduce: level; N=2: -0.02 at both seeds: apart
    assert (
        "- Level with allreduce (the paired difference's interval holds 0 and lies within ±3 points): "
        "ps_sync N=1.\n" in findings
    )
    assert "- Within 3 points of allreduce but apart from it (" in findings
    assert "excludes 0): ps_sync N=2 -0.0200 (-0.0200–-0.0200).\n" in findings
    assert "- allreduce at N=4: test top-1 " in findings and "(2 seeds)." in findings
    one_seed = findings_markdown(scaling, accuracy.assign(seeds=1), noise)
    assert "(1 seed)." in one_seed and "(1 seeds)" not in one_seed


def test_findings_rank_only_rows_that_are_not_oversubscribed(tmp_path):
    """ps_sync at N=2 ran oversubscribed (2 workers and a shard on 2 cores) beside a slow N=1 (its
    shard's round trip): its E of 1.5 is above allreduce's 0.95, but it is no scaling result, so it
    is listed apart, after the ranking, saying why."""
    windows = {("allreduce", 1): 100.0, ("allreduce", 2): 190.0, ("ps_sync", 1): 60.0, ("ps_sync", 2): 180.0}
    run_dirs = [
        write_run(tmp_path, strategy, n, seed, windows=[value] * 5, oversubscribed=strategy == "ps_sync" and n == 2)
        for (strategy, n), value in windows.items()
        for seed in SEEDS
    ]
    runs = load_runs(run_dirs)
    findings = findings_markdown(scaling_table(runs), accuracy_table(runs), noise_summary(runs))
    ranking = findings.split("- Efficiency at N=2 (the largest N not oversubscribed), best first:\n", 1)[1]
    ranked, apart = ranking.split("\n- Not ranked at N=2: oversubscribed", 1)
    assert ranked == "  - allreduce: E = 0.95 [0.95, 0.95]"
    assert "their E is not a scaling result" in apart.splitlines()[0]
    assert apart.splitlines()[1] == "  - ps_sync: E = 1.50 [1.50, 1.50]"
    assert "Also oversubscribed" not in findings  # said once, in its own list


# --- two kinds of run -------------------------------------------------------------------


def two_kinds(root):
    """Accuracy runs of allreduce at N = 1 and 4 (seeds 0 and 1, THROUGHPUT's windows), and
    scaling runs at N = 1, 2 and 4 (seed 2, ten times the accuracy runs' throughput)."""
    accuracy = [write_run(root, "allreduce", n, seed) for n in (1, 4) for seed in SEEDS]
    scaling = [
        write_run(root, "allreduce", n, 2, kind="scaling", windows=[10 * THROUGHPUT["allreduce", n][0]] * 5)
        for n in (1, 2, 4)
    ]
    return accuracy, scaling


def test_each_table_takes_its_figures_from_its_kind_of_run_and_says_which(tmp_path):
    accuracy_dirs, scaling_dirs = two_kinds(tmp_path)
    df = load_runs(accuracy_dirs + scaling_dirs)  # a scaling run needs no eval.json
    assert sorted(df["kind"]) == ["accuracy"] * 4 + ["scaling"] * 3
    scaling = scaling_table(df, ["allreduce"])
    assert set(scaling["from_runs"]) == {"scaling"} and list(scaling["workers"]) == [1, 2, 4]
    assert list(scaling["seeds"]) == [1, 1, 1]
    for n in (1, 2, 4):  # the scaling runs' windows, not the accuracy runs'
        assert row(scaling, "allreduce", n)["throughput"] == pytest.approx(10 * THROUGHPUT["allreduce", n][0])
    accuracy = accuracy_table(df, ["allreduce"])
    assert set(accuracy["from_runs"]) == {"accuracy"} and list(accuracy["workers"]) == [1, 4]
    assert row(accuracy, "allreduce", 4)["top1"] == pytest.approx(np.mean(TOP1["allreduce", 4]))
    assert row(accuracy, "allreduce", 4)["time_to_accuracy_s"] == pytest.approx(np.mean([40.0, 48.0]))
    assert noise_summary(df)["n1_runs"] == 1  # the machine's noise from the timed runs only
    assert "From the scaling runs" in scaling_markdown(scaling, noise_summary(df))
    assert "From the accuracy runs: full trainings" in accuracy_markdown(accuracy)
    findings = findings_markdown(scaling, accuracy, noise_summary(df))
    assert "From the scaling runs" in findings and "From the accuracy runs: full trainings" in findings
    # the control: without scaling runs the scaling table times the accuracy runs, and says so
    alone = scaling_table(load_runs(accuracy_dirs), ["allreduce"])
    assert set(alone["from_runs"]) == {"accuracy"}
    assert row(alone, "allreduce", 4)["throughput"] == pytest.approx(np.mean(THROUGHPUT["allreduce", 4]))
    assert "this study has no scaling runs" in scaling_markdown(alone, noise_summary(load_runs(accuracy_dirs)))


def test_the_same_run_of_two_kinds_is_no_duplicate(tmp_path):
    runs = load_runs([write_run(tmp_path, "allreduce", 1, 0), write_run(tmp_path, "allreduce", 1, 0, kind="scaling")])
    assert sorted(runs["kind"]) == ["accuracy", "scaling"]


def test_plots_of_two_kinds_say_which_runs_each_comes_from(tmp_path, monkeypatch):
    from dtstudy.analysis import plots

    accuracy_dirs, scaling_dirs = two_kinds(tmp_path)
    df = load_runs(accuracy_dirs + scaling_dirs)
    titles, convergence_runs = [], []
    real_save, real_panels = plots._save, plots._family_panels
    monkeypatch.setattr(
        plots, "_save", lambda figure, path: titles.append(figure.get_suptitle()) or real_save(figure, path)
    )
    paths = make_plots(df, load_run_metrics(accuracy_dirs + scaling_dirs), tmp_path / "plots", ["allreduce"])
    assert len(paths) == 5
    assert any("Throughput" in t and "scaling runs" in t for t in titles)
    assert any("Time to the target" in t and "accuracy runs" in t for t in titles)
    assert any("Efficiency" in t and "scaling runs" in t for t in titles)
    assert any("Test top-1" in t and "accuracy runs" in t for t in titles)
    assert any("Validation top-1" in t and "accuracy runs" in t for t in titles)
    # the convergence plot draws the accuracy runs only (one line per N, the lowest seed)
    monkeypatch.setattr(
        plots, "_family_panels", lambda table, *a: convergence_runs.append(table) or real_panels(table, *a)
    )
    plots.plot_convergence(
        df, {str(k): v for k, v in load_run_metrics(accuracy_dirs + scaling_dirs).items()}, tmp_path / "convergence.png"
    )
    assert set(convergence_runs[-1]["kind"]) == {"accuracy"} and sorted(convergence_runs[-1]["workers"]) == [1, 4]


# --- plots ----------------------------------------------------------------------------


def test_make_plots_writes_five_nontrivial_pngs(runs, run_dirs, tmp_path):
    run_metrics = load_run_metrics(run_dirs)
    paths = make_plots(runs, run_metrics, tmp_path / "plots")
    assert sorted(p.name for p in paths) == [
        "accuracy.png",
        "convergence.png",
        "efficiency.png",
        "throughput.png",
        "time_to_accuracy.png",
    ]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 5_000, path
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(p.name for p in paths)


@pytest.mark.slow
def test_every_plots_titles_fit_in_it_and_do_not_overlap(tmp_path, monkeypatch):
    """With a strategy of each family (four panels), each panel's title (its family) and the
    figure's (what is plotted, from which runs) lie inside the image, apart from each other:
    titles that said everything on each panel ran into the next panel's and past the image's edge."""
    from dtstudy.analysis import plots

    run_dirs = [
        write_run(tmp_path, strategy, workers, seed, windows=[100.0 * workers + seed] * 5, top1=0.8 + seed / 100)
        for strategy in ("allreduce", "ps_sync", "local_sgd", "allreduce_powersgd")
        for workers in (1, 2, 4)
        for seed in SEEDS
    ]
    figures = []
    real_save = plots._save
    monkeypatch.setattr(plots, "_save", lambda figure, path: figures.append(figure) or real_save(figure, path))
    make_plots(load_runs(run_dirs), load_run_metrics(run_dirs), tmp_path / "plots")
    assert len(figures) == 5 and all(len(figure.axes) == 4 for figure in figures)
    outside, overlapping = [], []
    for figure in figures:
        renderer, page = figure.canvas.get_renderer(), figure.bbox
        titles = [
            title for title in [figure._suptitle] + [ax.title for ax in figure.axes] if title and title.get_text()
        ]
        boxes = {title.get_text(): title.get_window_extent(renderer) for title in titles}
        outside += [
            text
            for text, box in boxes.items()
            if not (page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1)
        ]
        overlapping += [
            (a, b)
            for i, (a, box) in enumerate(boxes.items())
            for b, other in list(boxes.items())[i + 1 :]
            if box.overlaps(other)
        ]
    assert not outside and not overlapping, (outside, overlapping)
    assert all(figure.get_suptitle() for figure in figures)


@pytest.mark.slow
def test_plots_draw_each_familys_own_ideal_a_labelled_target_and_mark_oversubscribed_times(tmp_path, monkeypatch):
    """ps_sync's N=1 (80, 90 images/s) is not allreduce's (100, 110): its panel's ideal starts at
    its own; the convergence's target line says what it is; ps_sync at N=4 ran oversubscribed,
    which its time to the target (30 s, one seed) is marked with."""
    from dtstudy.analysis import plots

    run_dirs = [
        write_run(tmp_path, strategy, workers, seed, oversubscribed=strategy == "ps_sync" and workers == 4)
        for strategy, workers in THROUGHPUT
        for seed in SEEDS
    ]
    figures = {}
    real_save = plots._save
    monkeypatch.setattr(
        plots, "_save", lambda figure, path: figures.setdefault(path.stem, figure) and real_save(figure, path)
    )
    make_plots(load_runs(run_dirs), load_run_metrics(run_dirs), tmp_path / "plots")
    panels = {ax.get_title(): ax for ax in figures["throughput"].axes}

    def dashed_at_one(ax):
        return sorted(
            line.get_ydata()[0] for line in ax.get_lines() if line.get_linestyle() == "--" and len(line.get_xdata())
        )

    assert dashed_at_one(panels["parameter server"]) == [pytest.approx(85.0)]  # ps_sync's N=1: 80 and 90
    assert dashed_at_one(panels["synchronous"]) == [pytest.approx(105.0)]
    convergence = figures["convergence"].axes[0]
    assert "target_accuracy 0.85" in [line.get_label() for line in convergence.get_lines()]
    times = {ax.get_title(): ax for ax in figures["time_to_accuracy"].axes}["parameter server"]
    marks = [line for line in times.get_lines() if line.get_marker() == "x" and len(line.get_xdata())]
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in marks] == [([4], [30.0])]


# --- the whole step, with a real MLflow store -----------------------------------------


@pytest.mark.slow
def test_run_writes_everything_and_adopts_child_runs(tmp_path):
    from mlflow import MlflowClient

    from dtstudy.tracking import mlflow_store

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    experiment_id = mlflow_store.init_store(uri, "study-test")
    client = MlflowClient(tracking_uri=uri)
    run_dirs = []
    for workers in (1, 2):
        run_dir = write_run(tmp_path, "allreduce", workers, 0)
        child_id = client.create_run(experiment_id).info.run_id
        metrics = json.loads((run_dir / "metrics.json").read_text())
        metrics["mlflow"]["run_id"] = child_id
        (run_dir / "metrics.json").write_text(json.dumps(metrics))
        run_dirs.append(run_dir)

    for workers in (1, 2):
        scaling_dir = write_run(tmp_path, "allreduce", workers, 0, kind="scaling")
        child_id = client.create_run(experiment_id).info.run_id
        metrics = json.loads((scaling_dir / "metrics.json").read_text())
        metrics["mlflow"]["run_id"] = child_id
        (scaling_dir / "metrics.json").write_text(json.dumps(metrics))
        run_dirs.append(scaling_dir)

    summary = aggregate_study(
        run_dirs,
        tmp_path / "tables",
        tmp_path / "plots",
        uri,
        "study-test",
        strategies_order=["allreduce"],
        study_params={"model": "lenet5", "train": {"epochs": 3}},
    )

    # each Markdown file with its HTML page for the report (dtstudy.analysis.pages)
    assert sorted(p.name for p in (tmp_path / "tables").iterdir()) == [
        "accuracy.csv",
        "accuracy.html",
        "accuracy.md",
        "findings.html",
        "findings.md",
        "scaling.csv",
        "scaling.html",
        "scaling.md",
    ]
    parent = client.get_run(summary["parent_run_id"])
    assert parent.data.params == {"model": "lenet5", "train.epochs": "3"}
    assert parent.data.metrics == {"accuracy_runs": 2.0, "scaling_runs": 2.0}  # it logs both kinds
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"plots", "tables"}
    assert len(client.list_artifacts(parent.info.run_id, "tables")) == 5
    assert len(client.list_artifacts(parent.info.run_id, "plots")) == 5
    for run_dir in run_dirs:
        child_id = json.loads((run_dir / "metrics.json").read_text())["mlflow"]["run_id"]
        assert client.get_run(child_id).data.tags["mlflow.parentRunId"] == parent.info.run_id
    # the runs the scaling table pools (the scaling runs) carry their cell's efficiency, rounded as shown
    scaling = pd.read_csv(tmp_path / "tables/scaling.csv").set_index("workers")
    timed = client.get_run(json.loads((scaling_dir / "metrics.json").read_text())["mlflow"]["run_id"]).data.metrics
    assert timed["efficiency"] == round(scaling.loc[2, "efficiency"], 2)
    assert (timed["efficiency_low"], timed["efficiency_high"]) == (
        round(scaling.loc[2, "efficiency_low"], 2),
        round(scaling.loc[2, "efficiency_high"], 2),
    )


def test_speedup_at_one_worker_is_one_without_an_interval(tmp_path):
    narrow = [95.0, 97.0, 100.0, 103.0, 105.0]
    run_dirs = [write_run(tmp_path, "allreduce", 1, seed, windows=[w + 10 * seed for w in narrow]) for seed in SEEDS]
    r = row(scaling_table(load_runs(run_dirs)), "allreduce", 1)
    assert (r["speedup"], r["speedup_low"], r["speedup_high"]) == (1.0, 1.0, 1.0)
    assert (r["efficiency_low"], r["efficiency_high"]) == (1.0, 1.0)
    assert r["throughput_low"] < r["throughput"] < r["throughput_high"]
