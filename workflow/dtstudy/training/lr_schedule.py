"""Learning-rate scaling across N workers and the per-step schedule (Goyal et al. 2017)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

SCALING_RULES = {
    "linear": lambda ratio: ratio,
    "sqrt": math.sqrt,
    "none": lambda ratio: 1.0,
}


def scaled_lr(base_lr: float, global_batch: int, reference_batch: int, rule: str) -> float:
    """lr = base_lr * f(global_batch / reference_batch) for the rule f."""
    if rule not in SCALING_RULES:
        raise ValueError(f"train.lr_scaling: unknown rule {rule!r}; allowed: {', '.join(SCALING_RULES)}")
    return base_lr * SCALING_RULES[rule](global_batch / reference_batch)


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up from peak_lr/warmup_steps to peak_lr, then constant or cosine decay to 0."""

    peak_lr: float
    warmup_steps: int
    total_steps: int
    kind: str = "cosine"
    update_batch: int | None = None  # the images one update averages, whose rate peak_lr is
    update_batch_rule: str = ""  # the strategy's rule for it (Strategy.update_batch_rule)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak_lr
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return 0.5 * self.peak_lr * (1.0 + math.cos(math.pi * progress))

    def describe(self) -> dict:
        return asdict(self)


def make_schedule(
    train: dict, update_batch: int, steps_per_epoch: int, update_batch_rule: str = "", step_limit: int | None = None
) -> LRSchedule:
    """The schedule of a run whose updates each average `update_batch` images (N*b for the
    synchronous strategies, see Strategy.update_batch): the rate is that batch's. It ends
    after train.epochs, train.max_steps or the strategy's `step_limit`, whichever is first."""
    peak = scaled_lr(train["base_lr"], update_batch, train["lr_reference_batch"], train["lr_scaling"])
    total = steps_per_epoch * train["epochs"]
    for limit in (train["max_steps"], step_limit):
        if limit is not None:
            total = min(total, limit)
    warmup_steps = train.get("warmup_steps")  # in updates, whatever N; else in epochs
    warmup = min(total, warmup_steps if warmup_steps is not None else round(train["warmup_epochs"] * steps_per_epoch))
    return LRSchedule(
        peak_lr=peak,
        warmup_steps=warmup,
        total_steps=total,
        kind=train["lr_schedule"],
        update_batch=update_batch,
        update_batch_rule=update_batch_rule,
    )
