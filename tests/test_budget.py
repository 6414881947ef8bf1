"""The cost preview (dtstudy.projection.budget, `python -m dtstudy budget`): the steps a run takes
as the training loop counts them, a run's wall time and GPU-hours by hand, the refusals before
submission (budget, requeues, a profile of other nodes), the jobs' time limits, and the record
docs/cluster.md quotes, recomputed."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
from conftest import REPO

from dtstudy.config.study_config import deep_merge, read_yaml, validate_schema
from dtstudy.errors import ConfigError
from dtstudy.projection import budget, layer_profiles
from dtstudy.strategies.specs import AllReducePowerSGDSpec

RECORD = REPO / "docs" / "records" / "budget.json"
IMAGENET_TRAIN = 1281167  # ILSVRC-2012's training images (config/cluster.yaml's budget_train_images)


def cluster_config(**launcher) -> dict:
    """config/cluster.yaml on config/config.yaml, validated, with launcher keys changed."""
    config = deep_merge(read_yaml(REPO / "config" / "config.yaml"), read_yaml(REPO / "config" / "cluster.yaml"))
    config["launcher"].update(launcher)
    return validate_schema(config)


def images(config) -> budget.Images:
    return budget.study_images(config, None)


# ----- the steps a run takes ---------------------------------------------------------------------


@pytest.mark.parametrize("train_images, workers, batch", [(959, 3, 32), (1000, 8, 32), (4096, 64, 32), (50, 4, 8)])
def test_steps_are_the_training_loops(train_images, workers, batch):
    """The loop's DistributedSampler pads every worker's share to ceil(n / N) and its
    BatchSampler drops the last partial batch; the budget must count those batches."""
    from torch.utils.data import BatchSampler, DistributedSampler

    loop = {
        len(BatchSampler(DistributedSampler(range(train_images), num_replicas=workers, rank=rank), batch, True))
        for rank in range(workers)
    }
    assert len(loop) == 1
    config = {"train": {"epochs": 3, "batch_size": batch, "scaling": "weak", "max_steps": None}}
    counted = budget.steps(config, "allreduce", workers, budget.Images(train_images, 0, "test"), {})
    assert counted == 3 * loop.pop()
    if (train_images, workers) == (959, 3):  # the control: floor(n / N) would count one batch fewer
        assert 3 * ((train_images // workers) // batch) != counted


def test_max_steps_and_no_exchanges_own_steps_cut_a_run():
    config = cluster_config()
    seen = budget.Images(IMAGENET_TRAIN, 0, "test")
    full = budget.steps(config, "allreduce", 8, seen, {})
    assert full == 30 * (math.ceil(IMAGENET_TRAIN / 8) // 32)
    assert budget.steps(config, "no_exchange", 8, seen, {"steps": 400}) == 400
    config["train"]["max_steps"] = 100
    assert budget.steps(config, "allreduce", 8, seen, {}) == 100


def test_each_kind_of_run_is_costed_at_its_own_steps_n_and_seeds():
    """A scaling run counts its warm-up + timed steps, an accuracy run its epochs; each at its
    kind's N, each times its kind's seeds; the total is the sum over both kinds."""
    config = cluster_config()
    where = budget.load_costing("h100_ib400", config, "launcher.hardware")
    seen = images(config)
    costs = budget.study_costs(config, seen, where)
    scaling = [c for c in costs if c.kind == "scaling"]
    accuracy = [c for c in costs if c.kind == "accuracy"]
    assert len(scaling) == 12 * 7 and len(accuracy) == 12 * 3 and len(costs) == len(scaling) + len(accuracy)
    warm_and_timed = config["scaling"]["warmup_steps"] + config["scaling"]["steps"]
    assert {c.steps for c in scaling} == {warm_and_timed} and {c.seeds for c in scaling} == {2}
    assert {c.workers for c in accuracy} == {1, 8, 64} and {c.seeds for c in accuracy} == {3}
    for cost in accuracy:
        assert cost.steps == 30 * (math.ceil(seen.train / cost.workers) // 32)
    assert budget.total_gpu_hours(costs) == pytest.approx(
        2 * sum(c.gpu_hours for c in scaling) + 3 * sum(c.gpu_hours for c in accuracy), rel=1e-12
    )
    # the control: a scaling run counted at its epochs would cost as much as an accuracy run
    one_scaling = next(c for c in scaling if (c.strategy, c.workers) == ("allreduce", 1))
    one_accuracy = next(c for c in accuracy if (c.strategy, c.workers) == ("allreduce", 1))
    assert one_scaling.gpu_hours < one_accuracy.gpu_hours / 50
    # a study without scaling runs costs full trainings at every N and seed, as before kinds
    config["scaling"].update(steps=None, seeds=None)
    config["accuracy"]["workers"] = None
    plain = budget.study_costs(config, seen, where)
    assert {c.kind for c in plain} == {"accuracy"} and len(plain) == 12 * 7
    assert budget.total_gpu_hours(plain) == pytest.approx(
        3
        * sum(
            budget.run_cost(config, s, n, seen, where).gpu_hours
            for s in config["strategies"]
            for n in config["workers"]
        ),
        rel=1e-12,
    )


# ----- one run, by hand ----------------------------------------------------------------------


def test_an_n1_run_costs_its_compute_evaluation_and_start_up_on_one_gpu():
    """allreduce at N = 1 exchanges nothing: its wall time is steps x b / rate, the forward
    pass over the validation images it scores, and one start-up; it holds one GPU, not the
    node's 8 (the bug of the issue: every run asked for gpus_per_node)."""
    config = cluster_config()
    seen = images(config)
    where = budget.load_costing("h100_ib400", config, "launcher.hardware")
    rate = where.profile["train_images_per_s"]["resnet50"]["bf16"]
    cost = budget.run_cost(config, "allreduce", 1, seen, where)

    val = round(0.02 * IMAGENET_TRAIN)
    assert (seen.train, seen.val) == (IMAGENET_TRAIN - val, val)
    steps = 30 * ((IMAGENET_TRAIN - val) // 32)
    entry = json.loads((REPO / "workflow/dtstudy/projection/layer_profiles.json").read_text())["architectures"][
        "resnet50"
    ]
    forward = entry["forward_flops"] / (entry["forward_flops"] + entry["backward_flops"])
    # the base config's grid: evals_per_epoch points of its first eval_images a epoch, the whole split once
    grid = config["train"]["evals_per_epoch"] * min(config["train"]["eval_images"], val)
    assert config["train"]["evals_per_epoch"] > 1
    wall = steps * 32 / rate + (30 * grid + val) * forward / rate + budget.STARTUP_S
    assert cost.steps == steps and cost.attempts == 1
    assert cost.wall_s == pytest.approx(wall, rel=1e-9)
    assert cost.gpus == 1 and cost.gpu_hours == pytest.approx(wall / 3600, rel=1e-9)
    assert cost.gpu_hours * 8 != pytest.approx(wall / 3600)  # the control: the whole node's GPUs


def test_gpu_hours_are_wall_time_times_n_and_nearly_flat_under_weak_scaling_for_allreduce():
    config = cluster_config()
    where = budget.load_costing("h100_ib400", config, "launcher.hardware")
    costs = {n: budget.run_cost(config, "allreduce", n, images(config), where) for n in config["workers"]}
    for n, cost in costs.items():
        assert cost.gpus == n and cost.gpu_hours == pytest.approx(cost.wall_s * n / 3600)
    # weak scaling: the same images per GPU-second, plus each N's exchange and start-up
    assert costs[1].gpu_hours < costs[64].gpu_hours < 2 * costs[1].gpu_hours
    # the model's exchange is in it: a parameter server at N = 64 costs more than allreduce
    assert budget.run_cost(config, "ps_sync", 64, images(config), where).gpu_hours > costs[64].gpu_hours


def test_the_layer_profiles_matrices_are_resnet50s_weights_as_powersgd_sees_them():
    import torch
    import torchvision

    with torch.device("meta"):
        model = torchvision.models.resnet50()
    real = sorted([p.shape[0], p[0].numel() if p.dim() > 1 else 1] for p in model.parameters())
    derived = layer_profiles.matrices("resnet50", "test")
    assert sorted(derived) == real
    share = AllReducePowerSGDSpec.sent_share
    assert share(derived, 2) == pytest.approx(share(real, 2))
    # the control: every tensor taken as a vector would send everything whole
    assert share([[n * m, 1] for n, m in derived], 2) == 1.0 != share(real, 2)


# ----- refusals before submission ------------------------------------------------------------------


def test_a_study_over_its_gpu_hour_budget_is_refused_naming_the_key():
    config = cluster_config()
    where = budget.cluster_costing(config)
    total = budget.total_gpu_hours(budget.study_costs(config, images(config), where))
    budget.check_study(cluster_config(gpu_hour_budget=total * 1.001), images(config))  # the control: within
    with pytest.raises(
        ConfigError, match=r"'launcher.gpu_hour_budget'.* predicted to cost \d+ GPU-hours on h100_ib400"
    ):
        budget.check_study(cluster_config(gpu_hour_budget=total * 0.999), images(config))


def test_a_budget_without_a_profile_to_predict_on_is_refused():
    with pytest.raises(ConfigError, match="'launcher.gpu_hour_budget'.*launcher.hardware"):
        budget.check_study(cluster_config(hardware=None, gpu_hour_budget=100.0), images(cluster_config()))
    budget.check_study(cluster_config(hardware=None), images(cluster_config()))  # no budget, no profile: fine


def test_a_run_that_cannot_finish_within_its_requeues_is_refused():
    """On the source paper's K80s at fp32, allreduce at N = 1 takes about 190 h: with
    timeout_min 720 and the margin of 1.5 that is 24 jobs, so 23 requeues and not 22."""
    config = cluster_config(hardware="minotauro_k80", gpus_per_node=4)
    config["train"]["precision"] = "fp32"
    config["strategies"], config["workers"] = ["allreduce"], [1, 4]
    where = budget.cluster_costing(config)
    attempts = budget.run_cost(config, "allreduce", 1, images(config), where).attempts
    assert attempts > 11  # the shipped max_requeues (10) is not enough there
    config["launcher"]["max_requeues"] = attempts - 1
    budget.check_study(config, images(config))
    config["launcher"]["max_requeues"] = attempts - 2
    with pytest.raises(
        ConfigError,
        match=rf"'launcher.max_requeues': {attempts - 2} requeues cannot finish the accuracy run of allreduce at N=1",
    ):
        budget.check_study(config, images(config))


def test_a_profile_of_other_nodes_or_without_a_rate_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"'launcher.gpus_per_node': 4, but launcher.hardware 'h100_ib400' has 8"):
        budget.check_study(cluster_config(gpus_per_node=4), images(cluster_config()))
    config = cluster_config(hardware="minotauro_k80", gpus_per_node=4)  # bf16: a K80 has no rate for it
    with pytest.raises(ConfigError, match=r"'launcher.hardware'.*train_images_per_s.resnet50.bf16"):
        budget.check_study(config, images(config))


def test_a_study_without_its_data_set_or_a_stand_in_count_says_which_key_to_give():
    config = cluster_config(budget_train_images=None)
    with pytest.raises(ConfigError, match="'launcher.budget_train_images': null.*dataset.root"):
        budget.study_images(config, None, "dataset.root: '/path/to/imagenet' does not exist")
    counted = budget.study_images(config, 5000)  # the data set on disk wins
    assert (counted.train, counted.val) == (4900, 100) and "on disk" in counted.source


# ----- time limits ---------------------------------------------------------------------------------


def test_job_time_limits_come_from_each_runs_prediction_from_the_prepared_data(tmp_path):
    config = cluster_config()
    (tmp_path / "meta.json").write_text(json.dumps({"sizes": {"train": 1255544, "val": 25623, "test": 50000}}))
    where = budget.cluster_costing(config)
    limits = {}
    for n in (1, 64):
        limit = budget.job_time_limit_min(config, "allreduce", n, tmp_path)
        wall = budget.run_cost(config, "allreduce", n, budget.Images(1255544, 25623, "meta"), where).wall_s
        assert limit >= wall * 1.5 / 60 and limit <= config["launcher"]["timeout_min"]
        limits[n] = limit
    assert (
        limits[64]
        == budget.TIME_LIMIT_FLOOR_MIN
        < limits[1]
        == math.ceil(
            budget.run_cost(config, "allreduce", 1, budget.Images(1255544, 25623, "meta"), where).wall_s * 1.5 / 60
        )
    )
    # the control: a tenth of the data set, a shorter limit
    (tmp_path / "meta.json").write_text(json.dumps({"sizes": {"train": 125554, "val": 2562, "test": 5000}}))
    assert budget.job_time_limit_min(config, "allreduce", 1, tmp_path) < limits[1]
    assert budget.job_time_limit_min(cluster_config(hardware=None), "allreduce", 1, tmp_path) is None
    local = cluster_config(cluster="local")
    assert budget.job_time_limit_min(local, "allreduce", 1, tmp_path) is None


def test_a_run_longer_than_timeout_min_asks_timeout_min_and_the_floor_clears_the_signal():
    launcher = {"timeout_min": 720, "time_limit_margin": 1.5, "signal_delay_s": 300}
    assert budget.time_limit(30 * 3600, 3, launcher) == 720
    assert budget.time_limit(60, 1, launcher) == budget.TIME_LIMIT_FLOOR_MIN
    # a signal 40 min before the limit needs a longer floor: > 60 s after the start
    assert budget.time_limit(60, 1, {**launcher, "signal_delay_s": 2400}) * 60 - 2400 > 60


# ----- the command and its record ------------------------------------------------------------------


def run_budget(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dtstudy", "budget", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_the_budget_command_prints_every_run_and_the_total_and_refuses_over_budget():
    done = run_budget("--configfile", "config/cluster.yaml")
    assert done.returncode == 0, done.stderr
    rows = [line.split()[:3] for line in done.stdout.splitlines() if line.split()[1:2] in (["allreduce"], ["ps_sync"])]
    # allreduce and ps_sync on h100_ib400 (the one profile with a bf16 rate): scaling runs at 7 N,
    # accuracy runs at 3
    assert [row for row in rows if row[0] == "scaling"] == [
        ["scaling", s, str(n)] for s in ("allreduce", "ps_sync") for n in (1, 2, 4, 8, 16, 32, 64)
    ]
    assert [row for row in rows if row[0] == "accuracy"] == [
        ["accuracy", s, str(n)] for s in ("allreduce", "ps_sync") for n in (1, 8, 64)
    ]
    assert done.stdout.startswith(
        "Predicted cost of the study: 168 scaling runs (2 seeds each, the scaling table); "
        "108 accuracy runs (3 seeds each, "
    )
    assert "GPU-hours per kind of run: scaling runs " in done.stdout
    assert "total: " in done.stdout and "GPU-hours on h100_ib400" in done.stdout
    one_seed = run_budget("--configfile", "config/cluster.yaml", "--set", "seeds=[0]")
    assert "108 accuracy runs" not in one_seed.stdout and " accuracy runs (1 seed each, " in one_seed.stdout
    assert "minotauro_k80: not costed, no train_images_per_s.resnet50.bf16" in done.stdout
    over = run_budget("--configfile", "config/cluster.yaml", "--set", "launcher.gpu_hour_budget=100")
    assert over.returncode == 2 and "config key 'launcher.gpu_hour_budget'" in over.stderr
    assert "total: " in over.stdout  # the table first, then the refusal


def differences(recorded, recomputed, path="") -> list[str]:
    """Where two records differ (numbers within 1e-9 relative)."""
    if isinstance(recorded, dict) and isinstance(recomputed, dict):
        keys = recorded.keys() | recomputed.keys()
        return [d for k in sorted(keys) for d in differences(recorded.get(k), recomputed.get(k), f"{path}.{k}")]
    if isinstance(recorded, list) and isinstance(recomputed, list) and len(recorded) == len(recomputed):
        return [d for i, (a, b) in enumerate(zip(recorded, recomputed)) for d in differences(a, b, f"{path}.{i}")]
    if isinstance(recorded, (int, float)) and isinstance(recomputed, (int, float)) and not isinstance(recorded, bool):
        return [] if math.isclose(recorded, recomputed, rel_tol=1e-9) else [f"{path}: {recorded} != {recomputed}"]
    return [] if recorded == recomputed else [f"{path}: {recorded!r} != {recomputed!r}"]


@pytest.mark.slow
def test_the_record_docs_quote_is_what_the_command_computes_now(tmp_path):
    record = json.loads(RECORD.read_text())
    entries = [name for name in record if name != "about"]
    assert entries
    for name in entries:
        entry = record[name]
        out = tmp_path / f"{name}.json"
        args = [arg for config in entry["configs"][1:] for arg in ("--configfile", config)]
        args += [arg for setting in entry["set"] for arg in ("--set", setting)]
        done = run_budget(*args, "--record", str(out), "--record-as", name)
        assert done.returncode == 0, done.stderr
        found = differences(entry, json.loads(out.read_text())[name])
        assert not found, f"docs/records/budget.json#{name} is stale (rerun its command): {found[:5]}"
    # the control: a total off by a tenth of a percent is caught
    drifted = copy.deepcopy(record["cluster"])
    drifted["profiles"]["h100_ib400"]["total_gpu_hours"] *= 1.001
    assert differences(drifted, record["cluster"])


def test_the_train_command_submits_with_its_runs_predicted_time_limit(tmp_path, monkeypatch):
    """`python -m dtstudy train` on SLURM with launcher.hardware hands the launcher the run's
    predicted limit (from the prepared data's sizes); without a profile, none (timeout_min)."""
    from dtstudy import __main__ as cli
    from dtstudy.config.study_config import run_config, to_json
    from dtstudy.launch import launcher

    seen = []
    monkeypatch.setattr(
        launcher,
        "run_training_job",
        lambda spec, job_dir, time_limit_min=None: (
            seen.append(time_limit_min) or {"throughput": 1.0, "final_val_top1": 0.5, "wall_time_s": 1.0}
        ),
    )
    (tmp_path / "meta.json").write_text(json.dumps({"sizes": {"train": 1255544, "val": 25623, "test": 50000}}))
    for config, kind in (
        (cluster_config(), "accuracy"),
        (cluster_config(hardware=None), "accuracy"),
        (cluster_config(), "scaling"),
    ):
        args = [
            "train",
            "--config-json",
            to_json(run_config(config, "allreduce", kind)),
            "--strategy",
            "allreduce",
            "--workers",
            "1",
            "--seed",
            "0",
            "--data",
            str(tmp_path),
            "--out",
            str(tmp_path / "run"),
            "--no-tracking",
        ]
        assert cli.main(args) == 0
    expected = budget.job_time_limit_min(cluster_config(), "allreduce", 1, tmp_path)
    # a scaling run asks for its few hundred steps: the floor, not the accuracy run's hours
    assert seen == [expected, None, budget.TIME_LIMIT_FLOOR_MIN] and budget.TIME_LIMIT_FLOOR_MIN < expected
    assert expected < cluster_config()["launcher"]["timeout_min"]
