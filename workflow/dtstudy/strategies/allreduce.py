"""Synchronous data parallelism with all-reduce: PyTorch DDP (bucketed, overlapped with backward)."""

from __future__ import annotations

import time

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from .base import OptimizerFactory, Strategy


def ring_allreduce_bytes(payload_bytes: int, workers: int) -> float:
    """Bytes one worker sends in a ring all-reduce of `payload_bytes`: 2 (N-1)/N of it."""
    return 2.0 * (workers - 1) / workers * payload_bytes


class AllReduce(Strategy):
    """Every worker computes its gradient; DDP averages them by all-reduce; same update everywhere.

    Communication/wait is measured as the time backward() still runs after the last gradient
    bucket was handed to the communication hook: the part of the exchange that the overlap
    with backward did not hide.
    """

    name = "allreduce"
    defaults = {"bucket_cap_mb": 25}

    @classmethod
    def validate(cls, params, workers):
        if not isinstance(params["bucket_cap_mb"], (int, float)) or params["bucket_cap_mb"] <= 0:
            raise cls.bad_knob("bucket_cap_mb", params["bucket_cap_mb"], "a positive number of MiB")

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        model.to(self.ctx.device)
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(
            model,
            device_ids=device_ids,
            process_group=self.ctx.worker_group,
            bucket_cap_mb=self.params["bucket_cap_mb"],
        )
        self._last_bucket_time: float | None = None
        self.ddp.register_comm_hook(state=None, hook=self._timed_hook)
        self.optimizer = make_optimizer(self.ddp.parameters())
        return self.ddp

    def comm_hook(self, bucket):
        """The exchange of one gradient bucket; returns (future, bytes sent). Compressed
        variants override this."""
        payload = bucket.buffer().numel() * bucket.buffer().element_size()
        future = default_hooks.allreduce_hook(self.ctx.worker_group, bucket)
        return future, ring_allreduce_bytes(payload, self.ctx.workers)

    def _timed_hook(self, _state, bucket):
        self._last_bucket_time = time.perf_counter()
        future, sent = self.comm_hook(bucket)
        self.meter.bytes_sent += sent
        return future

    def backward(self, loss) -> None:
        self._last_bucket_time = None
        loss.backward()
        if self._last_bucket_time is not None:
            self.ctx.synchronize()
            self.meter.seconds += time.perf_counter() - self._last_bucket_time

    def eval_model(self) -> nn.Module:
        return self.ddp.module
