"""The Snakemake DAG, checked with dry runs of the real Snakefile."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, job_counts, run_snakemake, tiny_study

from dtstudy.strategies.registry import STRATEGIES


def dry_run(tmp_path, config, *args):
    return run_snakemake(tmp_path, config, "--dry-run", *(args or ("--cores", "2")), timeout=300)


def shipped_study_dry_run(workdir, *configfiles, args=("--cores", "2")) -> subprocess.CompletedProcess:
    """A dry run of the checkout's Snakefile and shipped `configfiles` (on top of
    config/config.yaml, as in the checkout) in `workdir`, its own working folder: it plans the
    whole study whatever the checkout's results/ holds (a user who ran the study, then the tests)."""
    configs = [str(REPO / "config/config.yaml"), *(str(REPO / path) for path in configfiles)]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--dry-run",
            "--snakefile",
            str(REPO / "Snakefile"),
            "--directory",
            str(workdir),
            "--configfile",
            *configs,
            *args,
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_default_study_dag_runs_every_strategy(tmp_path):
    result = shipped_study_dry_run(tmp_path)
    assert result.returncode == 0, result.stderr
    default = yaml.safe_load((REPO / "config/config.yaml").read_text())
    assert default["strategies"] == list(STRATEGIES) and default["workers"] == [1, 2, 4]
    assert len(default["seeds"]) >= 2  # every table cell has a spread
    runs = len(STRATEGIES) * 3 * len(default["seeds"])
    assert job_counts(result.stdout) == {
        "prepare_data": 1,
        "init_tracking": 1,
        "train": runs,
        "evaluate": runs,
        "aggregate": 1,
        "commbench": 1,
        "project": 1,
        "all": 1,
    }


def test_embedded_full_study_dag_has_three_seeds_of_every_strategy(tmp_path):
    result = shipped_study_dry_run(tmp_path, "config/embedded-full.yaml")
    assert result.returncode == 0, result.stderr
    full = yaml.safe_load((REPO / "config/embedded-full.yaml").read_text())
    assert full["seeds"] == [0, 1, 2] and full["dataset"]["subset"] is None
    runs = len(STRATEGIES) * 3 * 3
    assert job_counts(result.stdout)["train"] == runs and job_counts(result.stdout)["evaluate"] == runs


@pytest.mark.parametrize("workers, seeds", [([1, 2, 4, 8], [0, 1, 2]), ([3], [7])])
def test_one_train_and_evaluate_job_per_strategy_workers_seed(tmp_path, workers, seeds):
    result = dry_run(tmp_path, tiny_study(workers=workers, seeds=seeds, train={"batch_size": 8}))
    assert result.returncode == 0, result.stderr
    counts = job_counts(result.stdout)
    runs = len(workers) * len(seeds)
    assert counts["train"] == counts["evaluate"] == runs
    assert counts["prepare_data"] == counts["aggregate"] == counts["init_tracking"] == 1
    for n in workers:
        for seed in seeds:
            assert f"results/runs/allreduce/n{n}/seed{seed}/metrics.json" in result.stdout


def test_values_given_with_snakemakes_config_option_take_their_types(tmp_path):
    """`--config workers=[1,2,4] 'train={epochs: 2}'` as a user types it: Snakemake reads a
    list's and a mapping's items as text, and the study reads them as the numbers they are."""
    study = tiny_study(workers=[1], seeds=[0], train={"batch_size": 8})
    result = dry_run(
        tmp_path,
        study,
        "--cores",
        "2",
        "--config",
        "workers=[1,2,4]",
        "seeds=[0,1]",
        "train={epochs: 2, max_steps: null}",
        "--printshellcmds",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert job_counts(result.stdout)["train"] == 6
    [train] = [
        json.loads(shlex.split(line.split("--config-json", 1)[1])[0])
        for line in result.stdout.splitlines()
        if "dtstudy train" in line and "n4/seed1" in line
    ]
    assert (train["train"]["epochs"], train["train"]["max_steps"], train["train"]["batch_size"]) == (2, None, 8)


def jobs_of(dry_run_output: str, rule: str) -> dict[tuple[str, int, int], str]:
    """{(strategy, N, seed): the job's block} of `rule`'s jobs in a dry run's output."""
    found = {}
    for block in dry_run_output.split(f"\nrule {rule}:")[1:]:
        block = block.split("\n[", 1)[0]
        wildcards = re.search(r"wildcards: strategy=(\w+), workers=(\d+), seed=(\d+)", block)
        found[(wildcards.group(1), int(wildcards.group(2)), int(wildcards.group(3)))] = block
    return found


def run_config_of(job_block: str) -> dict:
    """The run config a train job's command hands `dtstudy train` (--config-json)."""
    command = shlex.split(job_block.split("Shell command:", 1)[1].split(">", 1)[0])
    return json.loads(command[command.index("--config-json") + 1])


def test_scaling_and_accuracy_runs_are_separate_jobs_at_their_own_n_and_seeds(tmp_path):
    """A study with both kinds: train_scaling jobs (warm-up + timed steps, their own folders, no
    test evaluation) at every N and scaling.seeds, train jobs (full trainings, evaluated) at
    accuracy.workers and the study's seeds; the projection times the scaling runs."""
    study = tiny_study(
        workers=[1, 2],
        seeds=[0, 1],
        train={"batch_size": 8},
        scaling={"steps": 20, "warmup_steps": 5, "seeds": [3]},
        accuracy={"workers": [2]},
    )
    result = dry_run(tmp_path, study, "--cores", "2", "--printshellcmds")
    assert result.returncode == 0, result.stderr
    counts = job_counts(result.stdout)
    assert counts["train_scaling"] == 2 and counts["train"] == 2 and counts["evaluate"] == 2
    scaling, accuracy = jobs_of(result.stdout, "train_scaling"), jobs_of(result.stdout, "train")
    assert set(scaling) == {("allreduce", 1, 3), ("allreduce", 2, 3)}
    assert set(accuracy) == {("allreduce", 2, 0), ("allreduce", 2, 1)}
    assert "output: results/runs/scaling/allreduce/n1/seed3/metrics.json" in scaling[("allreduce", 1, 3)]
    assert "output: results/runs/allreduce/n2/seed0/metrics.json" in accuracy[("allreduce", 2, 0)]
    # a scaling run stops after warm-up + timed steps and times only the steps after the warm-up
    timed = run_config_of(scaling[("allreduce", 1, 3)])
    assert timed["run_kind"] == "scaling"
    assert timed["train"]["max_steps"] == 25 and timed["train"]["steady_state_skip"] == 5
    # an accuracy run's config is the one runs had before kinds (finished runs are not rerun)
    full = run_config_of(accuracy[("allreduce", 2, 0)])
    assert "run_kind" not in full and full["train"]["max_steps"] is None and full["train"]["steady_state_skip"] == 5
    project = result.stdout.split("\nrule project:", 1)[1].split("\n[", 1)[0]
    assert "results/runs/scaling/allreduce/n2/seed3/metrics.json" in project
    assert "results/runs/allreduce/n2/seed0/metrics.json" not in project


def train_threads(dry_run_output: str) -> dict[tuple[str, int], int]:
    """{(strategy, N): threads} of the train jobs in a dry run's output (1 when not printed)."""
    found = {}
    for block in dry_run_output.split("rule train:")[1:]:
        block = block.split("\n[", 1)[0]
        wildcards = re.search(r"wildcards: strategy=(\w+), workers=(\d+)", block)
        threads = re.search(r"threads: (\d+)", block)
        found[(wildcards.group(1), int(wildcards.group(2)))] = int(threads.group(1)) if threads else 1
    return found


@pytest.mark.slow
def test_a_local_run_reserves_one_core_per_process(tmp_path):
    """Two N=1 runs may share 2 cores; an N=2 run (or a parameter server's N + S) has them to itself."""
    study = tiny_study(strategies=["allreduce", "ps_sync"], workers=[1, 2], train={"batch_size": 8})
    result = dry_run(tmp_path, study, "--cores", "8")
    assert result.returncode == 0, result.stderr
    assert train_threads(result.stdout) == {
        ("allreduce", 1): 1,
        ("allreduce", 2): 2,
        ("ps_sync", 1): 2,
        ("ps_sync", 2): 3,
    }
    capped = train_threads(dry_run(tmp_path, study, "--cores", "2").stdout)
    assert capped[("ps_sync", 2)] == 2 and capped[("allreduce", 1)] == 1  # Snakemake caps at --cores


@pytest.mark.parametrize(
    "override, words",
    [
        ({"strategies": ["telepathy"]}, ["strategies[0]", "telepathy", "allowed: ", "allreduce"]),
        ({"train": {"batch_size": 0}}, ["batch_size", "minimum of 1"]),
        ({"workers": [0]}, ["0 is less than the minimum of 1"]),
        ({"model": "vgg99"}, ["vgg99", "lenet5"]),
        ({"dataset": {"root": "/no/such/root"}}, ["dataset.root", "/no/such/root"]),
        ({"dataset": {"subset": 10**6}}, ["dataset.subset", "1000000", "60000"]),
        ({"scaling": {"steps": 10, "warmup_steps": 20}}, ["scaling.warmup_steps", "20", "scaling.steps 10"]),
        ({"scaling": {"steps": 4}}, ["scaling.steps", "4", "minimum of 5"]),
        ({"scaling": {"seeds": [1]}}, ["scaling.seeds", "scaling.steps is null"]),
        ({"accuracy": {"workers": [8]}}, ["accuracy.workers[0]", "8 is not in workers [1, 2]"]),
    ],
)
@pytest.mark.slow
def test_bad_config_fails_the_dry_run_with_a_clear_message(tmp_path, override, words):
    result = dry_run(tmp_path, tiny_study(**override))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    for word in words:
        assert word in output
    assert not (tmp_path / "results").exists()


def test_lint_is_clean():
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "--lint"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0
    assert "Congratulations, your workflow is in a good condition!" in result.stdout + result.stderr


def test_cluster_training_jobs_do_not_queue_on_the_local_slot(tmp_path):
    result = dry_run(tmp_path, tiny_study(launcher={"cluster": "slurm"}))
    assert result.returncode == 0, result.stderr
    assert job_counts(result.stdout)["train"] == 2
    assert "train_slot=1" not in result.stdout
