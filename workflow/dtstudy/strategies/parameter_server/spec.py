"""The parameter servers' specs (torch-free): ps_sync, ps_backup, ps_async and ssp, their
shards and performance model."""

from __future__ import annotations

from typing import Any

from dtstudy.perfmodel import steps
from dtstudy.perfmodel.machine import NO_STRAGGLERS
from dtstudy.strategies.spec import StrategySpec, default_placement

#: the request a worker sends each shard before its gradient (parameter_server.protocol:
#: REQUEST_SIZE float64, 5 since a push carries its checkpoint wish; a constant here, as the
#: specs import no torch)
PS_REQUEST_BYTES = 40


class ParameterServerSpec(StrategySpec):
    family = "parameter server"
    # a shard saves a contiguous range of the flattened parameters (db3e04d); before, whole tensors
    state_layout = "flat-range"
    no_fp16_because = (
        "the shards apply the pushed gradients: a worker's GradScaler can neither unscale "
        "them there nor skip a step with inf/NaN gradients"
    )
    # emulated: the shards are threads too, their work and messages on the cluster's clock
    # (dtstudy.emulation.runner, docs/emulation.md)

    @classmethod
    def extra_processes(cls, params, workers):
        if params["shards"] is None:
            raise ValueError(f"{cls.name}: the shard count is one per node; ask placed_params(params, nodes) first")
        return params["shards"]

    @classmethod
    def placed_params(cls, params, nodes):
        """`shards: null` (the default): one shard per node of the run, so that each node's
        NIC carries one shard's share (perfmodel.steps.shard_count models the same)."""
        return {**params, "shards": steps.default_shards(nodes) if params["shards"] is None else params["shards"]}

    @classmethod
    def model_step(cls, workload, machine, workers, params=None, stragglers=NO_STRAGGLERS):
        """As every strategy's, with `placement` (where the shards sit, a hardware profile's
        key) at the hardware schema's default where the caller gives none."""
        params = {"placement": default_placement(), **(params or {})}
        return super().model_step(workload, machine, workers, params, stragglers)

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        """Push to S shards, each waits for all N, updates, answers: 2 phases + the update."""
        return steps.ps_round_step(cls.name, workload, machine, workers, params, stragglers)

    @classmethod
    def parameters_from_bytes(cls, bytes_per_step, workers, params):
        """A worker pushes its fp32 gradient after a request to each shard (`shards` null: one
        per node, and the runs this reads ran on one node)."""
        if bytes_per_step <= 0:
            return None
        shards = {**cls.defaults, **params}["shards"] or 1
        return round((bytes_per_step - PS_REQUEST_BYTES * shards) / 4)


class PsSyncSpec(ParameterServerSpec):
    name = "ps_sync"


class PsBackupSpec(ParameterServerSpec):
    name = "ps_backup"

    #: k when neither `backup` nor `backup_fraction` is given
    DEFAULT_BACKUPS = 1

    @classmethod
    def validate(cls, params, workers):
        backup, fraction = params["backup"], params["backup_fraction"]
        if backup is not None and fraction is not None:
            raise cls.bad_knob(
                "backup_fraction",
                fraction,
                f"give backup (a count, here {backup!r}) or backup_fraction (a share of N), not both",
            )
        # a single worker has nobody to back it up: N=1 runs as ps_sync, so a study's
        # workers list may start at 1 with a count of 1 (a share is at most N-1 by itself)
        if backup is not None and workers > 1 and backup >= workers:
            raise cls.bad_knob("backup", backup, f"an integer from 0 to N-1 is needed and N={workers} is in workers")

    @classmethod
    def backups(cls, workers: int, params: dict[str, Any]) -> int:
        """k at N=workers: `backup`, or round(backup_fraction * N) when a share is given (1 when
        neither is); at most N-1."""
        backup, fraction = params.get("backup"), params.get("backup_fraction")
        if backup is None:
            backup = cls.DEFAULT_BACKUPS if fraction is None else round(fraction * workers)
        return max(0, min(backup, workers - 1))

    @classmethod
    def quorum(cls, workers: int, params: dict[str, Any]) -> int:
        """The gradients an update waits for: N-k (all N are still sent; N=1 waits for itself)."""
        return workers - cls.backups(workers, params)

    @classmethod
    def barrier(cls, workers, params):
        return workers, 1, cls.quorum(workers, params)

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        """As ps_sync, but the update waits for the (N-k)-th gradient."""
        return steps.ps_round_step(
            cls.name, workload, machine, workers, params, stragglers, quorum=cls.quorum(workers, params)
        )


class PsAsyncSpec(ParameterServerSpec):
    name = "ps_async"

    @classmethod
    def barrier(cls, workers, params):
        return 1, 1, None  # no barrier

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        return steps.ps_async_step(cls.name, workload, machine, workers, params, stragglers)


class SspSpec(ParameterServerSpec):
    name = "ssp"

    @classmethod
    def barrier(cls, workers, params):
        staleness = params["staleness"]
        return workers, (workers if staleness is None else staleness) + 1, None

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        """As ps_async (each push its own update, on arrival), but a worker may run only s
        steps ahead: it waits for the slowest over windows of s+1 steps (a fixed straggler
        still paces everybody). Unbounded (staleness null) it is ps_async."""
        if params["staleness"] is None:
            return steps.ps_async_step(PsAsyncSpec.name, workload, machine, workers, params, stragglers)
        return steps.ps_async_step(
            cls.name, workload, machine, workers, params, stragglers, window=params["staleness"] + 1
        )
