"""The launch backends (dtstudy.launch_backends): one per value of launcher.cluster, chosen in one
place; no other module compares launcher.cluster with a string. Their interface on hand-made
configs, and the launcher's submit, wait and resubmit with fake submitit jobs (no SLURM here)."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import tiny_study, validated

from dtstudy.config.study_config import results_sha256, run_config, validate_schema
from dtstudy.errors import ConfigError
from dtstudy.launch_backends.registry import BACKENDS, launch_backend
from dtstudy.runspec import RunSpec, lost_rank_path

ROOT = Path(__file__).resolve().parents[1]
#: the one module that reads launcher.cluster's value to choose
SELECTION = ROOT / "workflow" / "dtstudy" / "launch_backends" / "registry.py"


# ----- no string comparison of launcher.cluster outside the selection -----------------------------


def _reads_cluster(node: ast.AST) -> bool:
    """`x["cluster"]`, `x.get("cluster")`, `x.cluster` or a name `cluster`."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "cluster"
    if isinstance(node, ast.Call):
        return (
            isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and bool(node.args)
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == "cluster"
        )
    return (isinstance(node, ast.Attribute) and node.attr == "cluster") or (
        isinstance(node, ast.Name) and node.id == "cluster"
    )


def _is_text(node: ast.AST) -> bool:
    """A string literal, or a tuple, list or set of them."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_text(element) for element in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def python_comparisons(source: str) -> list[int]:
    """Lines of `source` (Python) that compare launcher.cluster (or a `cluster`) with a string."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(map(_reads_cluster, operands)) and any(map(_is_text, operands)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Match) and _reads_cluster(node.subject):
            lines.append(node.lineno)
    return sorted(lines)


_CLUSTER = r"""(?:\[\s*['"]cluster['"]\s*\]|\.get\(\s*['"]cluster['"][^)]*\)|\bcluster\b)"""
_TEXT = r"""(?:['"][\w-]*['"]|[(\[{]\s*['"])"""
_SNAKEMAKE_COMPARISON = re.compile(
    rf"{_CLUSTER}\s*(?:==|!=|\bnot\s+in\b|\bin\b)\s*{_TEXT}|['\"][\w-]*['\"]\s*(?:==|!=)\s*[^\s#]*{_CLUSTER}"
)


def snakemake_comparisons(source: str) -> list[int]:
    """Lines of `source` (a Snakefile or .smk, not Python to ast) that compare cluster with a string."""
    return [number for number, line in enumerate(source.splitlines(), 1) if _SNAKEMAKE_COMPARISON.search(line)]


def workflow_sources() -> list[Path]:
    workflow = ROOT / "workflow"
    return sorted([*workflow.rglob("*.py"), *workflow.rglob("*.smk"), ROOT / "Snakefile"])


def comparisons(path: Path) -> list[int]:
    text = path.read_text()
    return python_comparisons(text) if path.suffix == ".py" else snakemake_comparisons(text)


def test_no_module_but_the_selection_compares_launcher_cluster_with_a_string():
    sources = workflow_sources()
    assert SELECTION in sources and ROOT / "workflow" / "rules" / "common.smk" in sources
    assert len([path for path in sources if path.suffix == ".py"]) > 100, "the walk found no package: vacuous"
    found = {
        str(path.relative_to(ROOT)): lines for path in sources if path != SELECTION and (lines := comparisons(path))
    }
    assert not found, f"launcher.cluster compared with a string outside {SELECTION.name} (ask the backend): {found}"


def test_the_comparison_finder_finds_each_form_and_nothing_else():
    """The check above can fail: every way of comparing is found, a lookup or a record is not."""
    planted = "\n".join(
        [
            'a = config["launcher"]["cluster"] == "local"',
            'b = "slurm" != launcher["cluster"]',
            'c = job_env.cluster == "slurm"',
            'd = cluster in ("local", "emulate")',
            'e = config["launcher"].get("cluster") != "emulate"',
            'f = (launcher["cluster"]\n     == "slurm")',
            'match launcher["cluster"]:\n    case "local":\n        pass',
        ]
    )
    assert python_comparisons(planted) == [1, 2, 3, 4, 5, 6, 8]
    innocent = 'b = BACKENDS[config["launcher"]["cluster"]]\nr = {"cluster": "emulate"}\nm = self.cluster.machine\n'
    assert python_comparisons(innocent) == []
    rules = (
        'TRAIN_HERE = config["launcher"]["cluster"] == "local"\n# launcher.cluster: emulate\n'
        'if "slurm" == config["launcher"]["cluster"]:\n'
        'X = config["launcher"]["cluster"] in ["local", "slurm"]\nB = BACKENDS[config["launcher"]["cluster"]]\n'
    )
    assert snakemake_comparisons(rules) == [1, 3, 4]


# ----- the backends' interface -------------------------------------------------------------------


def launcher(**keys) -> dict:
    """A launcher section with the schema's defaults and `keys`."""
    return validate_schema(tiny_study(launcher=keys))["launcher"]


def test_the_backends_are_the_schemas_kinds_each_spelled_once():
    schema = yaml.safe_load((ROOT / "workflow" / "schemas" / "config.schema.yaml").read_text())
    assert list(BACKENDS) == schema["properties"]["launcher"]["properties"]["cluster"]["enum"]
    assert list(BACKENDS) == ["local", "slurm", "emulate"]
    for kind, backend in BACKENDS.items():
        assert backend.kind == kind and launch_backend({"launcher": {"cluster": kind}}) is backend


@pytest.mark.parametrize("value", ["pbs", "SLURM", None])
def test_an_unknown_kind_is_named_with_the_key_and_the_allowed_kinds(value):
    with pytest.raises(
        ConfigError,
        match=rf"config key 'launcher.cluster': {re.escape(repr(value))} is not a "
        r"launch backend; allowed: local, slurm, emulate",
    ):
        launch_backend({"launcher": {"cluster": value}})


def test_an_unknown_kind_is_refused_when_the_config_is_read_before_any_work():
    """The schema (the Snakefile's first step, and load_config's) refuses it, naming the key,
    the value and the kinds; so does a run config the rules would build from it."""
    config = tiny_study(launcher={"cluster": "pbs"})
    with pytest.raises(ConfigError, match=r"'launcher.cluster': 'pbs' is not one of \['local', 'slurm', 'emulate'\]"):
        validate_schema(config)
    with pytest.raises(ConfigError, match="launcher.cluster"):
        run_config(config, "allreduce")


@pytest.mark.parametrize(
    "kind, workers, gpus_per_node, workers_per_node, nodes",
    [
        ("local", 8, 4, None, 1),  # this machine is the one node, whatever the per-node keys say
        ("local", 8, 0, 2, 1),
        ("slurm", 8, 4, None, 2),  # the fewest nodes that hold the N workers
        ("slurm", 9, 4, None, 3),
        ("slurm", 8, 0, 2, 4),  # CPU workers: workers_per_node
        ("slurm", 8, 0, None, 1),  # neither: all N on one node
        ("emulate", 64, 4, None, 16),  # the emulated cluster's nodes, as a SLURM job's
        ("emulate", 64, 0, None, 1),
    ],
)
def test_nodes_per_run_of_each_kind(kind, workers, gpus_per_node, workers_per_node, nodes):
    section = launcher(cluster=kind, gpus_per_node=gpus_per_node, workers_per_node=workers_per_node)
    assert BACKENDS[kind].nodes(section, workers) == nodes
    study = validated(
        tiny_study(launcher=section, workers=[workers], train={"batch_size": 8}, emulate={"images_per_s": 1000.0})
    )
    spec = RunSpec("allreduce", workers, 0, run_config(study, "allreduce"), "data", "out")
    assert spec.nodes() == spec.layout().nodes == nodes


def test_only_slurm_resubmits_and_as_often_as_max_resubmits_says():
    assert {kind: backend.max_resubmits(launcher(max_resubmits=3)) for kind, backend in BACKENDS.items()} == {
        "local": 0,
        "slurm": 3,
        "emulate": 0,
    }
    assert BACKENDS["slurm"].max_resubmits(launcher(max_resubmits=0)) == 0


def test_what_each_kind_means_for_a_run():
    local, slurm, emulate = BACKENDS["local"], BACKENDS["slurm"], BACKENDS["emulate"]
    assert (local.processes_on_this_machine, slurm.processes_on_this_machine, emulate.processes_on_this_machine) == (
        True,
        False,
        False,
    )
    assert [b.emulated for b in (local, slurm, emulate)] == [False, False, True]
    assert [b.spans_nodes for b in (local, slurm, emulate)] == [False, True, True]
    # the master task picks the rendezvous port on its node on SLURM; the launcher picks it locally
    assert [b.port_from_master_task for b in (local, slurm, emulate)] == [False, True, False]
    # the study is costed (launcher.hardware, gpu_hour_budget) on SLURM alone
    assert [b.predicts_costs for b in (local, slurm, emulate)] == [False, True, False]
    assert local.uses_pool(launcher(local_processes="pool")) and not local.uses_pool(launcher(local_processes="tasks"))
    assert not slurm.uses_pool(launcher(local_processes="pool"))
    # an emulated run is one process of this machine: the pool forks it too (and scores it), unless tasks
    assert emulate.uses_pool(launcher(local_processes="pool"))
    assert not emulate.uses_pool(launcher(local_processes="tasks"))


def test_the_keys_each_kind_reads_alone_are_logged_for_its_runs_only():
    from dtstudy.tracking.logged_params import applicable_config

    def logged(kind: str) -> set[str]:
        return set(
            applicable_config(
                {"launcher": launcher(cluster=kind), "dataset": {"name": "synthetic"}, "model": "lenet5"}
            )["launcher"]
        )

    assert "local_processes" in logged("local") and "max_resubmits" not in logged("local")
    assert {"max_resubmits", "gpus_per_node", "partition"} <= logged("slurm")
    assert "local_processes" not in logged("slurm")
    assert "local_processes" in logged("emulate")  # the pool forks an emulated run too
    assert not (logged("emulate") & {"max_resubmits", "gpus_per_node"})
    assert {"cluster", "timeout_min"} <= logged("emulate")  # the shared keys stay
    assert not set(BACKENDS["local"].own_keys) & set(BACKENDS["slurm"].own_keys)


def test_a_local_job_takes_the_launchers_gpus_and_a_slurm_job_the_schedulers(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert BACKENDS["local"].job_environment() == {"CUDA_VISIBLE_DEVICES": "3"}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert BACKENDS["local"].job_environment() == {"CUDA_VISIBLE_DEVICES": None}  # unset in the tasks too
    assert BACKENDS["slurm"].job_environment() == {}


def test_each_kind_adds_its_own_job_parameters_and_an_emulated_run_has_no_job():
    assert BACKENDS["local"].job_parameters(launcher(signal_delay_s=90), 2) == {"signal_delay_s": 90}
    slurm = BACKENDS["slurm"].job_parameters(launcher(cluster="slurm", signal_delay_s=90, gpus_per_node=4), 2)
    assert slurm["slurm_signal_delay_s"] == 90 and slurm["gpus_per_node"] == 2 and "signal_delay_s" not in slurm
    with pytest.raises(TypeError, match="launcher.cluster 'emulate' submits no job"):
        BACKENDS["emulate"].job_parameters(launcher(cluster="emulate"), 2)


def test_only_slurm_records_its_job_for_a_later_launcher(tmp_path):
    from dtstudy.launch_backends.slurm import ACTIVE_JOB_FILE

    job = type("Job", (), {"job_id": "41"})()
    BACKENDS["local"].record_job(tmp_path, job, "run", "sha")
    assert not (tmp_path / ACTIVE_JOB_FILE).exists()
    BACKENDS["slurm"].record_job(tmp_path, job, "run", "sha")
    assert json.loads((tmp_path / ACTIVE_JOB_FILE).read_text()) == {
        "job_id": "41",
        "run_name": "run",
        "config_sha256": "sha",
    }
    assert BACKENDS["local"].running_job(tmp_path, "run", "sha") is None  # a local job ends with its launcher
    BACKENDS["local"].forget_job(tmp_path)
    assert (tmp_path / ACTIVE_JOB_FILE).exists()
    BACKENDS["slurm"].forget_job(tmp_path)
    assert not (tmp_path / ACTIVE_JOB_FILE).exists()


def test_the_backends_stay_light():
    """The Snakefile's parse and the login node's launcher ask them: no torch, MLflow or submitit."""
    code = (
        "import sys, json; import dtstudy.launch_backends.registry; "
        "print(json.dumps(sorted(m for m in ('torch', 'mlflow', 'submitit') if m in sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT / "workflow"
    )
    assert result.returncode == 0 and json.loads(result.stdout) == [], result.stdout + result.stderr


# ----- the launcher: submit, wait, resubmit ------------------------------------------------------


class FakeJob:
    """A submitit job that has ended: it lost rank 1 (PeerWatch's record) or finished with metrics."""

    def __init__(self, spec: RunSpec, folder: Path, job_id: str, loses_a_rank: bool):
        self.spec, self.job_id, self.state = spec, job_id, "FAILED" if loses_a_rank else "COMPLETED"
        self.paths = type(
            "Paths",
            (),
            {"folder": folder, "stdout": folder / f"{job_id}_0_log.out", "stderr": folder / f"{job_id}_0_log.err"},
        )()
        if loses_a_rank:
            lost_rank_path(folder, job_id).write_text(
                json.dumps({"rank": 1, "why": "its process is gone", "log": "1.err"})
            )

    def done(self, force_check: bool = False) -> bool:
        return True

    def results(self) -> list:
        metrics = {"job": self.job_id}
        self.spec.folder.metrics.write_text(json.dumps(metrics))
        return [metrics]


def fake_submissions(monkeypatch, spec: RunSpec, job_dir: Path, losses: int) -> list[FakeJob]:
    """make_executor's executors submit FakeJobs, the first `losses` of them losing a rank."""
    from dtstudy.launch import launcher

    submitted: list[FakeJob] = []

    class Executor:
        def submit(self, _callable):
            submitted.append(FakeJob(spec, job_dir, str(len(submitted) + 1), len(submitted) < losses))
            return submitted[-1]

    monkeypatch.setattr(launcher, "make_executor", lambda *args: Executor())
    return submitted


def run_spec(tmp_path: Path, **launcher_keys) -> RunSpec:
    study = validated(tiny_study(launcher=launcher_keys))
    (tmp_path / "run").mkdir(exist_ok=True)
    return RunSpec("allreduce", 2, 0, run_config(study, "allreduce"), "data", str(tmp_path / "run"))


def test_a_slurm_job_that_lost_a_rank_is_resubmitted_and_the_new_one_waited_on(tmp_path, monkeypatch):
    from dtstudy.launch.launcher import run_training_job
    from dtstudy.launch_backends.slurm import ACTIVE_JOB_FILE

    spec, job_dir = run_spec(tmp_path, cluster="slurm", max_resubmits=2), tmp_path / "job"
    job_dir.mkdir()
    for rank in range(2):  # a checkpoint of every worker to resume from
        spec.folder.rank_file(rank).parent.mkdir(parents=True, exist_ok=True)
        spec.folder.rank_file(rank).touch()
    submitted = fake_submissions(monkeypatch, spec, job_dir, losses=2)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    assert run_training_job(spec, job_dir) == {"job": "3"}
    assert [job.job_id for job in submitted] == ["1", "2", "3"]
    assert not (job_dir / ACTIVE_JOB_FILE).exists()  # the job ended: no later launcher waits on it
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers


@pytest.mark.parametrize(
    "keys, refused",
    [
        ({"cluster": "slurm", "max_resubmits": 1}, "launcher.max_resubmits is 1 and it was resubmitted 1 times"),
        ({"cluster": "local", "local_processes": "tasks", "max_resubmits": 3}, None),  # never resubmitted locally
    ],
)
def test_a_job_that_lost_a_rank_again_fails_the_run_saying_why(tmp_path, monkeypatch, keys, refused):
    from dtstudy.launch.launcher import TrainingJobFailed, run_training_job

    monkeypatch.delenv("MASTER_PORT", raising=False)
    spec, job_dir = run_spec(tmp_path, **keys), tmp_path / "job"
    job_dir.mkdir()
    for rank in range(2):
        spec.folder.rank_file(rank).parent.mkdir(parents=True, exist_ok=True)
        spec.folder.rank_file(rank).touch()
    submitted = fake_submissions(monkeypatch, spec, job_dir, losses=5)
    with pytest.raises(TrainingJobFailed, match="rank 1 was lost") as failure:
        run_training_job(spec, job_dir)
    assert len(submitted) == BACKENDS[keys["cluster"]].max_resubmits(spec.config["launcher"]) + 1
    if refused:
        assert refused in str(failure.value)
    else:
        assert "not resubmitted" not in str(failure.value)  # a local run resumes when it is started again
        assert "MASTER_PORT" in os.environ  # the launcher picked the tasks' port


def test_a_slurm_launcher_waits_on_the_job_an_earlier_launcher_left_running(tmp_path, monkeypatch):
    import submitit

    from dtstudy.launch.launcher import run_training_job
    from dtstudy.launch_backends.slurm import ACTIVE_JOB_FILE

    spec, job_dir = run_spec(tmp_path, cluster="slurm"), tmp_path / "job"
    job_dir.mkdir()
    (job_dir / ACTIVE_JOB_FILE).write_text(json.dumps({"job_id": "7", "config_sha256": results_sha256(spec.config)}))
    running = FakeJob(spec, job_dir, "7", loses_a_rank=False)
    states = iter([False, True])  # running when found, done when waited on
    monkeypatch.setattr(running, "done", lambda force_check=False: next(states, True), raising=False)
    monkeypatch.setattr(submitit, "SlurmJob", lambda folder, job_id, tasks: running)
    submitted = fake_submissions(monkeypatch, spec, job_dir, losses=0)
    assert run_training_job(spec, job_dir) == {"job": "7"} and submitted == []
    assert not (job_dir / ACTIVE_JOB_FILE).exists()


def test_an_emulated_run_is_refused_as_a_job_before_anything_is_submitted(tmp_path, monkeypatch):
    from dtstudy.launch.launcher import run_training_job

    spec = run_spec(tmp_path)
    spec = replace(spec, config={**spec.config, "launcher": launcher(cluster="emulate")})
    submitted = fake_submissions(monkeypatch, spec, tmp_path, losses=0)
    with pytest.raises(ValueError, match="launcher.cluster 'emulate' runs in the calling process"):
        run_training_job(spec, tmp_path / "job")
    assert submitted == []
