# Helpers shared by the rules: paths and the config each step receives.
import os
import sys

# The rules call the installed package (`pip install -e .`) as `python -m dtstudy`; the
# Snakefile itself imports it from the source tree, so that config checks never run stale code.
sys.path.insert(0, os.path.join(workflow.basedir, "workflow"))

import dtstudy.config.study_config as study_config
from dtstudy.checks import check_config
from dtstudy.data.prepare import prepared_files
from dtstudy.runspec import RunSpec

# The schema (strict types, defaults filled in; not snakemake.utils.validate, which takes 64.0
# for an integer), then the checks a schema cannot do (registry, knobs for every N, data on
# disk): fail before any job starts. The data set is walked once, in the main Snakemake
# process, not again in every job.
study_config.validate_schema(config)
TRAIN_IMAGES = check_config(config, check_data=workflow.is_main_process)  # None in a job's parse

DATASET = config["dataset"]["name"]
DATA_DIR = f"results/data/{DATASET}"
TRACKING_MARKER = "results/mlflow.ready.json"
RUN_DIR = "results/runs/{strategy}/n{workers}/seed{seed}"
# Local runs reserve the cores their processes use; cluster runs get their own nodes.
TRAIN_ON_THIS_MACHINE = config["launcher"]["cluster"] == "local"
# Local evaluations run in the study's warm pool (dtstudy.launch.pool), like the training runs.
EVALUATE_FLAGS = "--via-pool" if TRAIN_ON_THIS_MACHINE and config["launcher"]["local_processes"] == "pool" else ""


wildcard_constraints:
    strategy="[a-z0-9_]+",
    workers=r"\d+",
    seed=r"\d+",


def train_threads(wildcards):
    """Cores of this machine a train job reserves: locally one per process, its N workers plus
    the strategy's extra ones (parameter-server shards; Snakemake caps it at --cores), so that
    two N=1 runs share 2 cores while an N=2 run has them to itself; on a cluster 1 (it waits)."""
    if not TRAIN_ON_THIS_MACHINE:
        return 1
    spec = RunSpec(wildcards.strategy, int(wildcards.workers), 0, study_config.run_config(config, wildcards.strategy), "", "")
    return spec.processes()


def config_json(section_keys=None):
    """The validated config (or some of its sections) as the JSON the CLI takes."""
    if section_keys is None:
        return study_config.to_json(config)
    return study_config.to_json({key: config[key] for key in section_keys})


def run_config_json(wildcards):
    """Only what one training run depends on, so unrelated config edits trigger no rerun."""
    return study_config.to_json(study_config.run_config(config, wildcards.strategy))


def folder_of(kind, name):
    """A params function: the folder holding input/output file `name` (lint: no hard-coded prefixes)."""
    return lambda wildcards, input, output: os.path.dirname(getattr({"input": input, "output": output}[kind], name))


def folders_of_inputs(name):
    """A params function: the folders of all input files named `name`."""
    return lambda wildcards, input: [os.path.dirname(path) for path in input[name]]


def all_runs(filename):
    """`filename` in every run folder of the study ("" = the folders themselves)."""
    return expand(
        os.path.join(RUN_DIR, filename),
        strategy=config["strategies"],
        workers=config["workers"],
        seed=config["seeds"],
    )


def print_cost_summary():
    """A SLURM study's predicted cost per run, per strategy and in total on the profiles its config
    names (`python -m dtstudy budget`'s table), when it starts; check_config has already held it
    to launcher.gpu_hour_budget."""
    if config["launcher"]["cluster"] != "slurm" or TRAIN_IMAGES is None:
        return
    from dtstudy.projection import budget

    images = budget.study_images(config, TRAIN_IMAGES)
    print(budget.render(budget.report(config, images), config["launcher"]["gpu_hour_budget"]), flush=True)


def stop_warm_pool():
    """Ask this study's warm pool (dtstudy.launch.pool) to exit; it would after a while idle anyway."""
    if TRAIN_ON_THIS_MACHINE:
        from dtstudy.launch.pool.client import pool_address, stop

        stop(pool_address())
