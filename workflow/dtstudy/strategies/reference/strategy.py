"""The machine's ceiling: N workers that train on their shards and exchange nothing.

Not a way to train (rank 0's model has seen 1/N of the data), but the throughput that N
processes reach on this machine when the strategy costs nothing: the same data loading,
the same forward/backward/update, in parallel, with no exchange and no barrier. Its
efficiency E(N) is the ceiling the other strategies are compared with besides the ideal
E = 1 (on 2 CPU cores two independent loops reach about 0.84 of twice one loop: memory
bandwidth and frequency are shared).
"""

from __future__ import annotations

from torch import nn

from dtstudy.strategies.base import OptimizerFactory, Strategy
from dtstudy.strategies.reference.spec import NoExchangeSpec


class NoExchange(Strategy):
    spec = NoExchangeSpec
    resumable = True  # every worker's state is its own model and optimizer
    update_batch_rule = "b: each worker updates its own model with its own batch; nothing is exchanged"

    @classmethod
    def update_batch(cls, params, workers, per_worker_batch):
        return per_worker_batch

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        self.model = model.to(self.ctx.device)
        self.optimizer = make_optimizer(self.model.parameters())
        return self.model

    def eval_model(self) -> nn.Module:
        return self.model
