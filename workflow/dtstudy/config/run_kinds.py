"""The two kinds of training run a study makes, torch-free.

- scaling runs: every strategy at every N of `scaling.workers`, `scaling.warmup_steps`
  untimed steps then `scaling.steps` timed ones (tf_cnn_benchmarks', Horovod's and MLPerf's
  way of timing a step); they give the scaling table, and their final model is not tested
  (an accuracy after a few hundred steps is not a result);
- accuracy runs: full trainings (train.epochs) at the N and seeds of `accuracy`; they give
  the accuracy table and time-to-accuracy, and their final model is tested.

`scaling.steps: null` makes no scaling runs: the scaling table then comes from the accuracy
runs (the embedded laptop study trains fully at every N, and says so in config/config.yaml).
`workers` and `seeds` at the top level are every N the study runs at (the config checks
hold every N to the strategies' knobs and the data) and the seeds each kind takes by default;
a kind's `workers` picks some of them.

A kind is part of a run's identity: its folder (KINDS[kind].folder under results/runs/), its
run config (`run_config_changes`) and metrics.json's `kind`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dtstudy.errors import ConfigError

SCALING, ACCURACY = "scaling", "accuracy"
RUN_KIND_KEY = "run_kind"  # a scaling run's config says its kind; an accuracy run's has no such key


def _scaling_train(config: dict) -> dict:
    """A scaling run stops after warm-up + timed steps and leaves the warm-up out of its throughput
    (train.steady_state_skip; its timed windows are train.timing_window_steps long)."""
    scaling = config[SCALING]
    return {"max_steps": scaling["warmup_steps"] + scaling["steps"], "steady_state_skip": scaling["warmup_steps"]}


@dataclass(frozen=True)
class RunKind:
    """One kind of run: where its folders go, whether its final model is tested, what it changes in `train`."""

    name: str
    folder: str  # under results/runs/; "" = results/runs/<strategy>/..., the layout runs had before kinds
    tested: bool  # the evaluate rule scores its final model on the test split
    train_changes: Callable[[dict], dict]  # the study config -> the train keys this kind sets
    gives: str  # the tables it is the source of, in words


KINDS = {
    SCALING: RunKind(SCALING, "scaling", tested=False, train_changes=_scaling_train, gives="the scaling table"),
    # an accuracy run's config is the one every run had before there were kinds: a finished run is not rerun
    ACCURACY: RunKind(
        ACCURACY, "", tested=True, train_changes=lambda config: {}, gives="the accuracy table and time-to-accuracy"
    ),
}


def has_scaling_runs(config: dict) -> bool:
    return config[SCALING]["steps"] is not None


def kinds_run(config: dict) -> list[str]:
    """The kinds of run the study makes, scaling first."""
    return [SCALING, ACCURACY] if has_scaling_runs(config) else [ACCURACY]


def throughput_kind(config: dict) -> str:
    """The kind the scaling table (and the projection's calibration) takes its throughput from."""
    return SCALING if has_scaling_runs(config) else ACCURACY


def workers(config: dict, kind: str) -> list[int]:
    """N of the kind's runs: its own list, else every N of `workers`."""
    return config[kind]["workers"] or config["workers"]


def arm_workers(config: dict, name: str, kind: str) -> list[int]:
    """N of the runs of `kind` of a name of `strategies`: a variant's own N (config `variants`),
    else the kind's."""
    variant = config.get("variants", {}).get(name)
    if variant is not None and variant["workers"] is not None:
        return list(variant["workers"])
    return workers(config, kind)


def seeds(config: dict, kind: str) -> list[int]:
    return config[kind]["seeds"] or config["seeds"]


def run_count(config: dict, kind: str) -> int:
    return sum(len(arm_workers(config, name, kind)) for name in config["strategies"]) * len(seeds(config, kind))


def run_config_changes(config: dict, kind: str) -> dict:
    """What a run of `kind` changes in the run config of dtstudy.config.study_config.run_config."""
    changes = KINDS[kind].train_changes(config)
    return {} if not changes else {"train": changes, RUN_KIND_KEY: kind}


def kind_of_run_config(run_config: dict) -> str:
    """The kind of the run whose run config this is (no key: an accuracy run)."""
    return run_config.get(RUN_KIND_KEY, ACCURACY)


def check(config: dict) -> None:
    """The kinds' keys against each other and against `workers`; ConfigError naming the key."""
    scaling = config[SCALING]
    if scaling["steps"] is None:
        for key in ("workers", "seeds"):
            if scaling[key] is not None:
                raise ConfigError(
                    f"config key 'scaling.{key}': {scaling[key]} is set, but scaling.steps is null (no scaling runs: "
                    f"the throughput comes from the accuracy runs); allowed: null, or set scaling.steps"
                )
    elif scaling["warmup_steps"] > scaling["steps"]:
        # a run leaves out of its throughput at most its first half (dtstudy.training.measurements)
        raise ConfigError(
            f"config key 'scaling.warmup_steps': {scaling['warmup_steps']} is more than scaling.steps "
            f"{scaling['steps']}; allowed: 0 to scaling.steps (a run leaves at most its first half out of its timing)"
        )
    for kind in KINDS:
        for i, n in enumerate(config[kind]["workers"] or []):
            if n not in config["workers"]:
                raise ConfigError(
                    f"config key '{kind}.workers[{i}]': {n} is not in workers {config['workers']}; allowed: "
                    f"N of workers (every N the study runs at), or null for all of them"
                )
