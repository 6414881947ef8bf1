"""The learning-rate scaling rule and the warm-up schedule (Goyal et al. 2017)."""

from __future__ import annotations

import math

import pytest

from dtstudy.training.lr_schedule import LRSchedule, make_schedule, scaled_lr


@pytest.mark.parametrize(
    "rule, global_batch, expected",
    [("linear", 512, 0.2), ("linear", 64, 0.025), ("sqrt", 1024, 0.2), ("none", 4096, 0.1)],
)
def test_scaling_rules(rule, global_batch, expected):
    assert scaled_lr(0.1, global_batch, 256, rule) == pytest.approx(expected)


def test_unknown_rule_is_rejected_with_allowed_values():
    with pytest.raises(ValueError, match="cubic.*linear, sqrt, none"):
        scaled_lr(0.1, 256, 256, "cubic")


def test_warmup_then_cosine():
    schedule = LRSchedule(peak_lr=1.0, warmup_steps=4, total_steps=14, kind="cosine")
    assert [schedule(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert schedule(4) == pytest.approx(1.0)
    assert schedule(9) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert schedule(14) == pytest.approx(0.0)


def test_constant_after_warmup():
    schedule = LRSchedule(peak_lr=0.3, warmup_steps=2, total_steps=10, kind="constant")
    assert [schedule(s) for s in (0, 1, 2, 9)] == pytest.approx([0.15, 0.3, 0.3, 0.3])


#: a run's train keys as make_schedule reads them: 3 epochs, a warm-up of one, 0.05 at batch 256
SCHEDULE_TRAIN = {
    "base_lr": 0.05,
    "lr_reference_batch": 256,
    "lr_scaling": "linear",
    "epochs": 3,
    "max_steps": None,
    "warmup_epochs": 1,
    "warmup_steps": None,
    "lr_schedule": "cosine",
}


def test_make_schedule_from_config():
    train = SCHEDULE_TRAIN
    schedule = make_schedule(train, update_batch=256, steps_per_epoch=100)
    assert (schedule.peak_lr, schedule.warmup_steps, schedule.total_steps) == (pytest.approx(0.05), 100, 300)
    schedule = make_schedule({**train, "max_steps": 50}, update_batch=512, steps_per_epoch=100)
    assert (schedule.peak_lr, schedule.warmup_steps, schedule.total_steps) == (pytest.approx(0.1), 50, 50)
    # a strategy's own limit (no_exchange's steps): the first of the limits ends the schedule
    assert make_schedule(train, update_batch=256, steps_per_epoch=100, step_limit=40).total_steps == 40
    assert (
        make_schedule({**train, "max_steps": 50}, update_batch=256, steps_per_epoch=100, step_limit=60).total_steps
        == 50
    )


def test_schedule_records_the_update_batch_and_its_rule():
    train = {
        "base_lr": 0.1,
        "lr_reference_batch": 256,
        "lr_scaling": "linear",
        "epochs": 1,
        "max_steps": None,
        "warmup_epochs": 0,
        "lr_schedule": "constant",
    }
    described = make_schedule(train, update_batch=64, steps_per_epoch=10, update_batch_rule="b: async").describe()
    assert described["peak_lr"] == pytest.approx(0.025)
    assert (described["update_batch"], described["update_batch_rule"]) == (64, "b: async")
