"""Strategy variants (config `variants`: a registered strategy with train keys, knobs and N of
its own, a row of the tables under its own name) and the two train keys of a fixed number of
updates at every N (train.warmup_steps, train.eval_every_steps).

- the schema: a variant's defaults, its train keys checked as `train` is and its N against
  `workers`, each error naming the variant's key;
- study_config: strategy_of, variant_study, arm_workers, and a variant's run config (its
  strategy's under variant_study, naming the variant);
- check_config: an unknown name lists the variants, a variant may not take a registered name
  or name an unknown strategy, and each listed variant is checked as the study it runs under;
- the DAG: a variant's runs only at its own N (a tiny study; config/at-scale.yaml's Goyal and
  Dai variants);
- a variant's run: RunSpec's variant and run name, metrics.json's `variant`, the train command
  running it as its strategy (an emulated run end to end), the runs frame and the tables taking
  it as a row of its own whose family is its strategy's;
- warmup_steps in the schedule, eval_every_steps in the loop's grid and the budget's count;
- a SLURM study's predicted cost: each variant costed as its strategy at its own N, its runs
  counted against launcher.gpu_hour_budget with the rest;
- the run count counts each variant at its own N, the projection leaves variants out, a
  variant's knob error names the variant, and a run stopped by max_steps on a grid point scores
  it once.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO, tiny_study, validated
from test_aggregate import write_run
from test_run_kinds import worker_log
from test_schedule import SCHEDULE_TRAIN
from test_workflow import dry_run, job_counts, jobs_of, run_config_of, shipped_study_dry_run

from dtstudy.analysis.runs import FAMILY_OF, load_run_metrics, load_runs
from dtstudy.analysis.tables import ACCURACY_COLUMNS, accuracy_table, scaling_table
from dtstudy.checks import check_config, load_config
from dtstudy.config import run_kinds
from dtstudy.config.study_config import (
    VARIANT_KEY,
    deep_merge,
    read_yaml,
    run_config,
    strategy_of,
    to_json,
    validate_schema,
    variant_study,
)
from dtstudy.errors import ConfigError
from dtstudy.runspec import RunSpec

AT_SCALE = REPO / "config/at-scale.yaml"
EMULATE = {"hardware": "h100_ib400", "images_per_s": 10_000.0}
#: a variant of allreduce at N = 2 only, with a batch and warm-up of its own
QUICK = {"strategy": "allreduce", "workers": [2], "train": {"batch_size": 16, "warmup_steps": 3}}
#: a variant of ssp at the study's N, its bound its own
BOUNDED = {"strategy": "ssp", "strategy_params": {"staleness": 2}}


def variant_study_config(**overrides) -> dict:
    """The tiny study with allreduce, the variants quick and bounded listed, at N = 1 and 2."""
    return tiny_study(
        **deep_merge(
            {
                "strategies": ["allreduce", "quick", "bounded"],
                "variants": {"quick": QUICK, "bounded": BOUNDED},
                "strategy_params": {"ssp": {"shards": 1, "staleness": 0}},
            },
            overrides,
        )
    )


def error_of(config: dict) -> str:
    """The ConfigError's message that validating and checking `config` raises."""
    with pytest.raises(ConfigError) as err:
        validated(config)
    return str(err.value)


def at_scale() -> dict:
    """config/at-scale.yaml over config/config.yaml, validated, as the study runs it."""
    return validate_schema(deep_merge(read_yaml(REPO / "config/config.yaml"), read_yaml(AT_SCALE)))


# --- the schema and study_config ----------------------------------------------------------


def test_a_variant_takes_the_schemas_defaults_and_a_study_has_none_by_default():
    assert validate_schema(tiny_study())["variants"] == {}
    config = validate_schema(tiny_study(variants={"bare": {"strategy": "ssp"}}))
    assert config["variants"] == {"bare": {"strategy": "ssp", "workers": None, "train": {}, "strategy_params": {}}}


@pytest.mark.parametrize(
    "variant, words",
    [
        ({"workers": [1]}, ["'variants.v.strategy' is missing"]),
        ({"strategy": "ssp", "shards": 2}, ["variants.v", "'shards'"]),
        ({"strategy": "ssp", "workers": []}, ["variants.v.workers"]),
        ({"strategy": "ssp", "workers": [0]}, ["variants.v.workers[0]", "minimum of 1"]),
        # its train keys are checked against the schema's `train`, the errors naming the variant's key
        ({"strategy": "ssp", "train": {"batch_size": 0}}, ["'variants.v.train.batch_size'", "minimum of 1"]),
        ({"strategy": "ssp", "train": {"lr_scaling": "cubic"}}, ["'variants.v.train.lr_scaling'", "'cubic'", "sqrt"]),
        ({"strategy": "ssp", "train": {"bach_size": 8}}, ["'variants.v.train.bach_size'", "unknown key", "batch_size"]),
        ({"strategy": "ssp", "train": {"warmup_steps": -1}}, ["'variants.v.train.warmup_steps'", "minimum of 0"]),
        (
            {"strategy": "ssp", "train": {"eval_every_steps": 0}},
            ["'variants.v.train.eval_every_steps'", "minimum of 1"],
        ),
        # its N is some of the study's
        (
            {"strategy": "ssp", "workers": [2, 8]},
            ["'variants.v.workers[1]'", "8 is not in workers [1, 2]", "allowed: N of workers"],
        ),
    ],
)
def test_a_bad_variant_is_refused_naming_its_key(variant, words):
    with pytest.raises(ConfigError) as err:
        validate_schema(tiny_study(variants={"v": variant}))
    assert all(word in str(err.value) for word in words), str(err.value)


def test_a_variants_name_is_a_name_the_rules_wildcards_take():
    validate_schema(tiny_study(variants={"ssp_s0": {"strategy": "ssp"}}))  # the control
    with pytest.raises(ConfigError, match="'variants'.*'SSP-0'"):
        validate_schema(tiny_study(variants={"SSP-0": {"strategy": "ssp"}}))


def test_the_train_keys_of_a_fixed_number_of_updates_default_to_the_epochs_rules():
    train = validate_schema(tiny_study())["train"]
    assert (train["warmup_steps"], train["eval_every_steps"]) == (None, None)
    train = validate_schema(tiny_study(train={"warmup_steps": 0, "eval_every_steps": 20}))["train"]
    assert (train["warmup_steps"], train["eval_every_steps"]) == (0, 20)
    for key, bad in (("warmup_steps", -1), ("eval_every_steps", 0), ("warmup_steps", 1.5)):
        with pytest.raises(ConfigError, match=f"'train.{key}'"):
            validate_schema(tiny_study(train={key: bad}))


def test_strategy_of_a_name_is_its_variants_strategy_or_itself():
    config = validated(variant_study_config())
    assert [strategy_of(config, name) for name in config["strategies"]] == ["allreduce", "allreduce", "ssp"]
    assert strategy_of(tiny_study(), "gossip") == "gossip"  # a study without the key


def test_a_variants_study_is_the_studys_with_its_train_keys_knobs_and_n_over_it():
    config = validated(variant_study_config(accuracy={"workers": [1, 2]}, train={"base_lr": 0.3}))
    before = copy.deepcopy(config)
    quick = variant_study(config, "quick")
    assert quick["strategies"] == ["allreduce"] and quick["variants"] == {}
    assert quick["workers"] == [2] and quick["accuracy"]["workers"] is None and quick["scaling"]["workers"] is None
    # its train keys over the study's, the others the study's
    assert (quick["train"]["batch_size"], quick["train"]["warmup_steps"]) == (16, 3)
    assert (quick["train"]["base_lr"], quick["train"]["epochs"]) == (0.3, 1)
    # its knobs over the study's knobs of its strategy; without N of its own, the study's N
    bounded = variant_study(config, "bounded")
    assert bounded["strategies"] == ["ssp"] and bounded["strategy_params"]["ssp"] == {"shards": 1, "staleness": 2}
    assert bounded["workers"] == [1, 2] and bounded["accuracy"]["workers"] == [1, 2]
    assert bounded["train"] == config["train"]
    assert config == before  # the study is left as it was


def test_a_variant_runs_at_its_own_n_of_every_kind_else_at_the_kinds():
    config = validated(
        variant_study_config(
            workers=[1, 2],
            train={"batch_size": 8},
            accuracy={"workers": [2]},
            scaling={"steps": 20, "warmup_steps": 5, "workers": [1]},
        )
    )
    for kind in (run_kinds.ACCURACY, run_kinds.SCALING):
        assert run_kinds.arm_workers(config, "quick", kind) == [2]
    assert run_kinds.arm_workers(config, "bounded", run_kinds.ACCURACY) == run_kinds.arm_workers(
        config, "allreduce", run_kinds.ACCURACY
    )
    assert (
        run_kinds.arm_workers(config, "bounded", run_kinds.SCALING)
        == [1]
        == run_kinds.arm_workers(config, "ssp", run_kinds.SCALING)
    )
    assert run_kinds.arm_workers(config, "allreduce", run_kinds.ACCURACY) == [2]


def test_a_variants_run_config_is_its_strategys_under_its_study_naming_it():
    config = validated(variant_study_config(train={"base_lr": 0.3}))
    quick = run_config(config, "quick")
    assert quick[VARIANT_KEY] == {"name": "quick", "strategy": "allreduce"} and VARIANT_KEY == "variant"
    assert quick == {**run_config(variant_study(config, "quick"), "allreduce"), VARIANT_KEY: quick[VARIANT_KEY]}
    assert (quick["train"]["batch_size"], quick["train"]["warmup_steps"], quick["train"]["base_lr"]) == (16, 3, 0.3)
    assert quick["strategy_params"] == {"allreduce": {}}
    bounded = run_config(config, "bounded")
    assert bounded["strategy_params"] == {"ssp": {"shards": 1, "staleness": 2}}
    assert bounded[VARIANT_KEY] == {"name": "bounded", "strategy": "ssp"}
    # a strategy's own run config names no variant, and is what it was: the study's train keys
    plain = run_config(config, "allreduce")
    assert VARIANT_KEY not in plain and plain["train"] == config["train"]
    assert VARIANT_KEY not in run_config(config, "ssp")
    # a scaling run of a variant is a scaling run, of the variant
    scaling = run_config(
        validated(variant_study_config(train={"batch_size": 8}, scaling={"steps": 20, "warmup_steps": 5})),
        "quick",
        run_kinds.SCALING,
    )
    assert scaling["run_kind"] == "scaling" and scaling["train"]["max_steps"] == 25
    assert scaling[VARIANT_KEY]["name"] == "quick"


# --- check_config ---------------------------------------------------------------------------


def test_an_unknown_name_in_strategies_lists_the_variants_too():
    message = error_of(variant_study_config(strategies=["allreduce", "telepathy"]))
    assert "config key 'strategies[1]': unknown strategy 'telepathy'" in message
    assert message.endswith("ssp, or a variant: bounded, quick"), message
    # without variants, the registered strategies only
    assert "variant" not in error_of(tiny_study(strategies=["allreduce", "telepathy"]))


def test_a_name_of_strategies_may_be_a_variant_only_when_there_is_one():
    assert validated(variant_study_config())["strategies"] == ["allreduce", "quick", "bounded"]
    message = error_of(tiny_study(strategies=["allreduce", "quick"]))
    assert "'strategies[1]': unknown strategy 'quick'" in message


def test_a_variant_may_not_take_a_registered_strategys_name():
    message = error_of(tiny_study(variants={"gossip": {"strategy": "allreduce"}}))
    assert "config key 'variants.gossip': 'gossip' is a registered strategy's name" in message


def test_a_variants_strategy_must_be_registered():
    # listed in strategies or not (tiny_study's are allreduce only): a variant's typo is refused
    message = error_of(tiny_study(variants={"v": {"strategy": "telepathy"}}))
    assert "config key 'variants.v.strategy': unknown strategy 'telepathy'; allowed: allreduce" in message


@pytest.mark.parametrize(
    "variant, words",
    [
        # its knobs, checked at its N as its strategy's are
        ({"strategy": "ssp", "strategy_params": {"staleness": -1}}, ["staleness", "-1", "minimum of 0"]),
        ({"strategy": "ssp", "strategy_params": {"stalenes": 1}}, ["stalenes", "unknown knob", "'ssp'"]),
        # its train keys against each other, as the study's are
        ({"strategy": "allreduce", "train": {"nesterov": True, "momentum": 0.0}}, ["nesterov", "needs momentum"]),
        # its batch against the data set (1800 training images of the tiny study)
        (
            {"strategy": "allreduce", "workers": [2], "train": {"batch_size": 1000}},
            ["train.batch_size", "global batch of 2000", "1800 training images"],
        ),
    ],
)
def test_a_listed_variant_is_checked_as_the_study_it_runs_under(variant, words):
    message = error_of(tiny_study(strategies=["allreduce", "v"], variants={"v": variant}))
    assert all(word in message for word in words), message
    # the control: the same variant, not listed, runs nowhere
    assert validated(tiny_study(strategies=["allreduce"], variants={"v": variant}))


def test_a_variants_knobs_hold_at_its_n_only():
    """ps_backup's k backups must be below N: k = 2 holds for a variant at N = 4, not for one
    at the study's N = 1, 2, 4."""
    study = {"workers": [1, 2, 4], "strategies": ["allreduce", "v"]}
    four = {"strategy": "ps_backup", "workers": [4], "strategy_params": {"backup": 2}}
    assert validated(tiny_study(**study, variants={"v": four}))
    message = error_of(tiny_study(**study, variants={"v": {**four, "workers": None}}))
    assert "backup" in message and "N=2 is in workers" in message


def test_a_study_of_variants_only_is_checked_and_counts_its_data():
    config = tiny_study(strategies=["quick"], variants={"quick": QUICK})
    checked = validate_schema(copy.deepcopy(config))
    assert check_config(checked, check_data=False) is None
    counted = check_config(validate_schema(copy.deepcopy(config)))
    assert counted == check_config(validate_schema(tiny_study())) and counted > 0


# --- the DAG ---------------------------------------------------------------------------------


def test_a_dry_run_plans_each_variants_runs_at_its_own_n_with_its_run_config(tmp_path):
    study = variant_study_config(
        seeds=[0, 1],
        train={"batch_size": 8},
        scaling={"steps": 20, "warmup_steps": 5, "seeds": [3]},
    )
    result = dry_run(tmp_path, study, "--cores", "2", "--printshellcmds")
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy, scaling = jobs_of(result.stdout, "train"), jobs_of(result.stdout, "train_scaling")
    # quick at N = 2 only; bounded and allreduce at both N of the study
    cells = {(name, n) for name in ("allreduce", "bounded") for n in (1, 2)} | {("quick", 2)}
    assert set(accuracy) == {(name, n, seed) for name, n in cells for seed in (0, 1)}
    assert set(scaling) == {(name, n, 3) for name, n in cells}
    assert job_counts(result.stdout)["evaluate"] == len(accuracy) == 10
    assert "output: results/runs/quick/n2/seed0/metrics.json" in accuracy[("quick", 2, 0)]
    assert "output: results/runs/scaling/quick/n2/seed3/metrics.json" in scaling[("quick", 2, 3)]
    # the job's run config: its strategy's, with its keys, naming it; the train command gets its name
    quick = run_config_of(accuracy[("quick", 2, 1)])
    assert quick[VARIANT_KEY] == {"name": "quick", "strategy": "allreduce"}
    assert (quick["train"]["batch_size"], quick["train"]["warmup_steps"]) == (16, 3)
    assert "--strategy quick" in accuracy[("quick", 2, 1)]
    bounded = run_config_of(accuracy[("bounded", 1, 0)])
    assert bounded["strategy_params"] == {"ssp": {"shards": 1, "staleness": 2}}
    plain = run_config_of(accuracy[("allreduce", 2, 1)])
    assert VARIANT_KEY not in plain and plain["train"]["batch_size"] == 8
    # a local run reserves its strategy's processes: ssp's bounded at N = 2 has a shard beside
    assert "threads: 2" in accuracy[("quick", 2, 0)] and "threads: 2" in accuracy[("bounded", 1, 0)]


@pytest.mark.slow
def test_the_at_scale_dry_run_plans_goyal_at_n1_and_dai_at_n16_only(tmp_path):
    """config/at-scale.yaml: part 1's strategies at N = 4, 16, 64, Goyal's variants (goyal_*)
    at N = 1 only, Dai's (ssp_*) at N = 16 only, 3 seeds each: 99 train and evaluate jobs."""
    result = shipped_study_dry_run(tmp_path, AT_SCALE, args=("--cores", "2", "--printshellcmds"))
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = jobs_of(result.stdout, "train")
    cells = {(name, n) for name, n, _ in jobs}
    assert {seed for *_, seed in jobs} == {0, 1, 2} and len(jobs) == 3 * len(cells)
    assert {(name, n) for name, n in cells if name.startswith("ssp_")} == {
        (f"ssp_{bound}", 16) for bound in ("s0", "s1", "s2", "s4", "s8", "unbounded")
    }
    goyal = {(name, n) for name, n in cells if name.startswith("goyal_")}
    assert len(goyal) == 12 and {n for _, n in goyal} == {1}
    part_one = {(name, n) for name, n in cells if not name.startswith(("ssp_", "goyal_"))}
    assert part_one == {
        (name, n) for name in ("allreduce", "ps_backup", "ps_async", "gossip", "allreduce_onebit") for n in (4, 16, 64)
    }
    counts = job_counts(result.stdout)
    assert counts["train"] == counts["evaluate"] == 99
    ssp = run_config_of(jobs[("ssp_s0", 16, 2)])
    assert ssp[VARIANT_KEY] == {"name": "ssp_s0", "strategy": "ssp"}
    assert ssp["strategy_params"] == {"ssp": {"shards": 4, "staleness": 0}}
    assert (ssp["train"]["max_steps"], ssp["train"]["warmup_steps"], ssp["train"]["eval_every_steps"]) == (200, 80, 20)
    goyal = run_config_of(jobs[("goyal_b1024_rule", 1, 0)])
    assert (goyal["train"]["batch_size"], goyal["train"]["max_steps"], goyal["train"]["warmup_steps"]) == (
        1024,
        None,
        None,
    )


def test_the_at_scale_variants_run_at_their_own_n_with_their_keys():
    """The shipped study's variants as the rules plan them (the dry run above, without Snakemake)."""
    config = at_scale()
    check_config(copy.deepcopy(config), check_data=False)
    variants = [name for name in config["strategies"] if name in config["variants"]]
    assert {name.split("_")[0] for name in variants} == {"goyal", "ssp"}
    for name in variants:
        n = [16] if name.startswith("ssp_") else [1]
        assert run_kinds.arm_workers(config, name, run_kinds.ACCURACY) == n, name
    assert run_kinds.arm_workers(config, "allreduce", run_kinds.ACCURACY) == [4, 16, 64]
    unbounded = run_config(config, "ssp_unbounded")
    assert unbounded["strategy_params"]["ssp"] == {"shards": 4, "staleness": None}
    # part 1's recipe at half its base rate, the same at every bound
    assert unbounded["train"] == {**run_config(config, "ps_async")["train"], "base_lr": 0.05}
    assert {run_config(config, name)["train"]["base_lr"] for name in variants if name.startswith("ssp_")} == {0.05}
    half = run_config(config, "goyal_b64_half")["train"]
    assert (half["batch_size"], half["lr_scaling"], half["base_lr"], half["evals_per_epoch"]) == (64, "none", 0.025, 10)
    assert (half["max_steps"], half["warmup_steps"], half["eval_every_steps"], half["epochs"]) == (None, None, None, 3)


# --- a variant's run -------------------------------------------------------------------------


def test_a_variants_runspec_names_the_variant_and_runs_its_strategy():
    config = validated(variant_study_config(train={"batch_size": 8}, scaling={"steps": 20, "warmup_steps": 5}))
    spec = RunSpec("allreduce", 2, 1, run_config(config, "quick"), "", "")
    assert (spec.variant, spec.run_name) == ("quick", "quick-n2-seed1")
    scaling = RunSpec("allreduce", 2, 1, run_config(config, "quick", run_kinds.SCALING), "", "")
    assert scaling.run_name == "quick-n2-seed1-scaling"
    bounded = RunSpec("ssp", 2, 0, run_config(config, "bounded"), "", "")
    assert bounded.strategy_params()["staleness"] == 2 and bounded.processes() == 3
    plain = RunSpec("allreduce", 2, 1, run_config(config, "allreduce"), "", "")
    assert (plain.variant, plain.run_name) == (None, "allreduce-n2-seed1")


def test_metrics_json_records_the_variant_beside_its_strategy():
    from dtstudy.training.measurements import summarize

    config = validated(variant_study_config())
    for name, strategy, variant in (("quick", "allreduce", "quick"), ("allreduce", "allreduce", None)):
        spec = RunSpec(strategy, 2, 0, run_config(config, name), "", "")
        metrics = summarize(spec, [worker_log([0.01] * 12)], [], 1.0, {}, {}, {}, {})
        assert (metrics["strategy"], metrics["variant"], metrics["run_name"]) == (strategy, variant, f"{name}-n2-seed0")


def test_the_mlflow_tags_name_the_variant():
    from dtstudy.tracking.live_run import run_tags

    config = validated(variant_study_config())
    tags = run_tags(RunSpec("ssp", 2, 0, run_config(config, "bounded"), "", ""))
    assert tags == {"strategy": "ssp", "workers": "2", "seed": "0", "variant": "bounded"}
    assert "variant" not in run_tags(RunSpec("ssp", 2, 0, run_config(config, "ssp"), "", ""))


@pytest.mark.parametrize("whole_study", [False, True])
def test_the_train_command_runs_a_variants_run_as_its_strategy(tmp_path, monkeypatch, whole_study):
    """`dtstudy train --strategy quick` with the run config the rule passes (or the whole study
    config): a run of allreduce named for quick, with quick's keys."""
    import dtstudy.launch.launcher as launcher
    from dtstudy.__main__ import main

    submitted = []

    def fake_job(spec, job_dir, time_limit_min=None):
        submitted.append((spec, job_dir))
        return {"throughput": 1.0, "final_val_top1": 0.5, "wall_time_s": 1.0}

    monkeypatch.setattr(launcher, "run_training_job", fake_job)
    study = validated(variant_study_config())
    config = study if whole_study else run_config(study, "quick")
    command = ["train", "--config-json", to_json(config), "--strategy", "quick", "--workers", "2", "--seed", "1"]
    assert main([*command, "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--no-tracking"]) == 0
    [(spec, job_dir)] = submitted
    assert (spec.strategy, spec.variant, spec.run_name) == ("allreduce", "quick", "quick-n2-seed1")
    assert spec.config["train"]["batch_size"] == 16 and spec.config == run_config(study, "quick")
    assert str(job_dir) == str(spec.folder.job_logs)


@pytest.fixture(scope="module")
def emulated_variant_run(tmp_path_factory, tiny_data):
    """metrics.json of one emulated run of a variant through the train command: allreduce at
    N = 2, 12 updates, warm-up over 3 of them, a grid point every 4 steps."""
    from dtstudy.__main__ import main

    out = tmp_path_factory.mktemp("variant-run") / "run"
    study = validated(
        tiny_study(
            strategies=["allreduce", "quick"],
            launcher={"cluster": "emulate"},
            emulate=EMULATE,
            variants={
                "quick": {
                    **QUICK,
                    "train": {**QUICK["train"], "max_steps": 12, "eval_every_steps": 4, "eval_images": 64},
                }
            },
        )
    )
    command = ["train", "--config-json", to_json(run_config(study, "quick")), "--strategy", "quick"]
    assert (
        main([*command, "--workers", "2", "--seed", "0", "--data", str(tiny_data), "--out", str(out), "--no-tracking"])
        == 0
    )
    return json.loads((out / "metrics.json").read_text())


def test_an_emulated_variants_run_trains_its_strategy_with_its_keys(emulated_variant_run):
    metrics = emulated_variant_run
    assert (metrics["strategy"], metrics["variant"], metrics["run_name"]) == ("allreduce", "quick", "quick-n2-seed0")
    assert (metrics["steps"], metrics["per_worker_batch"], metrics["global_batch"]) == (12, 16, 32)
    # the warm-up in updates (of 56 an epoch: warmup_epochs 1 would be the whole run)
    assert (metrics["lr_schedule"]["warmup_steps"], metrics["lr_schedule"]["total_steps"]) == (3, 12)
    # a grid point every 4 steps of the epoch on the first 64 validation images, then the whole split
    grid = metrics["val_grid"]
    assert [point["step"] for point in grid][:3] == [4, 8, 12] and {point["step"] for point in grid} == {4, 8, 12}
    assert {point["images"] for point in grid} == {64}
    assert [(point["step"], point["images"]) for point in metrics["val"]] == [(12, 200)]


def test_a_run_stopped_by_max_steps_on_the_grid_scores_its_last_point_once(emulated_variant_run):
    assert [point["step"] for point in emulated_variant_run["val_grid"]] == [4, 8, 12]


# --- the runs frame and the tables -----------------------------------------------------------


def write_variant_run(root, name: str, strategy: str, workers: int, seed: int, top1: float, **metrics):
    """A hand-made accuracy run (test_aggregate.write_run) of `name` (a variant of `strategy`, or
    `strategy` itself): results/runs/<name>/..., metrics.json naming both, and `metrics`."""
    run_dir = write_run(root, name, workers, seed, windows=[100.0 * workers] * 5, top1=top1)
    path = run_dir / "metrics.json"
    recorded = json.loads(path.read_text())
    recorded.update(strategy=strategy, variant=None if name == strategy else name, **metrics)
    path.write_text(json.dumps(recorded))
    return run_dir


#: (name, strategy, top1 per seed, final val top-1 per seed, lr_schedule, strategy_params)
RUNS = [
    ("allreduce", "allreduce", (0.80, 0.82), (0.79, 0.81), {"rule": "linear", "peak_lr": 0.1}, {}),
    ("goyal_half", "allreduce", (0.70, 0.74), (0.70, 0.72), {"rule": "none", "peak_lr": 0.05}, {}),
    ("ssp_s0", "ssp", (0.78, 0.80), (0.77, 0.79), {"rule": "linear", "peak_lr": 0.1}, {"staleness": 0}),
    ("ssp_unbounded", "ssp", (0.60, 0.64), (0.61, 0.63), {"rule": "linear", "peak_lr": 0.1}, {"staleness": None}),
]


@pytest.fixture
def variant_runs(tmp_path):
    return [
        write_variant_run(
            tmp_path,
            name,
            strategy,
            workers,
            seed,
            top1[seed],
            final_val_top1=val[seed],
            lr_schedule=schedule,
            strategy_params={"shards": 1, **knobs} if strategy == "ssp" else knobs,
        )
        for name, strategy, top1, val, schedule, knobs in RUNS
        for workers in (1, 2)
        for seed in (0, 1)
    ]


def test_a_variants_runs_are_a_row_of_their_own_with_their_strategy_beside(variant_runs):
    runs = load_runs(variant_runs)  # four names at the same (N, seed): no duplicates
    assert len(runs) == 16
    by_name = runs.drop_duplicates("strategy").set_index("strategy")
    assert list(by_name.index) == [name for name, *_ in RUNS]
    assert dict(by_name["base_strategy"]) == {name: strategy for name, strategy, *_ in RUNS}
    assert dict(by_name["family"]) == {name: FAMILY_OF[strategy] for name, strategy, *_ in RUNS}
    # ssp's shard is an extra process of each of its variants' runs
    assert list(by_name["extra_processes"].fillna(0)) == [0, 0, 1, 1]


def test_the_accuracy_table_reads_what_tells_the_variants_apart(variant_runs):
    order = [name for name, *_ in RUNS]
    table = accuracy_table(load_runs(variant_runs), order, load_run_metrics(variant_runs))
    assert list(table.columns) == ACCURACY_COLUMNS
    assert {"base_strategy", "lr_rule", "peak_lr", "val_top1", "staleness_bound"} <= set(ACCURACY_COLUMNS)
    assert [(r.strategy, r.workers) for r in table.itertuples()] == [(name, n) for name in order for n in (1, 2)]
    rows = {(r["strategy"], r["workers"]): r for _, r in table.iterrows()}
    half = rows[("goyal_half", 2)]
    assert (half["base_strategy"], half["family"]) == ("allreduce", FAMILY_OF["allreduce"]) != ("allreduce", "unknown")
    assert (half["lr_rule"], half["peak_lr"]) == ("none", 0.05)
    assert half["val_top1"] == pytest.approx(0.71) and half["top1"] == pytest.approx(0.72)
    # paired by seed with allreduce's runs at the same N: (0.70 - 0.80 + 0.74 - 0.82) / 2
    assert half["top1_vs_allreduce"] == pytest.approx(-0.09) and half["paired_seeds"] == 2
    assert (rows[("ssp_s0", 1)]["family"], rows[("ssp_s0", 1)]["base_strategy"]) == (FAMILY_OF["ssp"], "ssp")
    assert rows[("ssp_s0", 1)]["staleness_bound"] == 0.0 and rows[("ssp_unbounded", 1)]["staleness_bound"] == math.inf
    assert math.isnan(rows[("allreduce", 1)]["staleness_bound"]) and rows[("allreduce", 1)]["lr_rule"] == "linear"


def test_the_scaling_table_gives_a_variant_its_strategys_family(variant_runs):
    table = scaling_table(load_runs(variant_runs))
    families = dict(zip(table["strategy"], table["family"]))
    assert families == {name: FAMILY_OF[strategy] for name, strategy, *_ in RUNS}


# --- warmup_steps and eval_every_steps -------------------------------------------------------


@pytest.mark.parametrize(
    "warmup_steps, steps_per_epoch, warmup",
    [
        (None, 100, 100),  # warmup_epochs: 1 epoch, whatever its steps
        (None, 40, 40),
        (7, 100, 7),  # in updates, whatever the epoch's steps (N)
        (7, 40, 7),
        (0, 100, 0),  # none: 0 is no null
        (500, 100, 300),  # never past the run's end
    ],
)
def test_the_warm_up_in_updates_replaces_the_warm_up_in_epochs(warmup_steps, steps_per_epoch, warmup):
    from dtstudy.training.lr_schedule import make_schedule

    train = {**SCHEDULE_TRAIN, "warmup_steps": warmup_steps}
    schedule = make_schedule(train, update_batch=256, steps_per_epoch=steps_per_epoch)
    assert (schedule.warmup_steps, schedule.total_steps) == (warmup, 3 * steps_per_epoch)
    if 0 < warmup < schedule.total_steps:
        # the peak (0.05 at the reference batch) at the warm-up's last step, not before
        assert schedule(warmup - 1) == pytest.approx(0.05) and schedule(warmup - 2) < 0.05


def grid_points(steps_per_epoch: int, grid_every: int | None, **train) -> list[int]:
    """The steps of an epoch after which grid_point_due asks for a grid evaluation."""
    from dtstudy.training.loop import grid_point_due

    run = SimpleNamespace(
        grid_every=grid_every,
        steps_per_epoch=steps_per_epoch,
        spec=SimpleNamespace(config={"train": {"evals_per_epoch": 1, "eval_every_steps": None, **train}}),
    )
    return [step + 1 for step in range(steps_per_epoch) if grid_point_due(run, step)]


def test_a_grid_point_every_eval_every_steps_of_an_epoch_whatever_its_length():
    # the epoch's end is its own point (validate), not also a grid point
    assert grid_points(50, 20, eval_every_steps=20) == [20, 40]
    assert grid_points(1687, 200, eval_every_steps=200) == [200, 400, 600, 800, 1000, 1200, 1400, 1600]
    assert grid_points(100, 20, eval_every_steps=20) == [20, 40, 60, 80]
    assert grid_points(10, 20, eval_every_steps=20) == []  # an epoch shorter than the grid: its end only
    # the control: evals_per_epoch's grid, evals_per_epoch - 1 points inside the epoch
    assert grid_points(1687, 168, evals_per_epoch=10) == [168 * k for k in range(1, 10)]
    assert grid_points(1687, None) == []


def test_the_budget_counts_the_grids_points_in_steps():
    from dtstudy.projection.budget import Images, eval_images

    images = Images(train=1800, val=200, source="test")
    # 28 steps an epoch at N = 2 (900 images, batches of 32): points at 5, 10, ..., 25 on 50 images, then the split
    config = validated(tiny_study(train={"eval_every_steps": 5, "eval_images": 50}))
    assert eval_images(config, images, 28, 2) == pytest.approx((5 * 50 + 200) / 2)
    # the same points whatever N: 28 steps at N = 1 too
    assert eval_images(config, images, 28, 1) == pytest.approx(5 * 50 + 200)
    # the controls: without it, evals_per_epoch's grid, or the whole split once an epoch
    grid = validated(tiny_study(train={"evals_per_epoch": 4, "eval_images": 50}))
    assert eval_images(grid, images, 28, 2) == pytest.approx((4 * 50 + 200) / 2)
    assert eval_images(validated(tiny_study()), images, 28, 2) == pytest.approx(200 / 2)


# --- a SLURM study's predicted cost -----------------------------------------------------------


def slurm_study(strategies: list[str], **launcher) -> dict:
    """config/cluster.yaml (SLURM, launcher.hardware h100_ib400) with `strategies` and the
    variants twin and twin2, each an allreduce under another name."""
    from test_budget import cluster_config

    config = cluster_config(**launcher)
    config.update(strategies=strategies, variants={name: {"strategy": "allreduce"} for name in ("twin", "twin2")})
    return validate_schema(config)


def test_the_budget_report_costs_a_variant_as_its_strategy():
    from dtstudy.projection import budget

    alone = slurm_study(["allreduce"])
    images = budget.study_images(alone, None)
    plain = budget.report(alone, images)["profiles"]["h100_ib400"]["total_gpu_hours"]
    assert plain > 0
    twice = budget.report(slurm_study(["allreduce", "twin"]), images)["profiles"]["h100_ib400"]
    assert twice["total_gpu_hours"] == pytest.approx(2 * plain)
    assert twice["by_strategy_gpu_hours"] == {"allreduce": pytest.approx(plain), "twin": pytest.approx(plain)}
    # a variant at one N of the study's costs that N's runs only
    one_n = slurm_study(["allreduce", "twin"])
    one_n["variants"]["twin"]["workers"] = [8]
    costs = budget.study_costs(one_n, images, budget.cluster_costing(one_n))
    assert {cost.workers for cost in costs if cost.strategy == "twin"} == {8}
    assert {cost.workers for cost in costs if cost.strategy == "allreduce"} == set(one_n["workers"])


def test_the_data_set_is_counted_once_however_many_variants(monkeypatch):
    """Every listed variant is checked against the data set (its batch at its N), but the data
    set is counted once: on a cluster that walks an ImageNet folder, which must not happen once a
    variant. A variant's batch too large for the count is still refused, naming the variant."""
    import dtstudy.checks as checks

    counts = []
    monkeypatch.setattr(checks, "count_training_images", lambda config: counts.append(1) or 1800)
    quick = {"strategy": "allreduce", "workers": [2], "train": {"batch_size": 16}}
    study = tiny_study(strategies=["allreduce", "quick", "slow"], variants={"quick": quick, "slow": quick})
    assert check_config(validate_schema(study)) == 1800
    assert counts == [1]
    huge = {"strategy": "allreduce", "workers": [2], "train": {"batch_size": 1000}}
    with pytest.raises(ConfigError, match=r"'variants\.huge'.*train\.batch_size"):
        check_config(validate_schema(tiny_study(strategies=["allreduce", "huge"], variants={"huge": huge})))


def test_a_variants_runs_count_against_the_gpu_hour_budget(monkeypatch):
    from test_budget import IMAGENET_TRAIN

    import dtstudy.checks as checks
    from dtstudy.projection import budget

    # the data set (ImageNet on a cluster) counted, not walked
    monkeypatch.setattr(checks, "count_training_images", lambda config: IMAGENET_TRAIN)
    alone = slurm_study(["allreduce"])
    where = budget.cluster_costing(alone)
    cost = budget.total_gpu_hours(budget.study_costs(alone, budget.study_images(alone, IMAGENET_TRAIN), where))
    assert check_config(slurm_study(["allreduce"], gpu_hour_budget=1.5 * cost)) == IMAGENET_TRAIN
    # the control: two registered strategies of that cost are refused
    with pytest.raises(ConfigError, match="'launcher.gpu_hour_budget'"):
        check_config(slurm_study(["allreduce", "allreduce_fp16"], gpu_hour_budget=1.5 * cost))
    with pytest.raises(ConfigError, match="'launcher.gpu_hour_budget'"):
        check_config(slurm_study(["allreduce", "twin"], gpu_hour_budget=1.5 * cost))
    # a study of variants only: theirs together
    with pytest.raises(ConfigError, match="'launcher.gpu_hour_budget'"):
        check_config(slurm_study(["twin", "twin2"], gpu_hour_budget=1.5 * cost))


# --- found on the way: run count, projection, errors ---------------------------------------------------


def test_the_run_count_counts_each_variant_at_its_own_n(capsys):
    from dtstudy.__main__ import main

    config = load_config(AT_SCALE)
    planned = sum(
        len(run_kinds.arm_workers(config, name, run_kinds.ACCURACY)) * len(run_kinds.seeds(config, run_kinds.ACCURACY))
        for name in config["strategies"]
    )
    assert planned == 99  # what the dry run plans (test_the_at_scale_dry_run_plans_goyal_at_n1_and_dai_at_n16_only)
    assert main(["check-config", "--config", str(AT_SCALE)]) == 0
    assert "config OK: 99 training runs" in capsys.readouterr().out
    assert run_kinds.run_count(config, run_kinds.ACCURACY) == 99


def test_the_projection_takes_a_study_with_a_variant(tmp_path):
    """The project rule projects the study's strategies and leaves a variant out (its own recipe
    is not the study's); before, a variant's name raised KeyError in it."""
    from test_projection import recorded_runs

    from dtstudy.projection import project

    metrics = recorded_runs(tmp_path)
    ring_run = next(path for path in metrics if "g2" in str(path))
    recorded = json.loads(Path(ring_run).read_text())
    Path(ring_run).write_text(json.dumps({**recorded, "variant": "ring"}))  # gossip's run is the variant's
    config = {
        "model": "lenet5",
        "strategies": ["allreduce", "ring"],
        "variants": {"ring": {"strategy": "gossip", "workers": [2], "train": {}, "strategy_params": {}}},
        "strategy_params": {},
        "stragglers": {},
        "projection": {"workers": [1, 2, 64], "hardware": "this_machine"},
    }
    out = [str(tmp_path / name) for name in ("projection.csv", "projection.md", "projection.png")]
    rows = project.run_study(metrics, str(tmp_path / "bench.json"), config, *out)
    assert {("allreduce", n) for n in (1, 2, 64)} <= {(row["strategy"], row["workers"]) for row in rows}
    assert {row["strategy"] for row in rows} == {"allreduce"}  # neither the variant nor its run's strategy


def test_a_variants_knob_error_names_the_variants_key():
    message = error_of(
        tiny_study(
            strategies=["allreduce", "v"], variants={"v": {"strategy": "ssp", "strategy_params": {"staleness": -1}}}
        )
    )
    assert "staleness" in message and "-1" in message
    assert "variants.v" in message, message


# --- strategy_train: a registered strategy's own train keys, its row keeping its name -------------


def test_strategy_train_defaults_to_none_and_its_keys_are_checked_as_train_is():
    assert validate_schema(tiny_study())["strategy_train"] == {}
    for train, words in (
        ({"bach_size": 8}, ["'strategy_train.ssp.bach_size'", "unknown key", "batch_size"]),
        ({"base_lr": -0.1}, ["'strategy_train.ssp.base_lr'"]),
        ({"lr_scaling": "cubic"}, ["'strategy_train.ssp.lr_scaling'", "'cubic'"]),
    ):
        with pytest.raises(ConfigError) as err:
            validate_schema(tiny_study(strategy_train={"ssp": train}))
        assert all(word in str(err.value) for word in words), str(err.value)
    # the control: a key of train is taken
    assert validate_schema(tiny_study(strategy_train={"ssp": {"base_lr": 0.05}}))["strategy_train"] == {
        "ssp": {"base_lr": 0.05}
    }


def test_strategy_train_names_a_registered_strategy():
    message = error_of(tiny_study(strategy_train={"telepathy": {"base_lr": 0.05}}))
    assert "config key 'strategy_train.telepathy': unknown strategy 'telepathy'; allowed: allreduce" in message
    # a variant's name is not a strategy's: its own train keys are its `train`
    message = error_of(variant_study_config(strategy_train={"quick": {"base_lr": 0.05}}))
    assert "'strategy_train.quick': unknown strategy 'quick'" in message


def test_a_strategys_runs_and_its_variants_train_under_its_strategy_train():
    config = validated(
        variant_study_config(
            train={"base_lr": 0.3},
            strategy_train={"allreduce": {"base_lr": 0.05, "warmup_steps": 7}, "ssp": {"momentum": 0.5}},
        )
    )
    own = run_config(config, "allreduce")
    assert (own["train"]["base_lr"], own["train"]["warmup_steps"], own["train"]["momentum"]) == (0.05, 7, 0.9)
    assert VARIANT_KEY not in own  # its row keeps its name
    # a variant of it: the strategy's keys under the variant's own (quick sets warmup_steps 3)
    quick = run_config(config, "quick")
    assert (quick["train"]["base_lr"], quick["train"]["warmup_steps"], quick["train"]["batch_size"]) == (0.05, 3, 16)
    bounded = run_config(config, "bounded")  # ssp's
    assert (bounded["train"]["momentum"], bounded["train"]["base_lr"]) == (0.5, 0.3)
    # the control: a strategy without any trains under the study's keys, and the study is unchanged
    plain = validated(variant_study_config(train={"base_lr": 0.3}))
    assert run_config(config, "gossip")["train"] == config["train"] == run_config(plain, "bounded")["train"]
    assert run_config(plain, "allreduce")["train"]["base_lr"] == 0.3
    assert config["train"]["base_lr"] == 0.3


def test_a_strategy_with_strategy_train_is_checked_as_the_study_it_runs_under():
    message = error_of(tiny_study(strategy_train={"allreduce": {"nesterov": True, "momentum": 0.0}}))
    assert "config key 'strategy_train.allreduce' (checked as its own study" in message
    assert "nesterov" in message and "needs momentum" in message, message
    message = error_of(tiny_study(strategy_train={"allreduce": {"batch_size": 1000}}))
    assert "'strategy_train.allreduce'" in message and "1800 training images" in message, message
    # the control: the same keys for a strategy the study does not run are not its runs' keys
    assert validated(tiny_study(strategy_train={"gossip": {"batch_size": 1000}}))


def test_the_budget_costs_a_strategy_under_its_strategy_train():
    from dtstudy.projection import budget

    alone = slurm_study(["allreduce"])
    images = budget.study_images(alone, None)
    plain = budget.report(alone, images)["profiles"]["h100_ib400"]["total_gpu_hours"]
    own = slurm_study(["allreduce"])
    own["strategy_train"] = {"allreduce": {"epochs": 2 * alone["train"]["epochs"]}}
    study = slurm_study(["allreduce"])
    study["train"]["epochs"] *= 2
    hours = [budget.report(config, images)["profiles"]["h100_ib400"]["total_gpu_hours"] for config in (own, study)]
    assert hours[0] == pytest.approx(hours[1]) and hours[0] > 1.5 * plain


def test_the_at_scale_study_trains_the_asynchronous_servers_at_its_stated_rate():
    config = at_scale()
    assert run_config(config, "ps_async")["train"]["base_lr"] == config["strategy_train"]["ps_async"]["base_lr"]
    assert config["strategy_train"]["ps_async"]["base_lr"] < config["train"]["base_lr"]
    # the others at the study's, and ssp's bounds at the same rate as ps_async (unbounded ssp is ps_async)
    for name in ("allreduce", "ps_backup", "gossip", "allreduce_onebit"):
        assert run_config(config, name)["train"] == run_config(config, "allreduce")["train"]
    assert run_config(config, "ssp_unbounded")["train"] == run_config(config, "ps_async")["train"]
