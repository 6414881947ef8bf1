"""The published claims an at-scale study tests (`CLAIMS`, `verdicts`), each read off the
accuracy table (dtstudy.analysis.tables.accuracy_table): whether it holds here, from which N,
and the figures with their intervals that say so.

- Goyal et al. 2017: the linear learning-rate rule with warm-up keeps accuracy up to a global
  batch, then breaks: allreduce's test top-1 against N (the global batch grows with N), the
  first N whose interval lies below N=1's;
- Chen et al. 2016: synchronous SGD with backup workers (ps_backup) beats asynchronous SGD
  (ps_async) at about 100 workers: their test top-1 at each N;
- Jin et al. 2016: asynchronous (ps_async) and decentralised (gossip) SGD reach the target faster
  at few nodes, synchronous SGD (allreduce) scales further: time to the target at each N, the
  crossover;
- Dai et al. 2019: staleness grows with N and costs asynchronous SGD accuracy and steps:
  ps_async's mean staleness, its paired top-1 difference to allreduce and its steps to the
  target at each N.

"Above"/"below" always means the two intervals are apart (dtstudy.analysis.intervals.overlaps);
overlapping intervals are within the noise. A claim whose strategies the study did not run is
"not measured", with the reason (e.g. the parameter servers are not emulated yet: their
spec's not_emulated_because), so that running them needs no change here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pandas as pd

from dtstudy.analysis import intervals
from dtstudy.analysis.intervals import Interval
from dtstudy.strategies.specs import SPECS

SYNC = "allreduce"
BACKUP = "ps_backup"
ASYNC = "ps_async"
DECENTRALISED = "gossip"
CHEN_SCALE = 64  # "about 100 workers": the claim is judged at the study's largest N, said short of it below this

HOLDS, PARTLY, DOES_NOT_HOLD, NOT_MEASURED = "holds", "holds in part", "does not hold", "not measured"


@dataclass(frozen=True)
class Verdict:
    """One claim's verdict on this study: `status` (HOLDS, PARTLY, DOES_NOT_HOLD, NOT_MEASURED),
    `summary` (a sentence, with the N from which it holds), `evidence` (one line per N or
    comparison, every figure with its interval)."""

    claim: str
    source: str
    status: str
    summary: str
    from_n: int | None = None
    evidence: list[str] = field(default_factory=list)


# --- reading the table ----------------------------------------------------------------

def _rows(table: pd.DataFrame, strategy: str) -> pd.DataFrame:
    return table[table["strategy"] == strategy].sort_values("workers")


#: the table's columns whose interval is over the seeds that reached the target only
OVER_REACHED = ("time_to_accuracy_s", "steps_to_accuracy")


def _interval(row, prefix: str) -> Interval:
    """The interval of columns prefix, prefix_low, prefix_high; its kind as intervals.mean_interval
    gives it for that many values (seeds, or the seeds that reached the target)."""
    n = int(row["reached_target"].split("/")[0]) if prefix in OVER_REACHED else int(row["seeds"])
    kind = "none" if n < 2 else "range" if n < intervals.MIN_SEEDS_FOR_CI else "t95"
    return Interval(row[prefix], row[f"{prefix}_low"], row[f"{prefix}_high"], n, kind)


def _apart_below(a: Interval, b: Interval) -> bool:
    """a lies below b with both intervals known and apart."""
    return not intervals.overlaps(a, b) and a.high < b.low


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


def faster(a, b) -> bool:
    """Run-set a reaches the target faster than b: both in every seed with a's time interval
    below b's, or a in every seed and b in none."""
    if _reached_all(a) and _reached_none(b):
        return True
    return _reached_all(a) and _reached_all(b) and _apart_below(_interval(a, "time_to_accuracy_s"),
                                                               _interval(b, "time_to_accuracy_s"))


def _trailing_start(ns: Sequence[int], flags: Sequence[bool]) -> int | None:
    """The smallest N from which every flag is true up to the largest N (None: not at the largest)."""
    start = None
    for n, flag in zip(ns, flags):
        start = (n if start is None else start) if flag else None
    return start


def not_run(table: pd.DataFrame, strategies: Sequence[str]) -> str | None:
    """Why a claim is not measured when some of `strategies` has no row (None: all ran)."""
    absent = [name for name in strategies if not (table["strategy"] == name).any()]
    if not absent:
        return None
    refused = [name for name in absent if SPECS[name].not_emulated_because]
    why = (f"the parameter servers are not emulated yet ({', '.join(refused)}: "
           f"{SPECS[refused[0]].not_emulated_because})" if refused else "the study does not run them")
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

def goyal_batch_limit(table: pd.DataFrame) -> Verdict:
    claim, source = "linear learning-rate scaling with warm-up keeps accuracy up to a global batch, then breaks", \
        "Goyal et al. 2017 (8k images on ImageNet)"
    why = unmeasured(table, [SYNC])
    rows = _rows(table, SYNC)
    if why is None and not ((rows["workers"] == 1).any() and (rows["workers"] > 1).any()):
        why = "allreduce needs N=1 and a larger N"
    if why:
        return _not_measured(claim, source, why)
    base = rows[rows["workers"] == 1].iloc[0]
    base_ci = _interval(base, "top1")
    evidence = [f"N=1{_batch(base)}: test top-1 {_cell(base, 'top1', '.4f')} (the reference)"]
    kept, broken = [], None
    for _, row in rows[rows["workers"] > 1].iterrows():
        below = _apart_below(_interval(row, "top1"), base_ci)
        evidence.append(f"N={row['workers']}{_batch(row)}: test top-1 {_cell(row, 'top1', '.4f')}, "
                        + ("below N=1's (intervals apart)" if below else "within N=1's noise (intervals overlap)"))
        if below and broken is None:
            broken = row
        elif broken is None:
            kept.append(row)
    if broken is None:
        last = rows.iloc[-1]
        return Verdict(claim, source, HOLDS, f"Accuracy is kept at every N up to N={last['workers']}"
                       f"{_batch(last)}: the limit lies beyond this study.", None, evidence)
    if not kept:
        return Verdict(claim, source, DOES_NOT_HOLD, f"Accuracy is below N=1's already at N={broken['workers']}"
                       f"{_batch(broken)}, the smallest N > 1: no batch range where the rule keeps it.",
                       int(broken["workers"]), evidence)
    return Verdict(claim, source, HOLDS, f"Accuracy is kept up to N={kept[-1]['workers']}{_batch(kept[-1])} and "
                   f"breaks from N={broken['workers']}{_batch(broken)}.", int(broken["workers"]), evidence)


def chen_backup_vs_async(table: pd.DataFrame) -> Verdict:
    claim, source = "synchronous SGD with backup workers beats asynchronous SGD at about 100 workers", "Chen et al. 2016"
    why = unmeasured(table, [BACKUP, ASYNC])
    if why:
        return _not_measured(claim, source, why)
    backup, asynchronous = _rows(table, BACKUP).set_index("workers"), _rows(table, ASYNC).set_index("workers")
    ns = sorted(set(backup.index) & set(asynchronous.index) - {1})
    if not ns:
        return _not_measured(claim, source, "ps_backup and ps_async share no N > 1")
    evidence, beats = [], []
    for n in ns:
        b, a = backup.loc[n], asynchronous.loc[n]
        above, below = (_apart_below(_interval(a, "top1"), _interval(b, "top1")),
                        _apart_below(_interval(b, "top1"), _interval(a, "top1")))
        beats.append(above)
        evidence.append(f"N={n}: ps_backup top-1 {_cell(b, 'top1', '.4f')} vs ps_async {_cell(a, 'top1', '.4f')}: "
                        + ("above" if above else "below" if below else "within the noise")
                        + f"; time to target {_time(b)} vs {_time(a)}")
    start = _trailing_start(ns, beats)
    short = f" (this study's largest N, {ns[-1]}, is short of Chen's ~100)" if ns[-1] < CHEN_SCALE else ""
    if start is None:
        return Verdict(claim, source, DOES_NOT_HOLD, f"At N={ns[-1]} ps_backup's top-1 is not above ps_async's"
                       f"{short}.", None, evidence)
    return Verdict(claim, source, HOLDS, f"ps_backup's top-1 is above ps_async's from N={start} up to N={ns[-1]}"
                   f"{short}.", start, evidence)


def _crossover(table: pd.DataFrame, challenger: str) -> tuple[str, int | None, list[str]]:
    """Jin's claim for one challenger of allreduce: (status, crossover N, evidence)."""
    sync, other = _rows(table, SYNC).set_index("workers"), _rows(table, challenger).set_index("workers")
    ns = sorted(set(sync.index) & set(other.index) - {1})
    if not ns:
        return NOT_MEASURED, None, [f"{challenger}: no N > 1 shared with allreduce"]
    evidence, challenger_ahead, sync_ahead = [], [], []
    for n in ns:
        s, o = sync.loc[n], other.loc[n]
        challenger_ahead.append(faster(o, s))
        sync_ahead.append(faster(s, o))
        evidence.append(f"N={n}: time to target {challenger} {_time(o)} vs allreduce {_time(s)}: "
                        + (f"{challenger} faster" if challenger_ahead[-1] else
                           "allreduce faster" if sync_ahead[-1] else
                           "neither reached the target" if _reached_none(o) and _reached_none(s) else
                           "within the noise"))
    crossover = _trailing_start(ns, sync_ahead)
    if challenger_ahead[0] and crossover is not None:
        return HOLDS, crossover, evidence
    return DOES_NOT_HOLD, crossover, evidence


def jin_crossover(table: pd.DataFrame) -> Verdict:
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
            else f"{name}: no such crossover" + (f" (allreduce faster from N={n})" if n else "")
            for name, (status, n) in parts.items()]
    held = [name for name, (status, _) in parts.items() if status == HOLDS]
    missing = [name for name in (ASYNC, DECENTRALISED) if name not in parts]
    status = HOLDS if held and len(held) == len(parts) and not missing else PARTLY if held else DOES_NOT_HOLD
    crossovers = [parts[name][1] for name in held]
    tail = f"; {', '.join(missing)} not measured" if missing else ""
    return Verdict(claim, source, status, "; ".join(said) + tail + ".", max(crossovers) if crossovers else None,
                   evidence)


def dai_staleness(table: pd.DataFrame) -> Verdict:
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
    grows_from = cost_from = steps_from = None
    evidence = []
    for _, row in rows.iterrows():
        n = int(row["workers"])
        grows = n > first["workers"] and _apart_below(_interval(first, "staleness"), _interval(row, "staleness"))
        costs = n > 1 and _apart_below(_interval(row, "top1_vs_allreduce"), Interval(0.0, 0.0, 0.0, 1, "t95"))
        more_steps = n in sync.index and _more_steps(row, sync.loc[n])
        grows_from = grows_from or (n if grows else None)
        cost_from = cost_from or (n if costs else None)
        steps_from = steps_from or (n if more_steps else None)
        steps_vs = (f"; steps to target {_cell(row, 'steps_to_accuracy', '.0f')} vs allreduce "
                    f"{_cell(sync.loc[n], 'steps_to_accuracy', '.0f')}" if n in sync.index else "")
        evidence.append(f"N={n}: mean staleness {_cell(row, 'staleness', '.2f')}; top-1 − allreduce "
                        f"{_cell(row, 'top1_vs_allreduce', '+.4f')}{steps_vs}")
    found = {"staleness grows": grows_from, "accuracy is lost": cost_from, "more steps are needed": steps_from}
    said = "; ".join(f"{what} from N={n}" if n else f"{what} at no N" for what, n in found.items())
    held = [n for n in found.values() if n]
    status = HOLDS if len(held) == len(found) else PARTLY if held else DOES_NOT_HOLD
    return Verdict(claim, source, status, said[0].upper() + said[1:] + ".", max(held) if status == HOLDS else None,
                   evidence)


def _more_steps(row, sync_row) -> bool:
    """ps_async needs more steps to the target than allreduce at the same N: both reached it in
    every seed with the intervals apart, or only allreduce reached it."""
    if _reached_all(sync_row) and _reached_none(row):
        return True
    return (_reached_all(row) and _reached_all(sync_row)
            and _apart_below(_interval(sync_row, "steps_to_accuracy"), _interval(row, "steps_to_accuracy")))


#: each claim's verdict from the accuracy table, in the order findings.md states them
CLAIMS: dict[str, Callable[[pd.DataFrame], Verdict]] = {
    "goyal": goyal_batch_limit,
    "chen": chen_backup_vs_async,
    "jin": jin_crossover,
    "dai": dai_staleness,
}


def verdicts(accuracy: pd.DataFrame) -> list[Verdict]:
    return [judge(accuracy) for judge in CLAIMS.values()]
