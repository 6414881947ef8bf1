"""Shared fixtures: a tiny prepared Fashion-MNIST and tiny study configs."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

pytest_plugins = ["tiers"]  # python3 -m pytest is the quick tier; --full runs every tier


TINY_SUBSET = 2000  # 1800 training + 200 validation images


def tiny_study(**overrides) -> dict:
    """The tiny study of the tests: real Fashion-MNIST subset, 1 epoch, workers 1 and 2."""
    from dtstudy.config.study_config import deep_merge

    base = {
        "dataset": {"name": "fashion_mnist", "subset": TINY_SUBSET, "val_fraction": 0.1},
        "model": "lenet5",
        "strategies": ["allreduce"],
        "workers": [1, 2],
        "seeds": [0],
        "train": {"epochs": 1, "batch_size": 32, "log_every": 20, "steady_state_skip": 5},
        "target_accuracy": 0.5,
    }
    return deep_merge(base, overrides)


def dataset_config(**keys) -> dict:
    """A `dataset` section with `keys` and the schema's defaults for the rest (as a study
    config gets it), so that a new dataset key needs no edit of the tests' configs."""
    from dtstudy.config.study_config import validate_schema

    return validate_schema({"dataset": copy.deepcopy(keys)})["dataset"]


def validated(config: dict) -> dict:
    from dtstudy.checks import check_config
    from dtstudy.config.study_config import validate_schema

    config = validate_schema(copy.deepcopy(config))
    check_config(config)
    return config


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """The tiny study's data set, prepared once per test session."""
    from dtstudy.data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "fashion_mnist"
    prepare(validated(tiny_study())["dataset"], out)
    return out


def train_run(
    tmp_path,
    data_dir,
    workers,
    batch_size,
    steps=12,
    seed=0,
    strategy="allreduce",
    strategy_params=None,
    stragglers=None,
    launcher=None,
    **train,
):
    """One training run through the real path (submitit LocalExecutor, torch.distributed on
    gloo), lr_scaling none and base_lr 0.1 unless `train` says otherwise.
    Returns (metrics, final state_dict, run folder)."""
    import torch

    from dtstudy.common.run_folder import MODEL
    from dtstudy.config.study_config import run_config
    from dtstudy.launch.launcher import run_training_job
    from dtstudy.runspec import RunSpec

    study = validated(
        tiny_study(
            strategies=[strategy],
            workers=[workers],
            strategy_params={strategy: strategy_params or {}},
            stragglers=stragglers or {},
            **({"launcher": launcher} if launcher else {}),
            train={"batch_size": batch_size, "max_steps": steps, "lr_scaling": "none", "base_lr": 0.1, **train},
        )
    )
    out = tmp_path / f"{strategy}-n{workers}-b{batch_size}-s{seed}"
    spec = RunSpec(
        strategy=strategy,
        workers=workers,
        seed=seed,
        config=run_config(study, strategy),
        data_dir=str(data_dir),
        out_dir=str(out),
    )
    metrics = run_training_job(spec, out / "submitit")
    return metrics, torch.load(out / MODEL, weights_only=True)["state_dict"], out


def assert_same_parameters(a: dict, b: dict, atol: float) -> None:
    import torch

    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=f"parameter {name} differs")


def run_snakemake(workdir: Path, config: dict, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run this repository's Snakefile in `workdir` with `config` as the config file."""
    config_path = workdir / "study.yaml"
    config_path.write_text(yaml.safe_dump(config))
    command = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--configfile",
        str(config_path),
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def job_counts(output: str) -> dict[str, int]:
    """Snakemake's 'Job stats' table as {rule: count}."""
    table = output.split("Job stats:", 1)[1]
    return {rule: int(count) for rule, count in re.findall(r"^(\w+)\s+(\d+)$", table, flags=re.M) if rule != "total"}


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def _in_worker(rank: int, workers: int, init_file: str, check, args) -> None:
    import torch
    import torch.distributed as dist

    from dtstudy.strategies.base import DistContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=workers)
    try:
        check(
            DistContext(
                rank=rank,
                world_size=workers,
                workers=workers,
                local_rank=rank,
                device=torch.device("cpu"),
                backend="gloo",
            ),
            *args,
        )
    finally:
        dist.destroy_process_group()


def in_workers(tmp_path, workers: int, check, *args) -> None:
    """Run `check(ctx, *args)` in `workers` gloo processes; an assertion in any fails the test."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _in_worker, args=(workers, str(tmp_path / "rendezvous"), check, args), nprocs=workers, start_method="fork"
    )


class MlflowServer:
    """A real `mlflow server` (SQLite behind it, as on a login node) that a test can stop and
    start again on the same port and store: a tracking server that goes away mid-study."""

    def __init__(
        self,
        folder: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        name: str | None = None,
        options: tuple[str, ...] = (),
        env: dict | None = None,
    ):
        """`host`: the address it listens on; `name`: the host name its clients use (a login
        node's); `options` and `env`: more of `mlflow server`'s (its authentication)."""
        from dtstudy.common.ports import free_port

        self.folder, self.port, self.host = Path(folder), port or free_port(), host
        self.uri = f"http://{name or host}:{self.port}"
        self.options, self.env = tuple(options), env or {}
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120) -> MlflowServer:
        import os
        import sys
        import time
        import urllib.request

        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--host",
                self.host,
                "--port",
                str(self.port),
                *self.options,
                "--backend-store-uri",
                f"sqlite:///{self.folder}/mlflow.db",
                "--artifacts-destination",
                str(self.folder / "artifacts"),
                "--workers",
                "1",
            ],
            cwd=self.folder,
            stdout=open(self.folder / "server.log", "a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2).read()
                return self
            except OSError:
                assert self.process.poll() is None and time.monotonic() < deadline, (
                    self.folder / "server.log"
                ).read_text()
                time.sleep(0.5)

    def stop(self) -> None:
        import os
        import signal

        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                # a loaded machine can hold uvicorn's graceful shutdown past 30 s; a server that
                # dies is the same outage for the runs, and the next start needs its port
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self.process = None
