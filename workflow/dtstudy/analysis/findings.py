"""The tables' Markdown (`scaling_markdown`, `accuracy_markdown`, the noise note) and
findings.md (`findings_markdown`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd

from dtstudy.analysis.claims import (
    ABOVE,
    BELOW,
    CHANCE_MULTIPLE,
    DEPENDS,
    FAMILY_ERROR,
    LEARNED_SHARE,
    LEVEL,
    RATE_FACTORS,
    RELATIVE_MARGIN,
    SCALES,
    UNDECIDED_READING,
    Verdict,
    beyond_zero,
    difference_range,
    read,
)
from dtstudy.analysis.tables import BASELINE_STRATEGY, GAP_POINTS, OVERSUBSCRIBED_NOTE, to_markdown
from dtstudy.common import intervals
from dtstudy.common.intervals import Interval
from dtstudy.config.run_kinds import ACCURACY, SCALING
from dtstudy.strategies.specs import REFERENCE_STRATEGY


def _interval(table_row, prefix: str, kind: str = "bootstrap95") -> Interval:
    """The interval that the columns prefix, prefix_low, prefix_high of a table row hold."""
    return Interval(table_row[prefix], table_row[f"{prefix}_low"], table_row[f"{prefix}_high"], 0, kind)


def _cell(table_row, prefix: str, fmt: str, kind: str = "bootstrap95") -> str:
    return intervals.format_interval(_interval(table_row, prefix, kind), fmt)


def _difference_cell(table_row) -> str:
    """The paired difference to allreduce: a t interval or a range, as its top-1 is."""
    return _cell(table_row, "top1_vs_allreduce", "+.4f", table_row["top1_interval"])


#: (the table, the kind of run its figures come from) -> the note that says so (dtstudy.config.run_kinds)
SOURCE_NOTES = {
    ("scaling", SCALING): "From the scaling runs: at every N, scaling.warmup_steps untimed steps, then "
    "scaling.steps timed ones (the column from_runs of scaling.csv).",
    ("scaling", ACCURACY): "From the accuracy runs (full trainings): this study has no scaling runs "
    "(scaling.steps: null), so its throughput is timed over whole trainings.",
    ("accuracy", ACCURACY): "From the accuracy runs: full trainings (train.epochs) at the N and seeds of "
    "accuracy.workers and accuracy.seeds (the column from_runs of accuracy.csv).",
}


def source_note(table_name: str, table: pd.DataFrame) -> str:
    """Which kind of run the table's figures come from, in words."""
    return SOURCE_NOTES[(table_name, table["from_runs"].iloc[0])]


def noise_note(noise: Mapping) -> str:
    if noise.get("n1_runs", 0) < 2:
        return (
            "Noise: fewer than two N=1 runs of the plain SGD loop (parameter servers left out), so the "
            "machine's noise is not measured in this study."
        )
    return (
        f"Noise of this machine: at N=1 every strategy without extra processes runs the same plain SGD loop "
        f"(a parameter server's N=1 sends every step to a shard: not the same loop, left out), and their "
        f"{noise['n1_runs']} runs measured {noise['n1_min']:.0f} to {noise['n1_max']:.0f} images/s "
        f"(max/min {noise['n1_ratio']:.2f}, CV {100 * noise['n1_cv']:.1f}%); inside one run the timed windows "
        f"vary by {100 * noise['window_cv']:.1f}% (CV, median over runs). A difference between two rows smaller "
        "than this spread is noise."
    )


def scaling_markdown(table: pd.DataFrame, noise: Mapping) -> str:
    rows = [
        {
            "strategy": r["strategy"],
            "N": r["workers"],
            "shards": ""
            if pd.isna(r["extra_processes"]) or not r["extra_processes"]
            else f"{r['extra_processes']:.0f}",
            "seeds × windows": f"{r['seeds']} × {r['windows'] // max(1, r['seeds'])}",
            "images/s [95% CI]": _cell(r, "throughput", ".0f"),
            "speedup [95% CI]": _cell(r, "speedup", ".2f"),
            "E(N) [95% CI]": _cell(r, "efficiency", ".2f"),
            "ceiling E(N)": "n/a" if pd.isna(r["ceiling_efficiency"]) else f"{r['ceiling_efficiency']:.2f}",
            "E / ceiling [95% CI]": _cell(r, "efficiency_vs_ceiling", ".2f"),
            "compute s": f"{r['compute_s']:.5f}",
            "exchange s": f"{r['comm_s']:.5f}",
            "bytes/step": f"{r['bytes_per_step']:.0f}",
            "notes": ", ".join(
                n for n, on in (("oversubscribed", r["oversubscribed"]), ("not pinned", not r["pinned"])) if on
            ),
        }
        for _, r in table.iterrows()
    ]
    notes = [
        source_note("scaling", table),
        "Throughput: median of the run's timed windows (train.timing_window_steps steps each, whole periods "
        "of a periodic average; after the warm-up steps and the strategy's own transient), pooled over seeds, "
        "with a bootstrap 95% CI over the windows. Speedup and E(N) = S(N)/N are against the same strategy "
        "at N=1. The ceiling is no_exchange: N workers that train alone and exchange nothing, i.e. what this "
        "machine gives N processes; E / ceiling compares a strategy with it.",
        noise_note(noise),
    ] + ([OVERSUBSCRIBED_NOTE] if table["oversubscribed"].any() else [])
    return to_markdown(pd.DataFrame(rows), "Scaling table", notes, formatted=True)


def accuracy_markdown(table: pd.DataFrame) -> str:
    rows = [
        {
            "strategy": r["strategy"],
            "N": r["workers"],
            "global batch": "" if pd.isna(r["global_batch"]) else f"{r['global_batch']:.0f}",
            "seeds": r["seeds"],
            "test top-1": _cell(r, "top1", ".4f", r["top1_interval"]),
            "test top-5": _cell(r, "top5", ".4f", r["top1_interval"]) if r["seeds"] else "",  # same seeds
            "top-1 − allreduce (paired)": "" if r["strategy"] == BASELINE_STRATEGY else _difference_cell(r),
            "time to target s [95% CI]": _cell(r, "time_to_accuracy_s", ".3g", _reached_interval_kind(r)),
            "reached": r["reached_target"],
            "mark": f"> {GAP_POINTS} points below allreduce" if r["below_allreduce"] else "",
        }
        for _, r in table.iterrows()
    ]
    notes = [
        source_note("accuracy", table),
        "Test top-1/top-5: the mean over seeds; [a, b] is a t 95% CI (3 or more seeds), (a–b) the range of "
        "2 seeds, too few for a CI. The difference to allreduce is paired: the same N and seed (same data "
        "order and initial weights), then averaged. Time to target: validation top-1 reaching target_accuracy, "
        "in training seconds (evaluation passes left out; an emulated run's are the cluster's), mean over the "
        "seeds that reached it, with a t 95% CI (3 or more of them) or their range (2).",
        f"Marked: more than {GAP_POINTS} points of top-1 below allreduce at the same N (each run's metrics.json "
        "-> strategy_metrics holds what the strategy measured: staleness, dropped gradients, consensus distance, "
        "quantisation error; docs/strategies.md).",
    ]
    return to_markdown(pd.DataFrame(rows), "Accuracy table", notes, formatted=True)


def _reached_interval_kind(table_row) -> str:
    """The kind of interval of a mean over the seeds that reached the target (as mean_interval gives it)."""
    reached = int(table_row["reached_target"].split("/")[0])
    return "none" if reached < 2 else "range" if reached < intervals.MIN_SEEDS_FOR_CI else "t95"


def claims_markdown(verdicts: Sequence[Verdict], cluster: str) -> list[str]:
    """findings.md's section on the published claims (dtstudy.analysis.claims), one per claim."""
    lines = [
        "",
        f"## The published claims at scale ({cluster})",
        "",
        'Each claim read off the accuracy table: "above"/"below" means the 95% intervals (or ranges) '
        'are apart; "level" (for a batch limit "kept") that they overlap and the difference\'s plausible '
        f"range lies within a margin ({GAP_POINTS} points of top-1, {RELATIVE_MARGIN:.0%} of a time, a count of "
        'steps or a staleness); "undecided" that they overlap but are too wide (or too few seeds) to tell. '
        "Intervals apart is a stricter test than a 95% interval of the difference: a difference whose range "
        "excludes zero while the intervals overlap stays undecided, and its reading says so. "
        "A claim of little or no loss (Seide's) reads the margin first: a loss within it is little even where "
        "the seeds tell it from zero, more than it only when the whole interval lies beyond. "
        "An N where a run-set the claim compares did not learn (its mean test top-1 below "
        f"{LEARNED_SHARE:.0%} of allreduce's best cell in this study, its own or a variant's at any N, or below "
        f"{CHANCE_MULTIPLE} x chance), or where neither reached the target, reads "
        '"cannot tell at N=…": no evidence for or against; a claim with no other N reads "cannot tell". '
        "A claim that reads a treatment against a control at each global batch or bound (Goyal's linear rule "
        "against the best rate of a sweep at that batch, picked by validation top-1; Dai's staleness bounds "
        "against the smallest bound) cannot tell at a batch or bound only where the control did not learn: "
        "the control shows what the budget can learn, and a treatment that did not learn where it did is the "
        "effect itself. "
        "No interval is narrower than what it was measured on (a top-1 the test split's 1/n, a time or steps "
        "to the target the validation grid's step), so seeds that agree or a deterministic emulated time do not "
        'make a difference apart. A claim\'s "above"/"below" over several N are held to a family-wise '
        f"error of {FAMILY_ERROR:.2g} by Holm's step-down procedure: each N's intervals must be apart at the "
        "stricter level its place among them asks. Runs of two strategies at the same N and "
        "seed share their data order and straggler draws, so they are compared by their per-seed differences "
        '("paired by seed"). '
        "Times are the emulated cluster's training seconds, on the compute rate the study assumed "
        "(emulate.images_per_s): a claim read on them (Jin's) is judged again at "
        + " and ".join(f"x{factor:g}" for factor in RATE_FACTORS)
        + " that rate, on a rescaled clock (each run's time to the target moved by its steps' compute), not a "
        "rerun: what the runs learned, and when, stays as measured. A verdict that changes with the rate reads "
        f'"{DEPENDS}", with what each rate gives.',
        "",
    ]
    for verdict in verdicts:
        lines.append(
            f"- **{verdict.source}**: {verdict.claim}. **{verdict.status.capitalize()}**"
            + (f" (from {verdict.from_text})" if verdict.from_n else "")
            + f": {verdict.summary}"
        )
        lines += [f"  - {line}" for line in verdict.evidence]
    return lines


def _versus_allreduce(efficiency: Interval, allreduce: Interval) -> str:
    """A strategy's E against allreduce's, read as the claims read a difference (claims.read):
    apart, level within the margin, or undecided (wide CI) -- an overlap alone shows no equality."""
    reading = read(efficiency, allreduce, "efficiency", "allreduce's")
    if reading.side in (ABOVE, BELOW):
        return f"; {reading.side} allreduce (CIs apart)"
    low, high = difference_range(efficiency, allreduce)
    margin = SCALES["efficiency"].margin_of(allreduce)
    if reading.side == LEVEL:
        return (
            f"; level with allreduce (the difference lies in [{low:+.2f}, {high:+.2f}], within ±{margin:.2f}, "
            f"{RELATIVE_MARGIN:.0%} of its E)"
        )
    return (
        f"; undecided (wide CI): the CIs overlap, but the difference may lie anywhere in [{low:+.2f}, {high:+.2f}], "
        f"wider than ±{margin:.2f} ({RELATIVE_MARGIN:.0%} of allreduce's E){beyond_zero(low, high)}"
    )


def _efficiency_line(table_row, base_ci: Interval | None) -> str:
    """A row of the efficiency ranking: its E, its share of the ceiling, and its reading against
    allreduce's E (`base_ci`; None: no comparison)."""
    versus = ""
    if base_ci is not None and table_row["strategy"] != BASELINE_STRATEGY:
        versus = _versus_allreduce(_interval(table_row, "efficiency"), base_ci)
    ceiling_part = (
        ""
        if pd.isna(table_row["efficiency_vs_ceiling"])
        else f", {_cell(table_row, 'efficiency_vs_ceiling', '.2f')} of the ceiling"
    )
    return f"{table_row['strategy']}: E = {_cell(table_row, 'efficiency', '.2f')}{ceiling_part}{versus}"


APART_WITHIN = "apart"
#: a row within GAP_POINTS of allreduce, by its paired difference's interval -> how findings.md says it
WITHIN_READINGS = {
    LEVEL: f"Level with allreduce (the paired difference's interval holds 0 and lies within ±{GAP_POINTS} points)",
    APART_WITHIN: f"Within {GAP_POINTS} points of allreduce but apart from it (the paired difference's interval, a "
    "t 95% CI or the range of 2 seeds, excludes 0)",
    UNDECIDED_READING: f"Within {GAP_POINTS} points of allreduce on average, undecided (the interval holds 0 but "
    f"reaches past ±{GAP_POINTS} points, or one seed gives none)",
}


def _within_reading(table_row) -> str:
    """LEVEL, APART_WITHIN or UNDECIDED_READING (WITHIN_READINGS) of a row's paired difference
    to allreduce, whose mean lies within GAP_POINTS."""
    difference = _interval(table_row, "top1_vs_allreduce", table_row["top1_interval"])
    if difference.kind == "none" or pd.isna(difference.low):
        return UNDECIDED_READING
    if difference.low > 0 or difference.high < 0:
        return APART_WITHIN
    margin = GAP_POINTS / 100
    return LEVEL if -margin <= difference.low and difference.high <= margin else UNDECIDED_READING


def _largest_timed_n(scaling: pd.DataFrame) -> int | None:
    """The largest N whose runs were not oversubscribed (their throughput means something)."""
    timed = scaling[(scaling["workers"] > 1) & ~scaling["oversubscribed"]]
    return int(timed["workers"].max()) if not timed.empty else None


def findings_markdown(
    scaling: pd.DataFrame, accuracy: pd.DataFrame, noise: Mapping, claims: tuple[Sequence[Verdict], str] | None = None
) -> str:
    """What the tables say, per question, written from the numbers (findings.md); `claims`
    (the verdicts, the cluster in words): an emulated study's section on the published claims."""
    lines = [
        "# Findings",
        "",
        "Written by the aggregate step from the tables beside this file; every figure "
        "carries its 95% CI (or the range of 2 seeds).",
        "",
        "## Scaling: how does throughput scale with N?",
        "",
        f"- {source_note('scaling', scaling)}",
        f"- {noise_note(noise)}",
    ]
    ceiling = scaling[scaling["strategy"] == REFERENCE_STRATEGY]
    for _, r in ceiling[ceiling["workers"] > 1].iterrows():
        lines.append(
            f"- Ceiling of this machine (no_exchange) at N={r['workers']}: E = {_cell(r, 'efficiency', '.2f')}"
            + (" (oversubscribed)" if r["oversubscribed"] else "")
            + "."
        )
    n_timed = _largest_timed_n(scaling)
    ranked_apart = pd.DataFrame()
    if n_timed is None:
        lines.append("- No N > 1 ran without oversubscription: no scaling result on this machine.")
    else:
        rows = scaling[(scaling["workers"] == n_timed) & (scaling["strategy"] != REFERENCE_STRATEGY)]
        rows = rows.sort_values("efficiency", ascending=False)
        # only rows whose throughput means something are ranked; the oversubscribed ones follow apart
        ranked, ranked_apart = rows[~rows["oversubscribed"]], rows[rows["oversubscribed"]]
        lines.append(f"- Efficiency at N={n_timed} (the largest N not oversubscribed), best first:")
        base = ranked[ranked["strategy"] == BASELINE_STRATEGY]
        base_ci = None if base.empty else _interval(base.iloc[0], "efficiency")
        lines += [f"  - {_efficiency_line(r, base_ci)}" for _, r in ranked.iterrows()]
        if not ranked_apart.empty:
            lines.append(
                f"- Not ranked at N={n_timed}: oversubscribed, the N workers and the strategy's extra "
                "processes (parameter-server shards) outnumber the cores, and their N=1, which sends every "
                "step to a shard, is slower than the plain loop: their E is not a scaling result."
            )
            lines += [f"  - {_efficiency_line(r, None)}" for _, r in ranked_apart.iterrows()]
    whole_n = [n for n, rows in scaling.groupby("workers") if rows["oversubscribed"].all()]
    if whole_n:
        lines.append(
            f"- N = {', '.join(map(str, whole_n))} ran more processes than cores: their throughput says "
            "nothing about scaling (the accuracy still does)."
        )
    partly = scaling[
        scaling["oversubscribed"] & ~scaling["workers"].isin(whole_n) & ~scaling.index.isin(ranked_apart.index)
    ]
    if not partly.empty:
        lines.append(
            "- Also oversubscribed (a strategy's extra processes, e.g. parameter-server shards, beside "
            "the N workers): "
            + ", ".join(f"{r['strategy']} N={r['workers']}" for _, r in partly.iterrows())
            + "; their efficiency is not a scaling result."
        )
    ceiling_above = ceiling[(ceiling["workers"] > 1) & (ceiling["efficiency_low"] > 1)]
    for _, r in ceiling_above.iterrows():
        lines.append(
            f"- The ceiling's E at N={r['workers']} is above 1 with its whole interval: the N=1 runs it is "
            "measured against ran slower than one worker of an N-worker run, i.e. what ran beside the N=1 "
            "runs (another run, an evaluation) slowed them; every speedup at this N is inflated by as much."
        )
    lines += [
        "",
        "## Accuracy: what does each strategy do to the final accuracy?",
        "",
        f"- {source_note('accuracy', accuracy)}",
    ]
    base = accuracy[accuracy["strategy"] == BASELINE_STRATEGY]
    for _, r in base.iterrows():
        lines.append(
            f"- allreduce at N={r['workers']}: test top-1 {_cell(r, 'top1', '.4f', r['top1_interval'])} "
            f"({r['seeds']} seed{'s' * (int(r['seeds']) != 1)})."
        )
    others = accuracy[accuracy["strategy"] != BASELINE_STRATEGY]
    marked = others[others["below_allreduce"]]
    if not marked.empty:
        lines.append(f"- More than {GAP_POINTS} points below allreduce (paired difference):")
        for _, r in marked.iterrows():
            lines.append(f"  - {r['strategy']} N={r['workers']}: {_difference_cell(r)}")
    within = others[~others["below_allreduce"] & others["top1_vs_allreduce"].notna()]
    readings = {r.name: _within_reading(r) for _, r in within.iterrows()}
    for reading, said in WITHIN_READINGS.items():
        cells = [
            f"{r['strategy']} N={r['workers']}" + ("" if reading == LEVEL else f" {_difference_cell(r)}")
            for _, r in within.iterrows()
            if readings[r.name] == reading
        ]
        if cells:
            lines.append(f"- {said}: " + ", ".join(cells) + ".")
    if claims is not None:
        lines += claims_markdown(*claims)
    return "\n".join(lines) + "\n"
