"""Parameter-server strategies: S shard processes own the parameters and the optimizer state;
workers push gradients and get parameters back (point-to-point torch.distributed over gloo).

    ps_sync    a shard averages the N gradients that read version v into update v, then
               answers every worker                                     rate of N*b
    ps_backup  the first N-k pushes that read version v make update v; a push that read an
               older version is dropped (Chen et al. 2016, TF SyncReplicas)  rate of (N-k)*b
    ps_async   every gradient is applied on arrival and answered at once  rate of b
    ssp        as ps_async, but a worker's clock (gradients pushed) stays at most s ahead of
               the slowest worker's: the reply to its push waits (Ho et al. 2013)  rate of b

The messages are in `protocol`, the shard in `shard` (both in this package).

Resumable: the workers agree on a checkpoint's step through the first shard (no collective
between the workers, which need not be in step), every worker and every shard saves its own rank
file there, and a run started again continues from the newest step they all saved (`protocol`).
"""

from __future__ import annotations

import datetime
import math
from abc import abstractmethod
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtstudy.gloo_loops import lower_gloo_event_loops
from dtstudy.strategies.base import CHECKPOINT, STOP, OptimizerFactory, Strategy
from dtstudy.strategies.parameter_server.protocol import (
    REPLY_HEADER_SIZE,
    SETUP_FIELDS,
    TAG_GRADIENT,
    TAG_PARAMETERS,
    TAG_REQUEST,
    TAG_SAVED,
    TAG_SETUP,
    TAG_VERSION,
    VALUE_DTYPE,
    BoundaryAction,
    Kind,
    request,
    split_contiguous,
)
from dtstudy.strategies.parameter_server.shard import ShardServer, ShardStats, UpdatePolicy
from dtstudy.strategies.parameter_server.spec import PsAsyncSpec, PsBackupSpec, PsSyncSpec, SspSpec

# the training loop's names of the boundary actions (dtstudy.training.checkpoint) and their codes
ACTION_CODES = {CHECKPOINT: BoundaryAction.CHECKPOINT, STOP: BoundaryAction.STOP}
ACTION_NAMES = {code: name for name, code in ACTION_CODES.items()}


class ShardSlice:
    """A worker's view of one shard: the pieces (parameter, start, end) of the flattened
    parameters it owns (`protocol.split_contiguous`) and flat CPU message buffers."""

    def __init__(self, rank: int, pieces: list[tuple[nn.Parameter, int, int]]):
        self.rank = rank
        self.pieces = pieces
        self.numel = sum(end - start for _, start, end in pieces)
        # page-locked when the parameters are on a GPU: its copies to and from them are DMA
        # transfers at full speed (no bounce through a staging buffer); they stay blocking,
        # as the buffers are sent and received into right after
        pinned = any(parameter.is_cuda for parameter, _, _ in pieces)
        self.outgoing = torch.empty(self.numel, dtype=VALUE_DTYPE, pin_memory=pinned)
        self.incoming = torch.empty(self.numel, dtype=VALUE_DTYPE, pin_memory=pinned)
        self.incoming_version = torch.empty(REPLY_HEADER_SIZE, dtype=torch.float64)
        self.read_version = 0  # the shard's version of the parameters this worker holds

    def views(self, flat: torch.Tensor):
        """(parameter, start, end, the piece's part of `flat`) for each piece, in order."""
        offset = 0
        for parameter, start, end in self.pieces:
            yield parameter, start, end, flat[offset : offset + end - start]
            offset += end - start

    def pack_gradients(self, flat_gradients: dict[nn.Parameter, torch.Tensor | None]) -> None:
        """`flat_gradients`: each parameter's gradient flattened in its logical order (None: no
        gradient, zeros are sent)."""
        for parameter, start, end, view in self.views(self.outgoing):
            gradient = flat_gradients[parameter]
            if gradient is None:
                view.zero_()
            else:
                view.copy_(gradient[start:end])

    def pack_parameters(self) -> None:
        for parameter, start, end, view in self.views(self.outgoing):
            view.copy_(parameter.detach().reshape(-1)[start:end])


class ShardClient:
    """A worker's end of the exchange with every shard."""

    def __init__(self, slices: list[ShardSlice], group):
        self.slices, self.group = slices, group
        # every parameter once, and where its values arrive: (start, end, part of a slice's
        # incoming buffer), in flat order (the shards' ranges follow it)
        self.arrivals: dict[nn.Parameter, list[tuple[int, int, torch.Tensor]]] = {}
        for piece in slices:
            for parameter, start, end, view in piece.views(piece.incoming):
                self.arrivals.setdefault(parameter, []).append((start, end, view))
        self.steps = 0  # gradients pushed so far = the step this worker is in
        self.wish = BoundaryAction.NONE  # a checkpoint or stop this worker asks for, in its pushes
        self.boundary: tuple[int, BoundaryAction] | None = None  # the agreed one, from the first shard

    def send_setup(self, optimizer: torch.optim.Optimizer) -> None:
        """Rank 0: each shard's size, the optimizer's hyper-parameters and initial values."""
        if type(optimizer) is not torch.optim.SGD:
            raise TypeError(f"parameter-server shards run SGD; the training loop built {type(optimizer).__name__}")
        hyper = optimizer.param_groups[0]
        for piece in self.slices:
            setup = [float(piece.numel)] + [float(hyper[name]) for name in SETUP_FIELDS[1:]]
            dist.send(torch.tensor(setup, dtype=torch.float64), dst=piece.rank, group=self.group, tag=TAG_SETUP)
            piece.pack_parameters()
            dist.send(piece.outgoing, dst=piece.rank, group=self.group, tag=TAG_PARAMETERS)

    def push(self, lr: float) -> int:
        """Send this step's gradients, wait for the parameters of the next step; returns bytes sent."""
        works = self._expect_replies()
        sent = 0
        # flattened once per parameter (a copy only for a non-contiguous gradient, e.g. channels_last)
        flat_gradients = {
            parameter: None if parameter.grad is None else parameter.grad.reshape(-1) for parameter in self.arrivals
        }
        for piece in self.slices:
            piece.pack_gradients(flat_gradients)
            header = request(Kind.PUSH, self.steps, piece.read_version, lr, self.wish)
            works.append(dist.isend(header, dst=piece.rank, group=self.group, tag=TAG_REQUEST))
            works.append(dist.isend(piece.outgoing, dst=piece.rank, group=self.group, tag=TAG_GRADIENT))
            sent += _nbytes(header) + _nbytes(piece.outgoing)
        for parameter in self.arrivals:  # only now: a parameter spanning shards is packed by each
            parameter.grad = None
        self._finish(works)
        self.steps += 1
        return sent

    def pull(self) -> None:
        works = self._expect_replies()
        works += [
            dist.isend(request(Kind.PULL), dst=piece.rank, group=self.group, tag=TAG_REQUEST) for piece in self.slices
        ]
        self._finish(works)

    def agree(self, step: int, wanted: BoundaryAction) -> BoundaryAction:
        """At a step boundary (`step` pushes done): ask for `wanted` (in the pushes from now on,
        until the first shard has agreed a boundary at least as strong) and return the agreed
        action when this is its step."""
        self.wish = max(self.wish, wanted)
        if self.boundary is None:
            return BoundaryAction.NONE
        at, action = self.boundary
        if at < step:  # the first shard's boundary is never behind a worker (protocol)
            raise RuntimeError(f"parameter-server worker at step {step}: the agreed boundary, step {at}, has passed")
        if at > step:
            return BoundaryAction.NONE
        self.boundary = None
        if action >= self.wish:
            self.wish = BoundaryAction.NONE
        return action

    def save(self, step: int, action: BoundaryAction) -> None:
        """At the agreed boundary: every shard saves its state of `step`; returns once all have."""
        works = [
            dist.isend(request(Kind.SAVE, step, wish=action), dst=piece.rank, group=self.group, tag=TAG_REQUEST)
            for piece in self.slices
        ]
        saved = [torch.empty(1, dtype=torch.float64) for _ in self.slices]
        works += [
            dist.irecv(done, src=piece.rank, group=self.group, tag=TAG_SAVED) for piece, done in zip(self.slices, saved)
        ]
        for work in works:
            work.wait()
        if any(int(done.item()) != step for done in saved):
            steps = [int(done.item()) for done in saved]
            raise RuntimeError(f"parameter-server worker: the shards saved steps {steps}, not {step}")

    def idle(self) -> None:
        """Tell every shard this worker sends no more pushes until its next pull."""
        for piece in self.slices:
            dist.send(request(Kind.IDLE), dst=piece.rank, group=self.group, tag=TAG_REQUEST)

    def done(self) -> None:
        for piece in self.slices:
            dist.send(request(Kind.DONE), dst=piece.rank, group=self.group, tag=TAG_REQUEST)

    def receive_stats(self) -> list[ShardStats]:
        return [ShardStats.receive(piece.rank, self.group) for piece in self.slices]

    def _expect_replies(self) -> list:
        # posted before the request goes out, so that a shard's reply never waits for us
        works = []
        for piece in self.slices:
            works.append(dist.irecv(piece.incoming_version, src=piece.rank, group=self.group, tag=TAG_VERSION))
            works.append(dist.irecv(piece.incoming, src=piece.rank, group=self.group, tag=TAG_PARAMETERS))
        return works

    def _finish(self, works: list) -> None:
        for work in works:
            work.wait()
        for piece in self.slices:
            piece.read_version = int(piece.incoming_version[0].item())
        self._take_parameters()
        at, action = self.slices[0].incoming_version[1:].tolist()  # the first shard's boundary
        self.boundary = (int(at), BoundaryAction(int(action))) if at >= 0 else None

    @torch.no_grad()
    def _take_parameters(self) -> None:
        """Copy the replies' values into the parameters, piece by piece."""
        for parameter, parts in self.arrivals.items():
            if parameter.is_contiguous():
                flat = parameter.view(-1)
                for start, end, values in parts:
                    flat[start:end].copy_(values)
            else:  # no flat view of it (channels_last): the whole tensor from its parts in order
                values = parts[0][2] if len(parts) == 1 else torch.cat([values for _, _, values in parts])
                parameter.copy_(values.view(parameter.shape))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class ParameterServer(Strategy):
    """What the four parameter-server strategies share; each gives its `update_policy`."""

    # the shards save their parameters, optimizer state, version and clocks at the agreed
    # boundary, next to the workers' files (protocol); ps_sync then resumes exactly
    resumable = True

    def __init__(self, ctx, params):
        super().__init__(ctx, params)
        # NCCL moves no CPU point-to-point messages; every rank creates the group, in this order
        # (a new group's time-out is the backend's default, not the run's: given here). gloo and
        # an emulated run's group (dtstudy.emulation) move them in the job's own group
        self.group = (
            dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=ctx.comm_timeout_s))
            if ctx.backend == "nccl"
            else None
        )
        if self.group is not None:
            lower_gloo_event_loops(ctx.gloo_loop_nice)  # the new group's loop
        self.shard_stats: list[ShardStats] = []

    @abstractmethod
    def update_policy(self) -> UpdatePolicy:
        """How the shards turn this strategy's pushes into updates."""

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        model.to(self.ctx.device)
        self.model = model
        self.batch = 0  # images of this worker's last training batch (each push's images)
        model.register_forward_pre_hook(self._note_batch)
        parameters = [p for p in model.parameters() if p.requires_grad]
        if any(p.dtype != VALUE_DTYPE for p in parameters):
            raise TypeError(f"parameter-server strategies exchange {VALUE_DTYPE} parameters only")
        owned = split_contiguous([p.numel() for p in parameters], self.params["shards"])
        slices = [
            ShardSlice(self.ctx.workers + shard, [(parameters[index], start, end) for index, start, end in pieces])
            for shard, pieces in enumerate(owned)
        ]
        self.client = ShardClient(slices, self.group)
        if self.ctx.rank == 0:
            self.client.send_setup(make_optimizer(parameters))
        self.client.pull()
        return model

    def _note_batch(self, module: nn.Module, args) -> None:
        if module.training and args:
            self.batch = len(args[0])

    def update(self, lr: float) -> None:
        # on a GPU the span starts at an event after backward: the host's wait for backward
        # in the gradients' device-to-host copy counts as compute, the copy as exchange
        with self.meter.timed():
            self.meter.bytes_sent += self.client.push(lr)

    def eval_model(self) -> nn.Module:
        self.client.idle()  # the shards may now close a version that can no longer fill up
        if self.ctx.workers > 1:
            # once every worker holds the replies to all its pushes, every shard has taken them in
            dist.barrier(group=self.ctx.worker_group)
            # buffers (batch-norm statistics) stay on the workers: evaluate rank 0's everywhere
            for buffer in self.model.buffers():
                dist.broadcast(buffer, src=0, group=self.ctx.worker_group)
        self.client.pull()
        return self.model

    # ----- checkpoints: agreed through the first shard, saved by every process -------------
    def boundary_agreement(self):
        def agree(step: int, wanted: str | None) -> str | None:
            return ACTION_NAMES.get(self.client.agree(step, ACTION_CODES.get(wanted, BoundaryAction.NONE)))

        return agree

    def resume_ranks(self):
        return self.ctx.world_size, self.group  # the shards save rank files too

    def save_extra_processes(self, step: int, stopping: bool) -> None:
        self.client.save(step, BoundaryAction.STOP if stopping else BoundaryAction.CHECKPOINT)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.client.steps, "batch": self.batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.client.steps, self.batch = int(state["steps"]), int(state["batch"])
        # the shards' parameters and version as resumed (with ps_async/ssp newer than the
        # ones this worker saved: the others' pushes after its last reply)
        self.client.pull()

    def finish(self) -> None:
        self.client.done()
        if self.ctx.rank == 0:
            self.shard_stats = self.client.receive_stats()

    @staticmethod
    def _histogram(counts: Counter) -> dict[str, int]:
        # JSON keys are strings: the same in metrics.json as in the returned dict
        return {str(value): counts[value] for value in sorted(counts)}

    def summary(self) -> dict[str, Any]:
        if not self.shard_stats:
            return {}
        staleness = sum((stats.staleness for stats in self.shard_stats), start=Counter())
        ahead = sum((stats.ahead for stats in self.shard_stats), start=Counter())
        gradients = staleness.total()
        dropped_by_worker = [sum(counts) for counts in zip(*(stats.dropped for stats in self.shard_stats))]
        dropped = sum(dropped_by_worker)
        busy = [stats.busy_s / stats.wall_s if stats.wall_s else 0.0 for stats in self.shard_stats]
        shards = len(self.shard_stats)
        return {
            "shards": shards,
            "shard_numel": [piece.numel for piece in self.client.slices],
            "updates": sum(stats.updates for stats in self.shard_stats),  # optimizer steps, all shards
            "gradients_applied": gradients,  # all shards
            "dropped_gradients": dropped,  # all shards
            "dropped_by_worker": dropped_by_worker,
            "dropped_fraction": dropped / max(dropped + gradients, 1),
            # the images whose gradients made updates (per shard: each shard sees every push;
            # every worker's batch has the same size, drop_last)
            "images_applied": gradients * self.batch / shards,
            "staleness": self._histogram(staleness),
            "staleness_mean": sum(value * count for value, count in staleness.items()) / max(gradients, 1),
            "staleness_max": max(staleness, default=0),
            # per answered push: how many clocks (gradients pushed) its worker was ahead of the slowest
            "clock_ahead": self._histogram(ahead),
            "clock_ahead_max": max(ahead, default=0),
            "shard_busy_fraction": sum(busy) / len(busy),
            "shard_busy_fraction_per_shard": busy,
        }

    def serve(self, files=None) -> None:
        ShardServer(
            self.ctx.workers,
            self.group,
            self.update_policy(),
            self.ctx.comm_timeout_s,
            self.ctx.startup_timeout_s,
            coordinator=self.ctx.rank == self.ctx.workers,
        ).serve(files)


class PsSync(ParameterServer):
    spec = PsSyncSpec

    def update_policy(self) -> UpdatePolicy:
        return UpdatePolicy.synchronous(self.ctx.workers)


class PsBackup(ParameterServer):
    spec = PsBackupSpec
    update_batch_rule = "(N-k)*b: an update averages the first N-k gradients of the version they read"

    @classmethod
    def update_batch(cls, params, workers, per_worker_batch):
        return cls.spec.quorum(workers, params) * per_worker_batch

    def update_policy(self) -> UpdatePolicy:
        return UpdatePolicy.synchronous(self.spec.quorum(self.ctx.workers, self.params))

    def summary(self) -> dict[str, Any]:
        summary = super().summary()
        if summary:  # k as this run resolved it (a backup_fraction gives it per N)
            summary["backups"] = self.spec.backups(self.ctx.workers, self.params)
        return summary


def implicit_momentum_compensation(momentum: float, workers: int) -> tuple[float, float]:
    """(explicit momentum, rate factor) for N asynchronous workers whose updates carry an
    implicit momentum of 1 - 1/N (Mitliagkas et al. 2016): mu' = max(0, 1 - N (1 - mu)) makes
    (1 - mu') (1 - (1 - 1/N)) = 1 - mu; the factor (1 - mu') / (1 - mu) keeps lr / (1 - mu)."""
    explicit = max(0.0, 1.0 - workers * (1.0 - momentum))
    return explicit, (1.0 - explicit) / (1.0 - momentum)


class AsyncParameterServer(ParameterServer):
    """Every gradient is an update of its own, applied on arrival: the rate is that of one
    worker's batch b (Dean et al. 2012; Zhang et al. 2016). Knobs shared by ps_async and ssp:

    staleness_lr: divide each update's rate by its staleness (>= 1) at the shard (Zhang et al.
        2016, staleness-aware async SGD).
    momentum: the momentum mu the run asks for (null: train.momentum, as every other strategy).
    implicit_momentum: count the momentum asynchrony adds by itself, about 1 - 1/N
        (Mitliagkas et al. 2016, "Asynchrony begets momentum"): the shards' explicit momentum
        becomes mu' = max(0, 1 - N (1 - mu)), so that (1 - mu') / N = 1 - mu, and every rate
        is multiplied by (1 - mu') / (1 - mu), so that the effective step lr / (1 - mu) is
        the one asked for (implicit_momentum_compensation). N=1: mu and the rate unchanged.
    """

    update_batch_rule = (
        "b: every worker's gradient is applied on arrival as an update of its own (times "
        "strategy_metrics.momentum.rate_factor with implicit_momentum)"
    )

    @classmethod
    def update_batch(cls, params, workers, per_worker_batch):
        return per_worker_batch

    def setup(self, model, make_optimizer):
        asked = self.params["momentum"]
        if asked is None:  # train.momentum, read off the run's own optimizer factory
            asked = make_optimizer([torch.zeros(1, requires_grad=True)]).param_groups[0]["momentum"]
        self.momentum_asked = asked
        self.momentum, self.rate_factor = (
            implicit_momentum_compensation(asked, self.ctx.workers)
            if self.params["implicit_momentum"]
            else (asked, 1.0)
        )

        def with_momentum(parameters, make=make_optimizer):
            optimizer = make(parameters)
            for group in optimizer.param_groups:
                group["momentum"] = self.momentum
                # no momentum left to look ahead along (N >= 1 / (1 - mu)): plain SGD, as torch requires
                group["nesterov"] = group["nesterov"] and self.momentum > 0
            return optimizer

        return super().setup(model, with_momentum)

    def update(self, lr: float) -> None:
        super().update(lr * self.rate_factor)

    def summary(self) -> dict[str, Any]:
        summary = super().summary()
        if summary:
            summary["momentum"] = {
                "asked": self.momentum_asked,
                "explicit": self.momentum,
                "rate_factor": self.rate_factor,
                "implicit_momentum": bool(self.params["implicit_momentum"]),
            }
        return summary

    def clock_bound(self) -> float:
        return math.inf

    def update_policy(self) -> UpdatePolicy:
        return UpdatePolicy.asynchronous(self.clock_bound(), self.params["staleness_lr"])


class PsAsync(AsyncParameterServer):
    spec = PsAsyncSpec


class Ssp(AsyncParameterServer):
    """Stale synchronous parallel (Ho et al. 2013): as ps_async, every gradient is applied on
    arrival and a worker's reply holds its own update, but a worker's clock (gradients it
    pushed) stays at most `staleness` s ahead of the slowest worker's: the reply that starts
    its next step waits until then. s = 0: every clock is a barrier (with momentum 0 and the
    linear rule, ps_sync's parameters); `staleness: null`: unbounded, ps_async."""

    spec = SspSpec

    def clock_bound(self) -> float:
        staleness = self.params["staleness"]
        return math.inf if staleness is None else staleness
