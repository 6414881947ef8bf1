"""The published claims an at-scale study tests (`CLAIMS`, `verdicts`), each read off the
accuracy table (dtstudy.analysis.tables.accuracy_table): whether it holds here, from which N,
and the figures with their intervals that say so.

- Goyal et al. 2017: the linear learning-rate rule with warm-up keeps accuracy up to a global
  batch, then breaks: allreduce's test top-1 against N (the global batch grows with N), kept up
  to the largest N read "kept" against N=1, broken from the first N whose interval lies below
  N=1's;
- Chen et al. 2016: synchronous SGD with backup workers (ps_backup) beats asynchronous SGD
  (ps_async) at about 100 workers: their test top-1 at each N;
- Jin et al. 2016: asynchronous (ps_async) and decentralised (gossip) SGD reach the target faster
  at few nodes, synchronous SGD (allreduce) scales further: time to the target at each N, the
  crossover;
- Dai et al. 2019: staleness grows with N and costs asynchronous SGD accuracy and steps:
  ps_async's mean staleness, its paired top-1 difference to allreduce and its steps to the
  target at each N;
- Seide et al. 2014: 1-bit SGD with error feedback costs little or no accuracy against
  full-precision synchronous SGD: allreduce_onebit's paired top-1 difference to allreduce at
  each N, read against the margin first (a small loss the seeds can tell apart from zero is
  still "little").

Every comparison is read three ways (`read`): "above"/"below" when the two intervals are apart
(dtstudy.common.intervals.overlaps); "level" (for Goyal "kept") only when the difference's
plausible range lies within a stated margin (`SCALES`: TOP1_MARGIN of top-1, RELATIVE_MARGIN of a
time, a count of steps or a staleness), an equivalence reading like TOST; otherwise "undecided":
the intervals are too wide (or too few seeds) to tell, which is not "within the noise" and not a
sign that nothing changed. A claim some of whose comparisons are undecided is UNDECIDED or PARTLY
and names them. Intervals are read as the table gives them, unclipped: a top-1 interval
outside [0, 1] says that there are too few seeds for its spread, and the reading says so.
Four rules keep a reading from saying more than the runs can:
- **Did not learn** (`learning_bar`): a cell whose mean test top-1 is below LEARNED_SHARE of the
  best of the same study's allreduce cells (its own and its variants', any N), or below
  CHANCE_MULTIPLE x chance, did not learn, and a comparison to the target at an N where neither
  run-set reached it has nothing to compare: such an N is "cannot tell at N=…" in the verdict,
  never evidence for or against; a claim with no other N is CANNOT_TELL. Comparing two
  strategies, either not learning silences the N; comparing a treatment with its own control
  (Goyal's rule against the tuned rate at a batch, Dai's bound against the smallest), only the
  control not learning does: it shows what the budget can learn, and the treatment's failure
  to learn where the control learned is the effect.
- **Several designs**: Goyal's claim is read against a learning-rate sweep at each global batch
  when the study has one (`goyal_against_tuned`), Dai's against ssp's bound at a fixed N when
  the study varies it (`dai_against_bound`); Jin's time verdict is judged again with the
  compute rate x0.5 and x2 (`with_rate_sensitivity`, a rescaled clock) and reads DEPENDS when
  it changes.
- **Resolution** (`Measure`, `StudyFacts.resolution`): no interval is narrower than what it was
  measured on (a top-1 the test split's 1/n, steps and times to the target the validation
  grid's step at that cell; a difference the sum of its terms'): seeds that all agree, or a
  deterministic emulated time, do not make any difference "apart".
- **Several N** (`read_family`): a claim's "above"/"below" readings over several N are one
  family whose error rate Holm's step-down procedure holds to FAMILY_ERROR; "level" needs no
  correction (each N must pass on its own, an intersection-union test).
- **Paired** (`paired`): runs of two strategies at the same N and seed share their seed's data
  order and straggler draws, so they are compared by their per-seed differences (with
  `StudyFacts.runs`; without them, the two cells' intervals).
A claim whose strategies the study did not run is "not measured", with the reason (the study
does not run them, or a strategy cannot be emulated: its spec's not_emulated_because), so that
running them needs no change here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import pandas as pd
from scipy import stats

from dtstudy.analysis.runs import read_json, runs_of_kind
from dtstudy.analysis.tables import GAP_POINTS, with_run_extras
from dtstudy.common import intervals
from dtstudy.common.intervals import Interval
from dtstudy.common.run_folder import RunFolder
from dtstudy.config.run_kinds import ACCURACY
from dtstudy.strategies.specs import SPECS

SYNC = "allreduce"
BACKUP = "ps_backup"
ASYNC = "ps_async"
DECENTRALISED = "gossip"
ONEBIT = "allreduce_onebit"
CHEN_SCALE = 64  # "about 100 workers": the claim is judged at the study's largest N, said short of it below this

HOLDS, PARTLY, UNDECIDED, CANNOT_TELL, DOES_NOT_HOLD, NOT_MEASURED, DEPENDS = (
    "holds",
    "holds in part",
    "undecided",
    "cannot tell",
    "does not hold",
    "not measured",
    "depends on the compute rate",
)
#: every status a verdict can have, in the order findings.md and the docs list them
STATUSES = (HOLDS, PARTLY, UNDECIDED, CANNOT_TELL, DOES_NOT_HOLD, DEPENDS, NOT_MEASURED)

#: a cell learned when its mean test top-1 is at least this share of the best of allreduce's cells
#: in the same study (its own and its variants', any N: what the study's budget can reach): half
#: of it lies far above chance for the study's 10 classes (0.44 against 0.10 for a best of 0.887)
#: and far below a cell that learned; a seed split (two at chance, one learned) averages below it
LEARNED_SHARE = 0.5
#: chance for the study's data sets (Fashion-MNIST's and CIFAR-10's 10 classes), and the multiple
#: of it below which no cell learned, whatever allreduce reached
CHANCE, CHANCE_MULTIPLE = 0.1, 2
#: the family-wise error rate of a claim's "above"/"below" readings over its N (Holm)
FAMILY_ERROR = 1 - intervals.LEVEL


@dataclass(frozen=True)
class Verdict:
    """One claim's verdict on this study: `status` (one of STATUSES; UNDECIDED: the intervals
    that would decide it are too wide; CANNOT_TELL: at no N did the runs it compares learn),
    `summary` (a sentence, with the N from which it holds and the N the study cannot tell),
    `evidence` (one line per N or comparison, every figure with its interval)."""

    claim: str
    source: str
    status: str
    summary: str
    from_n: int | None = None
    evidence: list[str] = field(default_factory=list)
    #: what from_n counts: workers ("N"), or a global batch for a claim read across batches
    from_what: str = "N"

    @property
    def from_text(self) -> str:
        """Where it holds from, as findings.md writes it: "N=64", "global batch 512"; "" when nowhere."""
        if not self.from_n:
            return ""
        return f"N={self.from_n}" if self.from_what == "N" else f"{self.from_what} {self.from_n}"


@dataclass(frozen=True, eq=False)
class StudyFacts:
    """What a claim needs to know of the study besides its accuracy table: the learning-rate
    rules its runs were scaled by (metrics.json's lr_schedule.rule), what its numbers were
    measured on (`test_images`: the test split's size; `grid`: (strategy, N) -> the steps and
    the training seconds between two validation points, the most over the seeds) and `runs`:
    the accuracy runs one per seed (strategy, workers, seed, top1, time_to_accuracy_s,
    steps_to_accuracy), for paired comparisons (`study_facts` reads them all)."""

    lr_rules: tuple[str, ...] = ("linear",)
    test_images: int | None = None
    grid: Mapping[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    runs: pd.DataFrame | None = None

    def resolution(self, quantity: str, strategy: str, workers: int) -> float:
        """The smallest step `quantity` of one run of (strategy, N) can take (0: unknown)."""
        if quantity == "top1":
            return 1 / self.test_images if self.test_images else 0.0
        if quantity == "top1_vs_allreduce":
            return 2 / self.test_images if self.test_images else 0.0
        steps, seconds = self.grid.get((strategy, int(workers)), (0.0, 0.0))
        return {"steps_to_accuracy": steps, "time_to_accuracy_s": seconds}.get(quantity, 0.0)


def grid_spacing(metrics: Mapping) -> tuple[float, float]:
    """(steps, training seconds) between two of a run's validation points, the most between
    any two in a row: a time or steps to the target is known to within one of them."""
    points = metrics.get("val_grid") or metrics.get("val") or []
    gaps = [
        (b["step"] - a["step"], b["train_s"] - a["train_s"])
        for a, b in zip(points, points[1:])
        if "step" in a and "train_s" in a and "step" in b and "train_s" in b
    ]
    return (float(max(g[0] for g in gaps)), float(max(g[1] for g in gaps))) if gaps else (0.0, 0.0)


def study_facts(runs: pd.DataFrame, run_metrics: Mapping[str, Mapping]) -> StudyFacts:
    """StudyFacts of a study from its runs frame (dtstudy.analysis.runs.load_runs), their
    metrics.json ({run_dir: ...}) and the accuracy runs' eval.json (their test split's size)."""
    rules = tuple(sorted({(m.get("lr_schedule") or {}).get("rule", "linear") for m in run_metrics.values()}))
    accuracy_runs = with_run_extras(runs_of_kind(runs, ACCURACY), run_metrics)
    sizes = [read_json(RunFolder(run_dir).evaluation).get("test_images") for run_dir in accuracy_runs["run_dir"]]
    grid = {}
    for (strategy, workers), cell in accuracy_runs.groupby(["strategy", "workers"]):
        spacings = [grid_spacing(run_metrics.get(run_dir, {})) for run_dir in cell["run_dir"]]
        grid[(strategy, int(workers))] = (max(s[0] for s in spacings), max(s[1] for s in spacings))
    known = [int(size) for size in sizes if size]
    return StudyFacts(
        rules,
        min(known) if known else None,
        grid,
        accuracy_runs[["strategy", "workers", "seed", *PAIRED_COLUMNS, "step_compute_s"]].copy(),
    )


# --- reading a difference: apart, level within a margin, or undecided ------------------

#: two top-1 accuracies within this of each other are level (Goyal: "kept"): the study's own
#: "within about 3 points" (tables.GAP_POINTS, the gap the accuracy table marks as a loss). The
#: claims' effects are larger (a batch limit costs tens of points) and the seeds of runs that
#: all learned spread far less (the at-scale study's N=1 intervals), so a difference whose
#: plausible range does not fit in it is too wide to call level
TOP1_MARGIN = GAP_POINTS / 100
#: times, steps, staleness and efficiencies within this share of the reference's value are
#: level: the claims on them are about factors (faster at few nodes, staleness growing with N)
RELATIVE_MARGIN = 0.1

BELOW, ABOVE, LEVEL, UNDECIDED_READING = "below", "above", "level", "undecided"
CANNOT_TELL_READING = "cannot tell"  # a side of a comparison that did not learn, or to a target neither reached
#: the only kinds of interval that can show a difference is small (a range of 2 seeds is no CI)
CONFIDENCE_KINDS = ("t95", "bootstrap95", "exact")
#: a difference to nothing: the reference of a paired difference
ZERO = Interval(0.0, 0.0, 0.0, 0, "exact")


@dataclass(frozen=True)
class Measure:
    """An interval and the resolution of what it measures: `at(level)` gives the interval at
    that confidence level, never narrower than the resolution (at least value ± resolution/2)."""

    interval: Interval
    resolution: float = 0.0

    def at(self, level: float = intervals.LEVEL) -> Interval:
        x = self.interval
        if any(math.isnan(v) for v in (x.value, x.low, x.high)):
            return x
        scale = 1.0
        if x.kind == "t95" and x.n >= 2 and level != intervals.LEVEL:
            scale = stats.t.ppf(0.5 + level / 2, x.n - 1) / stats.t.ppf(0.5 + intervals.LEVEL / 2, x.n - 1)
        elif x.kind == "bootstrap95" and level != intervals.LEVEL:
            scale = stats.norm.ppf(0.5 + level / 2) / stats.norm.ppf(0.5 + intervals.LEVEL / 2)
        half = self.resolution / 2
        low = min(x.value - (x.value - x.low) * scale, x.value - half)
        high = max(x.value + (x.high - x.value) * scale, x.value + half)
        return replace(x, low=low, high=high)


def measured(x: Interval | Measure) -> Measure:
    return x if isinstance(x, Measure) else Measure(x)


@dataclass(frozen=True)
class Scale:
    """How differences of one quantity are read: the margin within which two values are level
    (absolute, or a share of the reference's value), the values it can take, how it is written."""

    noun: str
    margin: float
    relative: bool = False
    bounds: tuple[float, float] = (-math.inf, math.inf)
    fmt: str = ".4f"

    def margin_of(self, reference: Interval) -> float:
        return self.margin * abs(reference.value) if self.relative else self.margin


#: the table's columns that claims compare -> how their differences are read
SCALES = {
    "top1": Scale("top-1", TOP1_MARGIN, bounds=(0.0, 1.0)),
    "top1_vs_allreduce": Scale("difference of two top-1", TOP1_MARGIN, bounds=(-1.0, 1.0), fmt="+.4f"),
    "time_to_accuracy_s": Scale("time", RELATIVE_MARGIN, relative=True, bounds=(0.0, math.inf), fmt=".3g"),
    "steps_to_accuracy": Scale("count of steps", RELATIVE_MARGIN, relative=True, bounds=(0.0, math.inf), fmt=".0f"),
    "staleness": Scale("staleness", RELATIVE_MARGIN, relative=True, bounds=(0.0, math.inf), fmt=".2f"),
    "efficiency": Scale("efficiency", RELATIVE_MARGIN, relative=True, bounds=(0.0, math.inf), fmt=".2f"),
}
#: a paired difference of a column -> the scale it is read on (its margin from the reference's value)
DIFFERENCE_SCALES = {
    "top1": Scale("difference of two top-1", TOP1_MARGIN, bounds=(-1.0, 1.0), fmt="+.4f"),
    "time_to_accuracy_s": Scale("difference of two times", RELATIVE_MARGIN, relative=True, fmt="+.3g"),
    "steps_to_accuracy": Scale("difference of two counts of steps", RELATIVE_MARGIN, relative=True, fmt="+.0f"),
}


@dataclass(frozen=True)
class Reading:
    """A cell against a reference: `side` BELOW/ABOVE (intervals apart), LEVEL (the difference
    lies within the margin on the side asked about), UNDECIDED_READING, or (read_family,
    to_target) CANNOT_TELL_READING; `text` says so with the figures."""

    side: str
    text: str


def difference_range(cell: Interval, reference: Interval) -> tuple[float, float]:
    """The plausible range of cell − reference from the two intervals, each side combined in
    quadrature (MOVER, Zou & Donner 2008): for two t intervals about the t interval of the
    difference, and the reference's own spread counts as well as the cell's."""
    difference = cell.value - reference.value
    low = difference - math.hypot(cell.value - cell.low, reference.high - reference.value)
    high = difference + math.hypot(cell.high - cell.value, reference.value - reference.low)
    return low, high


def beyond_zero(low: float, high: float) -> str:
    """What an undecided reading adds when the difference's range (difference_range) excludes
    zero: a difference at about the 95% level, which "above" and "below" (the two intervals
    apart, a stricter test) do not call; "" when the range holds zero."""
    if low <= 0 <= high:
        return ""
    return (
        f"; that range lies {'above' if low > 0 else 'below'} zero (a difference at about the 95% level), "
        "but above and below need the two intervals apart"
    )


def read(
    cell: Interval | Measure,
    reference: Interval | Measure,
    quantity: str,
    versus: str,
    guard: str | None = None,
    level: float = intervals.LEVEL,
    may_differ: bool = True,
    scale: Scale | None = None,
    margin: float | None = None,
) -> Reading:
    """`cell` against `reference` (`versus` names it, e.g. "N=1's"): BELOW or ABOVE when the
    intervals at `level` are apart (and `may_differ`: read_family says whether Holm lets it);
    LEVEL when the difference's plausible range (difference_range, of the 95% intervals) lies
    within the quantity's margin (or `margin`), on the side `guard` only (BELOW: it is not lower
    by more than the margin; ABOVE: not higher) or on both (None); UNDECIDED_READING otherwise:
    too wide, or no confidence interval (a single value, a range of 2 seeds) to show it small.
    Every interval is at least its Measure's resolution wide."""
    scale = scale or SCALES[quantity]
    cell_measure, reference_measure = measured(cell), measured(reference)
    cell, reference = cell_measure.at(), reference_measure.at()
    apart = not intervals.overlaps(cell_measure.at(level), reference_measure.at(level))
    if apart and may_differ:
        side = BELOW if cell.value < reference.value else ABOVE
        at = "" if level == intervals.LEVEL else f" at {level:.4g}, Holm's level for its place among the N"
        return Reading(side, f"{side} {versus} (intervals apart{at})")
    held = (
        "; the 95% intervals are apart, but not at Holm's level for the several N"
        if not may_differ and not intervals.overlaps(cell, reference)
        else ""
    )
    if any(math.isnan(x) for x in (cell.low, cell.high, reference.low, reference.high)):
        return Reading(UNDECIDED_READING, f"undecided against {versus}: no interval (a single value)")
    ranged = [x for x in (cell, reference) if x.kind not in CONFIDENCE_KINDS]
    if ranged:
        return Reading(
            UNDECIDED_READING,
            f"undecided against {versus}: {ranged[0].n} seeds give a range, "
            f"not a confidence interval, too few to show a difference small{held}",
        )
    margin = scale.margin_of(reference) if margin is None else margin
    low, high = difference_range(cell, reference)
    lies = f"the difference lies in [{low:+.3g}, {high:+.3g}]"
    if {BELOW: low >= -margin, ABOVE: high <= margin, None: low >= -margin and high <= margin}[guard]:
        side = {
            BELOW: f"not below {versus} by more than {margin:.3g}",
            ABOVE: f"not above {versus} by more than {margin:.3g}",
            None: f"level with {versus} within ±{margin:.3g}",
        }
        return Reading(LEVEL, f"{side[guard]}: {lies}")
    wide = cell if cell.high - cell.low >= reference.high - reference.low else reference
    wide_measure = cell_measure if wide is cell else reference_measure
    lo, hi = scale.bounds
    outside = (
        f"; it reaches outside [{lo:g}, {hi:g}], where no {scale.noun} lies: too few seeds for their spread"
        if wide.low < lo or wide.high > hi
        else ""
    )
    if wide_measure.resolution >= wide_measure.interval.high - wide_measure.interval.low:
        outside += f"; as wide as its resolution, {wide_measure.resolution:.3g}, what it was measured on can tell"
    return Reading(
        UNDECIDED_READING,
        f"undecided against {versus}: "
        + ("the interval" if wide is cell else f"{versus} interval")
        + f" [{wide.low:{scale.fmt}}, {wide.high:{scale.fmt}}] is too wide to tell ({wide.n} seeds{outside});"
        f" {lies}, wider than a margin of {margin:.3g} allows{beyond_zero(low, high) if not held else held}",
    )


# --- several N: Holm's step-down over a claim's comparisons -----------------------------


@dataclass(frozen=True)
class Comparison:
    """One N's reading of a claim, as `read` takes it (CANNOT_TELL_READING: `why` it cannot
    answer, no interval read)."""

    cell: Interval | Measure | None
    reference: Interval | Measure | None
    quantity: str
    versus: str
    guard: str | None = None
    scale: Scale | None = None
    margin: float | None = None
    why: str | None = None


def apart_p(cell: Interval | Measure, reference: Interval | Measure) -> float:
    """The smallest error rate α at which the two intervals, each at level 1 − α (never
    narrower than its resolution), are apart: 0 when they are apart at any level, 1 when at none
    (overlapping values, NaN bounds, or ranges that overlap)."""
    cell, reference = measured(cell), measured(reference)

    def apart(alpha: float) -> bool:
        return not intervals.overlaps(cell.at(1 - alpha), reference.at(1 - alpha))

    low, high = 1e-12, 1.0 - 1e-12
    if apart(low):
        return 0.0
    if not apart(high):
        return 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (low, middle) if apart(middle) else (middle, high)
    return high


def holm_levels(comparisons: Sequence[Comparison]) -> dict[int, float]:
    """Holm's step-down procedure over the comparisons that can answer (family-wise error
    FAMILY_ERROR): sorted by apart_p, the k-th smallest of m is apart at α / (m − k + 1) while
    every smaller one was. {index: the confidence level at which it is read apart}; the others
    may not read "above" or "below"."""
    # a comparison without an interval (a single value) tests nothing: it is not one of the m
    answering = [
        i
        for i, c in enumerate(comparisons)
        if c.why is None
        and not any(
            math.isnan(x)
            for side in (c.cell, c.reference)
            for x in (measured(side).interval.low, measured(side).interval.high)
        )
    ]
    p = {i: apart_p(comparisons[i].cell, comparisons[i].reference) for i in answering}
    levels = {}
    for rank, i in enumerate(sorted(answering, key=p.__getitem__)):
        alpha = FAMILY_ERROR / (len(answering) - rank)
        if p[i] >= alpha:
            break
        levels[i] = 1 - alpha
    return levels


def read_family(comparisons: Sequence[Comparison]) -> list[Reading]:
    """Each comparison read as `read` reads it, "above"/"below" only where holm_levels lets it
    (with one comparison: at 95%); the rest level or undecided; one with a `why` CANNOT_TELL_READING."""
    levels = holm_levels(comparisons)
    readings = []
    for i, c in enumerate(comparisons):
        if c.why is not None:
            readings.append(Reading(CANNOT_TELL_READING, f"cannot tell: {c.why}"))
            continue
        readings.append(
            read(
                c.cell,
                c.reference,
                c.quantity,
                c.versus,
                c.guard,
                level=levels.get(i, intervals.LEVEL),
                may_differ=i in levels,
                scale=c.scale,
                margin=c.margin,
            )
        )
    return readings


# --- reading the table ----------------------------------------------------------------


def _rows(table: pd.DataFrame, strategy: str) -> pd.DataFrame:
    return table[table["strategy"] == strategy].sort_values("workers")


def _by_n(table: pd.DataFrame, strategy: str) -> dict[int, pd.Series]:
    """{N: the strategy's row at N}."""
    return {int(row["workers"]): row for _, row in _rows(table, strategy).iterrows()}


#: the table's columns whose interval is over the seeds that reached the target only
OVER_REACHED = ("time_to_accuracy_s", "steps_to_accuracy")
#: the per-seed columns two strategies are paired on (StudyFacts.runs)
PAIRED_COLUMNS = ("top1", "time_to_accuracy_s", "steps_to_accuracy")


def _interval(row, prefix: str) -> Interval:
    """The interval of columns prefix, prefix_low, prefix_high; its kind as intervals.mean_interval
    gives it for that many values (seeds, or the seeds that reached the target)."""
    n = int(row["reached_target"].split("/")[0]) if prefix in OVER_REACHED else int(row["seeds"])
    return Interval(row[prefix], row[f"{prefix}_low"], row[f"{prefix}_high"], n, intervals.mean_interval_kind(n))


def _measure(row, prefix: str, study: StudyFacts) -> Measure:
    """The cell's interval of `prefix` with its resolution in this study."""
    return Measure(_interval(row, prefix), study.resolution(prefix, row["strategy"], row["workers"]))


def paired(study: StudyFacts, a: str, b: str, workers: int, column: str) -> Measure | None:
    """The mean per-seed difference a − b of `column` at N=`workers` over the seeds both
    recorded (for a time or steps: both reached the target), with its interval and the two
    cells' resolutions summed; None without per-seed runs or a seed in common."""
    if study.runs is None:
        return None
    runs = study.runs[study.runs["workers"] == workers]
    one, other = (runs[runs["strategy"] == name].set_index("seed")[column] for name in (a, b))
    differences = (one - other).dropna()
    if differences.empty:
        return None
    return Measure(
        intervals.mean_interval(list(differences)),
        study.resolution(column, a, workers) + study.resolution(column, b, workers),
    )


def _compare(study: StudyFacts, a_row, b_row, column: str, versus: str, guard: str | None = None) -> Comparison:
    """Run-set a against b at one N: their paired difference against zero where the study has
    per-seed runs (its margin from b's value), else their two intervals."""
    difference = paired(study, a_row["strategy"], b_row["strategy"], int(a_row["workers"]), column)
    if difference is None:
        return Comparison(_measure(a_row, column, study), _measure(b_row, column, study), column, versus, guard)
    return Comparison(
        difference,
        ZERO,
        column,
        versus + " (paired by seed)",
        guard,
        DIFFERENCE_SCALES[column],
        SCALES[column].margin_of(_interval(b_row, column)),
    )


def _cell(row, prefix: str, fmt: str) -> str:
    return intervals.format_interval(_interval(row, prefix), fmt)


def _batch(row) -> str:
    return "" if pd.isna(row["global_batch"]) else f", global batch {int(row['global_batch'])}"


def _reached_all(row) -> bool:
    done, total = (int(x) for x in row["reached_target"].split("/"))
    return done == total and total > 0


def _reached_none(row) -> bool:
    return row["reached_target"].startswith("0/")


def _time(row) -> str:
    if _reached_none(row):
        return f"not reached (0/{row['reached_target'].split('/')[1]} seeds)"
    return f"{_cell(row, 'time_to_accuracy_s', '.3g')} s (reached in {row['reached_target']} seeds)"


NEITHER_REACHED = "neither reached the target"


def to_target(a, b, prefix: str, versus: str, study: StudyFacts = StudyFacts()) -> Comparison | Reading:
    """Run-set a's time or steps (`prefix`) to the target against b's: a Comparison (for
    read_family) when both reached it in every seed; else its Reading: BELOW (ABOVE) when only a
    (b) reached it, in every seed; CANNOT_TELL_READING when neither did; undecided when some
    seeds did not (the mean leaves them out)."""
    if _reached_none(a) and _reached_none(b):
        return Comparison(None, None, prefix, versus, why=NEITHER_REACHED)
    if _reached_all(a) and _reached_none(b):
        return Reading(BELOW, f"below {versus}: only it reached the target")
    if _reached_none(a) and _reached_all(b):
        return Reading(ABOVE, f"above {versus}: only the other reached the target")
    if not (_reached_all(a) and _reached_all(b)):
        return Reading(
            UNDECIDED_READING,
            f"undecided against {versus}: not every seed reached the target "
            f"({a['reached_target']} vs {b['reached_target']})",
        )
    return _compare(study, a, b, prefix, versus)


def read_with_categories(items: Sequence[Comparison | Reading]) -> list[Reading]:
    """read_family over the Comparisons among `items`; the Readings (decided without
    intervals) as they are."""
    comparisons = [item for item in items if isinstance(item, Comparison)]
    family = iter(read_family(comparisons))
    return [next(family) if isinstance(item, Comparison) else item for item in items]


# --- did not learn ---------------------------------------------------------------------


def _runs_of(table: pd.DataFrame, strategy: str) -> pd.DataFrame:
    """The rows of `strategy` and of its variants (config `variants`: base_strategy)."""
    base = table["base_strategy"] if "base_strategy" in table.columns else table["strategy"]
    return table[(table["strategy"] == strategy) | (base == strategy)]


def learning_bar(table: pd.DataFrame) -> float | None:
    """The mean test top-1 a cell must reach to have learned: LEARNED_SHARE of the best of
    allreduce's cells (its own and its variants', any N: the budget that learned best), and never
    less than CHANCE_MULTIPLE times chance, so that a study whose allreduce did not learn either
    reads its cells at chance as not learned (None: the study has no allreduce, and no cell is
    said not to have learned)."""
    rows = _runs_of(table, SYNC)
    return None if rows.empty else max(LEARNED_SHARE * float(rows["top1"].max()), CHANCE_MULTIPLE * CHANCE)


def not_learned(table: pd.DataFrame, strategies: Sequence[str], workers: int) -> str | None:
    """Why a comparison of `strategies` at N=`workers` cannot tell (those below learning_bar, "did
    not learn"); None when all learned."""
    bar = learning_bar(table)
    if bar is None:
        return None
    below = [
        name
        for name in strategies
        if ((table["strategy"] == name) & (table["workers"] == workers) & (table["top1"] < bar)).any()
    ]
    return f"{' and '.join(below)} did not learn" if below else None


def cannot_tell(table: pd.DataFrame, silent: Mapping[int, str]) -> str:
    """The clause naming the N a claim cannot tell at, grouped by why ("" when none): 'cannot
    tell at N=64, 256: allreduce did not learn (a mean test top-1 below 0.4425, half of
    allreduce's best cell, at least 2 x chance)', the test said once."""
    by_why: dict[str, list[int]] = {}
    for n, why in silent.items():
        by_why.setdefault(why, []).append(n)
    bar = learning_bar(table)
    test = (
        f" (a mean test top-1 below {bar:.4f}, {LEARNED_SHARE:.0%} of allreduce's best cell, at least "
        f"{CHANCE_MULTIPLE} x chance)"
        if bar is not None
        else ""
    )
    clauses = []
    for why, ns in by_why.items():
        stated = why.endswith("did not learn") and test
        clauses.append(f"cannot tell at {_ns(ns)}: {why}{test if stated else ''}")
        test = "" if stated else test
    return "; ".join(clauses)


def _sentence(*clauses: str) -> str:
    said = "; ".join(clause for clause in clauses if clause)
    return said[0].upper() + said[1:] + "."


def _trailing_start(ns: Sequence[int], flags: Sequence[bool]) -> int | None:
    """The smallest N from which every flag is true up to the largest N (None: not at the largest)."""
    start = None
    for n, flag in zip(ns, flags):
        start = (n if start is None else start) if flag else None
    return start


def _ns(ns: Sequence[int]) -> str:
    return "N=" + ", ".join(str(n) for n in ns)


def not_run(table: pd.DataFrame, strategies: Sequence[str]) -> str | None:
    """Why a claim is not measured when some of `strategies` has no row (None: all ran)."""
    absent = [name for name in strategies if not (table["strategy"] == name).any()]
    if not absent:
        return None
    refused = [name for name in absent if SPECS[name].not_emulated_because]
    why = (
        f"{', '.join(refused)} cannot be emulated yet: {SPECS[refused[0]].not_emulated_because}"
        if refused
        else "the study does not run them"
    )
    return f"no runs of {', '.join(absent)}; {why}"


def unmeasured(table: pd.DataFrame, strategies: Sequence[str]) -> str | None:
    """Why a claim on `strategies` cannot be judged here (not run, or a single seed: no
    interval to tell a difference from the noise); None when it can."""
    why = not_run(table, strategies)
    if why is None:
        single = sorted({name for name in strategies if (_rows(table, name)["seeds"] < 2).any()})
        if single:
            why = (
                f"{', '.join(single)} ran with a single seed at some N: no interval to tell a difference from the noise"
            )
    return why


def _not_measured(claim: str, source: str, why: str) -> Verdict:
    return Verdict(claim, source, NOT_MEASURED, why[0].upper() + why[1:] + ".")


# --- the claims -----------------------------------------------------------------------

#: (claim, source) of the two claims each read in two designs (the study decides which: a sweep or not)
GOYAL = (
    "linear learning-rate scaling with warm-up keeps accuracy up to a global batch, then breaks",
    "Goyal et al. 2017 (8k images on ImageNet)",
)
DAI = ("staleness grows with N and costs asynchronous SGD accuracy and steps", "Dai et al. 2019")


def _silent(ns: Sequence[int], readings: Sequence[Reading], whys: Sequence[str | None]) -> dict[int, str]:
    return {n: why for n, reading, why in zip(ns, readings, whys) if reading.side == CANNOT_TELL_READING}


def _why(comparison: Comparison | Reading) -> str | None:
    return comparison.why if isinstance(comparison, Comparison) else None


def goyal_batch_limit(table: pd.DataFrame, study: StudyFacts = StudyFacts()) -> Verdict:
    """HOLDS up to the largest N read "kept" (not below N=1's by more than TOP1_MARGIN) and
    broken from the first N below N=1's (intervals apart at Holm's level over the N); an
    undecided N before the break makes it PARTLY (some N kept) or UNDECIDED (none), and the
    summary names it; an N where allreduce did not learn (learning_bar) is neither: the study
    cannot tell there (the budget failed, not the rule), and with no other N it is CANNOT_TELL."""
    claim, source = GOYAL
    if "lr_rule" in table.columns and (_runs_of(table, SYNC)["lr_rule"] == SWEPT_RULE).any():
        return goyal_against_tuned(table, study)
    why = unmeasured(table, [SYNC])
    rows = _rows(table, SYNC)
    if why is None and not ((rows["workers"] == 1).any() and (rows["workers"] > 1).any()):
        why = "allreduce needs N=1 and a larger N"
    if why is None and tuple(study.lr_rules) != ("linear",):
        why = (
            f"the study scales the learning rate by the {' and '.join(study.lr_rules)} rule, "
            "not linearly: the claim is about the linear rule"
        )
    if why:
        return _not_measured(claim, source, why)
    base = rows[rows["workers"] == 1].iloc[0]
    evidence = [f"N=1{_batch(base)}: test top-1 {_cell(base, 'top1', '.4f')} (the reference)"]
    larger = [row for _, row in rows[rows["workers"] > 1].iterrows()]
    comparisons = [
        Comparison(
            _measure(row, "top1", study),
            _measure(base, "top1", study),
            "top1",
            "N=1's",
            BELOW,
            why=not_learned(table, [SYNC], int(row["workers"])),
        )
        for row in larger
    ]
    readings = read_family(comparisons)
    kept, undecided, broken = [], [], None
    for row, reading in zip(larger, readings):
        evidence.append(
            f"N={row['workers']}{_batch(row)}: test top-1 {_cell(row, 'top1', '.4f')}, "
            + ("kept, " if reading.side in (LEVEL, ABOVE) else "")
            + reading.text
        )
        if broken is not None:
            continue
        if reading.side == BELOW:
            broken = row
        elif reading.side == UNDECIDED_READING:
            undecided.append(int(row["workers"]))
        elif reading.side != CANNOT_TELL_READING:
            kept.append(row)
    until = [int(row["workers"]) for row in larger if broken is None or row["workers"] < broken["workers"]]
    told = cannot_tell(
        table,
        {
            n: why
            for n, why in _silent([int(r["workers"]) for r in larger], readings, [c.why for c in comparisons]).items()
            if n in until
        },
    )
    if not kept and not undecided and broken is None:
        return Verdict(claim, source, CANNOT_TELL, _sentence(told), None, evidence)
    kept_to = f"kept up to N={kept[-1]['workers']}{_batch(kept[-1])}" if kept else ""
    breaks = f"below N=1's from N={broken['workers']}{_batch(broken)}" if broken is not None else ""
    if undecided:
        cannot = f"the study cannot tell at {_ns(undecided)} (intervals too wide)"
        said = "; ".join(x for x in (kept_to, cannot, told, breaks) if x)
        if not kept:
            return Verdict(claim, source, UNDECIDED, f"No N > 1 is kept: {said}.", None, evidence)
        return Verdict(
            claim,
            source,
            PARTLY,
            f"Accuracy is {said}: "
            + (
                f"where between N={kept[-1]['workers']} and N={broken['workers']} it breaks is not known."
                if broken is not None
                else "no break is seen, nor can one be ruled out."
            ),
            None,
            evidence,
        )
    if broken is None:
        last = kept[-1]
        if told:
            return Verdict(
                claim,
                source,
                HOLDS,
                f"Accuracy is kept at every N that learned, up to N={last['workers']}"
                f"{_batch(last)}; {told}: no break is seen where the runs learned.",
                None,
                evidence,
            )
        return Verdict(
            claim,
            source,
            HOLDS,
            f"Accuracy is kept at every N up to N={last['workers']}{_batch(last)}: the limit lies beyond this study.",
            None,
            evidence,
        )
    if not kept:
        return Verdict(
            claim,
            source,
            DOES_NOT_HOLD,
            f"Accuracy is below N=1's already at N={broken['workers']}"
            f"{_batch(broken)}, the smallest N > 1 that learned: no batch range where the rule keeps it"
            + (f"; {told}" if told else "")
            + ".",
            int(broken["workers"]),
            evidence,
        )
    return Verdict(
        claim,
        source,
        HOLDS,
        f"Accuracy is {kept_to} and breaks from N={broken['workers']}"
        f"{_batch(broken)}" + (f"; {told}" if told else "") + ".",
        int(broken["workers"]),
        evidence,
    )


#: the learning-rate rule (train.lr_scaling) of the runs of a learning-rate sweep: a fixed peak rate
#: (base_lr) whatever the batch
SWEPT_RULE = "none"
BATCH = "global batch"  # what goyal_against_tuned's from_n counts
LINEAR_RULE = "linear"


def _tuned(rows: pd.DataFrame) -> pd.Series:
    """Of a sweep's rows at one global batch, the one with the best mean final validation top-1
    (the rate a user would pick: the test split is only read after)."""
    return rows.loc[rows["val_top1"].idxmax()]


def _batches(sizes) -> str:
    """'global batch 256, 1024'."""
    return "global batch " + ", ".join(str(size) for size in sizes)


def goyal_against_tuned(table: pd.DataFrame, study: StudyFacts = StudyFacts()) -> Verdict:
    """Goyal's claim as Goyal et al. test it: at each global batch, allreduce under the linear
    rule with warm-up (lr_rule linear) against the best of a learning-rate sweep at that batch
    (lr_rule none, picked by validation top-1: `_tuned`), on test top-1 paired by seed. Kept:
    not below the tuned result by more than TOP1_MARGIN; broken: below it, intervals apart at
    Holm's level over the batches. HOLDS with batches kept and broken from a batch up to the
    largest, or kept at every batch (no break within the study); PARTLY/UNDECIDED with undecided
    batches; DOES_NOT_HOLD when broken at the smallest batch; a batch where the tuned rate did
    not learn cannot tell (where only the rule did not, that is its break)."""
    claim, source = GOYAL
    rows = _runs_of(table, SYNC)
    if (rows["seeds"] < 2).any():
        return _not_measured(claim, source, "allreduce ran with a single seed: no interval to tell a difference")
    rule = rows[rows["lr_rule"] == LINEAR_RULE].sort_values(["global_batch", "workers"])
    swept = rows[rows["lr_rule"] == SWEPT_RULE]
    entries, evidence = [], []
    for batch, rule_rows in rule.groupby("global_batch", sort=True):
        at_batch = swept[swept["global_batch"] == batch]
        rule_row = rule_rows.iloc[0]
        if at_batch.empty:
            evidence.append(f"global batch {int(batch)}: no learning-rate sweep, not read")
            continue
        tuned = _tuned(at_batch)
        # the tuned rate shows what the batch's budget can learn: only when it did not is the
        # batch silent; the rule's own failure to learn where the tuned rate learned is its break
        why = not_learned(table, [tuned["strategy"]], int(tuned["workers"]))
        comparison = (
            _compare(study, rule_row, tuned, "top1", "the tuned rate's", BELOW)
            if int(rule_row["workers"]) == int(tuned["workers"])
            else Comparison(
                _measure(rule_row, "top1", study), _measure(tuned, "top1", study), "top1", "the tuned rate's", BELOW
            )
        )
        entries.append((int(batch), rule_row, tuned, replace(comparison, why=why)))
    if not entries:
        return _not_measured(claim, source, "no global batch has both the linear rule and a learning-rate sweep")
    readings = read_family([entry[3] for entry in entries])
    kept, undecided, silent, broken = [], [], {}, None
    for (batch, rule_row, tuned, comparison), reading in zip(entries, readings):
        tried = ", ".join(f"{lr:.3g}" for lr in sorted(swept[swept["global_batch"] == batch]["peak_lr"]))
        evidence.append(
            f"global batch {batch}: linear rule (peak {rule_row['peak_lr']:.3g}) test top-1 "
            f"{_cell(rule_row, 'top1', '.4f')}; tuned (best validation of peaks {tried}: {tuned['peak_lr']:.3g}) "
            f"{_cell(tuned, 'top1', '.4f')}: " + ("kept, " if reading.side in (LEVEL, ABOVE) else "") + reading.text
        )
        if broken is not None:
            continue
        if reading.side == BELOW:
            broken = batch
        elif reading.side == UNDECIDED_READING:
            undecided.append(batch)
        elif reading.side == CANNOT_TELL_READING:
            silent[batch] = comparison.why
        else:
            kept.append(batch)
    told = "; ".join(f"cannot tell at {_batches([b])}: {why}" for b, why in silent.items())
    parts = [
        f"kept up to {_batches([kept[-1]])}" if kept else "",
        f"the study cannot tell at {_batches(undecided)} (intervals too wide)" if undecided else "",
        told,
        f"below the tuned rate's from {_batches([broken])}" if broken is not None else "",
    ]
    said = "Against the best rate of a sweep at each batch, accuracy is " + "; ".join(x for x in parts if x) + "."
    if not kept and not undecided and broken is None:
        return Verdict(claim, source, CANNOT_TELL, _sentence(told), None, evidence)
    if undecided:
        return Verdict(claim, source, PARTLY if kept else UNDECIDED, said, None, evidence)
    if broken is None:
        return Verdict(claim, source, HOLDS, said[:-1] + ": no break within the study's batches.", None, evidence)
    if not kept:
        return Verdict(claim, source, DOES_NOT_HOLD, said, broken, evidence, BATCH)
    return Verdict(claim, source, HOLDS, said, broken, evidence, BATCH)


#: what a verdict read on the emulated clock rests on (Jin's times; Chen's gradients dropped or not)
RESTS_ON_THE_CLOCK = (
    "rests on the emulated clock: the assumed compute rate (emulate.images_per_s, an estimate, "
    "not a measurement) and the straggler model (stragglers)"
)
#: Jin et al.'s decentralised SGD was asynchronous gossip; this study's is not
SYNCHRONOUS_GOSSIP = (
    "gossip here is synchronous (every worker averages with its fixed ring neighbours each step), "
    "not Jin et al.'s asynchronous gossip"
)


def chen_backup_vs_async(table: pd.DataFrame, study: StudyFacts = StudyFacts()) -> Verdict:
    """HOLDS from the N where ps_backup's top-1 is above ps_async's (apart, paired by seed,
    Holm over the N) up to the largest N that can answer; UNDECIDED when that N is undecided;
    DOES_NOT_HOLD when it is level or below there; an N where either did not learn cannot tell,
    and with no other N the claim is CANNOT_TELL."""
    claim, source = (
        "synchronous SGD with backup workers beats asynchronous SGD at about 100 workers",
        "Chen et al. 2016",
    )
    why = unmeasured(table, [BACKUP, ASYNC])
    if why:
        return _not_measured(claim, source, why)
    backup, asynchronous = _by_n(table, BACKUP), _by_n(table, ASYNC)
    ns = sorted(set(backup) & set(asynchronous) - {1})
    if not ns:
        return _not_measured(claim, source, "ps_backup and ps_async share no N > 1")
    comparisons = []
    for n in ns:
        why = not_learned(table, [BACKUP, ASYNC], n)
        comparisons.append(
            Comparison(None, None, "top1", "ps_async's", why=why)
            if why
            else _compare(study, backup[n], asynchronous[n], "top1", "ps_async's")
        )
    readings = read_family(comparisons)
    evidence = [f"which of ps_backup's gradients are dropped {RESTS_ON_THE_CLOCK}"] + [
        f"N={n}: ps_backup top-1 {_cell(backup[n], 'top1', '.4f')} vs ps_async "
        f"{_cell(asynchronous[n], 'top1', '.4f')}: {reading.text}; time to target {_time(backup[n])} "
        f"vs {_time(asynchronous[n])}"
        for n, reading in zip(ns, readings)
    ]
    told = cannot_tell(table, _silent(ns, readings, [c.why for c in comparisons]))
    answering = [(n, r) for n, r in zip(ns, readings) if r.side != CANNOT_TELL_READING]
    if not answering:
        return Verdict(claim, source, CANNOT_TELL, _sentence(told), None, evidence)
    largest, last = answering[-1]
    tail = f"; {told}" if told else ""
    start = _trailing_start([n for n, _ in answering], [r.side == ABOVE for _, r in answering])
    short = (
        f" (this study's largest N that can answer, {largest}, is short of Chen's ~100)" if largest < CHEN_SCALE else ""
    )
    if start is not None:
        return Verdict(
            claim,
            source,
            HOLDS,
            f"ps_backup's top-1 is above ps_async's from N={start} up to N={largest}{short}{tail}.",
            start,
            evidence,
        )
    above = [n for n, reading in answering if reading.side == ABOVE]
    # where it was above before the largest N: the verdict is the largest N's, and says so
    earlier = f"ps_backup's top-1 is above ps_async's at {_ns(above)}, but " if above else ""
    if last.side == UNDECIDED_READING:
        return Verdict(
            claim,
            source,
            UNDECIDED,
            f"{earlier}{'a' if earlier else 'A'}t N={largest} the study cannot "
            f"tell whether ps_backup's top-1 is above ps_async's (intervals too wide){short}{tail}.",
            None,
            evidence,
        )
    return Verdict(
        claim,
        source,
        DOES_NOT_HOLD,
        f"{earlier}{'a' if earlier else 'A'}t N={largest} ps_backup's top-1 is not above ps_async's{short}{tail}.",
        None,
        evidence,
    )


def _crossover(table: pd.DataFrame, challenger: str, study: StudyFacts) -> tuple[str, int | None, list[str], str]:
    """Jin's claim for one challenger of allreduce: (status, crossover N, evidence, what it
    cannot tell). HOLDS: the challenger faster at the smallest N > 1 that can answer and
    allreduce faster from an N up to the largest; UNDECIDED: neither part is refuted and one is
    undecided there; CANNOT_TELL: no N can answer (either did not learn, or neither reached the
    target); DOES_NOT_HOLD otherwise."""
    sync, other = _by_n(table, SYNC), _by_n(table, challenger)
    ns = sorted(set(sync) & set(other) - {1})
    if not ns:
        return NOT_MEASURED, None, [f"{challenger}: no N > 1 shared with allreduce"], ""
    items = []
    for n in ns:
        why = not_learned(table, [challenger, SYNC], n)
        items.append(
            Comparison(None, None, "time_to_accuracy_s", "allreduce's", why=why)
            if why
            else to_target(other[n], sync[n], "time_to_accuracy_s", "allreduce's", study)
        )
    readings = read_with_categories(items)
    evidence = []
    for n, reading in zip(ns, readings):
        said = {BELOW: f"{challenger} faster", ABOVE: "allreduce faster"}.get(reading.side, reading.text)
        evidence.append(f"N={n}: time to target {challenger} {_time(other[n])} vs allreduce {_time(sync[n])}: {said}")
    told = cannot_tell(table, _silent(ns, readings, [_why(item) for item in items]))
    answering = [(n, r) for n, r in zip(ns, readings) if r.side != CANNOT_TELL_READING]
    if not answering:
        return CANNOT_TELL, None, evidence, told
    crossover = _trailing_start([n for n, _ in answering], [r.side == ABOVE for _, r in answering])
    few, far = answering[0][1].side, answering[-1][1].side
    if few == BELOW and crossover is not None:
        return HOLDS, crossover, evidence, told
    if few in (BELOW, UNDECIDED_READING) and (crossover is not None or far == UNDECIDED_READING):
        return UNDECIDED, crossover, evidence, told
    return DOES_NOT_HOLD, crossover, evidence, told


def jin_crossover(table: pd.DataFrame, study: StudyFacts = StudyFacts()) -> Verdict:
    claim = "asynchronous and decentralised SGD are faster at few nodes, synchronous SGD scales further"
    source = "Jin et al. 2016"
    why = unmeasured(table, [SYNC])
    if why:
        return _not_measured(claim, source, why)
    parts, evidence = {}, [f"every time {RESTS_ON_THE_CLOCK}"]
    if not unmeasured(table, [DECENTRALISED]):
        evidence.append(SYNCHRONOUS_GOSSIP)
    for challenger in (ASYNC, DECENTRALISED):
        absent = unmeasured(table, [challenger])
        if absent:
            evidence.append(f"{challenger}: not measured, {absent}")
            continue
        status, crossover, lines, told = _crossover(table, challenger, study)
        parts[challenger] = (status, crossover, told)
        evidence += lines
    if not parts:
        return Verdict(claim, source, NOT_MEASURED, "Neither ps_async nor gossip ran.", None, evidence)
    said = [
        (
            f"{name} faster at the smallest N > 1 and allreduce faster from N={n}"
            if status == HOLDS
            else f"{name}: undecided, the times' intervals are too wide to tell"
            if status == UNDECIDED
            else f"{name}: {told}"
            if status == CANNOT_TELL
            else f"{name}: no such crossover" + (f" (allreduce faster from N={n})" if n else "")
        )
        + (f" ({told})" if told and status != CANNOT_TELL else "")
        for name, (status, n, told) in parts.items()
    ]
    held = [name for name, (status, _, _) in parts.items() if status == HOLDS]
    open_ = [name for name, (status, _, _) in parts.items() if status == UNDECIDED]
    silent = [name for name, (status, _, _) in parts.items() if status == CANNOT_TELL]
    missing = [name for name in (ASYNC, DECENTRALISED) if name not in parts]
    status = (
        HOLDS
        if held and len(held) == len(parts) and not missing
        else PARTLY
        if held
        else UNDECIDED
        if open_
        else CANNOT_TELL
        if len(silent) == len(parts)
        else DOES_NOT_HOLD
    )
    crossovers = [parts[name][1] for name in held]
    tail = f"; {', '.join(missing)} not measured" if missing else ""
    return Verdict(
        claim, source, status, "; ".join(said) + tail + ".", max(crossovers) if crossovers else None, evidence
    )


def _status_of_effects(found: Mapping, open_: Mapping, silent: Mapping, readings: Mapping) -> str:
    """A claim of several effects ({effect: where it was found, or None}): HOLDS with all found,
    PARTLY with some, UNDECIDED with none found and some undecided, CANNOT_TELL when no effect
    could be read anywhere (every reading silent), DOES_NOT_HOLD otherwise."""
    held = [what for what, where in found.items() if where]
    if len(held) == len(found):
        return HOLDS
    if held:
        return PARTLY
    if any(open_.values()):
        return UNDECIDED
    if all(len(silent[what]) == len(readings[what]) for what in found):
        return CANNOT_TELL
    return DOES_NOT_HOLD


def dai_staleness(table: pd.DataFrame, study: StudyFacts = StudyFacts()) -> Verdict:
    """Each of Dai's three effects is found from the first N where it is apart (Holm over the
    N of that effect), undecided when it is found nowhere and some N is undecided, absent
    otherwise; an N where ps_async or allreduce did not learn (or, for the steps, neither reached
    the target) cannot tell that effect. HOLDS with all three found, PARTLY with some, UNDECIDED
    with none found and some undecided, CANNOT_TELL when no effect can be read at any N,
    DOES_NOT_HOLD otherwise."""
    claim, source = DAI
    why = unmeasured(table, [ASYNC, SYNC])
    if why:
        return _not_measured(claim, source, why)
    rows = _rows(table, ASYNC)
    if rows["staleness"].isna().all():
        return _not_measured(claim, source, "ps_async's runs record no staleness")
    sweep = bound_sweep(table)
    if sweep is not None:
        return dai_against_bound(table, study, sweep)
    sync = _by_n(table, SYNC)
    first = rows.iloc[0]
    effects = {"staleness grows": ABOVE, "accuracy is lost": BELOW, "more steps are needed": ABOVE}
    items = {what: {} for what in effects}
    for _, row in rows.iterrows():
        n = int(row["workers"])
        if n > first["workers"]:
            items["staleness grows"][n] = Comparison(
                _measure(row, "staleness", study),
                _measure(first, "staleness", study),
                "staleness",
                f"N={first['workers']}'s",
                ABOVE,
            )
        learned = not_learned(table, [ASYNC, SYNC], n)
        if n > 1:
            items["accuracy is lost"][n] = Comparison(
                _measure(row, "top1_vs_allreduce", study), ZERO, "top1_vs_allreduce", "allreduce's", BELOW, why=learned
            )
        if n > 1 and n in sync:
            items["more steps are needed"][n] = (
                Comparison(None, None, "steps_to_accuracy", "allreduce's", why=learned)
                if learned
                else to_target(row, sync[n], "steps_to_accuracy", "allreduce's", study)
            )
    readings = {what: dict(zip(by_n, read_with_categories(list(by_n.values())))) for what, by_n in items.items()}
    found, open_, silent = dict.fromkeys(effects), {what: [] for what in effects}, {what: {} for what in effects}
    for what, by_n in readings.items():
        for n, reading in by_n.items():
            if reading.side == effects[what]:
                found[what] = found[what] or n
            elif reading.side == UNDECIDED_READING:
                open_[what].append(n)
            elif reading.side == CANNOT_TELL_READING:
                silent[what][n] = _why(items[what][n])
    evidence = []
    for _, row in rows.iterrows():
        n = int(row["workers"])
        steps_vs = (
            f"; steps to target {_cell(row, 'steps_to_accuracy', '.0f')} vs allreduce "
            f"{_cell(sync[n], 'steps_to_accuracy', '.0f')}"
            if n in sync
            else ""
        )
        unsure = [
            (what, by_n[n])
            for what, by_n in readings.items()
            if n in by_n and by_n[n].side in (UNDECIDED_READING, CANNOT_TELL_READING)
        ]
        evidence.append(
            f"N={n}: mean staleness {_cell(row, 'staleness', '.2f')}; top-1 − allreduce "
            f"{_cell(row, 'top1_vs_allreduce', '+.4f')}{steps_vs}"
            + "".join(f"; whether {what}: {reading.text}" for what, reading in unsure)
        )

    def effect(what: str) -> str:
        told = cannot_tell(table, silent[what])
        answered = len(readings[what]) > len(silent[what])
        said = (
            f"{what} from N={found[what]}"
            if found[what]
            else f"whether {what} is undecided ({_ns(open_[what])})"
            if open_[what]
            else f"{what} at no N"
            if answered
            else f"whether {what}: {told}"
        )
        return said + (f" ({told})" if told and answered else "")

    held = [n for n in found.values() if n]
    status = _status_of_effects(found, open_, silent, readings)
    return Verdict(
        claim,
        source,
        status,
        _sentence(*(effect(what) for what in effects)),
        max(held) if status == HOLDS else None,
        evidence,
    )


#: the strategy whose bound on staleness (its knob `staleness`) Dai's claim varies at a fixed N
BOUNDED = "ssp"


def bound_sweep(table: pd.DataFrame) -> pd.DataFrame | None:
    """ssp's rows (its own and its variants') at the N with the most distinct bounds, by bound
    (the smallest first, unbounded last); None when no N has two."""
    if "staleness_bound" not in table.columns:
        return None
    rows = _runs_of(table, BOUNDED)
    rows = rows[rows["staleness_bound"].notna()]
    if rows.empty:
        return None
    counts = rows.groupby("workers")["staleness_bound"].nunique()
    if counts.max() < 2:
        return None
    n = int(counts.idxmax())
    return rows[rows["workers"] == n].sort_values("staleness_bound").drop_duplicates("staleness_bound")


def _bound(row) -> str:
    return "unbounded" if math.isinf(row["staleness_bound"]) else f"s={int(row['staleness_bound'])}"


def dai_against_bound(table: pd.DataFrame, study: StudyFacts, sweep: pd.DataFrame) -> Verdict:
    """Dai's claim with staleness varied at a fixed N, as Dai et al. varied it: ssp's bound s
    (`bound_sweep`) against the smallest bound, everything else equal. Its three effects: the
    staleness grows with N (ps_async's mean staleness against its smallest N, as the N-trend
    reading has it), the staleness costs accuracy (top-1 at each larger bound below the
    smallest bound's, paired by seed) and steps (steps to the target above it); each found from
    the first N or bound where it is apart (Holm over them), as dai_staleness reads them."""
    claim, source = DAI
    effects = {"staleness grows with N": ABOVE, "accuracy is lost": BELOW, "more steps are needed": ABOVE}
    items = {what: {} for what in effects}
    asynchronous = _rows(table, ASYNC)
    first = asynchronous.iloc[0]
    for _, row in asynchronous.iloc[1:].iterrows():
        items["staleness grows with N"][f"N={row['workers']}"] = Comparison(
            _measure(row, "staleness", study),
            _measure(first, "staleness", study),
            "staleness",
            f"N={first['workers']}'s",
            ABOVE,
        )
    base, n = sweep.iloc[0], int(sweep.iloc[0]["workers"])
    versus = f"{_bound(base)}'s"
    # the smallest bound shows what the budget learns: only when it did not is a bound silent;
    # a larger bound's failure to learn where it learned is what the staleness cost
    learned = not_learned(table, [base["strategy"]], n)
    for _, row in sweep.iloc[1:].iterrows():
        items["accuracy is lost"][_bound(row)] = replace(_compare(study, row, base, "top1", versus, BELOW), why=learned)
        items["more steps are needed"][_bound(row)] = (
            Comparison(None, None, "steps_to_accuracy", versus, why=learned)
            if learned
            else to_target(row, base, "steps_to_accuracy", versus, study)
        )
    readings = {what: dict(zip(by, read_with_categories(list(by.values())))) for what, by in items.items()}
    evidence = [
        f"N={row['workers']}: ps_async's mean staleness {_cell(row, 'staleness', '.2f')}"
        for _, row in asynchronous.iterrows()
    ] + [
        f"ssp at N={n}, {_bound(row)} ({row['strategy']}): mean staleness {_cell(row, 'staleness', '.2f')}; test top-1 "
        f"{_cell(row, 'top1', '.4f')}; steps to target {_cell(row, 'steps_to_accuracy', '.0f')} "
        f"(reached in {row['reached_target']} seeds)"
        for _, row in sweep.iterrows()
    ]
    found, open_, silent = {}, {}, {}
    for what, by in readings.items():
        hits = [label for label, r in by.items() if r.side == effects[what]]
        found[what] = hits[0] if hits else None
        open_[what] = [label for label, r in by.items() if r.side == UNDECIDED_READING]
        silent[what] = {label: _why(items[what][label]) for label, r in by.items() if r.side == CANNOT_TELL_READING}
        evidence += [f"whether {what} at {label}: {r.text}" for label, r in by.items() if r.side != effects[what]]

    def effect(what: str) -> str:
        where = f" (ssp at N={n}, against {_bound(base)})" if what != "staleness grows with N" else ""
        if found[what]:
            return f"{what} from {found[what]}{where}"
        if open_[what]:
            return f"whether {what} is undecided ({', '.join(open_[what])}){where}"
        if silent[what] and len(silent[what]) == len(readings[what]):
            return f"whether {what}: cannot tell at " + "; ".join(f"{k}: {why}" for k, why in silent[what].items())
        return f"{what} at no {'N' if not where else 'bound'}{where}" if readings[what] else f"whether {what}: not read"

    status = _status_of_effects(found, open_, silent, readings)
    return Verdict(claim, source, status, _sentence(*(effect(what) for what in effects)), None, evidence)


#: the loss that is still "little" (Seide): a paired top-1 difference apart below it is a loss
LOSS_LINE = Interval(-TOP1_MARGIN, -TOP1_MARGIN, -TOP1_MARGIN, 0, "exact")


def _little_loss(cell: Interval | Measure, may_lose: bool = True, level: float = intervals.LEVEL) -> Reading:
    """A paired top-1 difference to allreduce against "little or no loss": LEVEL when its whole
    interval lies above −TOP1_MARGIN (a loss, if any, within the margin, even where the interval
    excludes zero), BELOW when at `level` it lies wholly below −TOP1_MARGIN (and `may_lose`:
    Holm's procedure over the N lets it), UNDECIDED_READING when it straddles −TOP1_MARGIN or is
    no confidence interval."""
    margin = TOP1_MARGIN
    measure = measured(cell)
    cell = measure.at()
    if cell.kind not in CONFIDENCE_KINDS or math.isnan(cell.low) or math.isnan(cell.high):
        return Reading(
            UNDECIDED_READING, f"undecided: {cell.n} seed(s) give no confidence interval, too few to show a loss small"
        )
    lies = f"the difference lies in [{cell.low:+.3g}, {cell.high:+.3g}]"
    if cell.low >= -margin:
        return Reading(LEVEL, f"not below allreduce's by more than {margin:.3g}: {lies}")
    if may_lose and measure.at(level).high < -margin:
        at = "" if level == intervals.LEVEL else f" (at {level:.4g}, Holm's level for its place among the N)"
        return Reading(BELOW, f"below allreduce's by more than {margin:.3g}: {lies}{at}")
    held = ", but not at Holm's level for the several N" if cell.high < -margin else ""
    below_zero = (
        f"; a loss at about the 95% level, but the seeds cannot tell whether more than {margin:.3g}"
        if cell.high < 0 and not held
        else ""
    )
    return Reading(UNDECIDED_READING, f"undecided: {lies}, across the margin of {-margin:+.3g}{held}{below_zero}")


def seide_onebit(table: pd.DataFrame, study: StudyFacts = StudyFacts()) -> Verdict:
    """HOLDS (from the smallest N > 1 that can answer) when allreduce_onebit's top-1 is within
    TOP1_MARGIN of allreduce's at every such N (_little_loss LEVEL); PARTLY when it is up to some
    N and lost (BELOW, Holm over the N) or undecided beyond it; DOES_NOT_HOLD when it is lost at
    the smallest; UNDECIDED when no N is decided either way; an N where either did not learn
    cannot tell (two runs at chance lose nothing to each other), and with no other N the claim
    is CANNOT_TELL."""
    claim = "1-bit SGD with error feedback costs little or no accuracy against full-precision synchronous SGD"
    source = "Seide et al. 2014 (a 46M-parameter speech DNN on 8 GPUs)"
    why = unmeasured(table, [ONEBIT, SYNC])
    if why:
        return _not_measured(claim, source, why)
    rows = _rows(table, ONEBIT)
    rows = rows[rows["workers"] > 1]
    if rows.empty:
        return _not_measured(claim, source, "allreduce_onebit ran only at N=1, where it exchanges nothing")
    ns = [int(n) for n in rows["workers"]]
    comparisons = [
        Comparison(
            _measure(row, "top1_vs_allreduce", study),
            LOSS_LINE,
            "top1_vs_allreduce",
            "",
            why=not_learned(table, [ONEBIT, SYNC], n),
        )
        for n, (_, row) in zip(ns, rows.iterrows())
    ]
    levels = holm_levels(comparisons)
    evidence, kept, lost, undecided, silent, without_interval = [], [], [], [], {}, False
    for i, (n, (_, row)) in enumerate(zip(ns, rows.iterrows())):
        comparison = comparisons[i]
        if comparison.why:
            reading = Reading(CANNOT_TELL_READING, f"cannot tell: {comparison.why}")
            silent[n] = comparison.why
        else:
            without_interval |= comparison.cell.interval.kind not in CONFIDENCE_KINDS
            reading = _little_loss(comparison.cell, i in levels, levels.get(i, intervals.LEVEL))
            {LEVEL: kept, BELOW: lost, UNDECIDED_READING: undecided}[reading.side].append(n)
        evidence.append(
            f"N={n}{_batch(row)}: top-1 {_cell(row, 'top1', '.4f')}, − allreduce "
            f"{_cell(row, 'top1_vs_allreduce', '+.4f')}: {reading.text}"
        )
    told = cannot_tell(table, silent)
    answering = [n for n in ns if n not in silent]
    if not answering:
        return Verdict(claim, source, CANNOT_TELL, _sentence(told), None, evidence)
    clauses = ([f"keeps its top-1 within {TOP1_MARGIN:.3g} of allreduce's at {_ns(kept)}"] if kept else []) + (
        [f"loses more than {TOP1_MARGIN:.3g} against allreduce's at {_ns(lost)}"] if lost else []
    )
    said = f"{ONEBIT} " + " and ".join(clauses) if clauses else ""
    if undecided:
        why = "intervals across the margin" + (
            ", or too few seeds for a confidence interval" if without_interval else ""
        )
        said += ("; the" if said else "The") + f" study cannot tell at {_ns(undecided)} ({why})"
    if told:
        said += ("; " if said else "") + (told if said else told[0].upper() + told[1:])
    said += "."
    if kept == answering:
        return Verdict(claim, source, HOLDS, said, answering[0], evidence)
    if kept and kept[0] == answering[0]:
        return Verdict(claim, source, PARTLY, said, None, evidence)
    if lost and lost[0] == answering[0]:
        return Verdict(claim, source, DOES_NOT_HOLD, said, None, evidence)
    return Verdict(claim, source, UNDECIDED if not kept else PARTLY, said, None, evidence)


#: each claim's verdict from the accuracy table, in the order findings.md states them
CLAIMS: dict[str, Callable[[pd.DataFrame, StudyFacts], Verdict]] = {
    "goyal": goyal_batch_limit,
    "chen": chen_backup_vs_async,
    "jin": jin_crossover,
    "dai": dai_staleness,
    "seide": seide_onebit,
}


#: the claims read on the emulated clock's times, rejudged with the compute rate scaled
TIMED_CLAIMS = ("jin",)
#: the compute rates the timed claims are rejudged at, as factors of emulate.images_per_s
RATE_FACTORS = (0.5, 2.0)


def at_compute_rate(table: pd.DataFrame, study: StudyFacts, factor: float) -> tuple[pd.DataFrame, StudyFacts] | None:
    """The table and facts as an emulated study at `factor` times its compute rate would time
    them: each run's time to the target moves by (1/factor − 1) × its step's compute × its steps
    to the target (each step's compute lies once on a worker's path: a synchronous step waits
    for the slowest compute + straggler delay, which shifts by the same), the validation grid's
    seconds likewise. Arrival orders, and so what an asynchronous run learned and when, are
    those of the measured rate: a rescaled clock, not a rerun. None without per-seed runs
    that record their step's compute (a study on real hardware)."""
    runs = study.runs
    if runs is None or "step_compute_s" not in runs.columns or runs["step_compute_s"].isna().any():
        return None
    shift = (1 / factor - 1) * runs["step_compute_s"]
    runs = runs.assign(time_to_accuracy_s=runs["time_to_accuracy_s"] + shift * runs["steps_to_accuracy"])
    table = table.copy()
    for i, row in table.iterrows():
        cell = runs[(runs["strategy"] == row["strategy"]) & (runs["workers"] == row["workers"])]
        interval = intervals.mean_interval(list(cell["time_to_accuracy_s"].dropna()))
        table.loc[i, ["time_to_accuracy_s", "time_to_accuracy_s_low", "time_to_accuracy_s_high"]] = (
            interval.value,
            interval.low,
            interval.high,
        )
    compute = runs.groupby(["strategy", "workers"])["step_compute_s"].max()
    grid = {
        key: (steps, seconds + (1 / factor - 1) * float(compute.get(key, 0.0)) * steps)
        for key, (steps, seconds) in study.grid.items()
    }
    return table, replace(study, grid=grid, runs=runs)


def with_rate_sensitivity(name: str, verdict: Verdict, accuracy: pd.DataFrame, study: StudyFacts) -> Verdict:
    """A timed claim's verdict rejudged at each RATE_FACTORS compute rate: the same verdict
    when none flips (its evidence says so), else DEPENDS naming what each rate gives."""
    if verdict.status == NOT_MEASURED:
        return verdict
    others = {}
    for factor in RATE_FACTORS:
        rescaled = at_compute_rate(accuracy, study, factor)
        if rescaled is None:
            return replace(verdict, evidence=[*verdict.evidence, "no compute-rate sensitivity: not an emulated study"])
        others[factor] = CLAIMS[name](*rescaled)
    rates = " and ".join(f"x{factor:g}" for factor in RATE_FACTORS)
    if all((v.status, v.from_n) == (verdict.status, verdict.from_n) for v in others.values()):
        return replace(
            verdict,
            evidence=[*verdict.evidence, f"the same verdict with the compute rate (emulate.images_per_s) {rates}"],
        )
    said = "; ".join(f"at x{factor:g} the compute rate: {v.status}: {v.summary}" for factor, v in others.items())
    return replace(
        verdict,
        status=DEPENDS,
        summary=f"At the assumed compute rate: {verdict.status}: {verdict.summary} {said[0].upper()}{said[1:]}",
        from_n=None,
        evidence=[*verdict.evidence, *(f"x{f:g}: {line}" for f, v in others.items() for line in v.evidence)],
    )


def verdicts(accuracy: pd.DataFrame, study: StudyFacts = StudyFacts()) -> list[Verdict]:
    judged = []
    for name, judge in CLAIMS.items():
        verdict = judge(accuracy, study)
        judged.append(with_rate_sensitivity(name, verdict, accuracy, study) if name in TIMED_CLAIMS else verdict)
    return judged
