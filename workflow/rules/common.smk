# Helpers shared by the rules: paths and the config each step receives.
import os
import sys

# The rules call the installed package (`pip install -e .`) as `python -m dtstudy`; the
# Snakefile itself imports it from the source tree, so that config checks never run stale code.
sys.path.insert(0, os.path.join(workflow.basedir, "workflow"))

import dtstudy.config.run_kinds as run_kinds
import dtstudy.config.study_config as study_config
from dtstudy.checks import check_config
from dtstudy.common.run_folder import EVALUATION, METRICS, MODEL
from dtstudy.data.prepare import prepared_files
from dtstudy.launch_backends.registry import launch_backend
from dtstudy.runspec import RunSpec

# The schema (strict types, defaults filled in; not snakemake.utils.validate, which takes 64.0
# for an integer), then the checks a schema cannot do (registry, knobs for every N, data on
# disk): fail before any job starts. The data set is walked once, in the main Snakemake
# process, not again in every job.
# Snakemake's --config reads a list's or mapping's items as text (workers=[1,2]): typed first.
study_config.validate_schema(study_config.retype_command_line(config, workflow.config_settings.config))
TRAIN_IMAGES = check_config(config, check_data=workflow.is_main_process)  # None in a job's parse
# What launcher.cluster's kind means for the rules: where runs train, what their jobs ask for.
BACKEND = launch_backend(config)

DATASET = config["dataset"]["name"]
DATA_DIR = f"results/data/{DATASET}"
TRACKING_MARKER = "results/mlflow.ready.json"
RUNS_DIR = "results/runs"
# one folder per run of each kind (dtstudy.config.run_kinds): accuracy runs in
# results/runs/{strategy}/..., scaling runs in results/runs/scaling/{strategy}/...; the files in
# it are named by dtstudy.common.run_folder (METRICS, MODEL, EVALUATION)
RUN_DIRS = {
    kind: os.path.join(RUNS_DIR, run_kind.folder, "{strategy}/n{workers}/seed{seed}")
    for kind, run_kind in run_kinds.KINDS.items()
}
RUN_DIR = RUN_DIRS[run_kinds.ACCURACY]
SCALING_RUN_DIR = RUN_DIRS[run_kinds.SCALING]
# Local runs reserve the cores their processes use; cluster runs get their own nodes.
TRAIN_ON_THIS_MACHINE = BACKEND.processes_on_this_machine
# An emulated run (dtstudy.emulation) is one process of this machine (forked by the study's
# warm pool, launcher.local_processes: pool), no submitit job; its N logical workers take turns
# on torch's intra-op threads (Snakemake sets OMP_NUM_THREADS to the job's threads, which the
# pool's process takes), so it reserves EMULATED_RUN_THREADS cores. One, so that
# --cores all runs that many runs side by side: LeNet-5's per-worker batches of 8 lose on a
# second thread (the measurement: docs/records/measurements.json, emulated_run_threads).
EMULATED = BACKEND.emulated
EMULATED_RUN_THREADS = 1
# The projection calibrates the performance model on the study's measured throughput and this
# machine's gloo benchmark; an emulated study's throughput is that model's own output on a
# hardware profile, so projecting it would fit the model to itself: no project target.
PROJECTS_THE_STUDY = not EMULATED
# Local and emulated evaluations run in the study's warm pool (dtstudy.launch.pool), like the
# training runs: no interpreter start and torch import for each run's second of scoring.
EVALUATE_FLAGS = "--via-pool" if BACKEND.uses_pool(config["launcher"]) else ""
# On a GPU cluster an evaluation is a SLURM job with one of the runs' GPUs (their partition,
# account...); elsewhere it takes the profile's default resources.
EVALUATE_RESOURCES = BACKEND.evaluation_resources(config["launcher"])


wildcard_constraints:
    strategy="[a-z0-9_]+",
    workers=r"\d+",
    seed=r"\d+",


def train_threads(wildcards):
    """Cores of this machine a train job reserves: locally one per process, its N workers plus
    the strategy's extra ones (parameter-server shards; Snakemake caps it at --cores), so that
    two N=1 runs share 2 cores while an N=2 run has them to itself; emulated, the run's torch
    threads (EMULATED_RUN_THREADS) whatever its N; on a cluster 1 (it waits)."""
    if EMULATED:
        return EMULATED_RUN_THREADS
    if not TRAIN_ON_THIS_MACHINE:
        return 1
    spec = RunSpec(
        study_config.strategy_of(config, wildcards.strategy),
        int(wildcards.workers),
        0,
        study_config.run_config(config, wildcards.strategy),
        "",
        "",
    )
    return spec.processes()


def config_json(section_keys=None):
    """The validated config (or some of its sections) as the JSON the CLI takes."""
    if section_keys is None:
        return study_config.to_json(config)
    return study_config.to_json({key: config[key] for key in section_keys})


def run_config_json(kind):
    """A params function: only what one training run of `kind` computes with, so unrelated
    config edits trigger no rerun (its operational keys: operational_json)."""
    return lambda wildcards: study_config.to_json(
        study_config.results_part(study_config.run_config(config, wildcards.strategy, kind))
    )


def operational_json(kind):
    """A params function: how one training run of `kind` is launched and watched
    (study_config.OPERATIONAL_KEYS: time limits, requeues, the MLflow server...). It takes
    `input`, which makes it a derived param that Snakemake does not track: changing one of
    these keys retrains no finished run."""
    return lambda wildcards, input: study_config.to_json(
        study_config.operational_part(study_config.run_config(config, wildcards.strategy, kind))
    )


def folder_of(kind, name):
    """A params function: the folder holding input/output file `name` (lint: no hard-coded prefixes)."""
    return lambda wildcards, input, output: os.path.dirname(getattr({"input": input, "output": output}[kind], name))


def folders_of_inputs(name):
    """A params function: the folders of all input files named `name`."""
    return lambda wildcards, input: [os.path.dirname(path) for path in input[name]]


def runs_of(kind, filename):
    """`filename` in every run folder of `kind` (dtstudy.config.run_kinds; "" = the folders),
    none when the study makes no runs of that kind."""
    if kind not in run_kinds.kinds_run(config):
        return []
    # a variant (config `variants`) runs at its own N
    return [
        path
        for name in config["strategies"]
        for path in expand(
            os.path.join(RUN_DIRS[kind], filename),
            strategy=name,
            workers=run_kinds.arm_workers(config, name, kind),
            seed=run_kinds.seeds(config, kind),
        )
    ]


def all_runs(filename, tested_only=False):
    """`filename` in every run folder of the study, of every kind (`tested_only`: of the kinds
    whose final model the evaluate rule tests)."""
    kinds = [kind for kind in run_kinds.kinds_run(config) if run_kinds.KINDS[kind].tested or not tested_only]
    return [path for kind in kinds for path in runs_of(kind, filename)]


def throughput_runs(filename):
    """`filename` in the folders of the runs the scaling table and the projection time: the
    scaling runs, or the accuracy runs in a study without scaling runs."""
    return runs_of(run_kinds.throughput_kind(config), filename)


def print_cost_summary():
    """A SLURM study's predicted cost per run, per strategy and in total on the profiles its config
    names (`python -m dtstudy budget`'s table), when it starts; check_config has already held it
    to launcher.gpu_hour_budget."""
    if not BACKEND.predicts_costs or TRAIN_IMAGES is None:
        return
    from dtstudy.projection import budget

    images = budget.study_images(config, TRAIN_IMAGES)
    print(budget.render(budget.report(config, images), config["launcher"]["gpu_hour_budget"]), flush=True)


def stop_warm_pool():
    """Ask this study's warm pool (dtstudy.launch.pool) to exit; it would after a while idle anyway."""
    if TRAIN_ON_THIS_MACHINE:
        from dtstudy.launch.pool.client import pool_address, stop

        stop(pool_address())
