# Helpers shared by the rules: paths and the config each step receives.
import os
import sys

# The rules call the package as `python -m dtstudy`; make it importable without installing.
PACKAGE_DIR = os.path.join(workflow.basedir, "workflow")
sys.path.insert(0, PACKAGE_DIR)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_DIR, os.environ.get("PYTHONPATH")]))

import dtstudy.config as study_config

# The checks a schema cannot do (registry, knobs, data on disk): fail before any job starts.
study_config.check_config(config)

DATASET = config["dataset"]["name"]
DATA_DIR = f"results/data/{DATASET}"
TRACKING_MARKER = "results/mlflow.ready.json"
RUN_DIR = "results/runs/{strategy}/n{workers}/seed{seed}"


wildcard_constraints:
    strategy="[a-z0-9_]+",
    workers=r"\d+",
    seed=r"\d+",


def config_json(section_keys=None):
    """The validated config (or some of its sections) as the JSON the CLI takes."""
    if section_keys is None:
        return study_config.to_json(config)
    return study_config.to_json({key: config[key] for key in section_keys})


def run_config_json(wildcards):
    """Only what one training run depends on, so unrelated config edits trigger no rerun."""
    return study_config.to_json(study_config.run_config(config, wildcards.strategy))


def all_runs(filename):
    """`filename` in every run folder of the study ("" = the folders themselves)."""
    return expand(
        os.path.join(RUN_DIR, filename),
        strategy=config["strategies"],
        workers=config["workers"],
        seed=config["seeds"],
    )
