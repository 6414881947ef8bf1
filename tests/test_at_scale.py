"""The at-scale study (config/at-scale.yaml, docs/emulation.md "The at-scale study"): emulated
runs through Snakemake, and the published claims it tests (dtstudy.analysis.claims).

- the shipped config validates, its DAG has one train and one evaluate job per strategy (or
  variant) x N x seed, no projection, one core a run; every claim has its runs in the one study
  and part 1 makes the same number of updates at every N;
- a tiny emulated study runs end to end through Snakemake: tables, the new plot, findings with
  the claims section, no warm pool, no projection;
- each claim's verdict on synthetic accuracy tables: holds, from which N, does not hold, not
  measured (the strategies it needs not run, or a single seed), and undecided where an interval
  is too wide: the three-way reading (apart, level within a margin, undecided) of claims.read.
"""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from conftest import REPO, run_snakemake, tiny_study
from test_workflow import job_counts, shipped_study_dry_run, train_threads

from dtstudy.analysis import claims
from dtstudy.analysis.findings import _versus_allreduce, claims_markdown
from dtstudy.analysis.tables import accuracy_table, with_run_extras
from dtstudy.common.intervals import Interval
from dtstudy.config import run_kinds, study_config
from dtstudy.strategies.specs import SPECS

AT_SCALE = REPO / "config/at-scale.yaml"
PARAMETER_SERVERS = ["ps_sync", "ps_backup", "ps_async", "ssp"]
EMULATE = {"hardware": "h100_ib400", "images_per_s": 10_000.0}


# --- the shipped config ----------------------------------------------------------------


def _at_scale() -> dict:
    """config/at-scale.yaml over config/config.yaml, validated (defaults filled), as the study runs it."""
    config = study_config.deep_merge(
        study_config.read_yaml(REPO / "config/config.yaml"), study_config.read_yaml(AT_SCALE)
    )
    return study_config.validate_schema(config)


def _variants_of(config: dict, strategy: str) -> dict[str, dict]:
    return {
        name: v for name, v in config["variants"].items() if v["strategy"] == strategy and name in config["strategies"]
    }


@pytest.mark.slow
def test_the_at_scale_study_is_one_dag_of_its_three_parts_and_no_projection(tmp_path):
    """One command runs the whole at-scale study: part 1's strategies at accuracy.workers, each
    variant (Goyal's batches and rates, Dai's bounds) at its own N only, 3 seeds, one thread a
    run, no projection (an emulated study's throughput is the model's own)."""
    config = _at_scale()
    result = shipped_study_dry_run(tmp_path, AT_SCALE, args=("--cores", "8", "--printshellcmds"))
    assert result.returncode == 0, result.stderr
    assert config["launcher"]["cluster"] == "emulate" and len(config["seeds"]) == 3
    plain = [name for name in config["strategies"] if name not in config["variants"]]
    runs = {(name, n) for name in config["strategies"] for n in run_kinds.arm_workers(config, name, run_kinds.ACCURACY)}
    assert {(name, n) for name, n in runs if name in plain} == {(name, n) for name in plain for n in (4, 16, 64)}
    threads = train_threads(result.stdout)
    assert set(threads) == runs and set(threads.values()) == {1}
    assert job_counts(result.stdout) == {
        "prepare_data": 1,
        "init_tracking": 1,
        "train": len(runs) * 3,
        "evaluate": len(runs) * 3,
        "aggregate": 1,
        "all": 1,
    }
    # every evaluation is scored in the study's warm pool (the --via-pool of the evaluate rule)
    assert result.stdout.count("--via-pool") == len(runs) * 3
    assert all("--via-pool" in line for line in result.stdout.splitlines() if "dtstudy evaluate" in line)


def test_every_claim_has_its_runs_in_the_one_study():
    """The five claims' strategies all run (none "not measured" for want of runs): Chen's, Jin's
    and Seide's at N = 4, 16, 64; Goyal's linear rule at each batch beside a sweep of fixed rates
    (the rule's /2, /4 and /8) at the same epochs on one worker; Dai's ssp bounds at one N, from 0 to
    unbounded. The runs the claims compare are the ones they read (`bound_sweep`, the sweep)."""
    from dtstudy.analysis import claims

    config = _at_scale()
    assert {claims.SYNC, claims.BACKUP, claims.ASYNC, claims.DECENTRALISED, claims.ONEBIT} <= set(config["strategies"])
    goyal = _variants_of(config, claims.SYNC)
    rules = {name: v for name, v in goyal.items() if v["train"]["lr_scaling"] == claims.LINEAR_RULE}
    sweeps = {name: v for name, v in goyal.items() if v["train"]["lr_scaling"] == claims.SWEPT_RULE}
    assert set(rules) | set(sweeps) == set(goyal) and len(rules) >= 3
    for rule in rules.values():
        assert rule["workers"] == [1]
        batch = rule["train"]["batch_size"]
        peak = rule["train"]["base_lr"] * batch / rule["train"].get("lr_reference_batch", 256)
        at_batch = [v for v in sweeps.values() if v["train"]["batch_size"] == batch]
        assert sorted(v["train"]["base_lr"] / peak for v in at_batch) == pytest.approx([0.125, 0.25, 0.5])
        assert all(v["train"]["epochs"] == rule["train"]["epochs"] and v["workers"] == [1] for v in at_batch)
    assert len({rule["train"]["epochs"] for rule in rules.values()}) == 1  # the same epochs at every batch
    dai = _variants_of(config, claims.BOUNDED)
    assert len({tuple(v["workers"]) for v in dai.values()}) == 1  # one fixed N
    bounds = [v["strategy_params"]["staleness"] for v in dai.values()]
    assert 0 in bounds and None in bounds and len(set(bounds)) >= 5


def test_part_one_makes_the_same_number_of_updates_at_every_n():
    """Part 1 stops every run at train.max_steps steps per worker, which every N reaches within
    train.epochs (the largest N's epoch is the shortest), warms up over a number of updates and
    validates every eval_every_steps steps: the same grid of updates whatever N."""
    config = _at_scale()
    train = config["train"]
    assert train["max_steps"] and train["warmup_steps"] and train["eval_every_steps"]
    assert train["warmup_steps"] < train["max_steps"] and train["eval_every_steps"] < train["max_steps"]
    validation = config["dataset"]["val_fraction"]
    images = round(60_000 * (1 - validation))
    for n in config["accuracy"]["workers"]:
        assert train["epochs"] * (images // n // train["batch_size"]) >= train["max_steps"], n


# --- a tiny emulated study through Snakemake -------------------------------------------------


@pytest.fixture(scope="module")
def emulated_study(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("emulated-study")
    config = tiny_study(
        strategies=["allreduce", "gossip"],
        workers=[1, 4],
        launcher={"cluster": "emulate"},
        emulate=EMULATE,
        train={"batch_size": 16, "evals_per_epoch": 4, "steady_state_skip": 2, "timing_window_steps": 5},
    )
    result = run_snakemake(workdir, config, "--cores", "2", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return workdir


@pytest.mark.slow
def test_an_emulated_study_writes_its_tables_plots_and_claims(emulated_study):
    results = emulated_study / "results"
    accuracy = pd.read_csv(results / "tables/accuracy.csv")
    assert sorted(zip(accuracy["strategy"], accuracy["workers"])) == [
        ("allreduce", 1),
        ("allreduce", 4),
        ("gossip", 1),
        ("gossip", 4),
    ]
    assert list(accuracy.sort_values(["strategy", "workers"])["global_batch"]) == [16, 64, 16, 64]
    for name in ("throughput", "efficiency", "accuracy", "time_to_accuracy", "convergence"):
        plot = results / f"plots/{name}.png"
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000
    findings = (results / "tables/findings.md").read_text()
    section = findings.split("## The published claims at scale (emulated on h100_ib400)", 1)[1]
    for source in ("Goyal et al. 2017", "Chen et al. 2016", "Jin et al. 2016", "Dai et al. 2019", "Seide et al. 2014"):
        assert source in section
    assert "**Not measured**: No runs of ps_backup, ps_async" in section
    # one seed: no interval, so no verdict on allreduce's limit
    assert "**Not measured**: Allreduce ran with a single seed at some N" in section
    # an emulated run is one process: no submitit job, no projection; the study's warm pool
    # forks it and scores its test split (no interpreter start a run)
    assert not (results / "tables/projection.csv").exists() and not (results / "commbench").exists()
    assert not list(results.glob("logs/submitit/**/*.out"))
    assert "in the warm pool" in (results / "logs/evaluate/gossip/n4/seed0.log").read_text()
    assert "in the warm pool" in (results / "logs/train/gossip/n4/seed0.log").read_text()
    metrics = json.loads((results / "runs/gossip/n4/seed0/metrics.json").read_text())
    assert metrics["emulation"]["hardware"] == "h100_ib400"


# --- the claims on synthetic tables ---------------------------------------------------------

SEEDS = 3
REACHED = [0.5, 0.6, 0.7]  # a run's time to the target, seconds, per seed (scaled per cell)


def seed_runs(cells: dict, seeds: int = SEEDS) -> tuple[pd.DataFrame, dict]:
    """The runs frame and metrics.json of hand-made runs: cells {(strategy, N): {top1: [per seed],
    time: [per seed, None = not reached], steps: [...], staleness: [...]}}."""
    rows, metrics = [], {}
    for (strategy, workers), cell in cells.items():
        for seed in range(seeds):
            run_dir = f"runs/{strategy}/n{workers}/seed{seed}"
            time = cell.get("time", REACHED)[seed]
            steps = cell.get("steps", [100, 100, 100])[seed]
            rows.append(
                {
                    "kind": "accuracy",
                    "strategy": strategy,
                    "workers": workers,
                    "seed": seed,
                    "top1": cell["top1"][seed],
                    "top5": 0.99,
                    "run_dir": run_dir,
                    "time_to_accuracy_s": math.nan if time is None else time,
                }
            )
            # the first grid point at or above the target is the one counted
            grid = [{"step": 1, "top1": 0.1}] + (
                [] if steps is None else [{"step": steps, "top1": 0.85}, {"step": steps + 50, "top1": 0.9}]
            )
            metrics[run_dir] = {
                "global_batch": 8 * workers,
                "target_accuracy": 0.8,
                "val_grid": grid,
                "strategy_metrics": ({"staleness_mean": cell["staleness"][seed]} if "staleness" in cell else {}),
            }
    return pd.DataFrame(rows), metrics


def table(cells: dict, seeds: int = SEEDS) -> pd.DataFrame:
    """The accuracy table (tables.accuracy_table) of hand-made runs (seed_runs)."""
    runs, metrics = seed_runs(cells, seeds)
    return accuracy_table(runs, None, metrics)


def paired_facts(cells: dict, **facts) -> claims.StudyFacts:
    """StudyFacts with the hand-made runs one per seed (for paired comparisons), and `facts`."""
    runs, metrics = seed_runs(cells)
    extras = with_run_extras(runs, metrics)
    return claims.StudyFacts(runs=extras[["strategy", "workers", "seed", *claims.PAIRED_COLUMNS]], **facts)


KEPT = [0.880, 0.885, 0.890]


def goyal_cells(**by_n):
    return {("allreduce", n): {"top1": by_n.get(f"n{n}", KEPT)} for n in (1, 4, 16, 64, 256)}


def test_goyal_holds_up_to_a_batch_then_breaks():
    verdict = claims.goyal_batch_limit(table(goyal_cells(n64=[0.80, 0.81, 0.79], n256=[0.10, 0.10, 0.11])))
    assert verdict.status == claims.HOLDS and verdict.from_n == 64
    assert "kept up to N=16, global batch 128 and breaks from N=64, global batch 512" in verdict.summary
    assert len(verdict.evidence) == 5 and "N=64, global batch 512: test top-1 0.8000 [" in verdict.evidence[3]
    # N=4, 16 and 64 answer (N=256 did not learn): N=64, the clearest, is read at Holm's 1 - 0.05/3
    assert verdict.evidence[3].endswith(
        "below N=1's (intervals apart at 0.9833, Holm's level for its place among the N)"
    )
    assert ", kept, not below N=1's by more than 0.03: the difference lies in [" in verdict.evidence[2]


def test_goyal_a_narrow_overlapping_cell_is_kept():
    # N=64's mean is 1.25 points lower, its interval overlaps N=1's and is narrow: the difference
    # lies within TOP1_MARGIN below N=1's mean, so accuracy is kept there
    verdict = claims.goyal_batch_limit(table(goyal_cells(n64=[0.870, 0.8725, 0.875])))
    assert verdict.status == claims.HOLDS and verdict.from_n is None
    assert "limit lies beyond this study" in verdict.summary
    assert (
        "N=64, global batch 512: test top-1 0.8725 [0.8663, 0.8787], kept, not below N=1's by more than 0.03"
        in verdict.evidence[3]
    )


N1 = [0.845974, 0.85, 0.854026]  # 0.8500 [0.8400, 0.8600]
SPLIT = [0.10, 0.10, 0.677]  # one seed learned, two did not: 0.2923 [-0.5352, 1.1199], the last at-scale run's N=64
WIDE = [0.45, 0.88, 0.88]  # every seed learned, one far less: 0.7367 [0.1200, 1.3534]
CHANCE = [0.10, 0.10, 0.10]  # did not learn, in every seed


@pytest.mark.parametrize(
    "n256, status, said",
    [
        (
            N1,
            claims.PARTLY,
            "Accuracy is kept up to N=256, global batch 2048; the study cannot tell at N=64 (intervals "
            "too wide): no break is seen, nor can one be ruled out.",
        ),
        (
            CHANCE,
            claims.PARTLY,
            "Accuracy is kept up to N=16, global batch 128; the study cannot tell at N=64 (intervals "
            "too wide); cannot tell at N=256: allreduce did not learn (a mean test top-1 below 0.4250, "
            "50% of allreduce's best cell, at least 2 x chance): no break is seen, nor can one be ruled out.",
        ),
    ],
)
def test_goyal_a_wide_interval_is_undecided_not_kept(n256, status, said):
    cells = goyal_cells(n1=N1, n4=N1, n16=N1, n64=WIDE, n256=n256)
    accuracy = table(cells)
    wide = accuracy[accuracy["workers"] == 64].iloc[0]
    assert round(wide["top1_low"], 2) == 0.12 and round(wide["top1_high"], 2) == 1.35  # unclipped
    verdict = claims.goyal_batch_limit(accuracy)
    assert verdict.status == status and verdict.from_n is None and verdict.summary == said
    assert verdict.evidence[3] == (
        "N=64, global batch 512: test top-1 0.7367 [0.1200, 1.3534], undecided against N=1's: the interval "
        "[0.1200, 1.3534] is too wide to tell (3 seeds; it reaches outside [0, 1], where no top-1 lies: too few "
        "seeds for their spread); the difference lies in [-0.73, +0.503], wider than a margin of 0.03 allows"
    )


def test_goyal_is_undecided_when_no_n_is_kept_or_below():
    verdict = claims.goyal_batch_limit(table(goyal_cells(n4=WIDE, n16=WIDE, n64=WIDE, n256=WIDE)))
    assert verdict.status == claims.UNDECIDED and verdict.from_n is None
    assert verdict.summary == "No N > 1 is kept: the study cannot tell at N=4, 16, 64, 256 (intervals too wide)."
    assert "**Undecided**: No N > 1 is kept" in "\n".join(claims_markdown([verdict], "emulated"))


def test_reading_a_difference_apart_level_or_undecided():
    reference = Interval(0.85, 0.84, 0.86, 3, "t95")
    read = claims.read
    assert read(Interval(0.80, 0.79, 0.81, 3, "t95"), reference, "top1", "N=1's").side == claims.BELOW
    assert read(Interval(0.90, 0.89, 0.91, 3, "t95"), reference, "top1", "N=1's").side == claims.ABOVE
    # overlapping and narrow: level within the margin; 2.5 points higher is level only on the lower side
    assert read(Interval(0.845, 0.835, 0.855, 3, "t95"), reference, "top1", "N=1's").side == claims.LEVEL
    higher = Interval(0.875, 0.855, 0.895, 3, "t95")
    assert read(higher, reference, "top1", "N=1's", guard=claims.BELOW).side == claims.LEVEL
    assert read(higher, reference, "top1", "N=1's").side == claims.UNDECIDED_READING
    # overlapping intervals, a difference whose range excludes zero: still undecided, and the reading says why
    reading = read(Interval(0.92, 0.86, 0.98, 3, "t95"), reference, "top1", "N=1's")
    assert reading.side == claims.UNDECIDED_READING and reading.text.endswith(
        "the difference lies in [+0.00917, +0.131], wider than a margin of 0.03 allows; that range lies above zero "
        "(a difference at about the 95% level), but above and below need the two intervals apart"
    ), reading.text
    # the reference's own width counts: a narrow cell against a wide reference is undecided too
    reading = read(reference, Interval(0.85, 0.70, 1.00, 3, "t95"), "top1", "N=1's")
    assert reading.side == claims.UNDECIDED_READING and "N=1's interval [0.7000, 1.0000] is too wide" in reading.text
    # two seeds give a range, no CI: however narrow, it cannot show a difference small
    reading = read(Interval(0.85, 0.849, 0.851, 2, "range"), reference, "top1", "N=1's")
    assert reading.side == claims.UNDECIDED_READING and "2 seeds give a range" in reading.text
    # a relative margin: a tenth of the reference's time
    times = Interval(1.0, 0.99, 1.01, 3, "t95")
    assert read(Interval(1.05, 1.0, 1.08, 3, "t95"), times, "time_to_accuracy_s", "allreduce's").side == claims.LEVEL
    reading = read(Interval(1.05, 0.9, 1.2, 3, "t95"), times, "time_to_accuracy_s", "allreduce's")
    assert reading.side == claims.UNDECIDED_READING and "zero" not in reading.text  # its range holds zero


def test_findings_read_efficiency_against_allreduce_three_ways():
    allreduce = Interval(0.90, 0.88, 0.92, 0, "bootstrap95")
    assert _versus_allreduce(Interval(0.89, 0.87, 0.91, 0, "bootstrap95"), allreduce).startswith(
        "; level with allreduce (the difference lies in [-0.04, +0.02], within ±0.09"
    )
    assert _versus_allreduce(Interval(0.80, 0.60, 1.00, 0, "bootstrap95"), allreduce).startswith(
        "; undecided (wide CI): the CIs overlap, but the difference may lie anywhere in [-0.30, +0.10]"
    )
    assert _versus_allreduce(Interval(0.70, 0.65, 0.75, 0, "bootstrap95"), allreduce) == "; below allreduce (CIs apart)"
    lower = _versus_allreduce(Interval(0.84, 0.80, 0.88, 0, "bootstrap95"), allreduce)  # touching CIs
    assert lower.startswith(
        "; undecided (wide CI): the CIs overlap, but the difference may lie anywhere in [-0.10, -0.02]"
    ) and lower.endswith(
        "that range lies below zero (a difference at about "
        "the 95% level), but above and below need the two "
        "intervals apart"
    ), lower
    assert "zero" not in _versus_allreduce(Interval(0.80, 0.60, 1.00, 0, "bootstrap95"), allreduce)


def test_goyal_is_not_judged_on_a_study_that_does_not_scale_linearly():
    """The claim is about the linear rule: a study scaled by the square-root rule (the
    asynchronous half) says so instead of reading its allreduce rows as the linear rule's."""
    cells = table(goyal_cells(n64=[0.10, 0.10, 0.11]))
    assert claims.goyal_batch_limit(cells).status == claims.HOLDS
    verdict = claims.goyal_batch_limit(cells, claims.StudyFacts(lr_rules=("sqrt",)))
    assert verdict.status == claims.NOT_MEASURED and "sqrt rule, not linearly" in verdict.summary
    assert [v.status for v in claims.verdicts(cells, claims.StudyFacts(("sqrt",)))][0] == claims.NOT_MEASURED


def test_a_single_seed_gives_no_verdict():
    verdict = claims.goyal_batch_limit(table(goyal_cells(n64=[0.10, 0.10, 0.10]), seeds=1))
    assert verdict.status == claims.NOT_MEASURED and "single seed" in verdict.summary


def test_goyal_does_not_hold_when_the_first_step_up_breaks():
    verdict = claims.goyal_batch_limit(table(goyal_cells(n4=[0.70, 0.71, 0.72])))
    assert verdict.status == claims.DOES_NOT_HOLD and verdict.from_n == 4


def ps_cells(backup: dict, asynchronous: dict) -> dict:
    cells = goyal_cells()
    for n in (1, 4, 16, 64, 256):
        cells[("ps_backup", n)] = {"top1": backup.get(n, KEPT)}
        cells[("ps_async", n)] = {"top1": asynchronous.get(n, KEPT)}
    return cells


def test_chen_holds_from_the_n_where_backup_stays_above_async():
    low = [0.70, 0.71, 0.72]
    verdict = claims.chen_backup_vs_async(table(ps_cells({}, {16: low, 64: low, 256: low})))
    assert verdict.status == claims.HOLDS and verdict.from_n == 16
    assert verdict.evidence[0].startswith("which of ps_backup's gradients are dropped rests on the emulated clock")
    assert verdict.evidence[2].startswith("N=16: ps_backup top-1 0.8850 [")
    assert ": above ps_async's (intervals apart at " in verdict.evidence[2]
    # above at 64 only, level at the largest N: it does not hold at Chen's scale
    verdict = claims.chen_backup_vs_async(table(ps_cells({}, {64: low})))
    assert verdict.status == claims.DOES_NOT_HOLD and verdict.from_n is None
    assert verdict.summary.startswith(
        "ps_backup's top-1 is above ps_async's at N=64, but at N=256 ps_backup's top-1 is not above ps_async's"
    )
    assert ": level with ps_async's within ±0.03:" in verdict.evidence[-1]
    # a lower async mean whose seeds spread over backup's: overlapping but too wide to call level
    noisy = [0.80, 0.95, 0.84]
    verdict = claims.chen_backup_vs_async(table(ps_cells({}, {64: noisy, 256: noisy})))
    assert verdict.status == claims.UNDECIDED and verdict.from_n is None
    assert verdict.summary.startswith("At N=256 the study cannot tell whether ps_backup's top-1 is above ps_async's")
    assert ": undecided against ps_async's: ps_async's interval [0.6704, 1.0563] is too wide" in verdict.evidence[-1]
    # above at 16 and 64, undecided at the largest N: the summary names where it was above
    verdict = claims.chen_backup_vs_async(table(ps_cells({}, {16: low, 64: low, 256: noisy})))
    assert verdict.status == claims.UNDECIDED
    assert verdict.summary.startswith(
        "ps_backup's top-1 is above ps_async's at N=16, 64, but at N=256 the study cannot tell"
    )


def test_claims_of_strategies_not_run_are_not_measured_and_say_why(monkeypatch):
    only_sync = table(goyal_cells())
    for judge in (claims.chen_backup_vs_async, claims.dai_staleness):
        verdict = judge(only_sync)
        assert verdict.status == claims.NOT_MEASURED and verdict.summary.startswith("No runs of ps_")
        assert "the study does not run them" in verdict.summary, verdict.summary
    # a strategy that cannot be emulated (its spec says why): the verdict gives that reason
    monkeypatch.setattr(SPECS["ps_async"], "not_emulated_because", "its shards' clock is not modelled")
    verdict = claims.dai_staleness(only_sync)
    assert "ps_async cannot be emulated yet: its shards' clock is not modelled" in verdict.summary, verdict.summary


def onebit_cells(**by_n) -> dict:
    """allreduce at KEPT everywhere; allreduce_onebit at KEPT or by_n's top-1 per seed."""
    cells = goyal_cells()
    for n in (1, 4, 16, 64, 256):
        cells[("allreduce_onebit", n)] = {"top1": by_n.get(f"n{n}", KEPT)}
    return cells


LOST = [0.80, 0.81, 0.82]  # 7.5 points below KEPT in every seed: apart from the margin
ONEBIT_WIDE = [0.80, 0.88, 0.90]  # learned in every seed, 8 points below KEPT in one: across the margin


def test_seide_holds_where_onebit_keeps_allreduces_top1_within_the_margin():
    # a point below allreduce in every seed: a loss the seeds tell apart from zero, but little
    accuracy = table(onebit_cells(n256=[0.870, 0.875, 0.880]))
    verdict = claims.seide_onebit(accuracy)
    assert verdict.status == claims.HOLDS and verdict.from_n == 4
    assert verdict.summary == "allreduce_onebit keeps its top-1 within 0.03 of allreduce's at N=4, 16, 64, 256."
    assert verdict.evidence[-1] == (
        "N=256, global batch 2048: top-1 0.8750 [0.8626, 0.8874], − allreduce -0.0100 "
        "[-0.0100, -0.0100]: not below allreduce's by more than 0.03: the difference "
        "lies in [-0.01, -0.01]"
    )
    # the control: read as the other claims read a difference (apart first), the same cell is "below"
    cell = accuracy[(accuracy["strategy"] == "allreduce_onebit") & (accuracy["workers"] == 256)].iloc[0]
    difference = Interval(
        cell["top1_vs_allreduce"], cell["top1_vs_allreduce_low"], cell["top1_vs_allreduce_high"], 3, "t95"
    )
    assert (
        claims.read(difference, claims.ZERO, "top1_vs_allreduce", "allreduce's", guard=claims.BELOW).side
        == claims.BELOW
    )


@pytest.mark.parametrize(
    "by_n, status, summary",
    [
        (
            {"n64": LOST, "n256": LOST},
            claims.PARTLY,
            "allreduce_onebit keeps its top-1 within 0.03 of allreduce's at N=4, 16 and loses more than 0.03 "
            "against allreduce's at N=64, 256.",
        ),
        (
            {"n4": LOST, "n16": LOST, "n64": LOST, "n256": LOST},
            claims.DOES_NOT_HOLD,
            "allreduce_onebit loses more than 0.03 against allreduce's at N=4, 16, 64, 256.",
        ),
        (
            {"n4": ONEBIT_WIDE, "n16": ONEBIT_WIDE, "n64": ONEBIT_WIDE, "n256": ONEBIT_WIDE},
            claims.UNDECIDED,
            "The study cannot tell at N=4, 16, 64, 256 (intervals across the margin).",
        ),
        (
            {"n256": ONEBIT_WIDE},
            claims.PARTLY,
            "allreduce_onebit keeps its top-1 within 0.03 of allreduce's at N=4, 16, 64; "
            "the study cannot tell at N=256 (intervals across the margin).",
        ),
    ],
)
def test_seide_is_lost_or_undecided_where_onebits_difference_leaves_the_margin(by_n, status, summary):
    verdict = claims.seide_onebit(table(onebit_cells(**by_n)))
    assert (verdict.status, verdict.summary) == (status, summary)
    if status == claims.UNDECIDED:
        assert "across the margin of -0.03" in verdict.evidence[0], verdict.evidence[0]


def test_seide_says_where_a_loss_is_sure_but_its_size_is_not():
    # 3.2 points lower in every seed, give or take 0.4: below zero, across the margin
    verdict = claims.seide_onebit(table(onebit_cells(n16=[0.848, 0.853, 0.862])))
    assert verdict.status == claims.PARTLY
    assert verdict.evidence[1].endswith(
        "across the margin of -0.03; a loss at about the 95% level, but the seeds cannot tell whether more than 0.03"
    ), verdict.evidence[1]


def test_seide_with_two_seeds_has_no_interval_to_show_a_loss_small():
    verdict = claims.seide_onebit(table(onebit_cells(), seeds=2))
    assert verdict.status == claims.UNDECIDED
    assert verdict.summary == (
        "The study cannot tell at N=4, 16, 64, 256 (intervals across the margin, or too few "
        "seeds for a confidence interval)."
    )
    assert verdict.evidence[0].endswith(
        "undecided: 2 seed(s) give no confidence interval, too few to show a loss small"
    )


def test_seide_is_not_measured_without_onebit_runs_at_n_above_1():
    verdict = claims.seide_onebit(table(goyal_cells()))
    assert verdict.status == claims.NOT_MEASURED and "No runs of allreduce_onebit" in verdict.summary
    only_n1 = table({key: cell for key, cell in onebit_cells().items() if key[0] == "allreduce" or key[1] == 1})
    assert "only at N=1" in claims.seide_onebit(only_n1).summary


def jin_cells(gossip_times: dict, async_times: dict | None = None) -> dict:
    """allreduce reaches the target in 1 s at every N; the challengers in their own times."""
    cells = goyal_cells()
    for n in (1, 4, 16, 64, 256):
        cells[("allreduce", n)]["time"] = [1.0, 1.01, 1.02]
        cells[("gossip", n)] = {"top1": KEPT, "time": gossip_times.get(n, [1.0, 1.01, 1.02])}
        if async_times is not None:
            cells[("ps_async", n)] = {"top1": KEPT, "time": async_times.get(n, [1.0, 1.01, 1.02])}
    return cells


FAST, SLOW, NEVER = [0.5, 0.51, 0.52], [2.0, 2.01, 2.02], [None, None, None]


def test_jin_crossover_with_gossip_only_holds_in_part():
    verdict = claims.jin_crossover(table(jin_cells({4: FAST, 64: SLOW, 256: NEVER})))
    assert verdict.status == claims.PARTLY and verdict.from_n == 64
    assert "gossip faster at the smallest N > 1 and allreduce faster from N=64" in verdict.summary
    assert "ps_async not measured" in verdict.summary
    assert any(line.startswith("ps_async: not measured") for line in verdict.evidence)
    # what the verdict rests on, said with it: the emulated clock's assumptions, and which gossip this is
    assert verdict.evidence[:2] == [
        "every time rests on the emulated clock: the assumed compute rate (emulate.images_per_s, an estimate, not a "
        "measurement) and the straggler model (stragglers)",
        "gossip here is synchronous (every worker averages with its fixed ring neighbours each step), not Jin et al.'s "
        "asynchronous gossip",
    ]


def test_jin_holds_with_both_challengers_and_fails_without_a_crossover():
    verdict = claims.jin_crossover(table(jin_cells({4: FAST, 256: SLOW}, {4: FAST, 16: FAST, 64: SLOW, 256: SLOW})))
    assert verdict.status == claims.HOLDS and verdict.from_n == 256  # the later of the two crossovers
    # gossip faster everywhere: no crossover; level at N=4: not faster at few nodes
    for gossip in ({n: FAST for n in (4, 16, 64, 256)}, {256: SLOW}):
        verdict = claims.jin_crossover(table(jin_cells(gossip)))
        assert verdict.status == claims.DOES_NOT_HOLD
    assert (
        "N=4: time to target gossip 1.01 [0.985, 1.03] s (reached in 3/3 seeds) vs allreduce 1.01 [0.985, 1.03] s "
        "(reached in 3/3 seeds): level with allreduce's within ±0.101" in verdict.evidence[3]
    )
    # ahead at N=4 by a mean within a wide interval: the study cannot tell, not "does not hold"
    verdict = claims.jin_crossover(table(jin_cells({4: [0.9, 1.0, 1.05], 256: SLOW})))
    assert verdict.status == claims.UNDECIDED and verdict.from_n is None
    assert "gossip: undecided, the times' intervals are too wide to tell" in verdict.summary
    assert "undecided against allreduce's: the interval [0.794, 1.17] is too wide" in verdict.evidence[3]


def dai_cells(staleness: dict, top1: dict, steps: dict) -> dict:
    cells = goyal_cells()
    for n in (1, 4, 16, 64, 256):
        cells[("allreduce", n)]["steps"] = [100, 101, 102]
        cells[("ps_async", n)] = {
            "top1": top1.get(n, KEPT),
            "staleness": staleness.get(n, [0.0, 0.0, 0.0]),
            "steps": steps.get(n, [100, 101, 102]),
        }
    return cells


def test_dai_holds_from_the_n_where_staleness_accuracy_and_steps_all_cost():
    grows = {4: [3.0, 3.1, 3.2], 16: [15.0, 15.2, 15.1], 64: [60.0, 61.0, 62.0], 256: [250.0, 251.0, 252.0]}
    verdict = claims.dai_staleness(
        table(
            dai_cells(
                grows, {16: [0.85, 0.86, 0.855], 64: [0.7, 0.71, 0.72]}, {64: [150, 160, 170], 256: [None, None, None]}
            )
        )
    )
    assert verdict.status == claims.HOLDS and verdict.from_n == 64
    assert verdict.summary == ("Staleness grows from N=4; accuracy is lost from N=16; more steps are needed from N=64.")
    assert verdict.evidence[2].startswith("N=16: mean staleness 15.10 [")


def test_dai_does_not_hold_without_growth_or_cost_and_in_part_with_growth_only():
    verdict = claims.dai_staleness(table(dai_cells({n: [1.0, 1.01, 1.02] for n in (1, 4, 16, 64, 256)}, {}, {})))
    assert verdict.status == claims.DOES_NOT_HOLD and verdict.from_n is None
    assert verdict.summary == "Staleness grows at no N; accuracy is lost at no N; more steps are needed at no N."
    # higher means in wide intervals: staleness, the accuracy gap and the steps are undecided, not absent
    noisy = claims.dai_staleness(
        table(dai_cells({1: [1.0, 1.5, 2.0], 256: [1.0, 1.5, 2.6]}, {256: [0.80, 0.95, 0.84]}, {256: [90, 100, 125]}))
    )
    assert noisy.status == claims.UNDECIDED and noisy.from_n is None
    assert noisy.summary == (
        "Whether staleness grows is undecided (N=256); whether accuracy is lost is "
        "undecided (N=256); whether more steps are needed is undecided (N=256)."
    )
    verdict = claims.dai_staleness(table(dai_cells({256: [9.0, 9.5, 10.0]}, {}, {})))
    assert verdict.status == claims.PARTLY and verdict.summary.startswith(
        "Staleness grows from N=256; accuracy is lost at no N"
    )


# --- what a verdict cannot tell: runs that did not learn, the resolution, several N, pairs ----


def at_chance_beyond_n1(strategies: tuple[str, ...]) -> dict:
    """allreduce and `strategies` at KEPT at N=1 and at chance in every seed at every N > 1."""
    return {
        (name, n): {"top1": KEPT if n == 1 else CHANCE}
        for name in ("allreduce", *strategies)
        for n in (1, 4, 16, 64, 256)
    }


def test_seide_with_both_at_chance_in_every_seed_cannot_tell():
    """Misreading (i): two runs at chance lose nothing to each other, a paired difference of zero
    width that read "holds"."""
    verdict = claims.seide_onebit(table(at_chance_beyond_n1(("allreduce_onebit",))))
    assert (verdict.status, verdict.from_n) == (claims.CANNOT_TELL, None)
    assert verdict.summary == (
        "Cannot tell at N=4, 16, 64, 256: allreduce_onebit and allreduce did not learn (a mean "
        "test top-1 below 0.4425, 50% of allreduce's best cell, at least 2 x chance)."
    )
    assert verdict.evidence[0].endswith(
        "+0.0000 [+0.0000, +0.0000]: cannot tell: allreduce_onebit and allreduce did not learn"
    )
    assert "**Cannot tell**: Cannot tell at N=4" in "\n".join(claims_markdown([verdict], "emulated"))


def test_chen_with_both_at_chance_at_the_largest_n_is_read_where_they_learned():
    """Misreading (ii): both at chance at the largest N read "level" there, so "does not hold"."""
    low = [0.70, 0.71, 0.72]
    verdict = claims.chen_backup_vs_async(table(ps_cells({256: CHANCE}, {16: low, 64: low, 256: CHANCE})))
    assert (verdict.status, verdict.from_n) == (claims.HOLDS, 16)
    assert verdict.summary == (
        "ps_backup's top-1 is above ps_async's from N=16 up to N=64; cannot tell at N=256: "
        "ps_backup and ps_async did not learn (a mean test top-1 below 0.4425, 50% of "
        "allreduce's best cell, at least 2 x chance)."
    )
    assert ": cannot tell: ps_backup and ps_async did not learn; time to target" in verdict.evidence[-1]
    everywhere = claims.chen_backup_vs_async(table(at_chance_beyond_n1(("ps_backup", "ps_async"))))
    assert everywhere.status == claims.CANNOT_TELL


def test_jin_with_neither_reaching_the_target_at_the_largest_n_keeps_its_crossover():
    """Misreading (iii): neither run-set reaching the target at the largest N forced "does not
    hold" on a clean crossover at smaller N."""
    cells = jin_cells({4: FAST, 64: SLOW, 256: NEVER}, {4: FAST, 64: SLOW, 256: NEVER})
    cells[("allreduce", 256)]["time"] = NEVER
    verdict = claims.jin_crossover(table(cells))
    assert (verdict.status, verdict.from_n) == (claims.HOLDS, 64)
    assert verdict.summary == (
        "ps_async faster at the smallest N > 1 and allreduce faster from N=64 (cannot tell at "
        "N=256: neither reached the target); gossip faster at the smallest N > 1 and allreduce "
        "faster from N=64 (cannot tell at N=256: neither reached the target)."
    )
    # a challenger that did not learn cannot tell either, whatever its time
    cells = jin_cells({4: FAST, 256: SLOW})
    cells[("gossip", 4)]["top1"] = CHANCE
    verdict = claims.jin_crossover(table(cells))
    assert "cannot tell at N=4: gossip did not learn" in verdict.summary and verdict.status == claims.DOES_NOT_HOLD


def test_goyal_a_budget_that_does_not_learn_is_no_break_of_the_rule():
    """N=256 at chance (52 updates of the at-scale budget) read as where the linear rule breaks."""
    verdict = claims.goyal_batch_limit(table(goyal_cells(n256=CHANCE)))
    assert (verdict.status, verdict.from_n) == (claims.HOLDS, None)
    assert verdict.summary == (
        "Accuracy is kept at every N that learned, up to N=64, global batch 512; cannot tell at "
        "N=256: allreduce did not learn (a mean test top-1 below 0.4425, 50% of allreduce's "
        "best cell, at least 2 x chance): no break is seen where the runs learned."
    )
    verdict = claims.goyal_batch_limit(table(at_chance_beyond_n1(())))
    assert (verdict.status, verdict.from_n) == (claims.CANNOT_TELL, None)
    # a run that learned, below N=1's: that is a break
    verdict = claims.goyal_batch_limit(table(goyal_cells(n256=[0.60, 0.61, 0.62])))
    assert (verdict.status, verdict.from_n) == (claims.HOLDS, 256)


def test_dai_cannot_tell_accuracy_or_steps_where_ps_async_did_not_learn():
    grows = {4: [3.0, 3.1, 3.2], 16: [15.0, 15.2, 15.1], 64: [60.0, 61.0, 62.0], 256: [250.0, 251.0, 252.0]}
    verdict = claims.dai_staleness(table(dai_cells(grows, {256: CHANCE}, {256: [None, None, None]})))
    assert verdict.status == claims.PARTLY
    assert verdict.summary.startswith(
        "Staleness grows from N=4; accuracy is lost at no N (cannot tell at N=256: ps_async did not learn"
    ), verdict.summary
    assert "; whether accuracy is lost: cannot tell: ps_async did not learn" in verdict.evidence[-1]


def test_no_interval_is_narrower_than_what_it_was_measured_on():
    """Deterministic emulated times half a validation-grid step apart, and seeds that agree to
    one test image: zero-width intervals would read them apart."""
    cells = jin_cells({4: [0.95] * 3, 16: [0.95] * 3, 64: SLOW, 256: SLOW})
    for n in (1, 4, 16, 64, 256):
        cells[("allreduce", n)]["time"] = [1.0] * 3
    accuracy = table(cells)
    assert claims.jin_crossover(accuracy).status == claims.PARTLY  # gossip "faster" by half a grid step
    grid = {(name, n): (50.0, 0.1) for name in ("allreduce", "gossip") for n in (1, 4, 16, 64, 256)}
    verdict = claims.jin_crossover(accuracy, claims.StudyFacts(grid=grid))
    assert verdict.status == claims.UNDECIDED
    assert (
        "the interval [0.9, 1] is too wide to tell (3 seeds; as wide as its resolution, 0.1, what it was measured "
        "on can tell)" in verdict.evidence[3]
    ), verdict.evidence[3]
    one_image = table(
        ps_cells({n: [0.8801] * 3 for n in (4, 16, 64, 256)}, {n: [0.8800] * 3 for n in (4, 16, 64, 256)})
    )
    assert claims.chen_backup_vs_async(one_image).status == claims.HOLDS
    verdict = claims.chen_backup_vs_async(one_image, claims.StudyFacts(test_images=10_000))
    assert verdict.status == claims.DOES_NOT_HOLD and ": level with ps_async's within ±0.03" in verdict.evidence[-1]


def test_study_facts_read_the_resolution_and_the_seeds_from_the_runs(tmp_path):
    runs, metrics = seed_runs({("allreduce", 1): {"top1": KEPT}, ("allreduce", 4): {"top1": KEPT}})
    runs["run_dir"] = [str(tmp_path / run_dir) for run_dir in runs["run_dir"]]
    metrics = {str(tmp_path / run_dir): {**m, "lr_schedule": {"rule": "linear"}} for run_dir, m in metrics.items()}
    for i, run_dir in enumerate(runs["run_dir"]):
        (tmp_path / run_dir).mkdir(parents=True)
        (tmp_path / run_dir / "eval.json").write_text(json.dumps({"top1": 0.88, "test_images": 10_000 - i}))
        # the grid's points 0.5 s apart, one gap of 0.75 s; step gaps 40 and 60
        metrics[run_dir]["val_grid"] = [
            {"step": s, "train_s": t, "top1": 0.5} for s, t in ((0, 0.0), (40, 0.5), (100, 1.25), (140, 1.75))
        ]
    facts = claims.study_facts(runs, metrics)
    assert facts.lr_rules == ("linear",) and facts.test_images == 10_000 - 5
    assert facts.grid[("allreduce", 4)] == (60.0, 0.75)
    assert facts.resolution("top1", "allreduce", 4) == 1 / 9995
    assert facts.resolution("time_to_accuracy_s", "allreduce", 4) == 0.75
    assert facts.resolution("steps_to_accuracy", "allreduce", 1) == 60.0
    assert list(facts.runs.columns) == ["strategy", "workers", "seed", *claims.PAIRED_COLUMNS, "step_compute_s"]
    assert len(facts.runs) == 6


def test_several_n_are_one_family_whose_error_holm_holds():
    """Each N alone has its intervals apart at 95% (by 0.0002); four such N read at once are
    not all "above": Holm's step-down lets none of them."""
    cells = ps_cells({}, {n: [0.855, 0.86, 0.865] for n in (4, 16, 64, 256)})
    accuracy = table(cells)
    single = table({key: cell for key, cell in cells.items() if key[1] in (1, 256)})
    assert claims.chen_backup_vs_async(single).status == claims.HOLDS  # one N: read at 95%
    verdict = claims.chen_backup_vs_async(accuracy)
    assert verdict.status == claims.UNDECIDED
    assert "the 95% intervals are apart, but not at Holm's level for the several N" in verdict.evidence[-1]
    # Holm's step-down: a clear difference is apart at α/m, the next at α/(m-1)
    clear, reference = Interval(0.5, 0.49, 0.51, 3, "t95"), Interval(0.88, 0.87, 0.89, 3, "t95")
    just = Interval(0.853, 0.8406, 0.8654, 3, "t95")  # apart at 95%, not at 97.5%
    comparisons = [claims.Comparison(x, reference, "top1", "N=1's") for x in (just, clear, reference)]
    assert claims.holm_levels(comparisons) == {1: 1 - 0.05 / 3}
    assert claims.apart_p(clear, reference) < 1e-3 and claims.apart_p(reference, reference) == 1.0


def test_runs_sharing_seeds_and_stragglers_are_compared_by_their_paired_differences():
    """ps_backup 2 points above ps_async in every seed, the seeds 5 points apart: the two
    cells' intervals overlap widely, their per-seed differences do not."""
    backup, asynchronous = [0.80, 0.85, 0.90], [0.78, 0.83, 0.88]
    cells = ps_cells({n: backup for n in (4, 16, 64, 256)}, {n: asynchronous for n in (4, 16, 64, 256)})
    accuracy = table(cells)
    assert claims.chen_backup_vs_async(accuracy).status == claims.UNDECIDED
    verdict = claims.chen_backup_vs_async(accuracy, paired_facts(cells, test_images=10_000))
    assert (verdict.status, verdict.from_n) == (claims.HOLDS, 4)
    assert ": above ps_async's (paired by seed) (intervals apart at 0.9875" in verdict.evidence[1]
    # the times of Jin's claim too: gossip 0.1 s ahead of allreduce in every seed of spread times
    jin = jin_cells({n: [0.4, 0.9, 1.4] for n in (4, 16)} | {64: SLOW, 256: SLOW})
    for n in (4, 16):
        jin[("allreduce", n)]["time"] = [0.5, 1.0, 1.5]
    assert claims.jin_crossover(table(jin)).status == claims.UNDECIDED
    assert claims.jin_crossover(table(jin), paired_facts(jin)).status == claims.PARTLY


def prose(path) -> str:
    """A file's words on one line (a YAML file's comment marks dropped), for phrases that wrap."""
    return " ".join(line.strip().lstrip("#") for line in path.read_text().splitlines()).replace("  ", " ")


def test_the_docs_read_a_budget_that_did_not_learn_as_cannot_tell_not_as_goyals_limit():
    """A batch whose budget learns at no rate tried is the budget's limit, not the rule's: the
    docs must not present a budget failure as where Goyal's rule breaks, they say that only the
    control (the tuned rate, the smallest bound) decides "cannot tell", and what the time and
    gossip verdicts rest on: the compute rate each time verdict is judged again at."""
    docs = {path: " ".join(prose(path).split()) for path in (REPO / "README.md", REPO / "docs/emulation.md", AT_SCALE)}
    for path, text in docs.items():
        for reading in (
            "the linear rule breaks there",
            "shows where the rule breaks",
            "there the rule breaks",
            "finding on Goyal's claim",
        ):
            assert reading not in text, f"{path}: {reading!r}"
    emulation = docs[REPO / "docs/emulation.md"]
    rule_broken = "a batch whose budget learns at some rate but not at the rule's is a break of the rule"
    budget_failed = (
        'a batch whose budget learns at no rate tried is "cannot tell", a limit of the budget and not of the rule'
    )
    assert rule_broken in emulation and budget_failed in emulation
    assert "only the control decides" in emulation
    assert "not Jin et al.'s asynchronous gossip" in emulation and "not Jin's asynchronous gossip" in docs[AT_SCALE]
    rates = " and ".join(f"x{factor:g}" for factor in claims.RATE_FACTORS)
    assert f"judged again at {rates} that rate" in emulation and f'"{claims.DEPENDS}"' in emulation
    assert all("emulate.images_per_s" in docs[path] for path in (REPO / "docs/emulation.md", AT_SCALE))


def test_findings_and_statistics_md_say_what_every_verdict_and_rule_means():
    """findings.md's claims section opens with how a verdict is read, and docs/statistics.md
    says the same: every status a verdict can have, and the four rules that keep it from
    saying more than its runs can (did not learn, resolution, Holm over several N, pairing),
    each with its figure as the code has it."""
    preamble = " ".join("\n".join(claims_markdown([], "emulated")).split())
    statistics = " ".join(prose(REPO / "docs/statistics.md").split())
    rules = (
        "did not learn",
        "neither reached the target",
        "narrower than what it was measured on",
        "validation grid's step",
        "Holm's step-down procedure",
        "per-seed differences",
        "paired by seed",
    )
    for text in (preamble, statistics):
        assert all(phrase in text for phrase in rules), [phrase for phrase in rules if phrase not in text]
    assert all(f'"{status}"' in statistics for status in claims.STATUSES)
    assert '"cannot tell at N=…"' in preamble and '"cannot tell"' in preamble
    assert f"below {claims.LEARNED_SHARE:.0%} of allreduce's best cell" in preamble
    assert f"or below {claims.CHANCE_MULTIPLE} x chance" in preamble
    assert f"a family-wise error of {claims.FAMILY_ERROR:.2g}" in preamble
    assert f"`LEARNED_SHARE` ({claims.LEARNED_SHARE:g})" in statistics
    assert f"`CHANCE_MULTIPLE` ({claims.CHANCE_MULTIPLE:g})" in statistics
    assert f"`FAMILY_ERROR` ({claims.FAMILY_ERROR:.2g}" in statistics


# --- the recorded run of the one study ---------------------------------------------------------


def _recorded_at_scale() -> dict:
    return json.loads((REPO / "docs/records/studies.json").read_text())["at_scale"]


def _snapshot_frame(rows: list[dict]) -> pd.DataFrame:
    """A record's rows as the frame they were read from ("inf": an unbounded bound; null: NaN)."""
    return pd.DataFrame(rows).replace({"inf": math.inf}).infer_objects()


def test_the_recorded_verdicts_are_what_the_claims_read_off_the_recorded_runs():
    """docs/records/studies.json keeps the at-scale run's accuracy table and per-seed runs
    (`snapshot`) beside its verdicts: read again by today's claims they give the same verdicts,
    so a change of a rule that would change what the docs quote fails here until the record is
    made again (docs/README.md)."""
    measurements = _recorded_at_scale()["measurements"]
    snapshot = json.loads((REPO / measurements["snapshot"]["file"]).read_text())
    facts = claims.StudyFacts(
        tuple(snapshot["lr_rules"]),
        snapshot["test_images"],
        {(strategy, int(n)): (steps, seconds) for strategy, n, steps, seconds in snapshot["grid"]},
        _snapshot_frame(snapshot["runs"]),
    )
    read = claims.verdicts(_snapshot_frame(snapshot["table"]), facts)
    assert {name: (v.status, v.from_n, v.summary) for name, v in zip(claims.CLAIMS, read)} == {
        name: (v["status"], v["from_n"], v["summary"]) for name, v in measurements["verdicts"]["by_claim"].items()
    }


def _recorded_learning() -> tuple[pd.DataFrame, dict[tuple[str, int], bool]]:
    """The recorded run's table and, by claims.learning_bar, whether each cell learned."""
    measurements = _recorded_at_scale()["measurements"]
    table = _snapshot_frame(json.loads((REPO / measurements["snapshot"]["file"]).read_text())["table"])
    bar = claims.learning_bar(table)
    return table, {(row.strategy, int(row.workers)): bool(row.top1 >= bar) for row in table.itertuples()}


def test_the_record_says_which_cells_learned_by_the_claims_own_bar():
    measurements = _recorded_at_scale()["measurements"]
    table, learned = _recorded_learning()
    assert measurements["learning"]["bar"] == pytest.approx(claims.learning_bar(table))
    recorded = {
        (name, int(n)): cell["learned"]
        for name, by_n in measurements["learning"]["cells"].items()
        for n, cell in by_n.items()
    }
    assert recorded == learned
    assert measurements["learning"]["did_not_learn"] == sorted(
        f"{name} N={n}" for (name, n), ok in learned.items() if not ok
    )


def test_every_control_of_the_recorded_study_learned():
    """The study's design promise: at every N and batch it includes, what a claim compares with
    learned (a mean test top-1 at claims.learning_bar): allreduce at each N of part 1, the best
    rate of the sweep at each batch of part 2, ssp's smallest bound in part 3. A treatment may
    fail to learn (the rule's rate at a batch too large for it): that is what is measured."""
    table, learned = _recorded_learning()
    sweep = table[table["lr_rule"] == claims.SWEPT_RULE]
    controls = [(claims.SYNC, int(n)) for n in table[table["strategy"] == claims.SYNC]["workers"]]
    controls += [(claims._tuned(rows)["strategy"], 1) for _, rows in sweep.groupby("global_batch")]
    bounds = claims.bound_sweep(table)
    controls.append((bounds.iloc[0]["strategy"], int(bounds.iloc[0]["workers"])))
    assert len(controls) >= 3 + 3 + 1
    assert all(learned[control] for control in controls), [control for control in controls if not learned[control]]
