"""Scaling runs and accuracy runs (dtstudy.config.run_kinds): a scaling run's config, its timing
window over the steps after its warm-up, and a real scaling run that stops after warm-up +
timed steps. The DAG of both kinds: tests/test_workflow.py; their tables: tests/test_aggregate.py;
their cost: tests/test_budget.py."""

from __future__ import annotations

import pytest
import yaml
from conftest import REPO, tiny_study, validated

from dtstudy.config import run_kinds
from dtstudy.config.study_config import run_config
from dtstudy.errors import ConfigError
from dtstudy.runspec import RunSpec

WARMUP, TIMED = 8, 20


def scaling_study(**overrides) -> dict:
    return validated(tiny_study(scaling={"steps": TIMED, "warmup_steps": WARMUP}, **overrides))


def test_a_scaling_runs_config_stops_after_warm_up_and_timed_steps_and_skips_the_warm_up():
    study = scaling_study()
    timed = run_config(study, "allreduce", run_kinds.SCALING)
    assert timed["train"]["max_steps"] == WARMUP + TIMED and timed["train"]["steady_state_skip"] == WARMUP
    assert run_kinds.kind_of_run_config(timed) == "scaling"
    spec = RunSpec("allreduce", 2, 0, timed, "", "")
    assert spec.kind == "scaling" and spec.run_name == "allreduce-n2-seed0-scaling"
    # an accuracy run's config is the study's train section, unchanged
    full = run_config(study, "allreduce")
    assert full["train"] == study["train"] and run_kinds.kind_of_run_config(full) == "accuracy"
    assert RunSpec("allreduce", 2, 0, full, "", "").run_name == "allreduce-n2-seed0"


def test_the_kinds_runs_and_their_defaults():
    study = scaling_study(workers=[1, 2, 4], seeds=[0, 1, 2], accuracy={"workers": [4]}, train={"epochs": 2})
    assert run_kinds.kinds_run(study) == ["scaling", "accuracy"] and run_kinds.throughput_kind(study) == "scaling"
    assert run_kinds.workers(study, "scaling") == [1, 2, 4] and run_kinds.workers(study, "accuracy") == [4]
    assert run_kinds.seeds(study, "scaling") == run_kinds.seeds(study, "accuracy") == [0, 1, 2]
    assert run_kinds.run_count(study, "scaling") == 9 and run_kinds.run_count(study, "accuracy") == 3
    plain = validated(tiny_study())
    assert run_kinds.kinds_run(plain) == ["accuracy"] and run_kinds.throughput_kind(plain) == "accuracy"


def test_the_default_config_says_it_trains_fully_at_every_n_and_the_cluster_config_has_both_kinds():
    default = yaml.safe_load((REPO / "config/config.yaml").read_text())
    assert default["scaling"]["steps"] is None  # stated, not left to the schema's default
    cluster = yaml.safe_load((REPO / "config/cluster.yaml").read_text())
    assert cluster["scaling"]["steps"] and set(cluster["accuracy"]["workers"]) < set(cluster["workers"])


def test_a_scaling_run_that_train_epochs_would_cut_short_is_refused_before_any_job():
    """The tiny data's 1800 training images give a worker 14 steps an epoch at N = 4 (450 images,
    batch 32): one epoch cannot hold 8 warm-up + 20 timed steps, and the loop, which stops at
    the epochs' end, would time 6 steps instead of 20 without a word."""
    with pytest.raises(
        ConfigError,
        match=r"config key 'scaling.steps': 20 timed steps after scaling.warmup_steps 8 "
        r"make a scaling run of 28 steps, but at N=4 a worker has 14 steps an "
        r"epoch .* after 14; allowed: warmup_steps \+ steps of at most 14",
    ):
        scaling_study(workers=[1, 2, 4])
    # what the message offers fits: two epochs, or no scaling runs at N = 4 (N = 2: 28 steps an epoch)
    assert scaling_study(workers=[1, 2, 4], train={"epochs": 2})
    assert validated(tiny_study(workers=[1, 2, 4], scaling={"steps": TIMED, "warmup_steps": WARMUP, "workers": [1, 2]}))
    # strong scaling keeps the global batch: every N has 56 steps an epoch, and 28 fit
    assert scaling_study(workers=[1, 2, 4], train={"scaling": "strong"})


def worker_log(step_s: list[float], images: int = 32):
    """One worker's log of steps taking `step_s` seconds, `images` each."""
    from dtstudy.training.measurements import WorkerLog

    log = WorkerLog(rank=0)
    for seconds in step_s:
        log.record(data_s=0.0, step_s=seconds, comm_s=0.0, bytes_sent=0.0, images=images)
    log.loss = [1.0] * len(step_s)
    return log


def summarize_steps(run_cfg: dict, slow: int, fast: int, images: int = 32) -> dict:
    """metrics.json of a one-worker run whose first `slow` steps take 1 s and the next `fast` 0.01 s."""
    from dtstudy.training.measurements import summarize

    spec = RunSpec("allreduce", 1, 0, run_cfg, "", "")
    return summarize(spec, [worker_log([1.0] * slow + [0.01] * fast, images)], [], 1.0, {}, {}, {}, {})


def test_a_scaling_runs_throughput_is_timed_over_the_steps_after_its_warm_up_only():
    study = scaling_study()
    metrics = summarize_steps(run_config(study, "allreduce", run_kinds.SCALING), WARMUP, TIMED)
    assert (
        metrics["kind"] == "scaling" and metrics["steady_state_skip"] == WARMUP and metrics["steps"] == WARMUP + TIMED
    )
    assert metrics["throughput"] == pytest.approx(32 / 0.01) and metrics["throughput_median"] == pytest.approx(3200)
    assert len(metrics["throughput_windows"]) * metrics["timing_window_steps"] == TIMED
    # the control: the accuracy run's window (steady_state_skip 5) takes 3 slow warm-up steps in
    full = summarize_steps(run_config(study, "allreduce"), WARMUP, TIMED)
    assert full["kind"] == "accuracy" and full["throughput"] < 0.2 * metrics["throughput"]


def test_timed_windows_span_whole_cycles_of_the_exchange():
    from dtstudy.training.measurements import timed_window

    assert timed_window(10, 1, 100) == 10  # every step the same: as asked
    assert timed_window(5, 8, 100) == 8 and timed_window(10, 8, 200) == 16  # rounded up to whole periods
    assert timed_window(10, 8, 50) == 8  # 5 windows of 8 fit, not of 16
    assert timed_window(10, 8, 20) == 8  # fewer than 5 windows of a period: one period, 2 windows
    assert timed_window(10, 8, 12) == 2  # not two periods: as many steps as 5 windows allow


def _summarize(strategy: str, step_s: list[float], **train) -> dict:
    from dtstudy.training.measurements import summarize

    study = validated(tiny_study(strategies=[strategy], train={"steady_state_skip": 5, **train}))
    spec = RunSpec(strategy, 1, 0, run_config(study, strategy), "", "")
    return summarize(spec, [worker_log(step_s)], [], 1.0, {}, {}, {}, {})


def test_a_periodic_exchange_weighs_in_every_window_as_in_a_long_run():
    """local_sgd averages every 8 steps (0.08 s beside steps of 0.01 s): a long run's
    throughput is 8 x 32 images / 0.16 s. The at-scale study's windows of 5 steps would hold
    the average or not (5 of 8 of them do), and their median would say 5 x 32 / 0.13 s, 23%
    low; the windows span whole periods instead, each 1600 images/s."""
    from dtstudy.common.intervals import median_interval
    from dtstudy.training.measurements import run_windows

    step_s = [0.09 if (step + 1) % 8 == 0 else 0.01 for step in range(5 + 8 * 6)]
    metrics = _summarize("local_sgd", step_s, timing_window_steps=5)
    assert metrics["timing_window_steps"] == 8 and len(metrics["throughput_windows"]) == 6
    assert metrics["throughput_windows"] == pytest.approx([1600.0] * 6, rel=1e-9)
    assert metrics["throughput_median"] == pytest.approx(1600.0, rel=1e-9)
    # the control: windows of 5 steps, as asked, miss it
    assert median_interval([run_windows([worker_log(step_s)], 5, 5)]).value == pytest.approx(160 / 0.13, rel=1e-9)


def test_a_strategys_transient_is_left_out_of_its_steady_state():
    """allreduce_powersgd all-reduces the whole gradient for its first start_powerSGD_iter (10)
    steps: they are left out of the timed steps though steady_state_skip is 5."""
    step_s = [0.03] * 10 + [0.01] * 40
    metrics = _summarize("allreduce_powersgd", step_s)
    assert metrics["steady_state_skip"] == 10
    assert metrics["throughput"] == pytest.approx(3200.0, rel=1e-9)
    assert _summarize("allreduce", step_s)["steady_state_skip"] == 5  # the control: plain allreduce has none


def test_a_real_scaling_run_stops_after_warm_up_and_timed_steps(tmp_path, tiny_data):
    """allreduce at N = 1 with the default study's training settings, as a scaling run."""
    from dtstudy.launch.launcher import run_training_job

    users = yaml.safe_load((REPO / "config/config.yaml").read_text())["train"]
    study = validated(
        tiny_study(workers=[1], train={**users, "evals_per_epoch": 1}, scaling={"steps": TIMED, "warmup_steps": WARMUP})
    )
    spec = RunSpec(
        "allreduce", 1, 0, run_config(study, "allreduce", run_kinds.SCALING), str(tiny_data), str(tmp_path / "run")
    )
    metrics = run_training_job(spec, tmp_path / "run" / "submitit")
    # the tiny data's epoch (1800 images, batch 32) has 56 steps: the run stops well before it
    assert metrics["steps"] == WARMUP + TIMED and metrics["epochs_run"] == 1
    assert metrics["kind"] == "scaling" and metrics["run_name"] == "allreduce-n1-seed0-scaling"
    assert metrics["steady_state_skip"] == WARMUP
    assert len(metrics["throughput_windows"]) * metrics["timing_window_steps"] == TIMED


def test_check_config_counts_each_kind_at_its_own_n_and_seeds(tmp_path, capsys):
    """`python -m dtstudy check-config` says how many runs of each kind the study makes (the
    scaling runs at every N, the accuracy runs at theirs), not strategies x workers x seeds."""
    import argparse

    from dtstudy.__main__ import cmd_check_config

    study = tiny_study(
        workers=[1, 2, 4],
        seeds=[0, 1, 2],
        scaling={"steps": TIMED, "warmup_steps": WARMUP},
        accuracy={"workers": [4], "seeds": [0]},
        train={"epochs": 2},
    )
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    cmd_check_config(argparse.Namespace(config=str(path), config_json=None))
    strategies = len(study["strategies"])
    printed = capsys.readouterr().out
    assert f"config OK: {strategies * 9 + strategies} training runs" in printed, printed
    assert f"{strategies * 9} scaling runs" in printed and f"{strategies} accuracy runs" in printed, printed
