"""One training run (strategy x N x seed, of a kind: dtstudy.config.run_kinds): what it
depends on, its folder (dtstudy.common.run_folder) and how its tasks spread over nodes (TaskLayout). Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dtstudy.common.run_folder import RunFolder
from dtstudy.config import run_kinds
from dtstudy.config.study_config import VARIANT_KEY
from dtstudy.errors import ConfigError
from dtstudy.launch_backends.registry import launch_backend
from dtstudy.strategies.specs import get_spec


@dataclass(frozen=True)
class TaskLayout:
    """Where the tasks of a run's job go: N workers and a strategy's extra processes over nodes.

    Each node runs the same number of tasks (submitit's tasks_per_node). On every node the
    first tasks are workers (one per GPU), the rest extra processes (parameter-server shards);
    when the extras do not divide evenly over the nodes, the last extra slots stay idle. Ranks
    in torch.distributed are then 0..N-1 for the workers and N.. for the extras, wherever the
    tasks land, so that the strategies never see the layout.
    """

    workers: int
    extras: int
    nodes: int = 1

    def __post_init__(self):
        if self.nodes < 1 or self.workers % self.nodes:
            raise ValueError(f"{self.workers} workers do not spread evenly over {self.nodes} nodes")

    @classmethod
    def over_nodes(cls, workers: int, extras: int, workers_per_node: int | None) -> TaskLayout:
        """The fewest nodes of `workers_per_node` workers that hold all N (None: one node)."""
        nodes = math.ceil(workers / workers_per_node) if workers_per_node else 1
        return cls(workers, extras, nodes)

    @property
    def workers_per_node(self) -> int:
        return self.workers // self.nodes

    @property
    def extras_per_node(self) -> int:
        return math.ceil(self.extras / self.nodes)

    @property
    def tasks_per_node(self) -> int:
        return self.workers_per_node + self.extras_per_node

    @property
    def world_size(self) -> int:
        """Processes in the process group: workers and extras, never the idle slots."""
        return self.workers + self.extras

    @property
    def idle_tasks(self) -> int:
        return self.nodes * self.tasks_per_node - self.world_size

    def rank_of_task(self, task: int) -> int | None:
        """The torch.distributed rank of the job's task number `task` (SLURM_PROCID); None = idle."""
        node, slot = divmod(task, self.tasks_per_node)
        if slot < self.workers_per_node:
            return node * self.workers_per_node + slot
        extra = node * self.extras_per_node + slot - self.workers_per_node
        return self.workers + extra if extra < self.extras else None


def lost_rank_path(job_folder: str | Path, job_id: str) -> Path:
    """Where a run's process that saw a peer lost records which (dtstudy.launch.process_group.PeerWatch),
    for the launcher's error: `<job folder>/<job id>_lost_rank.json`."""
    return Path(job_folder) / f"{job_id}_lost_rank.json"


@dataclass
class RunSpec:
    """Everything one training run depends on."""

    strategy: str
    workers: int
    seed: int
    config: dict  # dtstudy.config.study_config.run_config(...) of the study
    data_dir: str
    out_dir: str
    tracking_uri: str | None = None  # resolved MLflow URI; None = no MLflow logging

    @property
    def kind(self) -> str:
        """scaling or accuracy (dtstudy.config.run_kinds), as its run config says."""
        return run_kinds.kind_of_run_config(self.config)

    @property
    def run_name(self) -> str:
        # an accuracy run keeps the name runs had before there were kinds
        suffix = "" if self.kind == run_kinds.ACCURACY else f"-{self.kind}"
        return f"{self.variant or self.strategy}-n{self.workers}-seed{self.seed}{suffix}"

    @property
    def variant(self) -> str | None:
        """The name of the variant (config `variants`) this run is of, None for a strategy's own run."""
        return (self.config.get(VARIANT_KEY) or {}).get("name")

    @property
    def folder(self) -> RunFolder:
        """The run's files (dtstudy.common.run_folder)."""
        return RunFolder(self.out_dir)

    def strategy_params(self) -> dict:
        """The strategy's knobs, defaults filled in (those that depend on the run's nodes too)."""
        spec = get_spec(self.strategy)
        params = spec.check_params(self.config["strategy_params"].get(self.strategy, {}), self.workers)
        return spec.placed_params(params, self.nodes())

    def nodes(self) -> int:
        """The nodes the run's job spans (`layout`'s): one locally, else the fewest nodes of
        launcher.gpus_per_node (or workers_per_node) workers that hold all N (its launch backend's)."""
        return launch_backend(self.config).nodes(self.config["launcher"], self.workers)

    def processes(self) -> int:
        """The run's processes: N workers plus the strategy's extra ones (parameter-server shards)."""
        return self.workers + get_spec(self.strategy).extra_processes(self.strategy_params(), self.workers)

    def layout(self) -> TaskLayout:
        """How the N workers and the strategy's extra processes spread over the job's nodes
        (the launcher submits this layout; every task maps itself to its rank with it)."""
        extras = self.processes() - self.workers
        per_node = launch_backend(self.config).workers_per_node(self.config["launcher"])
        try:
            return TaskLayout.over_nodes(self.workers, extras, per_node)
        except ValueError:
            raise ConfigError(
                f"config key 'workers': N={self.workers} does not spread evenly over "
                f"{math.ceil(self.workers / per_node)} nodes of "
                f"{per_node} workers (launcher.gpus_per_node / launcher.workers_per_node); "
                "use N <= that or a multiple of it"
            ) from None
