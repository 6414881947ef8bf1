"""Synchronous data parallelism with all-reduce: PyTorch DDP (bucketed, overlapped with backward)."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtstudy.perfmodel.collectives import ring_allreduce_bytes
from dtstudy.strategies.allreduce.spec import AllReduceSpec
from dtstudy.strategies.base import OptimizerFactory, Strategy


class AllReduce(Strategy):
    """Every worker computes its gradient; DDP averages them by all-reduce; same update everywhere.

    Communication/wait is the time backward() still runs after the last gradient was
    accumulated: the part of the exchange that the overlap with backward did not hide. Both
    ends are marks of the device's clock (a CUDA event after the last gradient's
    accumulation, one after backward), not the host's time when that work was queued.
    With one worker there is nothing to exchange and the model trains unwrapped (DDP at
    world size 1 would only add bucket copies, ~6% of a LeNet step on a CPU).
    """

    spec = AllReduceSpec
    resumable = True  # the same update on every worker; DDP holds no state between steps
    # DDP rebuilds its buckets after the first step: a resumed run replays that first
    replays_first_step = True

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        model.to(self.ctx.device)
        self.model = model
        self.module = model
        if self.ctx.workers > 1:
            device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
            self.module = DistributedDataParallel(
                model,
                device_ids=device_ids,
                process_group=self.ctx.worker_group,
                bucket_cap_mb=self.params["bucket_cap_mb"],
            )
        hook = self.comm_hook() if self.ctx.workers > 1 else None
        if hook is not None:
            self.module.register_comm_hook(state=self, hook=hook)
        # the plain all-reduce moves every gradient each step; a custom hook counts its own bytes
        self._plain_bytes_per_step = self.bytes_per_step() if hook is None else 0.0
        self._last_grad_mark = None
        # gradients of a backward; the mark is taken at the last (the count of the backward
        # before: one event per step, not one per parameter; the first marks every one)
        self._grads_seen, self._grads_expected = 0, None
        if self.ctx.workers > 1:
            for parameter in model.parameters():
                if parameter.requires_grad:
                    parameter.register_post_accumulate_grad_hook(self._note_gradient)
        self.optimizer = make_optimizer(self.module.parameters())
        return self.module

    def comm_hook(self):
        """A DDP communication hook `hook(state, bucket) -> Future` replacing the plain
        all-reduce (None = DDP's built-in one). Compressed variants return theirs and add
        the bytes they really send to self.meter.bytes_sent."""
        return None

    def bytes_per_step(self) -> float:
        """Bytes this worker sends per step with the plain all-reduce of every gradient."""
        payload = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        return ring_allreduce_bytes(payload, self.ctx.workers)

    def _note_gradient(self, _parameter) -> None:
        self._grads_seen += 1
        if self._grads_expected is None or self._grads_seen >= self._grads_expected:
            self._last_grad_mark = self.meter.clock.mark()

    def backward(self, loss) -> None:
        self._last_grad_mark, self._grads_seen = None, 0
        loss.backward()
        if self._last_grad_mark is not None:
            self._grads_expected = self._grads_seen
            self.meter.add_span(self._last_grad_mark, self.meter.clock.mark())
            self.meter.bytes_sent += self._plain_bytes_per_step

    def eval_model(self) -> nn.Module:
        return self.model
