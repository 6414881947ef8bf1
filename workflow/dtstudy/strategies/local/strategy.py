"""Workers that train their own copy of the model and exchange parameters now and then:
local SGD (Lin et al. 2020, with the post-local-SGD warm-up) and synchronous elastic
averaging SGD (Zhang, Choromanska, LeCun 2015).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from dtstudy.perfmodel.collectives import ring_allreduce_bytes
from dtstudy.strategies.base import OptimizerFactory, Strategy
from dtstudy.strategies.local.spec import EASGDSpec, LocalSGDSpec


@torch.no_grad()
def average_over_workers(tensors: Iterable[torch.Tensor], group) -> int:
    """Replace each tensor by its mean over the workers (one flat all-reduce); returns the payload bytes.

    In place: each tensor keeps its strides (a channels_last weight stays channels_last, its
    gradient keeps the parameter's strides, as the fused CUDA SGD kernel wants) and its
    identity. torch's average_parameters would set `.data` to contiguous views of its flat
    buffer, and synchronize the device before its all-reduce (tests/test_device_rules.py)."""
    tensors = list(tensors)
    flat = flatten(tensors)
    flat /= dist.get_world_size(group)
    dist.all_reduce(flat, group=group)
    torch._foreach_copy_(tensors, shaped_like(flat, tensors))
    return sum(t.numel() * t.element_size() for t in tensors)


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def shaped_like(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` cut and shaped as `tensors` (the inverse of `flatten`)."""
    return [part.view_as(t) for t, part in zip(tensors, flat.split([t.numel() for t in tensors]))]


def floating_state(model: nn.Module) -> list[torch.Tensor]:
    """Parameters and floating buffers (e.g. BatchNorm statistics): what an averaged model averages."""
    return [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]


class LocalTraining(Strategy):
    """Each worker steps its own model with its own optimizer (no DDP); subclasses exchange.

    All workers start from rank 0's parameters. `eval_model` is the average of the workers'
    models, its BatchNorm statistics recomputed on training batches (`recompute_batch_norm`:
    the mean of the workers' statistics is not the averaged model's); it also records the
    consensus distance (mean over workers of the squared distance of a worker's parameters
    to that average), reported per evaluation in `summary`.
    """

    resumable = True  # the workers exchange in lockstep; all the state is on them
    averages_models = True  # the evaluated model's BatchNorm statistics are recomputed

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        model.to(self.ctx.device)
        self.model = model
        if self.ctx.workers > 1:
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0, group=self.ctx.worker_group)
        self.optimizer = make_optimizer(model.parameters())
        self.steps = 0  # steps taken by this worker
        self._averaged: nn.Module | None = None
        self._consensus: dict[int, float] = {}  # step -> consensus distance
        return model

    def update(self, lr: float) -> None:
        super().update(lr)
        self.steps += 1

    def exchange_average(self, tensors: Iterable[torch.Tensor]) -> None:
        """Average `tensors` over the workers as this step's communication (timed and counted)."""
        with self.meter.timed():  # from the work queued before it to the average's end, on the device
            payload = average_over_workers(tensors, self.ctx.worker_group)
        self.meter.bytes_sent += ring_allreduce_bytes(payload, self.ctx.workers)

    def eval_model(self) -> nn.Module:
        averaged = self.average_and_record()
        if averaged is not self.model:
            self.recompute_batch_norm(averaged)
        return averaged

    @torch.no_grad()
    def average_and_record(self) -> nn.Module:
        """The workers' average (this worker's model at N=1); records the consensus distance."""
        if self.ctx.workers == 1:
            self._consensus[self.steps] = 0.0
            return self.model
        if self._averaged is None:
            self._averaged = copy.deepcopy(self.model)
        self._averaged.load_state_dict(self.model.state_dict())
        average_over_workers(floating_state(self._averaged), self.ctx.worker_group)
        squared = sum(
            (mine - mean).pow(2).sum() for mine, mean in zip(self.model.parameters(), self._averaged.parameters())
        )
        dist.all_reduce(squared, group=self.ctx.worker_group)
        self._consensus[self.steps] = squared.item() / self.ctx.workers
        return self._averaged

    def summary(self) -> dict:
        return {"consensus_distance": [{"step": s, "distance": d} for s, d in sorted(self._consensus.items())]}

    # every worker's model and optimizer are saved by the training loop; here: the step
    # counter (the exchange period counts from it) and the consensus record
    def state_dict(self) -> dict:
        return {"steps": self.steps, "consensus": [[s, d] for s, d in sorted(self._consensus.items())]}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self._consensus = {int(s): float(d) for s, d in state["consensus"]}


class LocalSGD(LocalTraining):
    """`period` (H) local steps, then parameters and momentum buffers averaged by all-reduce.

    The first `warmup_steps` steps are synchronous SGD instead (gradients averaged by an
    all-reduce every step: post-local SGD). Averaging happens after local steps H, 2H, ...
    counted from the end of the warm-up. Bytes: ring all-reduce of the averaged tensors on
    the steps that exchange, 0 on the others.
    """

    spec = LocalSGDSpec

    def _warming_up(self) -> bool:
        return self.steps < self.params["warmup_steps"]

    def backward(self, loss) -> None:
        loss.backward()
        if self._warming_up() and self.ctx.workers > 1:
            self.exchange_average(p.grad for p in self.model.parameters() if p.grad is not None)

    def update(self, lr: float) -> None:
        super().update(lr)
        local_steps = self.steps - self.params["warmup_steps"]
        if local_steps > 0 and local_steps % self.params["period"] == 0 and self.ctx.workers > 1:
            self.exchange_average([*self.model.parameters(), *self._momentum_buffers()])

    def _momentum_buffers(self) -> list[torch.Tensor]:
        buffers = (self.optimizer.state[p].get("momentum_buffer") for p in self.model.parameters())
        return [b for b in buffers if b is not None]


class EASGD(LocalTraining):
    """Synchronous elastic averaging SGD.

    Every `period` (tau) local steps: d_i = alpha (x_i - c); x_i -= d_i; c += sum_i d_i, the
    sum by an all-reduce so that the centre c stays the same on every worker. The moving
    rate is alpha = beta / N (the paper's choice, beta = 0.9), or `alpha` when set, with
    N alpha <= 1 for every N of the study (checked before any job starts). The
    default period 8 matches local_sgd's, so both exchange a model every 8 steps.
    `eval_model` is a model holding the centre. With one worker there is nothing to couple:
    the centre is the worker's model and training is plain SGD (docs/strategies.md, "Equivalences
    the tests check").
    Bytes: ring all-reduce of the parameters on the steps that exchange.
    """

    spec = EASGDSpec

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        module = super().setup(model, make_optimizer)
        alpha = self.params["alpha"]
        self.alpha = alpha if alpha is not None else self.params["beta"] / self.ctx.workers
        self.centre = flatten(model.parameters())
        self.centre_model = copy.deepcopy(model)
        return module

    @torch.no_grad()
    def update(self, lr: float) -> None:
        super().update(lr)
        if self.ctx.workers == 1 or self.steps % self.params["period"]:
            return
        with self.meter.timed():
            parameters = list(self.model.parameters())
            elastic = flatten(parameters).sub_(self.centre).mul_(self.alpha)
            for parameter, d in zip(parameters, shaped_like(elastic, parameters)):
                parameter.sub_(d)
            dist.all_reduce(elastic, group=self.ctx.worker_group)
            self.centre += elastic
        self.meter.bytes_sent += ring_allreduce_bytes(elastic.numel() * elastic.element_size(), self.ctx.workers)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "centre": self.centre.detach().cpu()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.centre.copy_(state["centre"])

    @torch.no_grad()
    def eval_model(self) -> nn.Module:
        self.average_and_record()  # records how far the workers are apart
        if self.ctx.workers == 1:
            return self.model
        self.centre_model.load_state_dict(self.model.state_dict())  # buffers: recomputed below
        parameters = list(self.centre_model.parameters())
        for parameter, c in zip(parameters, shaped_like(self.centre, parameters)):
            parameter.copy_(c)
        self.recompute_batch_norm(self.centre_model)
        return self.centre_model
