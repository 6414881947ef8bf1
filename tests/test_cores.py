"""Distinct cores for a timed run: leases (lock files) and pinning, and what a run records."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import tiny_study, train_run, validated

from dtstudy.launch import cores

CORES = len(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(CORES < 2, reason="needs 2 cores")


@pytest.fixture
def private_leases(tmp_path, monkeypatch):
    monkeypatch.setenv(cores.LEASE_DIR_ENV, str(tmp_path / "leases"))


@needs_two
def test_leases_are_distinct_and_exhaustible(private_leases):
    first = cores.lease(CORES - 1)
    assert first is not None and len(set(first.cores)) == CORES - 1
    second = cores.lease(1)
    assert second is not None and second.cores[0] not in first.cores
    assert cores.lease(1) is None  # every core is held
    second.release()
    third = cores.lease(1)
    assert third is not None and third.cores == second.cores
    assert cores.lease(CORES + 1) is None


def test_a_killed_holder_frees_its_cores(private_leases, tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from dtstudy.launch import cores; "
            f"held = cores.lease({CORES}); print(held.cores, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ,
    )
    try:
        assert holder.stdout.readline().strip() == str(sorted(os.sched_getaffinity(0)))
        assert cores.lease(1) is None
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    again = cores.lease(CORES)
    assert again is not None


@needs_two
def test_a_run_pins_each_rank_to_its_own_core(tmp_path, tiny_data):
    """Through the warm pool (the local default): rank 0 runs on one core, the run's two
    ranks on two distinct ones, and metrics.json says which."""
    metrics, _, _ = train_run(tmp_path, tiny_data, workers=2, batch_size=32, steps=6)
    environment = metrics["environment"]
    pinned = environment["pinned_cores"]
    if pinned is None:  # another study on this machine holds cores now: nothing to check
        pytest.skip("the machine's cores are leased by another run")
    assert len(pinned) == 2 and len(set(pinned)) == 2
    assert environment["affinity"] == [pinned[0]]
    assert not environment["oversubscribed"] and environment["cores"] == os.cpu_count()


@needs_two
def test_a_run_with_no_free_core_is_not_pinned_and_says_so(tmp_path, tiny_data):
    held = cores.lease(CORES)  # the machine's own lease folder: what the pool uses
    if held is None:
        pytest.skip("the machine's cores are leased by another run")
    try:
        metrics, _, _ = train_run(tmp_path, tiny_data, workers=2, batch_size=32, steps=6)
    finally:
        held.release()
    assert metrics["environment"]["pinned_cores"] is None
    assert len(metrics["environment"]["affinity"]) == CORES


# ----- how many cores a rank gets: one per CPU worker, its loader's too where it has one ------


def test_a_cpu_worker_gets_one_core_and_a_loader_or_a_gpu_worker_gets_its_loaders_cores():
    # the CPU study: one core per process, shards included, whatever loader.workers null resolves to
    assert cores.cores_per_rank(2, 1, on_gpu=False, loader_workers=None, machine=16) == [1, 1, 1]
    assert cores.cores_per_rank(4, 0, on_gpu=False, loader_workers=0, machine=16) == [1] * 4
    # loader processes decode beside their worker, not on its core
    assert cores.cores_per_rank(2, 0, on_gpu=False, loader_workers=3, machine=16) == [4, 4]
    assert cores.cores_per_rank(2, 1, on_gpu=True, loader_workers=2, machine=16) == [3, 3, 1]
    # a GPU worker with loader.workers null: its share of the machine (the shards' cores aside)
    assert cores.cores_per_rank(4, 0, on_gpu=True, loader_workers=None, machine=32) == [8] * 4
    assert cores.cores_per_rank(2, 1, on_gpu=True, loader_workers=None, machine=16) == [7, 7, 1]
    assert cores.cores_per_rank(4, 0, on_gpu=True, loader_workers=None, machine=2) == [1] * 4
    assert cores.split([3, 4, 5, 6, 9], [2, 2, 1]) == [[3, 4], [5, 6], [9]]


def _spec(
    device: str,
    strategy: str = "allreduce",
    workers: int = 2,
    dataset: str = "imagefolder",
    loader_workers: int | None = None,
):
    """A run's spec (its config as the schema fills it in; nothing checks for a GPU or the data)."""
    from dtstudy.config.study_config import run_config, validate_schema
    from dtstudy.runspec import RunSpec

    data = {"name": dataset, "root": "/data", "subset": None} if dataset == "imagefolder" else {}
    study = validate_schema(
        tiny_study(
            dataset=data,
            loader={"workers": loader_workers},
            launcher={"device": device},
            strategies=[strategy],
            workers=[workers],
        )
    )
    return RunSpec(strategy, workers, 0, run_config(study, strategy), "", "")


def test_the_pool_gives_a_gpu_runs_ranks_their_share_of_the_machine(monkeypatch):
    """A local GPU run's ranks (launcher.device cuda, or auto where NVML sees a GPU) are pinned
    to the machine's cores / workers each, not one core: their DataLoader processes inherit
    the pinning. A CPU run keeps one core per process."""
    import torch

    from dtstudy.launch.pool import server

    monkeypatch.setattr(cores, "machine_cores", lambda: list(range(16)))
    assert server._cores_per_rank(_spec("cuda"), {}) == [8, 8]
    assert server._cores_per_rank(_spec("cuda", "ps_sync"), {}) == [7, 7, 1]  # a shard: one core
    assert server._cores_per_rank(_spec("cuda", loader_workers=3), {}) == [4, 4]
    assert server._cores_per_rank(_spec("cuda", dataset="fashion_mnist"), {}) == [1, 1]  # in memory: no loader
    assert server._cores_per_rank(_spec("cpu"), {}) == [1, 1]
    # auto: NVML's count of the GPUs the client's CUDA_VISIBLE_DEVICES leaves, CUDA untouched
    seen = {}

    def nvml_count():
        seen["visible"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        return 2

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", nvml_count)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert server._cores_per_rank(_spec("auto"), {"CUDA_VISIBLE_DEVICES": "0,1"}) == [8, 8]
    assert seen["visible"] == "0,1"
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)  # NVML cannot tell: as before, CPU
    assert server._cores_per_rank(_spec("auto"), {}) == [1, 1]


def write_jpeg_tree(root, classes: int = 2, per_class: int = 10, size: int = 20):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in range(classes):
        (root / f"class{label}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(
                root / f"class{label}" / f"{i}.jpg"
            )
    return root


@needs_two
def test_a_rank_with_loader_processes_is_pinned_to_their_cores_too(tmp_path):
    """Through the warm pool: a worker whose loader runs one worker process gets two cores,
    its own and its loader's (the DataLoader's process inherits the rank's pinning: on one
    core it would decode on the core that trains), and metrics.json says which."""
    from dtstudy.config.study_config import run_config
    from dtstudy.data.prepare import prepare
    from dtstudy.launch.launcher import run_training_job
    from dtstudy.runspec import RunSpec

    study = validated(
        tiny_study(
            dataset={
                "name": "imagefolder",
                "root": str(write_jpeg_tree(tmp_path / "tree")),
                "subset": None,
                "val_fraction": 0.2,
                "test_fraction": 0.2,
                "image_size": 16,
            },
            loader={"workers": 1},
            workers=[1],
            train={"batch_size": 4, "max_steps": 2, "log_every": 1, "steady_state_skip": 0, "eval_images": None},
        )
    )
    prepare(study["dataset"], tmp_path / "data")
    spec = RunSpec("allreduce", 1, 0, run_config(study, "allreduce"), str(tmp_path / "data"), str(tmp_path / "run"))
    environment = run_training_job(spec, tmp_path / "run" / "submitit")["environment"]
    if environment["pinned_cores"] is None:  # another study on this machine holds cores now
        pytest.skip("the machine's cores are leased by another run")
    assert len(environment["pinned_cores"]) == 2
    assert environment["affinity"] == sorted(environment["pinned_cores"])
