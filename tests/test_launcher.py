"""The submitit job a run becomes: tasks, nodes, GPUs."""

from __future__ import annotations

import pytest
from conftest import tiny_study, validated

from dtstudy.config.study_config import run_config
from dtstudy.errors import ConfigError
from dtstudy.launch.launcher import job_parameters
from dtstudy.runspec import RunSpec


def spec_for(workers, launcher, strategy="allreduce", strategy_params=None):
    study = validated(
        tiny_study(
            workers=[workers],
            strategies=[strategy],
            launcher=launcher,
            strategy_params={strategy: strategy_params or {}},
            train={"batch_size": 8},
        )
    )
    return RunSpec(strategy, workers, 0, run_config(study, strategy), "data", "out")


def test_local_job_runs_every_process_on_this_machine():
    assert job_parameters(spec_for(4, {"cluster": "local", "timeout_min": 30})) == {
        "name": "allreduce-n4-seed0",
        "timeout_min": 30,
        "nodes": 1,
        "tasks_per_node": 4,
        "signal_delay_s": 120,
    }


def test_slurm_job_with_8_workers_on_4_gpu_nodes():
    parameters = job_parameters(
        spec_for(
            8,
            {
                "cluster": "slurm",
                "gpus_per_node": 4,
                "partition": "gpu",
                "account": "proj",
                "additional_parameters": {"overcommit": True},
            },
        )
    )
    assert (parameters["nodes"], parameters["tasks_per_node"], parameters["gpus_per_node"]) == (2, 4, 4)
    assert parameters["slurm_partition"] == "gpu" and parameters["slurm_account"] == "proj"
    assert parameters["slurm_additional_parameters"] == {"overcommit": True}
    assert "slurm_qos" not in parameters


@pytest.mark.parametrize("workers, per_node, nodes", [(1, 4, 1), (4, 4, 1), (12, 4, 3), (64, 4, 16)])
def test_nodes_are_the_fewest_that_hold_the_workers(workers, per_node, nodes):
    parameters = job_parameters(spec_for(workers, {"cluster": "slurm", "gpus_per_node": per_node}))
    assert parameters["nodes"] == nodes and parameters["tasks_per_node"] == min(workers, per_node)


def test_cpu_slurm_job_defaults_to_one_node():
    parameters = job_parameters(spec_for(4, {"cluster": "slurm"}))
    assert (parameters["nodes"], parameters["tasks_per_node"]) == (1, 4) and "gpus_per_node" not in parameters


def test_workers_that_do_not_fill_nodes_evenly_are_rejected_before_any_job():
    with pytest.raises(ConfigError, match="N=5 .* 2 nodes of 4 workers"):
        spec_for(5, {"cluster": "slurm", "gpus_per_node": 4})


def test_parameter_server_shards_ride_along_on_multi_node_jobs():
    """N=8 on 4-GPU nodes with 3 shards: 4 workers + 2 shard slots per node, one slot idle."""
    spec = spec_for(8, {"cluster": "slurm", "gpus_per_node": 4}, strategy="ps_sync", strategy_params={"shards": 3})
    parameters = job_parameters(spec)
    assert (parameters["nodes"], parameters["tasks_per_node"], parameters["gpus_per_node"]) == (2, 6, 4)
    layout = spec.layout()
    ranks = [layout.rank_of_task(task) for task in range(2 * 6)]
    # workers 0-3 on node 0's first slots and 4-7 on node 1's (one per GPU), shards 8-10 after them
    assert ranks == [0, 1, 2, 3, 8, 9, 4, 5, 6, 7, 10, None]
    assert layout.world_size == 11 and layout.idle_tasks == 1


@pytest.mark.parametrize("workers, extras, nodes", [(1, 0, 1), (2, 1, 1), (8, 1, 2), (64, 4, 16), (12, 5, 3)])
def test_every_rank_has_exactly_one_task_and_workers_fill_the_first_slots(workers, extras, nodes):
    from dtstudy.runspec import TaskLayout

    layout = TaskLayout(workers, extras, nodes)
    ranks = [layout.rank_of_task(task) for task in range(nodes * layout.tasks_per_node)]
    assert sorted(rank for rank in ranks if rank is not None) == list(range(workers + extras))
    for task, rank in enumerate(ranks):
        if rank is not None and rank < workers:  # a worker's slot on its node is a GPU index
            assert task % layout.tasks_per_node < layout.workers_per_node


def test_slurm_job_carries_the_requeue_settings():
    parameters = job_parameters(spec_for(2, {"cluster": "slurm", "signal_delay_s": 45}))
    assert parameters["slurm_signal_delay_s"] == 45


@pytest.mark.parametrize("preference", ["auto", "cuda"])
def test_more_workers_on_a_node_than_visible_gpus_fails_before_the_group_forms(monkeypatch, preference):
    """NCCL refuses two ranks on one GPU only at its first collective; the worker names the
    key and the counts before it joins (the GPU count is faked: no GPU here)."""
    import torch

    from dtstudy.training.compute import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device(preference, 1, workers_per_node=2) == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match=r"launcher.device .*4 workers on this node but 2 visible GPU"):
        pick_device(preference, 3, workers_per_node=4)
    assert pick_device("cpu", 3, workers_per_node=4) == torch.device("cpu")


@pytest.mark.parametrize("processes", ["pool", "tasks"])
@pytest.mark.parametrize("visible", [None, "5"])
@pytest.mark.slow
def test_a_local_run_sees_the_gpus_its_launcher_sees(tmp_path, tiny_data, monkeypatch, processes, visible):
    """submitit's local executor sets CUDA_VISIBLE_DEVICES="" in its tasks (no GPU) unless
    given gpus_per_node; the run's ranks must see what the launcher sees, unset included,
    also when the pool was started by another run. Recorded in metrics.json."""
    from conftest import train_run

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    metrics, _, _ = train_run(
        tmp_path, tiny_data, workers=1, batch_size=32, steps=4, launcher={"local_processes": processes}
    )
    assert metrics["environment"]["cuda_visible_devices"] == visible


def sbatch_lines(spec, tmp_path, time_limit_min=None) -> set[str]:
    """The #SBATCH lines of the script submitit would submit for the run (nothing is submitted)."""
    from dtstudy.launch.launcher import make_executor

    executor = make_executor(spec, tmp_path, time_limit_min=time_limit_min)
    script = executor._executor._make_submission_file_text("python -c pass", "uid")
    return {line for line in script.splitlines() if line.startswith("#SBATCH")}


def test_an_n1_job_asks_for_one_gpu_and_an_n8_job_for_the_gpus_of_its_two_nodes(tmp_path):
    """Issue 30: every run asked for the whole node's GPUs; each node now asks for the GPUs
    its workers use (the shards of a parameter server take none)."""
    pytest.importorskip("submitit")
    one = sbatch_lines(spec_for(1, {"cluster": "slurm", "gpus_per_node": 4}), tmp_path)
    assert {"#SBATCH --gpus-per-node=1", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1"} <= one
    eight = sbatch_lines(spec_for(8, {"cluster": "slurm", "gpus_per_node": 4}), tmp_path)
    assert {"#SBATCH --gpus-per-node=4", "#SBATCH --nodes=2"} <= eight  # the control: a full node's
    shards = sbatch_lines(
        spec_for(2, {"cluster": "slurm", "gpus_per_node": 4}, strategy="ps_sync", strategy_params={"shards": 2}),
        tmp_path,
    )
    assert {"#SBATCH --gpus-per-node=2", "#SBATCH --ntasks-per-node=4"} <= shards  # 2 workers + 2 CPU shards


def test_a_gres_site_gets_gres_and_a_predicted_time_limit_replaces_timeout_min(tmp_path):
    pytest.importorskip("submitit")
    lines = sbatch_lines(
        spec_for(1, {"cluster": "slurm", "gpus_per_node": 4, "gpu_request": "gres", "timeout_min": 720}),
        tmp_path,
        time_limit_min=386,
    )
    assert {"#SBATCH --gres=gpu:1", "#SBATCH --time=386"} <= lines
    assert not any(line.startswith("#SBATCH --gpus-per-node") for line in lines)
    default = sbatch_lines(spec_for(1, {"cluster": "slurm", "gpus_per_node": 4, "timeout_min": 720}), tmp_path)
    assert "#SBATCH --time=720" in default  # the control: no prediction, timeout_min


def test_an_evaluation_on_a_gpu_cluster_asks_for_one_gpu_where_the_runs_train():
    """The `evaluate` rule's SLURM resources: one GPU as the site takes it, the runs' partition,
    account, qos and constraint, a training task's CPUs and one GPU's share of a node's memory;
    none on a CPU-only or local study."""
    from dtstudy.launch_backends.registry import launch_backend

    def evaluation_job_resources(config: dict) -> dict:  # as the rules ask (common.smk)
        return launch_backend(config).evaluation_resources(config["launcher"])

    gpu_cluster = validated(
        tiny_study(
            launcher={
                "cluster": "slurm",
                "gpus_per_node": 4,
                "gpu_request": "gres",
                "cpus_per_task": 6,
                "mem_gb": 250,
                "partition": "gpu",
                "account": "proj",
                "qos": "high",
                "constraint": "h100",
            }
        )
    )
    assert evaluation_job_resources(gpu_cluster) == {
        "gres": "gpu:1",
        "cpus_per_task": 6,
        "mem_mb": 64000,
        "slurm_partition": "gpu",
        "slurm_account": "proj",
        "qos": "high",
        "constraint": "h100",
    }
    defaults = validated(tiny_study(launcher={"cluster": "slurm", "gpus_per_node": 4}))
    assert evaluation_job_resources(defaults) == {"gpu": 1, "cpus_per_task": defaults["launcher"]["cpus_per_task"]}
    cpu_cluster = validated(tiny_study(launcher={"cluster": "slurm", "gpus_per_node": 0, "partition": "cpu"}))
    assert evaluation_job_resources(cpu_cluster) == {}
    assert evaluation_job_resources(validated(tiny_study())) == {}


class EndedJob:
    """What the launcher reads of a submitit job that has ended: its folder, id and state."""

    def __init__(self, folder, state: str):
        self.paths, self.job_id, self.state = type("Paths", (), {"folder": folder})(), "7", state


def test_only_a_job_that_lost_a_process_or_its_node_and_has_a_checkpoint_is_resubmitted(tmp_path):
    """launcher.max_resubmits: a lost rank (PeerWatch's record) or NODE_FAIL is a loss, another
    failure is not; a resubmission needs one left and a checkpoint file of every worker; a
    local run is never resubmitted. (The whole path: tests/test_slurm.py, a task killed.)"""
    import json
    from dataclasses import replace

    from dtstudy.launch.launcher import lost_process, resubmission_refused
    from dtstudy.runspec import lost_rank_path

    assert lost_process(EndedJob(tmp_path, "FAILED")) is None  # e.g. an error in the training code
    assert lost_process(EndedJob(tmp_path, "NODE_FAIL")) == "its node failed (SLURM state NODE_FAIL)"
    lost_rank_path(tmp_path, "7").write_text(
        json.dumps({"rank": 1, "why": "its process 9 on vm is gone", "log": "7_1_log.err"})
    )
    assert (
        lost_process(EndedJob(tmp_path, "FAILED"))
        == "rank 1 was lost (its process 9 on vm is gone); its log: 7_1_log.err"
    )

    spec = replace(spec_for(2, {"cluster": "slurm", "max_resubmits": 2}), out_dir=str(tmp_path / "run"))
    assert "rank0.pt, rank1.pt missing" in resubmission_refused(spec, 0, 2)
    spec.folder.resume.mkdir(parents=True)
    (spec.folder.resume / "rank0.pt").touch()
    assert "rank1.pt missing" in resubmission_refused(spec, 0, 2)
    (spec.folder.resume / "rank1.prev.pt").touch()  # a rank caught writing its next one still has this
    assert resubmission_refused(spec, 0, 2) is None and resubmission_refused(spec, 1, 2) is None
    assert "launcher.max_resubmits is 2 and it was resubmitted 2 times" in resubmission_refused(spec, 2, 2)
    assert "launcher.max_resubmits is 0" in resubmission_refused(spec, 0, 0)
    assert (
        resubmission_refused(
            replace(spec, config={**spec.config, "launcher": {**spec.config["launcher"], "cluster": "local"}}), 0, 2
        )
        == ""
    )


class _FakeSlurmJob:
    """submitit.SlurmJob as the slurm backend's running_job asks it: its state, done() and cancel()."""

    states: dict[str, str] = {}
    cancelled: list[str] = []

    def __init__(self, folder, job_id, tasks=(0,)):
        self.job_id = job_id

    @property
    def state(self) -> str:
        return self.states[self.job_id]

    def done(self, force_check=False) -> bool:
        return self.state not in ("PENDING", "RUNNING", "REQUEUED")

    def cancel(self, check=True) -> None:
        self.cancelled.append(self.job_id)
        self.states[self.job_id] = "CANCELLED"


@pytest.mark.parametrize(
    "state, same_config, waited_on",
    [
        ("RUNNING", True, True),  # the lost launcher's job trains on: wait for it
        ("PENDING", True, True),
        ("COMPLETED", True, False),  # ended while no launcher waited: the record goes, the run is submitted
        ("FAILED", True, False),
        ("RUNNING", False, False),  # another config: cancelled, then submitted afresh
    ],
)
def test_a_launcher_waits_only_for_a_running_job_of_its_own_config(
    tmp_path, monkeypatch, state, same_config, waited_on
):
    import json

    import submitit

    from dtstudy.config.study_config import results_sha256
    from dtstudy.launch_backends.slurm import ACTIVE_JOB_FILE, SLURM

    def running_job(spec, job_dir):  # as the launcher asks
        return SLURM.running_job(job_dir, spec.run_name, results_sha256(spec.config))

    spec = spec_for(2, {"cluster": "slurm", "timeout_min": 30})
    assert running_job(spec, tmp_path) is None  # no record: nothing to wait for
    other = spec_for(2, {"cluster": "slurm", "timeout_min": 90})  # an operational key: the same numbers
    edited = RunSpec(
        spec.strategy, 2, 0, {**spec.config, "train": {**spec.config["train"], "base_lr": 0.07}}, "data", "out"
    )
    recorded = other if same_config else edited
    assert (results_sha256(recorded.config) == results_sha256(spec.config)) == same_config
    record = {"job_id": "41", "config_sha256": results_sha256(recorded.config)}
    (tmp_path / ACTIVE_JOB_FILE).write_text(json.dumps(record))
    monkeypatch.setattr(submitit, "SlurmJob", _FakeSlurmJob)
    monkeypatch.setattr(_FakeSlurmJob, "states", {"41": state})
    monkeypatch.setattr(_FakeSlurmJob, "cancelled", [])

    job = running_job(spec, tmp_path)
    assert (job is not None and job.job_id == "41") == waited_on
    assert (tmp_path / ACTIVE_JOB_FILE).exists() == waited_on  # kept while a launcher may wait on it
    assert _FakeSlurmJob.cancelled == ([] if same_config else ["41"])
