"""The claims' new readings (dtstudy.analysis.claims) on hand-made tables:

- the learning bar: LEARNED_SHARE of allreduce's best cell (its own rows and its variants', any
  N), never below CHANCE_MULTIPLE x chance, so that a study whose allreduce did not learn reads
  its cells at chance as "did not learn";
- Goyal against a learning-rate sweep at each global batch (goyal_against_tuned): the linear
  rule against the sweep's rate picked by validation top-1, paired by seed, each status;
- Dai against ssp's bound at a fixed N (dai_against_bound): its three effects, and what a
  smallest bound that did not learn can and cannot tell;
- Jin rejudged at RATE_FACTORS the compute rate (at_compute_rate, with_rate_sensitivity):
  the rescaled times, and DEPENDS where the verdict moves with the rate.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
from test_at_scale import CHANCE, KEPT, LOST, WIDE, seed_runs

from dtstudy.analysis import claims
from dtstudy.analysis.findings import claims_markdown
from dtstudy.analysis.tables import accuracy_table, with_run_extras

NS = (1, 4, 16, 64, 256)
FACT_COLUMNS = ["strategy", "workers", "seed", *claims.PAIRED_COLUMNS, "step_compute_s"]


def study(cells: dict, seeds: int = 3, **facts) -> tuple[pd.DataFrame, claims.StudyFacts]:
    """The accuracy table and StudyFacts (per-seed runs, with their step's compute) of hand-made
    runs: test_at_scale.seed_runs's cells {(strategy, N): {top1, time, steps, staleness}} and,
    per cell, what tells a variant apart: `base` (its strategy: base_strategy), `lr_rule` and
    `peak_lr` (metrics.json's lr_schedule), `val` (final validation top-1 per seed), `bound`
    (ssp's knob `staleness`, None: unbounded) and `compute` (the emulated step's compute, s)."""
    runs, metrics = seed_runs(cells, seeds)
    runs["base_strategy"] = [cells[(s, n)].get("base", s) for s, n in zip(runs["strategy"], runs["workers"])]
    for (strategy, workers), cell in cells.items():
        for seed in range(seeds):
            run = metrics[f"runs/{strategy}/n{workers}/seed{seed}"]
            if "lr_rule" in cell:
                run["lr_schedule"] = {"rule": cell["lr_rule"], "peak_lr": cell.get("peak_lr")}
            if "val" in cell:
                run["final_val_top1"] = cell["val"][seed]
            if "bound" in cell:
                run["strategy_params"] = {"staleness": cell["bound"]}
            if "compute" in cell:
                run["emulation"] = {"step_compute_s": cell["compute"]}
    extras = with_run_extras(runs, metrics)
    return accuracy_table(runs, None, metrics), claims.StudyFacts(runs=extras[FACT_COLUMNS].copy(), **facts)


def row(table: pd.DataFrame, strategy: str, workers: int) -> pd.Series:
    return table[(table["strategy"] == strategy) & (table["workers"] == workers)].iloc[0]


# --- the learning bar ----------------------------------------------------------------------


def everywhere(top1: list[float], *strategies: str) -> dict:
    return {(name, n): {"top1": top1} for name in strategies for n in NS}


def test_a_study_whose_allreduce_is_at_chance_everywhere_learned_nothing():
    """Half of allreduce's at chance (0.05) let every cell at chance pass as learned: two runs at
    chance then lose nothing to each other (Seide "holds") or are level (Chen "does not hold")."""
    seide, _ = study(everywhere(CHANCE, "allreduce", "allreduce_onebit"))
    assert claims.learning_bar(seide) == claims.CHANCE_MULTIPLE * claims.CHANCE
    assert share_of_best(seide) < claims.CHANCE_MULTIPLE * claims.CHANCE  # the floor, not the share, is the bar
    verdict = claims.seide_onebit(seide)
    assert (verdict.status, verdict.from_n) == (claims.CANNOT_TELL, None)
    assert verdict.summary.startswith(
        "Cannot tell at N=4, 16, 64, 256: allreduce_onebit and allreduce did not learn (a mean test top-1 "
        f"below {claims.CHANCE_MULTIPLE * claims.CHANCE:.4f}"
    ), verdict.summary
    chen, _ = study(everywhere(CHANCE, "allreduce", "ps_backup", "ps_async"))
    verdict = claims.chen_backup_vs_async(chen)
    assert (verdict.status, verdict.from_n) == (claims.CANNOT_TELL, None)
    assert "ps_backup and ps_async did not learn" in verdict.summary
    # the control: the same cells a little above the floor learned, and are read
    above, _ = study(everywhere([0.25, 0.25, 0.25], "allreduce", "allreduce_onebit"))
    assert claims.seide_onebit(above).status == claims.HOLDS


def share_of_best(table: pd.DataFrame) -> float:
    """LEARNED_SHARE of the best mean top-1 of allreduce's rows (its own and its variants')."""
    rows = table[(table["strategy"] == "allreduce") | (table["base_strategy"] == "allreduce")]
    return claims.LEARNED_SHARE * rows["top1"].max()


def test_allreduces_best_cell_at_a_larger_n_sets_the_bar_not_n1():
    """allreduce at N=1 learned little of what the budget can (0.50), at N=4 and up it learned
    0.885: a onebit cell at 0.41 lies below half the best, so it did not learn (against N=1's
    half, 0.25, it would read a loss)."""
    cells = everywhere(KEPT, "allreduce", "allreduce_onebit")
    cells[("allreduce", 1)] = {"top1": [0.49, 0.50, 0.51]}
    cells[("allreduce_onebit", 4)] = {"top1": [0.40, 0.41, 0.42]}
    accuracy, _ = study(cells)
    best = row(accuracy, "allreduce", 4)["top1"]
    assert best > row(accuracy, "allreduce", 1)["top1"]
    assert claims.learning_bar(accuracy) == pytest.approx(claims.LEARNED_SHARE * best)
    assert claims.not_learned(accuracy, ["allreduce_onebit"], 4) == "allreduce_onebit did not learn"
    verdict = claims.seide_onebit(accuracy)
    assert (verdict.status, verdict.from_n) == (claims.HOLDS, 16)
    assert verdict.summary.endswith(
        "cannot tell at N=4: allreduce_onebit did not learn (a mean test top-1 below "
        f"{claims.LEARNED_SHARE * best:.4f}, "
        "50% of allreduce's best cell, at least 2 x chance)."
    ), verdict.summary


def test_a_variant_of_allreduce_sets_the_bar_with_allreduces_own_rows():
    """allreduce's own rows reach 0.60, a variant of it (base_strategy allreduce) 0.90: the
    bar is half the variant's; a strategy that is not allreduce's does not count."""
    cells = everywhere([0.59, 0.60, 0.61], "allreduce") | everywhere([0.97, 0.98, 0.99], "allreduce_onebit")
    cells[("allreduce_long", 4)] = {"top1": [0.89, 0.90, 0.91], "base": "allreduce"}
    accuracy, _ = study(cells)
    assert row(accuracy, "allreduce_long", 4)["base_strategy"] == "allreduce"
    assert claims.learning_bar(accuracy) == pytest.approx(claims.LEARNED_SHARE * 0.90)
    # a cell at 0.40: above half of allreduce's own (0.30), below half of its variant's (0.45)
    low = accuracy.copy()
    low.loc[(low["strategy"] == "allreduce") & (low["workers"] == 16), "top1"] = 0.40
    assert claims.not_learned(low, ["allreduce"], 16) == "allreduce did not learn"


# --- Goyal against a learning-rate sweep at each batch --------------------------------------

SWEEP_NS = (1, 4, 16, 64)  # global batches 8, 32, 128, 512 (test_at_scale.seed_runs: 8 per worker)
BROKEN = [0.70, 0.71, 0.72]
LOWER = [0.80, 0.81, 0.82]
TUNED_VAL, OTHER_VAL = [0.89, 0.89, 0.89], [0.84, 0.85, 0.86]
CHANCE_VAL, OTHER_CHANCE_VAL = [0.10, 0.10, 0.10], [0.12, 0.12, 0.12]


def sweep_cells(rule: dict | None = None, other: dict | None = None, at_chance=(), other_val: dict | None = None):
    """allreduce under the linear rule (its top-1 KEPT or `rule`'s) and a sweep of two fixed
    peak rates at every N: allreduce_lr0.1 (KEPT, the best validation top-1) and
    allreduce_lr0.4 (LOWER or `other`'s); at the N in `at_chance` both sweep rows at chance
    (allreduce_lr0.4 a little higher on validation)."""
    rule, other, other_val = rule or {}, other or {}, other_val or {}
    cells = {}
    for n in SWEEP_NS:
        chance = n in at_chance
        cells[("allreduce", n)] = {"top1": rule.get(n, KEPT), "lr_rule": "linear", "peak_lr": 0.05 * n}
        cells[("allreduce_lr0.1", n)] = {
            "top1": CHANCE if chance else KEPT,
            "val": CHANCE_VAL if chance else TUNED_VAL,
            "base": "allreduce",
            "lr_rule": "none",
            "peak_lr": 0.1,
        }
        cells[("allreduce_lr0.4", n)] = {
            "top1": CHANCE if chance else other.get(n, LOWER),
            "val": OTHER_CHANCE_VAL if chance else other_val.get(n, OTHER_VAL),
            "base": "allreduce",
            "lr_rule": "none",
            "peak_lr": 0.4,
        }
    return cells


def goyal(cells: dict) -> claims.Verdict:
    accuracy, facts = study(cells, test_images=10_000)
    return claims.goyal_batch_limit(accuracy, facts)  # dispatches to goyal_against_tuned


OPENING = "Against the best rate of a sweep at each batch, accuracy is "


@pytest.mark.parametrize(
    "rule, at_chance, status, from_n, summary",
    [
        (
            {64: BROKEN},
            (),
            claims.HOLDS,
            512,
            OPENING + "kept up to global batch 128; below the tuned rate's from global batch 512.",
        ),
        ({}, (), claims.HOLDS, None, OPENING + "kept up to global batch 512: no break within the study's batches."),
        ({1: BROKEN}, (), claims.DOES_NOT_HOLD, 8, OPENING + "below the tuned rate's from global batch 8."),
        (
            {16: WIDE},
            (),
            claims.PARTLY,
            None,
            OPENING + "kept up to global batch 512; the study cannot tell at global batch 128 (intervals too wide).",
        ),
        (
            dict.fromkeys(SWEEP_NS, WIDE),
            (),
            claims.UNDECIDED,
            None,
            OPENING + "the study cannot tell at global batch 8, 32, 128, 512 (intervals too wide).",
        ),
        (
            {},
            SWEEP_NS,
            claims.CANNOT_TELL,
            None,
            "Cannot tell at global batch 8: allreduce_lr0.4 did not learn; cannot tell at global batch 32: "
            "allreduce_lr0.4 did not learn; cannot tell at global batch 128: allreduce_lr0.4 did not learn; "
            "cannot tell at global batch 512: allreduce_lr0.4 did not learn.",
        ),
    ],
    ids=["kept-then-broken", "kept-everywhere", "broken-at-the-smallest", "partly", "undecided", "cannot-tell"],
)
def test_goyal_against_the_tuned_rate_at_each_batch(rule, at_chance, status, from_n, summary):
    verdict = goyal(sweep_cells(rule, at_chance=at_chance))
    assert (verdict.status, verdict.from_n, verdict.summary) == (status, from_n, summary)
    assert len(verdict.evidence) == len(SWEEP_NS)


def test_goyal_reads_the_linear_rule_paired_by_seed_against_the_sweep():
    """Paired by seed: the rule within a point of the tuned rate in every seed, the seeds 5
    points apart: kept on the paired differences (within the margin), while the two cells'
    intervals alone are too wide to call it kept."""
    spread, rule = [0.83, 0.88, 0.93], [0.82, 0.885, 0.928]
    cells = sweep_cells()
    for n in SWEEP_NS:
        cells[("allreduce", n)]["top1"] = rule
        cells[("allreduce_lr0.1", n)]["top1"] = spread
    accuracy, facts = study(cells, test_images=10_000)
    verdict = claims.goyal_batch_limit(accuracy, facts)
    assert (verdict.status, verdict.from_n) == (claims.HOLDS, None)
    assert "kept, not below the tuned rate's (paired by seed) by more than 0.03" in verdict.evidence[-1]
    unpaired = claims.goyal_batch_limit(accuracy, claims.StudyFacts(test_images=10_000))
    assert unpaired.status == claims.UNDECIDED


def test_goyal_picks_the_sweeps_rate_by_validation_not_by_test():
    """At global batch 128 the 0.4 rate has the higher test top-1 (0.95) and the lower
    validation top-1: the tuned rate is 0.1's, against which the rule is kept."""
    higher_test = [0.945, 0.95, 0.955]
    verdict = goyal(sweep_cells(other={16: higher_test}))
    assert (verdict.status, verdict.from_n) == (claims.HOLDS, None)
    assert "tuned (best validation of peaks 0.1, 0.4: 0.1) 0.8850 [" in verdict.evidence[2], verdict.evidence[2]
    # the control: the same 0.4 rate with the better validation top-1 is the tuned rate, and the rule breaks
    control = goyal(sweep_cells(other={16: higher_test}, other_val={16: [0.90, 0.90, 0.90]}))
    assert (control.status, control.from_n) == (claims.HOLDS, 128)
    assert "tuned (best validation of peaks 0.1, 0.4: 0.4) 0.9500 [" in control.evidence[2], control.evidence[2]


def test_goyal_a_rule_at_chance_where_the_tuned_rate_learned_is_a_break():
    verdict = goyal(sweep_cells({64: CHANCE}))
    assert (verdict.status, verdict.from_n) == (claims.HOLDS, 512)
    assert verdict.summary.endswith("below the tuned rate's from global batch 512.")
    assert "did not learn" not in verdict.summary
    assert "below the tuned rate's (paired by seed) (intervals apart" in verdict.evidence[-1], verdict.evidence[-1]


def test_goyal_a_tuned_rate_at_chance_cannot_tell():
    """At global batch 512 no rate of the sweep learned (the budget failed): the rule at chance
    there is no break, the batch cannot tell."""
    verdict = goyal(sweep_cells({64: CHANCE}, at_chance=(64,)))
    assert (verdict.status, verdict.from_n) == (claims.HOLDS, None)
    assert verdict.summary == (
        OPENING + "kept up to global batch 128; cannot tell at global batch 512: allreduce_lr0.4 did not learn: "
        "no break within the study's batches."
    )
    assert verdict.evidence[-1].endswith("cannot tell: allreduce_lr0.4 did not learn"), verdict.evidence[-1]


def test_goyal_against_the_sweep_says_from_which_batch_in_findings():
    """The break is at a global batch, and findings.md says so (not "from N=512", an N never run)."""
    verdict = goyal(sweep_cells({64: BROKEN}))
    heading = claims_markdown([verdict], "emulated")[-len(verdict.evidence) - 1]
    assert heading.startswith("- **Goyal et al. 2017")
    assert "(from global batch 512)" in heading and "N=512" not in heading, heading


# --- Dai against ssp's bound at a fixed N ---------------------------------------------------

GROWS = {1: [0.0, 0.0, 0.0], 4: [3.0, 3.1, 3.2], 16: [15.0, 15.1, 15.2]}
BOUNDS = {"ssp_s0": 0, "ssp_s4": 4, "ssp_inf": None}
NEVER = {"top1": CHANCE, "time": [None] * 3, "steps": [None] * 3}


def bound_cells(bounds: dict | None = None, async_ns=(1, 4, 16)) -> dict:
    """allreduce at N=1, 4, 16 (KEPT); ps_async at `async_ns`, its staleness growing (GROWS);
    ssp at N=16 under the bounds 0, 4 and unbounded, each KEPT in 100 steps unless `bounds`
    ({variant: cell keys}) says otherwise."""
    cells = {("allreduce", n): {"top1": KEPT} for n in (1, 4, 16)}
    cells |= {("ps_async", n): {"top1": KEPT, "staleness": GROWS[n]} for n in async_ns}
    for name, bound in BOUNDS.items():
        cells[(name, 16)] = {"top1": KEPT, "steps": [100, 101, 102], "base": "ssp", "bound": bound}
        cells[(name, 16)] |= (bounds or {}).get(name, {})
    return cells


def dai(cells: dict) -> claims.Verdict:
    accuracy, facts = study(cells, test_images=10_000)
    return claims.dai_staleness(accuracy, facts)


AGAINST = " (ssp at N=16, against s=0)"


def test_dai_sweeps_ssps_bound_at_one_n_smallest_first_unbounded_last():
    accuracy, _ = study(bound_cells())
    sweep = claims.bound_sweep(accuracy)
    assert list(sweep["strategy"]) == ["ssp_s0", "ssp_s4", "ssp_inf"] and set(sweep["workers"]) == {16}
    assert list(sweep["staleness_bound"]) == [0.0, 4.0, math.inf]
    # one bound at each N is no sweep: the N-trend reading against allreduce
    single = study({key: cell for key, cell in bound_cells().items() if key[0] != "ssp_s4"})[0]
    single.loc[single["strategy"] == "ssp_inf", "workers"] = 4
    assert claims.bound_sweep(single) is None


def test_dai_holds_with_every_effect_against_the_smallest_bound():
    lost = {"top1": LOST, "steps": [150, 160, 170]}
    verdict = dai(bound_cells({"ssp_s4": lost, "ssp_inf": lost}))
    assert (verdict.status, verdict.from_n) == (claims.HOLDS, None)
    assert verdict.summary == (
        f"Staleness grows with N from N=4; accuracy is lost from s=4{AGAINST}; more steps are needed from s=4{AGAINST}."
    )


def test_dai_reads_a_bounds_cost_paired_by_seed():
    """s=4 5 points below s=0 in every seed, the seeds 5 points apart: accuracy is lost on the
    paired differences, undecided on the two cells' intervals alone."""
    cells = bound_cells({"ssp_s0": {"top1": [0.83, 0.88, 0.93]}, "ssp_s4": {"top1": [0.78, 0.83, 0.88]}})
    accuracy, facts = study(cells, test_images=10_000)
    assert "accuracy is lost from s=4" + AGAINST in claims.dai_staleness(accuracy, facts).summary
    unpaired = claims.dai_staleness(accuracy, claims.StudyFacts(test_images=10_000))
    assert "whether accuracy is lost is undecided (s=4, unbounded)" + AGAINST in unpaired.summary, unpaired.summary


def test_dai_holds_in_part_with_staleness_growing_but_no_bound_costing():
    verdict = dai(bound_cells())
    assert verdict.status == claims.PARTLY
    assert verdict.summary == (
        f"Staleness grows with N from N=4; accuracy is lost at no bound{AGAINST}; more steps are needed at no "
        f"bound{AGAINST}."
    )


def test_dai_a_larger_bound_at_chance_where_s0_learned_is_accuracy_lost():
    verdict = dai(bound_cells({"ssp_inf": NEVER}))
    assert (verdict.status, verdict.from_n) == (claims.HOLDS, None)
    assert verdict.summary == (
        f"Staleness grows with N from N=4; accuracy is lost from unbounded{AGAINST}; more steps are needed "
        f"from unbounded{AGAINST}."
    )


def test_dai_a_smallest_bound_at_chance_cannot_tell_what_the_bound_costs():
    """s=0 at chance: the budget did not learn at this N, so no bound can show a cost, even one
    that learned."""
    said = (
        "whether accuracy is lost: cannot tell at s=4: ssp_s0 did not learn; unbounded: ssp_s0 did not learn; "
        "whether more steps are needed: cannot tell at s=4: ssp_s0 did not learn; unbounded: ssp_s0 did not learn."
    )
    for bounds in ({"ssp_s0": NEVER, "ssp_s4": NEVER, "ssp_inf": NEVER}, {"ssp_s0": NEVER}):
        verdict = dai(bound_cells(bounds))
        assert verdict.status == claims.PARTLY
        assert verdict.summary == "Staleness grows with N from N=4; " + said
    # with ps_async at one N (no growth to read), nothing can be told
    verdict = dai(bound_cells({"ssp_s0": NEVER, "ssp_s4": NEVER, "ssp_inf": NEVER}, async_ns=(16,)))
    assert (verdict.status, verdict.from_n) == (claims.CANNOT_TELL, None)
    assert verdict.summary == "Whether staleness grows with N: not read; " + said


# --- Jin at other compute rates ---------------------------------------------------------------

#: allreduce: 100 steps of 10 ms compute (1 s of its time); gossip the same; ps_async 400 cheap steps
#: of 1 ms (0.4 s): a slower compute rate costs allreduce more than ps_async, a faster one saves it more
SYNC_STEPS, SYNC_COMPUTE, ASYNC_STEPS, ASYNC_COMPUTE = 100, 0.01, 400, 0.001
SYNC_TIME = [1.50, 1.51, 1.52]
GOSSIP_TIMES = {4: [1.00, 1.01, 1.02], 16: [1.00, 1.02, 1.01], 64: [2.00, 2.01, 2.02], 256: [2.00, 2.02, 2.01]}


def jin_cells(async_times: dict, compute: bool = True) -> dict:
    """allreduce and gossip (crossover at N=64 whatever the rate: the same steps and compute)
    and ps_async at `async_times` (N: per seed), at N=1, 4, 16, 64, 256."""
    cells = {}
    for n in NS:
        cells[("allreduce", n)] = {"top1": KEPT, "time": SYNC_TIME, "steps": [SYNC_STEPS] * 3}
        cells[("gossip", n)] = {"top1": KEPT, "time": GOSSIP_TIMES.get(n, SYNC_TIME), "steps": [SYNC_STEPS] * 3}
        cells[("ps_async", n)] = {"top1": KEPT, "time": async_times.get(n, SYNC_TIME), "steps": [ASYNC_STEPS] * 3}
        if compute:
            for name, step in (("allreduce", SYNC_COMPUTE), ("gossip", SYNC_COMPUTE), ("ps_async", ASYNC_COMPUTE)):
                cells[(name, n)]["compute"] = step
    return cells


def jin(cells: dict, **facts) -> claims.Verdict:
    accuracy, study_facts = study(cells, **facts)
    return next(v for v in claims.verdicts(accuracy, study_facts) if v.source == "Jin et al. 2016")


def plus(times: list[float], seconds: float) -> list[float]:
    return [t + seconds for t in times]


# ps_async's times minus allreduce's move by -0.6 s at x0.5 the compute rate, +0.3 s at x2
CROSSES_LATER_WHEN_SLOWER = {
    4: plus(SYNC_TIME, -0.5),
    16: plus(SYNC_TIME, -0.5),
    64: [1.90, 1.91, 1.93],
    256: [3.0] * 3,
}
LOSES_FEW_NODES_WHEN_FASTER = {4: [1.30, 1.32, 1.31], 16: [1.30, 1.31, 1.33], 64: [3.0] * 3, 256: [3.01, 3.0, 3.02]}
FIRM = {4: [0.50, 0.51, 0.53], 16: [0.50, 0.52, 0.51], 64: [3.0, 3.01, 3.0], 256: [3.0, 3.02, 3.01]}


def test_jin_at_its_own_rate_holds_with_both_crossovers():
    for times in (CROSSES_LATER_WHEN_SLOWER, LOSES_FEW_NODES_WHEN_FASTER, FIRM):
        verdict = claims.jin_crossover(*study(jin_cells(times)))
        assert (verdict.status, verdict.from_n) == (claims.HOLDS, 64)


@pytest.mark.parametrize(
    "times, slower, faster",
    [
        (CROSSES_LATER_WHEN_SLOWER, (claims.HOLDS, 256), (claims.HOLDS, 64)),
        (LOSES_FEW_NODES_WHEN_FASTER, (claims.HOLDS, 64), (claims.PARTLY, 64)),  # gossip still holds from N=64
    ],
    ids=["crossover-moves", "status-changes"],
)
def test_jin_depends_on_the_compute_rate_where_its_verdict_moves_with_it(times, slower, faster):
    accuracy, facts = study(jin_cells(times))
    at = {factor: claims.jin_crossover(*claims.at_compute_rate(accuracy, facts, factor)) for factor in (0.5, 2.0)}
    assert (at[0.5].status, at[0.5].from_n) == slower and (at[2.0].status, at[2.0].from_n) == faster
    verdict = jin(jin_cells(times))
    assert (verdict.status, verdict.from_n) == (claims.DEPENDS, None)
    assert verdict.summary.startswith("At the assumed compute rate: holds: ")
    assert f"; at x2 the compute rate: {faster[0]}: {at[2.0].summary}" in verdict.summary
    assert f". At x0.5 the compute rate: {slower[0]}: {at[0.5].summary}" in verdict.summary
    assert [line for line in verdict.evidence if line.startswith("x0.5: ")] == [f"x0.5: {x}" for x in at[0.5].evidence]


def test_jin_keeps_its_verdict_where_no_compute_rate_moves_it():
    verdict = jin(jin_cells(FIRM))
    assert (verdict.status, verdict.from_n) == (claims.HOLDS, 64)
    assert verdict.evidence[-1] == "the same verdict with the compute rate (emulate.images_per_s) x0.5 and x2"
    assert verdict == claims.with_rate_sensitivity(
        "jin", claims.jin_crossover(*study(jin_cells(FIRM))), *study(jin_cells(FIRM))
    )
    # a study whose runs record no step's compute (real hardware): no rejudging, and it says so
    verdict = jin(jin_cells(CROSSES_LATER_WHEN_SLOWER, compute=False))
    assert (verdict.status, verdict.from_n) == (claims.HOLDS, 64)
    assert verdict.evidence[-1] == "no compute-rate sensitivity: not an emulated study"
    accuracy, facts = study(jin_cells(CROSSES_LATER_WHEN_SLOWER, compute=False))
    assert claims.at_compute_rate(accuracy, facts, 0.5) is None
    assert claims.at_compute_rate(accuracy, claims.StudyFacts(), 0.5) is None


@pytest.mark.parametrize("factor", claims.RATE_FACTORS)
def test_the_rescaled_clock_moves_each_run_by_its_steps_compute(factor):
    grid = {("ps_async", 4): (50.0, 0.2), ("allreduce", 4): (20.0, 0.3)}
    accuracy, facts = study(jin_cells(CROSSES_LATER_WHEN_SLOWER), grid=grid)
    before_table, before_runs = accuracy.copy(), facts.runs.copy()
    table, rescaled = claims.at_compute_rate(accuracy, facts, factor)
    run = facts.runs[(facts.runs["strategy"] == "ps_async") & (facts.runs["workers"] == 4)].set_index("seed")
    moved = rescaled.runs[(rescaled.runs["strategy"] == "ps_async") & (rescaled.runs["workers"] == 4)]
    moved = moved.set_index("seed")["time_to_accuracy_s"]
    one = run.loc[1]
    assert moved[1] == pytest.approx(
        one["time_to_accuracy_s"] + (1 / factor - 1) * one["step_compute_s"] * one["steps_to_accuracy"], abs=1e-12
    )
    assert moved[1] != pytest.approx(one["time_to_accuracy_s"])
    cell = row(table, "ps_async", 4)
    assert cell["time_to_accuracy_s"] == pytest.approx(moved.mean(), abs=1e-12)
    assert cell["time_to_accuracy_s_high"] - cell["time_to_accuracy_s_low"] == pytest.approx(
        row(accuracy, "ps_async", 4)["time_to_accuracy_s_high"] - row(accuracy, "ps_async", 4)["time_to_accuracy_s_low"]
    )  # every seed moved by the same: the same spread
    steps, seconds = grid[("ps_async", 4)]
    assert rescaled.grid[("ps_async", 4)] == pytest.approx((steps, seconds + (1 / factor - 1) * ASYNC_COMPUTE * steps))
    assert rescaled.grid[("allreduce", 4)][1] == pytest.approx(0.3 + (1 / factor - 1) * SYNC_COMPUTE * 20.0)
    # the measured table and facts are left as they were
    pd.testing.assert_frame_equal(accuracy, before_table)
    pd.testing.assert_frame_equal(facts.runs, before_runs)
