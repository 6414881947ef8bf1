"""One training run (strategy x N x seed): what it depends on and where its files go. Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .strategy_specs import get_spec
from .task_layout import TaskLayout

METRICS_FILE = "metrics.json"  # the train rule's output, written last
CHECKPOINT_FILE = "model.pt"
EVAL_FILE = "eval.json"
RESUME_DIR = "resume"  # an interrupted run's saved state (dtstudy.resume)


def lost_rank_path(job_folder: str | Path, job_id: str) -> Path:
    """Where a run's process that saw a peer lost records which (dtstudy.distributed.PeerWatch),
    for the launcher's error: `<job folder>/<job id>_lost_rank.json`."""
    return Path(job_folder) / f"{job_id}_lost_rank.json"


@dataclass
class RunSpec:
    """Everything one training run depends on."""

    strategy: str
    workers: int
    seed: int
    config: dict  # dtstudy.config.run_config(...) of the study
    data_dir: str
    out_dir: str
    tracking_uri: str | None = None  # resolved MLflow URI; None = no MLflow logging

    @property
    def run_name(self) -> str:
        return f"{self.strategy}-n{self.workers}-seed{self.seed}"

    @property
    def metrics_path(self) -> Path:
        return Path(self.out_dir) / METRICS_FILE

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.out_dir) / CHECKPOINT_FILE

    @property
    def resume_dir(self) -> Path:
        return Path(self.out_dir) / RESUME_DIR

    def strategy_params(self) -> dict:
        spec = get_spec(self.strategy)
        return spec.check_params(self.config["strategy_params"].get(self.strategy, {}), self.workers)

    def processes(self) -> int:
        """The run's processes: N workers plus the strategy's extra ones (parameter-server shards)."""
        return self.workers + get_spec(self.strategy).extra_processes(self.strategy_params(), self.workers)

    def layout(self) -> TaskLayout:
        """How the N workers and the strategy's extra processes spread over the job's nodes
        (the launcher submits this layout; every task maps itself to its rank with it)."""
        launcher = self.config["launcher"]
        extras = self.processes() - self.workers
        if launcher["cluster"] == "local":
            return TaskLayout(self.workers, extras)
        per_node = launcher["gpus_per_node"] or launcher["workers_per_node"]
        try:
            return TaskLayout.over_nodes(self.workers, extras, per_node)
        except ValueError:
            raise ConfigError(
                f"config key 'workers': N={self.workers} does not spread evenly over "
                f"{math.ceil(self.workers / per_node)} nodes of "
                f"{per_node} workers (launcher.gpus_per_node / launcher.workers_per_node); "
                "use N <= that or a multiple of it"
            ) from None
