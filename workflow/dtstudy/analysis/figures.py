"""What each figure of the study draws, said once (`DRAWN`): the figure's title is written from
it (`title`), and tests/test_report.py holds the report's caption of the figure
(workflow/report/<name>.rst) to it: the same kind of interval, seeds and x axis."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: the kinds of error bar or band a figure may draw -> how its title names it
INTERVALS = {
    "bootstrap95": "bootstrap 95% CI over the timed windows of every seed",
    "t95": "t 95% CI over seeds (3 or more)",
    "range": "the range of 2 seeds",
    "band": "a shaded band, the model at the ends of its measured inputs' 95% intervals",
}
#: which seeds (or runs) a point comes from -> how a title says it
SEEDS = {
    "pooled": "the median of the timed windows pooled over seeds",
    "mean": "the mean over seeds",
    "reached": "the mean over the seeds that reached it",
    "lowest": "the lowest seed",
    "runs_mean": "the runs' mean",
}
#: the x axes -> their label
X_AXES = {
    "workers": "workers N",
    "training_time": "training time (s, evaluation left out)",
}


@dataclass(frozen=True)
class Drawn:
    """One figure: what a point is, the kinds of interval it may draw (INTERVALS' keys; which of
    them a study's figure draws depends on its seeds), the seeds a point comes from (SEEDS) and
    its x axis (X_AXES)."""

    quantity: str
    intervals: tuple[str, ...]
    seeds: str
    x: str

    def title(self, source: str, drawn: Iterable[str] | None = None) -> str:
        """The figure's title: the quantity, its seeds, the intervals it draws (`drawn`, those of
        its rows; all of `intervals` by default) and `source` (which runs)."""
        kinds = [kind for kind in self.intervals if drawn is None or kind in set(drawn)]
        bars = f"; intervals: {' or '.join(INTERVALS[kind] for kind in kinds)}" if kinds else "; no error bars"
        return f"{self.quantity} ({SEEDS[self.seeds]}{bars}; {source})"

    @property
    def x_label(self) -> str:
        return X_AXES[self.x]


DRAWN = {
    "throughput": Drawn("Throughput against N (images/s over all workers)", ("bootstrap95",), "pooled", "workers"),
    "efficiency": Drawn("Efficiency E(N) = S(N)/N against N", ("bootstrap95",), "pooled", "workers"),
    "accuracy": Drawn("Test top-1 against N", ("t95", "range"), "mean", "workers"),
    "time_to_accuracy": Drawn("Time to the target accuracy against N", ("t95", "range"), "reached", "workers"),
    "convergence": Drawn("Validation top-1 against training time", (), "lowest", "training_time"),
    "projection": Drawn(
        "Projected throughput and efficiency against N (lines); measured here (points)",
        ("band", "t95", "range"),
        "runs_mean",
        "workers",
    ),
}
