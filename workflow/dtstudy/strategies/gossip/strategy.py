"""Decentralized (gossip) SGD: a local step, then each worker averages its parameters with
its neighbours' by point-to-point messages; no global synchronisation (Lian et al. 2017)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from dtstudy.strategies.base import OptimizerFactory
from dtstudy.strategies.gossip.spec import GossipSpec
from dtstudy.strategies.local.strategy import LocalTraining, flatten, shaped_like


def ring_neighbours(rank: int, workers: int) -> list[int]:
    """Left and right neighbour; with two workers both are the other one, counted once, so
    that each worker mixes 1/2 : 1/2 and the mixing matrix stays doubly stochastic."""
    return sorted({(rank - 1) % workers, (rank + 1) % workers} - {rank})


def pair_partner(rank: int, permutation: Sequence[int]) -> list[int]:
    """The partner of `rank` when consecutive entries of `permutation` form pairs ([] if unpaired)."""
    position = list(permutation).index(rank)
    partner = position ^ 1  # 0<->1, 2<->3, ...
    return [int(permutation[partner])] if partner < len(permutation) else []


@torch.no_grad()
def gossip_average(parameters: list[torch.Tensor], peers: Sequence[int], group=None) -> int:
    """Replace `parameters` by the mean of this worker's and its peers' (each peer does the
    same with its own peers): mixing weights 1/(1+len(peers)). Returns the bytes sent."""
    mine = flatten(parameters)
    theirs = [torch.empty_like(mine) for _ in peers]
    operations = [dist.P2POp(dist.isend, mine, peer, group) for peer in peers]
    operations += [dist.P2POp(dist.irecv, buffer, peer, group) for peer, buffer in zip(peers, theirs)]
    for work in dist.batch_isend_irecv(operations):
        work.wait()
    average_into(parameters, mine, theirs)
    return mine.numel() * mine.element_size() * len(peers)


@torch.no_grad()
def average_into(parameters: list[torch.Tensor], mine: torch.Tensor, theirs: Sequence[torch.Tensor]) -> None:
    """`parameters` <- the mean of this worker's flat parameters and its peers': a gossip
    step's own work besides the exchange (the communication benchmark times it as a kernel)."""
    mixed = torch.stack([mine, *theirs]).mean(dim=0)
    for parameter, part in zip(parameters, shaped_like(mixed, parameters)):
        parameter.copy_(part)


class Gossip(LocalTraining):
    """Local step, then average with the neighbours: `topology` `ring` (default: left and
    right neighbour, weights 1/3 each) or `random_pairs` (workers paired at random every
    step, the same draw on every worker from a seed rank 0 broadcasts at setup; with odd N
    one worker sits the step out). Momentum buffers stay local.

    `eval_model` is the average of the workers' models (all-reduce); the consensus distance
    is recorded at every evaluation. Bytes: the parameters once per neighbour per step.
    """

    spec = GossipSpec

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        module = super().setup(model, make_optimizer)
        if self.params["topology"] == "random_pairs" and self.ctx.workers > 1:
            # on the run's device: NCCL moves no host memory (tests/test_device_rules.py)
            seed = torch.tensor([torch.initial_seed() % 2**62], device=self.ctx.device)
            dist.broadcast(seed, src=0, group=self.ctx.worker_group)
            self.pairing = torch.Generator().manual_seed(int(seed.item()))
        return module

    def neighbours(self) -> list[int]:
        if self.ctx.workers == 1:
            return []
        if self.params["topology"] == "ring":
            return ring_neighbours(self.ctx.rank, self.ctx.workers)
        return pair_partner(self.ctx.rank, torch.randperm(self.ctx.workers, generator=self.pairing).tolist())

    def state_dict(self) -> dict:
        state = super().state_dict()
        if hasattr(self, "pairing"):
            state["pairing"] = self.pairing.get_state()  # where the random pairs' draws are
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if hasattr(self, "pairing"):
            self.pairing.set_state(state["pairing"])

    def update(self, lr: float) -> None:
        super().update(lr)
        peers = self.neighbours()
        if peers:
            with self.meter.timed():  # marks of the device's clock: no host sync needed
                self.meter.bytes_sent += gossip_average(list(self.model.parameters()), peers, self.ctx.worker_group)
