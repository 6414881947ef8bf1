"""Run one training run emulated (launcher.cluster: emulate): its N logical workers are
threads of this process, each running the real training loop (dtstudy.training.loop.train_worker)
with the real strategy object over the emulated process group, one at a time on the cluster's
clock. It writes what a real run writes (metrics.json, model.pt), with metrics.json's times the
emulated cluster's and an `emulation` section saying so.

A strategy's extra processes (a parameter server's S shards, global ranks N..N+S-1) are threads
of the run too, running the strategy's real `serve()` on a ShardClock; as a job's processes,
every rank makes the workers' own group. The shard count is the run's `shards` knob, or one per
node of the emulated cluster (not of the launcher's settings: the cluster is the profile's).

Memory: N copies of one worker's state (model, optimizer, the strategy's buffers) and one copy
of the data set (dtstudy.data.loading.shared_splits).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from dtstudy.config.study_config import per_worker_batch
from dtstudy.data.loading import shared_splits
from dtstudy.emulation.clock import EmulatedClock, ExchangeCosts, ShardClock
from dtstudy.emulation.process_group import BACKEND
from dtstudy.emulation.settings import EmulatedCluster, emulated_cluster
from dtstudy.emulation.workers import LogicalWorkers
from dtstudy.launch_backends.emulate import EMULATE
from dtstudy.perfmodel.machine import Machine
from dtstudy.runspec import RunSpec
from dtstudy.strategies.base import DistContext
from dtstudy.strategies.specs import get_spec
from dtstudy.tracking.run_outputs import write_metrics
from dtstudy.training.compute import pick_device
from dtstudy.training.loop import train_worker


def step_compute_s(spec: RunSpec, cluster: EmulatedCluster) -> float:
    """One worker's compute of a step on the cluster: its batch at one GPU's rate, scaled for
    the busy workers of a node as the performance model scales it (StrategySpec.model_step)."""
    machine = cluster.machine
    scale = machine.compute_scale.get(machine.local(spec.workers), 1.0) if machine.compute_scale else 1.0
    return per_worker_batch(spec.config["train"], spec.workers) / cluster.images_per_s * scale


def placed_on_cluster(spec: RunSpec, machine: Machine) -> RunSpec:
    """`spec` with its knobs that depend on the run's nodes (a parameter server's `shards: null`:
    one per node) filled in for the nodes of `machine` the N workers fill."""
    strategy = get_spec(spec.strategy)
    params = strategy.check_params(spec.config["strategy_params"].get(spec.strategy, {}), spec.workers)
    placed = strategy.placed_params(params, machine.nodes(spec.workers))
    if placed == params:  # nothing depends on the nodes: the run's config as the study wrote it
        return spec
    config = {**spec.config, "strategy_params": {**spec.config["strategy_params"], spec.strategy: placed}}
    return dataclasses.replace(spec, config=config)


class EmulatedRun:
    """One run's N logical workers (dtstudy.emulation.workers), each training as rank r, and
    its extra processes (ranks N and up) serving."""

    def __init__(self, spec: RunSpec):
        self.cluster = emulated_cluster(spec.config)
        machine = self.cluster.machine
        self.spec = spec = placed_on_cluster(spec, machine)
        self.world_size = spec.processes()  # N workers and the strategy's extra processes
        self.compute_s = step_compute_s(spec, self.cluster)
        # every logical worker computes on this process's device: its GPU (one for all) or the CPU
        self.device = pick_device(spec.config["launcher"]["device"], local_rank=0)
        costs = ExchangeCosts(machine, spec.workers, self.cluster.placement(spec.strategy))
        self.workers = LogicalWorkers(self.world_size, costs, self.make_clock)

    def make_clock(self, scheduler, rank: int) -> EmulatedClock:
        if rank >= self.spec.workers:  # a shard: the model's time of its work
            return ShardClock(scheduler, rank, self.cluster.machine.server_bandwidth)
        return EmulatedClock(scheduler, rank, self.compute_s, self.cluster.machine.skew_fraction, self.spec.seed)

    def run(self, timings: dict | None = None) -> dict:
        """Train; rank 0's metrics (also in metrics.json). Raises the first logical worker's error."""
        timings = dict(timings or {})
        started = time.perf_counter()
        workers = self.spec.workers

        def train(rank: int) -> dict | None:
            # with extra processes, a workers-only group, made by every rank (join_process_group's)
            worker_group = dist.new_group(list(range(workers))) if self.world_size > workers else None
            ctx = DistContext(
                rank=rank,
                world_size=self.world_size,
                workers=workers,
                local_rank=rank,
                device=self.device if rank < workers else torch.device("cpu"),
                backend=BACKEND,
                worker_group=worker_group,
                concurrent_ranks=1,
            )
            return train_worker(self.spec, ctx, timings={**timings, "process_start": time.time()})

        with shared_splits():
            metrics = self.workers.run(train, self.spec.run_name)[0]
        metrics["emulation"] = self.record(metrics, time.perf_counter() - started)
        metrics["wall_time_s"] = metrics["emulation"]["wall_time_s"]  # the cluster's, as throughput's
        write_metrics(self.spec, metrics)
        return metrics

    def record(self, metrics: dict, host_s: float) -> dict:
        """metrics.json's `emulation`: the cluster, its clock's inputs, the emulated and host times."""
        cluster, scheduler = self.cluster, self.workers.scheduler
        return {
            "cluster": EMULATE.kind,
            "hardware": cluster.profile,
            "images_per_s": cluster.images_per_s,
            "images_per_s_source": cluster.rate_source,
            "step_compute_s": self.compute_s,
            # the run's emulated seconds: from the start to the last worker's end (set-up and
            # evaluations' exchanges included, their compute not modelled)
            "wall_time_s": max(scheduler.time),
            "host_wall_time_s": host_s,
            "host_loop_wall_time_s": metrics["wall_time_s"],
            "collectives": self.workers.world.collectives,
            "extra_processes": self.world_size - self.spec.workers,
            "baton_switches": scheduler.switches,
        }


def run_emulated(spec: RunSpec, timings: dict | None = None) -> dict:
    """Run `spec` emulated in this process; rank 0's metrics (metrics.json and model.pt written)."""
    return EmulatedRun(spec).run(timings)
