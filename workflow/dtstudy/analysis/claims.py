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
(dtstudy.analysis.intervals.overlaps); "level" (for Goyal "kept") only when the difference's
plausible range lies within a stated margin (`SCALES`: TOP1_MARGIN of top-1, RELATIVE_MARGIN of a
time, a count of steps or a staleness), an equivalence reading like TOST; otherwise "undecided":
the intervals are too wide (or too few seeds) to tell, which is not "within the noise" and not a
sign that nothing changed. A claim some of whose comparisons are undecided is UNDECIDED or PARTLY
and names them. Intervals are read as the table gives them, unclipped: a top-1 interval
outside [0, 1] says that there are too few seeds for its spread, and the reading says so.
A claim whose strategies the study did not run is "not measured", with the reason (the study
does not run them, or a strategy cannot be emulated: its spec's not_emulated_because), so that
running them needs no change here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pandas as pd

from dtstudy.analysis import intervals
from dtstudy.analysis.intervals import Interval
from dtstudy.analysis.tables import GAP_POINTS
from dtstudy.strategies.specs import SPECS

SYNC = "allreduce"
BACKUP = "ps_backup"
ASYNC = "ps_async"
DECENTRALISED = "gossip"
ONEBIT = "allreduce_onebit"
CHEN_SCALE = 64  # "about 100 workers": the claim is judged at the study's largest N, said short of it below this

HOLDS, PARTLY, UNDECIDED, DOES_NOT_HOLD, NOT_MEASURED = (
    "holds", "holds in part", "undecided", "does not hold", "not measured")
#: every status a verdict can have, in the order findings.md and the docs list them
STATUSES = (HOLDS, PARTLY, UNDECIDED, DOES_NOT_HOLD, NOT_MEASURED)


@dataclass(frozen=True)
class Verdict:
    """One claim's verdict on this study: `status` (one of STATUSES; UNDECIDED: the intervals
    that would decide it are too wide), `summary` (a sentence, with the N from which it holds
    and the N the study cannot tell), `evidence` (one line per N or comparison, every figure
    with its interval)."""

    claim: str
    source: str
    status: str
    summary: str
    from_n: int | None = None
    evidence: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StudyFacts:
    """What a claim needs to know of the study besides its accuracy table: the learning-rate
    rules its runs were scaled by (metrics.json's lr_schedule.rule)."""

    lr_rules: tuple[str, ...] = ("linear",)


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
#: the only kinds of interval that can show a difference is small (a range of 2 seeds is no CI)
CONFIDENCE_KINDS = ("t95", "bootstrap95", "exact")
#: a difference to nothing: the reference of a paired difference
ZERO = Interval(0.0, 0.0, 0.0, 0, "exact")


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


@dataclass(frozen=True)
class Reading:
    """A cell against a reference: `side` BELOW/ABOVE (intervals apart), LEVEL (the difference
    lies within the margin on the side asked about) or UNDECIDED_READING; `text` says so with
    the figures."""

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
    return (f"; that range lies {'above' if low > 0 else 'below'} zero (a difference at about the 95% level), "
            "but above and below need the two intervals apart")


def read(cell: Interval, reference: Interval, quantity: str, versus: str, guard: str | None = None) -> Reading:
    """`cell` against `reference` (`versus` names it, e.g. "N=1's"): BELOW or ABOVE when the
    intervals are apart; LEVEL when the difference's plausible range (difference_range) lies
    within the quantity's margin, on the side `guard` only (BELOW: it is not lower by more than
    the margin; ABOVE: not higher) or on both (None); UNDECIDED_READING otherwise: too wide,
    or no confidence interval (a single value, a range of 2 seeds) to show it small."""
    scale = SCALES[quantity]
    if not intervals.overlaps(cell, reference):
        side = BELOW if cell.high < reference.low else ABOVE
        return Reading(side, f"{side} {versus} (intervals apart)")
    if any(math.isnan(x) for x in (cell.low, cell.high, reference.low, reference.high)):
        return Reading(UNDECIDED_READING, f"undecided against {versus}: no interval (a single value)")
    ranged = [x for x in (cell, reference) if x.kind not in CONFIDENCE_KINDS]
    if ranged:
        return Reading(UNDECIDED_READING, f"undecided against {versus}: {ranged[0].n} seeds give a range, "
                       "not a confidence interval, too few to show a difference small")
    margin = scale.margin_of(reference)
    low, high = difference_range(cell, reference)
    lies = f"the difference lies in [{low:+.3g}, {high:+.3g}]"
    if {BELOW: low >= -margin, ABOVE: high <= margin, None: low >= -margin and high <= margin}[guard]:
        side = {BELOW: f"not below {versus} by more than {margin:.3g}",
                ABOVE: f"not above {versus} by more than {margin:.3g}", None: f"level with {versus} within ±{margin:.3g}"}
        return Reading(LEVEL, f"{side[guard]}: {lies}")
    wide = cell if cell.high - cell.low >= reference.high - reference.low else reference
    lo, hi = scale.bounds
    outside = (f"; it reaches outside [{lo:g}, {hi:g}], where no {scale.noun} lies: too few seeds for their spread"
               if wide.low < lo or wide.high > hi else "")
    return Reading(UNDECIDED_READING, f"undecided against {versus}: "
                   + ("the interval" if wide is cell else f"{versus} interval")
                   + f" [{wide.low:{scale.fmt}}, {wide.high:{scale.fmt}}] is too wide to tell ({wide.n} seeds{outside});"
                   f" {lies}, wider than a margin of {margin:.3g} allows{beyond_zero(low, high)}")


# --- reading the table ----------------------------------------------------------------

def _rows(table: pd.DataFrame, strategy: str) -> pd.DataFrame:
    return table[table["strategy"] == strategy].sort_values("workers")


#: the table's columns whose interval is over the seeds that reached the target only
OVER_REACHED = ("time_to_accuracy_s", "steps_to_accuracy")


def _interval(row, prefix: str) -> Interval:
    """The interval of columns prefix, prefix_low, prefix_high; its kind as intervals.mean_interval
    gives it for that many values (seeds, or the seeds that reached the target)."""
    n = int(row["reached_target"].split("/")[0]) if prefix in OVER_REACHED else int(row["seeds"])
    return Interval(row[prefix], row[f"{prefix}_low"], row[f"{prefix}_high"], n, intervals.mean_interval_kind(n))


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


NEITHER = "neither"  # a side of a reading to the target: neither run-set reached it, nothing to compare


def to_target(a, b, prefix: str, versus: str) -> Reading:
    """Run-set a's time or steps (`prefix`) to the target against b's: read as `read` does when
    both reached it in every seed; BELOW (ABOVE) when only a (b) reached it, in every seed;
    NEITHER when neither did; undecided when some seeds did not (the mean leaves them out)."""
    if _reached_none(a) and _reached_none(b):
        return Reading(NEITHER, "neither reached the target")
    if _reached_all(a) and _reached_none(b):
        return Reading(BELOW, f"below {versus}: only it reached the target")
    if _reached_none(a) and _reached_all(b):
        return Reading(ABOVE, f"above {versus}: only the other reached the target")
    if not (_reached_all(a) and _reached_all(b)):
        return Reading(UNDECIDED_READING, f"undecided against {versus}: not every seed reached the target "
                       f"({a['reached_target']} vs {b['reached_target']})")
    return read(_interval(a, prefix), _interval(b, prefix), prefix, versus)


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
    why = (f"{', '.join(refused)} cannot be emulated yet: {SPECS[refused[0]].not_emulated_because}" if refused
           else "the study does not run them")
    return f"no runs of {', '.join(absent)}; {why}"


def unmeasured(table: pd.DataFrame, strategies: Sequence[str]) -> str | None:
    """Why a claim on `strategies` cannot be judged here (not run, or a single seed: no
    interval to tell a difference from the noise); None when it can."""
    why = not_run(table, strategies)
    if why is None:
        single = sorted({name for name in strategies if (_rows(table, name)["seeds"] < 2).any()})
        if single:
            why = f"{', '.join(single)} ran with a single seed at some N: no interval to tell a difference from the noise"
    return why


def _not_measured(claim: str, source: str, why: str) -> Verdict:
    return Verdict(claim, source, NOT_MEASURED, why[0].upper() + why[1:] + ".")


# --- the claims -----------------------------------------------------------------------

def goyal_batch_limit(table: pd.DataFrame, study: StudyFacts = StudyFacts()) -> Verdict:
    """HOLDS up to the largest N read "kept" (not below N=1's by more than TOP1_MARGIN) and
    broken from the first N below N=1's (intervals apart); an undecided N before the break makes
    it PARTLY (some N kept) or UNDECIDED (none), and the summary names it."""
    claim, source = "linear learning-rate scaling with warm-up keeps accuracy up to a global batch, then breaks", \
        "Goyal et al. 2017 (8k images on ImageNet)"
    why = unmeasured(table, [SYNC])
    rows = _rows(table, SYNC)
    if why is None and not ((rows["workers"] == 1).any() and (rows["workers"] > 1).any()):
        why = "allreduce needs N=1 and a larger N"
    if why is None and tuple(study.lr_rules) != ("linear",):
        why = (f"the study scales the learning rate by the {' and '.join(study.lr_rules)} rule, "
               "not linearly: the claim is about the linear rule")
    if why:
        return _not_measured(claim, source, why)
    base = rows[rows["workers"] == 1].iloc[0]
    base_ci = _interval(base, "top1")
    evidence = [f"N=1{_batch(base)}: test top-1 {_cell(base, 'top1', '.4f')} (the reference)"]
    kept, undecided, broken = [], [], None
    for _, row in rows[rows["workers"] > 1].iterrows():
        reading = read(_interval(row, "top1"), base_ci, "top1", "N=1's", guard=BELOW)
        evidence.append(f"N={row['workers']}{_batch(row)}: test top-1 {_cell(row, 'top1', '.4f')}, "
                        + ("kept, " if reading.side in (LEVEL, ABOVE) else "") + reading.text)
        if broken is not None:
            continue
        if reading.side == BELOW:
            broken = row
        elif reading.side == UNDECIDED_READING:
            undecided.append(int(row["workers"]))
        else:
            kept.append(row)
    kept_to = f"kept up to N={kept[-1]['workers']}{_batch(kept[-1])}" if kept else ""
    breaks = f"below N=1's from N={broken['workers']}{_batch(broken)}" if broken is not None else ""
    if undecided:
        cannot = f"the study cannot tell at {_ns(undecided)} (intervals too wide)"
        said = "; ".join(x for x in (kept_to, cannot, breaks) if x)
        if not kept:
            return Verdict(claim, source, UNDECIDED, f"No N > 1 is kept: {said}.", None, evidence)
        return Verdict(claim, source, PARTLY, f"Accuracy is {said}: "
                       + (f"where between N={kept[-1]['workers']} and N={broken['workers']} it breaks is not known."
                          if broken is not None
                          else "no break is seen, nor can one be ruled out."), None, evidence)
    if broken is None:
        last = rows.iloc[-1]
        return Verdict(claim, source, HOLDS, f"Accuracy is kept at every N up to N={last['workers']}"
                       f"{_batch(last)}: the limit lies beyond this study.", None, evidence)
    if not kept:
        return Verdict(claim, source, DOES_NOT_HOLD, f"Accuracy is below N=1's already at N={broken['workers']}"
                       f"{_batch(broken)}, the smallest N > 1: no batch range where the rule keeps it.",
                       int(broken["workers"]), evidence)
    return Verdict(claim, source, HOLDS, f"Accuracy is {kept_to} and breaks from N={broken['workers']}"
                   f"{_batch(broken)}.", int(broken["workers"]), evidence)


def chen_backup_vs_async(table: pd.DataFrame, study: StudyFacts = StudyFacts()) -> Verdict:
    """HOLDS from the N where ps_backup's top-1 is above ps_async's (apart) up to the largest N;
    UNDECIDED when the largest N is undecided; DOES_NOT_HOLD when it is level or below there."""
    claim, source = "synchronous SGD with backup workers beats asynchronous SGD at about 100 workers", "Chen et al. 2016"
    why = unmeasured(table, [BACKUP, ASYNC])
    if why:
        return _not_measured(claim, source, why)
    backup, asynchronous = _rows(table, BACKUP).set_index("workers"), _rows(table, ASYNC).set_index("workers")
    ns = sorted(set(backup.index) & set(asynchronous.index) - {1})
    if not ns:
        return _not_measured(claim, source, "ps_backup and ps_async share no N > 1")
    evidence, readings = [], []
    for n in ns:
        b, a = backup.loc[n], asynchronous.loc[n]
        readings.append(read(_interval(b, "top1"), _interval(a, "top1"), "top1", "ps_async's"))
        evidence.append(f"N={n}: ps_backup top-1 {_cell(b, 'top1', '.4f')} vs ps_async {_cell(a, 'top1', '.4f')}: "
                        f"{readings[-1].text}; time to target {_time(b)} vs {_time(a)}")
    start = _trailing_start(ns, [r.side == ABOVE for r in readings])
    short = f" (this study's largest N, {ns[-1]}, is short of Chen's ~100)" if ns[-1] < CHEN_SCALE else ""
    if start is not None:
        return Verdict(claim, source, HOLDS, f"ps_backup's top-1 is above ps_async's from N={start} up to N={ns[-1]}"
                       f"{short}.", start, evidence)
    above = [n for n, reading in zip(ns, readings) if reading.side == ABOVE]
    # where it was above before the largest N: the verdict is the largest N's, and says so
    earlier = f"ps_backup's top-1 is above ps_async's at {_ns(above)}, but " if above else ""
    if readings[-1].side == UNDECIDED_READING:
        return Verdict(claim, source, UNDECIDED, f"{earlier}{'a' if earlier else 'A'}t N={ns[-1]} the study cannot "
                       f"tell whether ps_backup's top-1 is above ps_async's (intervals too wide){short}.", None, evidence)
    return Verdict(claim, source, DOES_NOT_HOLD, f"{earlier}{'a' if earlier else 'A'}t N={ns[-1]} ps_backup's top-1 "
                   f"is not above ps_async's{short}.", None, evidence)


def _crossover(table: pd.DataFrame, challenger: str) -> tuple[str, int | None, list[str]]:
    """Jin's claim for one challenger of allreduce: (status, crossover N, evidence). HOLDS: the
    challenger faster at the smallest N > 1 and allreduce faster from an N up to the largest;
    UNDECIDED: neither part is refuted and one is undecided there; DOES_NOT_HOLD otherwise."""
    sync, other = _rows(table, SYNC).set_index("workers"), _rows(table, challenger).set_index("workers")
    ns = sorted(set(sync.index) & set(other.index) - {1})
    if not ns:
        return NOT_MEASURED, None, [f"{challenger}: no N > 1 shared with allreduce"]
    evidence, readings = [], []
    for n in ns:
        s, o = sync.loc[n], other.loc[n]
        readings.append(to_target(o, s, "time_to_accuracy_s", "allreduce's"))
        said = {BELOW: f"{challenger} faster", ABOVE: "allreduce faster"}.get(readings[-1].side, readings[-1].text)
        evidence.append(f"N={n}: time to target {challenger} {_time(o)} vs allreduce {_time(s)}: {said}")
    crossover = _trailing_start(ns, [r.side == ABOVE for r in readings])
    few, far = readings[0].side, readings[-1].side
    if few == BELOW and crossover is not None:
        return HOLDS, crossover, evidence
    if few in (BELOW, UNDECIDED_READING) and (crossover is not None or far == UNDECIDED_READING):
        return UNDECIDED, crossover, evidence
    return DOES_NOT_HOLD, crossover, evidence


def jin_crossover(table: pd.DataFrame, study: StudyFacts = StudyFacts()) -> Verdict:
    claim = "asynchronous and decentralised SGD are faster at few nodes, synchronous SGD scales further"
    source = "Jin et al. 2016"
    why = unmeasured(table, [SYNC])
    if why:
        return _not_measured(claim, source, why)
    parts, evidence = {}, []
    for challenger in (ASYNC, DECENTRALISED):
        absent = unmeasured(table, [challenger])
        if absent:
            evidence.append(f"{challenger}: not measured, {absent}")
            continue
        status, crossover, lines = _crossover(table, challenger)
        parts[challenger] = (status, crossover)
        evidence += lines
    if not parts:
        return Verdict(claim, source, NOT_MEASURED, "Neither ps_async nor gossip ran.", None, evidence)
    said = [f"{name} faster at the smallest N > 1 and allreduce faster from N={n}" if status == HOLDS
            else f"{name}: undecided, the times' intervals are too wide to tell" if status == UNDECIDED
            else f"{name}: no such crossover" + (f" (allreduce faster from N={n})" if n else "")
            for name, (status, n) in parts.items()]
    held = [name for name, (status, _) in parts.items() if status == HOLDS]
    open_ = [name for name, (status, _) in parts.items() if status == UNDECIDED]
    missing = [name for name in (ASYNC, DECENTRALISED) if name not in parts]
    status = (HOLDS if held and len(held) == len(parts) and not missing else PARTLY if held
              else UNDECIDED if open_ else DOES_NOT_HOLD)
    crossovers = [parts[name][1] for name in held]
    tail = f"; {', '.join(missing)} not measured" if missing else ""
    return Verdict(claim, source, status, "; ".join(said) + tail + ".", max(crossovers) if crossovers else None,
                   evidence)


def dai_staleness(table: pd.DataFrame, study: StudyFacts = StudyFacts()) -> Verdict:
    """Each of Dai's three effects is found from the first N where it is apart, undecided when it
    is found nowhere and some N is undecided, absent otherwise: HOLDS with all three found,
    PARTLY with some, UNDECIDED with none found and some undecided, DOES_NOT_HOLD with none."""
    claim = "staleness grows with N and costs asynchronous SGD accuracy and steps"
    source = "Dai et al. 2019"
    why = unmeasured(table, [ASYNC, SYNC])
    if why:
        return _not_measured(claim, source, why)
    rows = _rows(table, ASYNC)
    if rows["staleness"].isna().all():
        return _not_measured(claim, source, "ps_async's runs record no staleness")
    sync = _rows(table, SYNC).set_index("workers")
    first = rows.iloc[0]
    effects = {"staleness grows": ABOVE, "accuracy is lost": BELOW, "more steps are needed": ABOVE}
    found, open_ = dict.fromkeys(effects), {what: [] for what in effects}
    evidence = []
    for _, row in rows.iterrows():
        n = int(row["workers"])
        readings = {}
        if n > first["workers"]:
            readings["staleness grows"] = read(_interval(row, "staleness"), _interval(first, "staleness"), "staleness",
                                               f"N={first['workers']}'s", guard=ABOVE)
        if n > 1:
            readings["accuracy is lost"] = read(_interval(row, "top1_vs_allreduce"), ZERO, "top1_vs_allreduce",
                                                "allreduce's", guard=BELOW)
        if n in sync.index:
            readings["more steps are needed"] = to_target(row, sync.loc[n], "steps_to_accuracy", "allreduce's")
        for what, reading in readings.items():
            if reading.side == effects[what]:
                found[what] = found[what] or n
            elif reading.side in (UNDECIDED_READING, NEITHER):  # neither reached: no steps to compare
                open_[what].append(n)
        steps_vs = (f"; steps to target {_cell(row, 'steps_to_accuracy', '.0f')} vs allreduce "
                    f"{_cell(sync.loc[n], 'steps_to_accuracy', '.0f')}" if n in sync.index else "")
        undecided = [what for what, reading in readings.items() if reading.side in (UNDECIDED_READING, NEITHER)]
        evidence.append(f"N={n}: mean staleness {_cell(row, 'staleness', '.2f')}; top-1 − allreduce "
                        f"{_cell(row, 'top1_vs_allreduce', '+.4f')}{steps_vs}"
                        + "".join(f"; whether {what}: {readings[what].text}" for what in undecided))
    said = "; ".join(f"{what} from N={found[what]}" if found[what]
                     else f"whether {what} is undecided ({_ns(open_[what])})" if open_[what]
                     else f"{what} at no N" for what in effects)
    held = [n for n in found.values() if n]
    status = (HOLDS if len(held) == len(found) else PARTLY if held
              else UNDECIDED if any(open_.values()) else DOES_NOT_HOLD)
    return Verdict(claim, source, status, said[0].upper() + said[1:] + ".", max(held) if status == HOLDS else None,
                   evidence)


def _little_loss(cell: Interval) -> Reading:
    """A paired top-1 difference to allreduce against "little or no loss": LEVEL when its whole
    interval lies above −TOP1_MARGIN (a loss, if any, within the margin, even where the interval
    excludes zero), BELOW when it lies wholly below −TOP1_MARGIN, UNDECIDED_READING when it
    straddles −TOP1_MARGIN or is no confidence interval."""
    margin = TOP1_MARGIN
    if cell.kind not in CONFIDENCE_KINDS or math.isnan(cell.low) or math.isnan(cell.high):
        return Reading(UNDECIDED_READING, f"undecided: {cell.n} seed(s) give no confidence interval, "
                       "too few to show a loss small")
    lies = f"the difference lies in [{cell.low:+.3g}, {cell.high:+.3g}]"
    if cell.low >= -margin:
        return Reading(LEVEL, f"not below allreduce's by more than {margin:.3g}: {lies}")
    if cell.high < -margin:
        return Reading(BELOW, f"below allreduce's by more than {margin:.3g}: {lies}")
    below_zero = (f"; a loss at about the 95% level, but the seeds cannot tell whether more than {margin:.3g}"
                  if cell.high < 0 else "")
    return Reading(UNDECIDED_READING, f"undecided: {lies}, across the margin of {-margin:+.3g}{below_zero}")


def seide_onebit(table: pd.DataFrame, study: StudyFacts = StudyFacts()) -> Verdict:
    """HOLDS (from the smallest N > 1) when allreduce_onebit's top-1 is within TOP1_MARGIN of
    allreduce's at every N > 1 (_little_loss LEVEL); PARTLY when it is up to some N and lost
    (BELOW) or undecided beyond it; DOES_NOT_HOLD when it is lost at the smallest N > 1;
    UNDECIDED when no N is decided either way."""
    claim = "1-bit SGD with error feedback costs little or no accuracy against full-precision synchronous SGD"
    source = "Seide et al. 2014 (a 46M-parameter speech DNN on 8 GPUs)"
    why = unmeasured(table, [ONEBIT, SYNC])
    if why:
        return _not_measured(claim, source, why)
    rows = _rows(table, ONEBIT)
    rows = rows[rows["workers"] > 1]
    if rows.empty:
        return _not_measured(claim, source, "allreduce_onebit ran only at N=1, where it exchanges nothing")
    evidence, kept, lost, undecided, without_interval = [], [], [], [], False
    for _, row in rows.iterrows():
        n = int(row["workers"])
        difference = _interval(row, "top1_vs_allreduce")
        without_interval |= difference.kind not in CONFIDENCE_KINDS
        reading = _little_loss(difference)
        evidence.append(f"N={n}{_batch(row)}: top-1 {_cell(row, 'top1', '.4f')}, − allreduce "
                        f"{_cell(row, 'top1_vs_allreduce', '+.4f')}: {reading.text}")
        {LEVEL: kept, BELOW: lost, UNDECIDED_READING: undecided}[reading.side].append(n)
    ns = [int(n) for n in rows["workers"]]
    clauses = ([f"keeps its top-1 within {TOP1_MARGIN:.3g} of allreduce's at {_ns(kept)}"] if kept else []) + \
        ([f"loses more than {TOP1_MARGIN:.3g} against allreduce's at {_ns(lost)}"] if lost else [])
    said = f"{ONEBIT} " + " and ".join(clauses) if clauses else ""
    if undecided:
        why = "intervals across the margin" + (", or too few seeds for a confidence interval" if without_interval else "")
        said += ("; the" if said else "The") + f" study cannot tell at {_ns(undecided)} ({why})"
    said += "."
    if kept == ns:
        return Verdict(claim, source, HOLDS, said, ns[0], evidence)
    if kept and kept[0] == ns[0]:
        return Verdict(claim, source, PARTLY, said, None, evidence)
    if lost and lost[0] == ns[0]:
        return Verdict(claim, source, DOES_NOT_HOLD, said, None, evidence)
    return Verdict(claim, source, UNDECIDED if not kept else PARTLY, said, None, evidence)


#: each claim's verdict from the accuracy table, in the order findings.md states them
CLAIMS: dict[str, Callable[[pd.DataFrame], Verdict]] = {
    "goyal": goyal_batch_limit,
    "chen": chen_backup_vs_async,
    "jin": jin_crossover,
    "dai": dai_staleness,
    "seide": seide_onebit,
}


def verdicts(accuracy: pd.DataFrame, study: StudyFacts = StudyFacts()) -> list[Verdict]:
    return [judge(accuracy, study) for judge in CLAIMS.values()]
