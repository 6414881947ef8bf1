"""Where the tasks of a run's job go: N workers and a strategy's extra processes over nodes.

Each node runs the same number of tasks (submitit's tasks_per_node). On every node the
first tasks are workers (one per GPU), the rest extra processes (parameter-server shards);
when the extras do not divide evenly over the nodes, the last extra slots stay idle. Ranks
in torch.distributed are then 0..N-1 for the workers and N.. for the extras, wherever the
tasks land, so that the strategies never see the layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TaskLayout:
    workers: int
    extras: int
    nodes: int = 1

    def __post_init__(self):
        if self.nodes < 1 or self.workers % self.nodes:
            raise ValueError(f"{self.workers} workers do not spread evenly over {self.nodes} nodes")

    @classmethod
    def over_nodes(cls, workers: int, extras: int, workers_per_node: int | None) -> "TaskLayout":
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
