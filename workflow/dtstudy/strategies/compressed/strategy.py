"""`allreduce` with the gradients compressed before the exchange, as DDP communication hooks:
half precision (fp16, bf16), PowerSGD (Vogels et al. 2019) and 1-bit SGD with error
feedback (Seide et al. 2014), exchanged by all-gather or by 1-bit Adam's compressed
reduce-scatter + all-gather (Tang et al. 2021). Each counts the bytes it really sends."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from dtstudy.strategies.allreduce.strategy import AllReduce, ring_allreduce_bytes
from dtstudy.strategies.compressed.onebit_codec import (
    Chunks,
    chunk_layout,
    decode,
    dequantize,
    encode,
    group_index,
    levels_per_group,
    quantization_groups,
    quantize,
    reduce_chunk,
)
from dtstudy.strategies.compressed.spec import (
    AllReduceBF16Spec,
    AllReduceFP16Spec,
    AllReduceOneBitSpec,
    AllReducePowerSGDSpec,
)


def memory_order(tensor: torch.Tensor) -> list[int] | None:
    """`tensor`'s dimensions from the outermost in memory when it is dense but not contiguous
    (a channels_last weight: N, H, W, C), else None. DDP lays such a parameter's gradient in
    its bucket in that order (its bucket views take the parameter's strides), while
    GradBucket.gradients() views every segment as contiguous."""
    if tensor.is_contiguous():
        return None
    order = sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))
    return order if tensor.permute(order).is_contiguous() else None


def in_bucket_order(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` flat in the order of its gradient in a DDP bucket (see memory_order)."""
    order = memory_order(tensor)
    return (tensor if order is None else tensor.permute(order)).reshape(-1)


class LogicalBuckets:
    """A bucket's segments in DDP's memory order (channels_last weights) rearranged in place
    to the logical order its `gradients()` views assume, and back: a hook that reads those
    views as matrices (PowerSGD's) then compresses a channels_last run's gradients as a
    contiguous run's, not with each row's columns permuted (tests/test_device_rules.py)."""

    def __init__(self, bucket: dist.GradBucket):
        self.segments = [
            (view.view(-1), parameter.shape, order)
            for parameter, view in zip(bucket.parameters(), bucket.gradients())
            if (order := memory_order(parameter)) is not None
        ]

    @torch.no_grad()
    def to_logical(self) -> None:
        for flat, shape, order in self.segments:
            stored = flat.view([shape[d] for d in order])
            flat.copy_(stored.permute([order.index(d) for d in range(len(order))]).reshape(-1))

    @torch.no_grad()
    def to_memory(self, future: torch.futures.Future) -> torch.Tensor:
        for flat, shape, order in self.segments:
            flat.copy_(flat.view(shape).permute(order).reshape(-1))
        return future.value()


def strategy_hook(state, bucket):
    """The DDP hook of every compressed strategy: AllReduce registers it with state=the strategy.
    (No annotations: DDP compares them with dist.GradBucket, and here they would be strings.)"""
    return state.exchange(bucket)


class CompressedAllReduce(AllReduce):
    """AllReduce whose DDP hook calls `exchange(bucket)` (at N=1, as AllReduce, nothing is exchanged)."""

    def comm_hook(self):
        return strategy_hook

    def exchange(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Start averaging the bucket's gradients; add the bytes sent to self.meter.bytes_sent."""
        raise NotImplementedError


class HalfPrecisionAllReduce(CompressedAllReduce):
    """Gradients cast to 16 bits, all-reduced, cast back: half the bytes of `allreduce`."""

    compress_hook: ClassVar[Callable]  # torch's hook(process_group, bucket)
    wire_dtype: ClassVar[torch.dtype]

    def exchange(self, bucket):
        wire_bytes = bucket.buffer().numel() * torch.finfo(self.wire_dtype).bits // 8
        self.meter.bytes_sent += ring_allreduce_bytes(wire_bytes, self.ctx.workers)
        return self.compress_hook(self.ctx.worker_group, bucket)


class AllReduceFP16(HalfPrecisionAllReduce):
    spec = AllReduceFP16Spec
    compress_hook = staticmethod(default_hooks.fp16_compress_hook)
    wire_dtype = torch.float16


class AllReduceBF16(HalfPrecisionAllReduce):
    spec = AllReduceBF16Spec
    compress_hook = staticmethod(default_hooks.bf16_compress_hook)
    wire_dtype = torch.bfloat16


class AllReducePowerSGD(CompressedAllReduce):
    """PowerSGD: each gradient matrix (n x m) is sent as two rank-r factors P (n x r) and
    Q (m x r); vectors (biases) and matrices too small to gain go uncompressed; the
    approximation error is added to the next gradient (`use_error_feedback`) and Q is
    reused between steps (`warm_start`). The first `start_powerSGD_iter` steps use the
    plain all-reduce (torch requires >= 2 with error feedback or warm start: DDP rebuilds
    its buckets after the first step). Bytes: ring all-reduce of what is really reduced
    (P, Q and the uncompressed tensors), from torch's own compression accounting.
    """

    spec = AllReducePowerSGDSpec

    def comm_hook(self):
        self.powersgd = PowerSGDState(
            process_group=self.ctx.worker_group,
            matrix_approximation_rank=self.params["rank"],
            start_powerSGD_iter=self.params["start_powerSGD_iter"],
            use_error_feedback=self.params["use_error_feedback"],
            warm_start=self.params["warm_start"],
        )
        return super().comm_hook()

    def exchange(self, bucket):
        state = self.powersgd
        compressing = state.iter >= state.start_powerSGD_iter
        _, _, reduced_before = state.compression_stats()  # elements reduced so far, P, Q and uncompressed
        logical = LogicalBuckets(bucket) if compressing else None
        if logical is not None and logical.segments:
            logical.to_logical()
            future = powerSGD_hook(state, bucket).then(logical.to_memory)
        else:
            future = powerSGD_hook(state, bucket)
        buffer = bucket.buffer()
        numel = state.compression_stats()[2] - reduced_before if compressing else buffer.numel()
        self.meter.bytes_sent += ring_allreduce_bytes(numel * buffer.element_size(), self.ctx.workers)
        return future

    def summary(self):
        if self.ctx.workers == 1:
            return {}
        return {"powersgd_compression_rate": self.powersgd.compression_stats()[0]}

    # PowerSGD's memory (error feedback, warm-started Q) is kept per DDP bucket index, in
    # the bucket's order of gradients; the resumed run replays DDP's first step
    # (replays_first_step) so that its buckets are the interrupted run's.
    _COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression", "next_stats_report")

    def state_dict(self):
        if self.ctx.workers == 1:
            return {}
        state = self.powersgd
        _, keys, position, has_gauss, cached_gaussian = state.rng.get_state()
        return {
            **{name: getattr(state, name) for name in self._COUNTERS},
            "error": {index: t.detach().cpu() for index, t in state.error_dict.items()},
            "p": {index: t.detach().cpu() for index, t in state.p_memory_dict.items()},
            "q": {index: t.detach().cpu() for index, t in state.q_memory_dict.items()},
            "rng": {
                "keys": torch.from_numpy(keys.astype("int64")),
                "position": int(position),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            },
        }

    def load_state_dict(self, saved):
        if self.ctx.workers == 1:
            return
        state, device = self.powersgd, self.ctx.device
        for name in self._COUNTERS:
            setattr(state, name, saved[name])
        state.error_dict = {int(i): t.to(device) for i, t in saved["error"].items()}
        state.p_memory_dict = {int(i): t.to(device) for i, t in saved["p"].items()}
        state.q_memory_dict = {int(i): t.to(device) for i, t in saved["q"].items()}
        rng = saved["rng"]
        state.rng.set_state(
            ("MT19937", rng["keys"].numpy().astype("uint32"), rng["position"], rng["has_gauss"], rng["cached_gaussian"])
        )


class AllReduceOneBit(CompressedAllReduce):
    """1-bit SGD with error feedback, per DDP bucket. What is compressed is each worker's
    momentum, not its gradient: the worker keeps a momentum buffer of its own gradients,
    m_i <- beta m_i + g_i (train.momentum; train.nesterov sends g_i + beta m_i), adds its kept
    residual, sends the signs (8 per byte) and the reconstruction values of each group
    (`quantizer`: `column`, two per column, the means of its non-negative and of its negative
    values, Seide et al. 2014; `tensor`, one mean |value| per tensor) and keeps the
    quantisation error as the new residual; the decoded average is the update, applied by the
    optimizer with its momentum and weight decay set to 0. Weight decay, the same on every
    worker, is not sent: its own momentum buffer d <- beta d + wd x is added to the decoded
    average, so that without quantisation the update is the optimizer's momentum SGD exactly.
    This is where error-feedback sign compression puts the momentum (Karimireddy et al. 2019's
    code, Zheng et al. 2019); compressing each batch's gradient and applying the momentum to the
    decoded average, as this strategy once did, ends far below it at N=4 on the default study
    (tests/test_onebit_reference.py, docs/strategies.md). Residuals and momentum buffers are
    kept per parameter, in gradient units (not lr-scaled), as DDP reorders its buckets after
    the first step. Replicas stay identical: every worker decodes the same messages in the same
    order.

    `exchange: allgather`: every worker gathers all messages and averages the dequantised
    momenta. It sends its message to the N-1 others: (N-1) (n/8 + 4 x values) bytes per
    bucket, against 2 (N-1)/N x 4n for the ring all-reduce of fp32: the ratio is N/64, so
    it saves nothing from N = 64 workers on.
    `exchange: reduce_scatter` (1-bit Adam's compressed all-reduce, Tang et al. 2021): the
    bucket in N chunks (`chunk_groups`), chunk j of every worker's message sent to worker j
    (all_to_all); worker j averages the N decoded chunks, adds its server residual for that
    chunk, quantises again and keeps what that lost as the new server residual; the N
    averaged chunks are then all-gathered (each chunk's message sent by its owner to the N-1
    others). Per step, with e_i worker i's residual and s the server residuals (each entry's
    held by its owner only) and m_i worker i's momentum (its gradient at momentum 0):
    sent + mean_i e_i' + s' = mean_i m_i + mean_i e_i + s, so that from zero residuals
    sum_t sent_t + mean_i e_i + s = sum_t mean_i m_i. Bytes: 2 (N-1)/N
    of the compressed bucket plus the chunks' values, 1/32 of ring all-reduce's at any N.
    The server residual is kept per parameter at full size on every worker (zero outside
    its chunks): when DDP's new buckets give an entry another owner, the old owner's server
    residual for it moves into its own worker residual, times N (`_hand_over`).

    `quantization_error` in the summary: the mean over exchanges of |e|/|u|, e the worker's
    quantisation error of u = momentum + residual (the same in both exchanges);
    `server_quantization_error` (reduce_scatter): the same for the owner's second
    quantisation of its averaged chunk plus server residual.
    """

    spec = AllReduceOneBitSpec

    def setup(self, model, make_optimizer):
        module = super().setup(model, make_optimizer)
        if self.ctx.workers > 1:
            self._take_over_momentum()
        return module

    def _take_over_momentum(self) -> None:
        """The optimizer's momentum, Nesterov flag and weight decay move into the exchange; the
        optimizer is left plain SGD (x <- x - lr * what the exchange delivered)."""
        groups = self.optimizer.param_groups
        first = groups[0]
        self.momentum, self.nesterov, self.weight_decay = first["momentum"], first["nesterov"], first["weight_decay"]
        for group in groups:
            group.update(momentum=0.0, nesterov=False, weight_decay=0.0)
        with torch.no_grad():
            if self.momentum:
                self.velocities = {p: torch.zeros_like(r) for p, r in self.residuals.items()}
            if self.momentum and self.weight_decay:
                self.decay_velocities = {p: torch.zeros_like(r) for p, r in self.residuals.items()}

    def _worker_update(self, gradient: torch.Tensor, parameters) -> torch.Tensor:
        """What the worker compresses (before its residual): its momentum of its own gradients."""
        if not self.momentum:
            return gradient
        velocity = torch.cat([self.velocities[p] for p in parameters]).mul_(self.momentum).add_(gradient)
        self.velocities.update(zip(parameters, velocity.split([p.numel() for p in parameters])))
        return gradient.add(velocity, alpha=self.momentum) if self.nesterov else velocity

    def _decay_update(self, parameters) -> torch.Tensor | None:
        """Weight decay's share of the update, the same on every worker (nothing sent)."""
        if not self.weight_decay:
            return None
        # in the bucket's order: a channels_last weight lies there as it does in memory
        decay = torch.cat([in_bucket_order(p.detach()) for p in parameters]).mul_(self.weight_decay)
        if not self.momentum:
            return decay
        velocity = torch.cat([self.decay_velocities[p] for p in parameters]).mul_(self.momentum).add_(decay)
        self.decay_velocities.update(zip(parameters, velocity.split([p.numel() for p in parameters])))
        return decay.add(velocity, alpha=self.momentum) if self.nesterov else velocity

    def _deliver(self, buffer: torch.Tensor, averaged: torch.Tensor, decay: torch.Tensor | None) -> torch.Tensor:
        return buffer.copy_(averaged if decay is None else averaged.add_(decay))

    def comm_hook(self):
        self.residuals = {
            p: torch.zeros(p.numel(), device=p.device) for p in self.model.parameters() if p.requires_grad
        }
        self.momentum, self.nesterov, self.weight_decay = 0.0, False, 0.0  # until setup takes the optimizer's
        self._groups: dict[tuple[int, ...], tuple[list[int], torch.Tensor | None]] = {}
        self._error_sum, self._exchanges = 0.0, 0
        if self.params["exchange"] == "reduce_scatter":
            self.server_residuals = {p: torch.zeros_like(r) for p, r in self.residuals.items()}
            self._chunks: dict[tuple[int, ...], Chunks] = {}
            self._server_error_sum, self._reductions = 0.0, 0
        return super().comm_hook()

    def state_dict(self):
        if self.ctx.workers == 1:
            return {}
        # copies, in model order: the server residuals are updated in place by later steps
        kept = {"residuals": self.residuals, **self._momentum_buffers()}
        if self.params["exchange"] == "reduce_scatter":
            kept["server_residuals"] = self.server_residuals
        return {key: [r.detach().to("cpu", copy=True) for r in residuals.values()] for key, residuals in kept.items()}

    def load_state_dict(self, saved):
        if self.ctx.workers == 1:
            return
        kept = [(self.residuals, "residuals"), *((buffers, key) for key, buffers in self._momentum_buffers().items())]
        if self.params["exchange"] == "reduce_scatter":
            kept.append((self.server_residuals, "server_residuals"))
        with torch.no_grad():
            for residuals, key in kept:
                for residual, value in zip(residuals.values(), saved[key], strict=True):
                    residual.copy_(value)

    def _momentum_buffers(self) -> dict:
        """The momentum buffers the exchange keeps (none without momentum)."""
        return {key: getattr(self, key) for key in ("velocities", "decay_velocities") if hasattr(self, key)}

    def summary(self):
        if self.ctx.workers == 1 or not self._exchanges:
            return {}
        summary = {
            "quantizer": self.params["quantizer"],
            "exchange": self.params["exchange"],
            "quantization_error": float(self._error_sum) / self._exchanges,
        }
        if self.params["exchange"] == "reduce_scatter" and self._reductions:
            summary["server_quantization_error"] = float(self._server_error_sum) / self._reductions
        return summary

    def _groups_of(self, parameters) -> tuple[list[int], torch.Tensor]:
        key = tuple(id(p) for p in parameters)
        if key not in self._groups:
            quantizer = self.params["quantizer"]
            groups = quantization_groups([p.shape for p in parameters], quantizer)
            self._groups[key] = (groups, group_index(groups, parameters[0].device))
        return self._groups[key]

    def exchange(self, bucket):
        if self.params["exchange"] == "reduce_scatter":
            return self._reduce_scatter(bucket)
        buffer, parameters = bucket.buffer(), bucket.parameters()
        groups, index = self._groups_of(parameters)
        quantizer = self.params["quantizer"]
        corrected = self._worker_update(buffer, parameters) + torch.cat([self.residuals[p] for p in parameters])
        decay = self._decay_update(parameters)
        packed, levels = quantize(corrected, groups, quantizer, index)
        self._keep_residual(parameters, corrected, corrected - dequantize(packed, levels, groups, index))
        message = encode(packed, levels)
        gathered = [torch.empty_like(message) for _ in range(self.ctx.workers)]
        self.meter.bytes_sent += (self.ctx.workers - 1) * message.numel()
        future = dist.all_gather(gathered, message, group=self.ctx.worker_group, async_op=True).get_future()
        per_group = levels_per_group(quantizer)

        def average(_):
            total = sum(dequantize(*decode(m, len(groups), per_group), groups, index) for m in gathered)
            return self._deliver(buffer, total.div_(self.ctx.workers), decay)

        return future.then(average)

    def _keep_residual(self, parameters, corrected: torch.Tensor, residual: torch.Tensor) -> None:
        """Keep `residual`, the worker's quantisation error of `corrected`, per parameter, and note |e|/|g|."""
        self._error_sum += (residual.norm() / corrected.norm().clamp(min=1e-30)).detach()  # no host sync here
        self._exchanges += 1
        self.residuals.update(zip(parameters, residual.split([p.numel() for p in parameters])))

    # ----- exchange: reduce_scatter ---------------------------------------------------------
    def _chunks_of(self, parameters) -> Chunks:
        key = tuple(id(p) for p in parameters)
        if key not in self._chunks:
            quantizer, workers, rank = self.params["quantizer"], self.ctx.workers, self.ctx.rank
            groups = quantization_groups([p.shape for p in parameters], quantizer)
            device = parameters[0].device
            layout = chunk_layout(groups, workers, quantizer, device)
            start = sum(layout.sizes[:rank])
            end, owned, offset = start + layout.sizes[rank], [], 0
            for p in parameters:
                lo, hi = max(start, offset), min(end, offset + p.numel())
                if hi > lo:
                    owned.append((p, lo - offset, hi - offset))
                offset += p.numel()
            own_groups = layout.groups[rank]
            self._chunks[key] = Chunks(layout, group_index(own_groups, device) if own_groups else None, owned)
            self._hand_over(parameters, owned)
        return self._chunks[key]

    def _hand_over(self, parameters, owned) -> None:
        """A new bucket layout (DDP rebuilds its buckets after the first step) may give entries
        this worker reduced to another owner, who holds no server residual for them: this
        worker's server residual outside its new chunk moves into its worker residual, times N
        (the exchange averages the worker residuals over the N workers and adds the server
        residuals once), so the sums above stay exact and nothing is dropped."""
        mine = {p: (lo, hi) for p, lo, hi in owned}
        with torch.no_grad():
            for p in parameters:
                moved = self.server_residuals[p].clone()
                lo, hi = mine.get(p, (0, 0))
                moved[lo:hi] = 0
                self.residuals[p].add_(moved, alpha=self.ctx.workers)
                self.server_residuals[p].sub_(moved)

    def _reduce_scatter(self, bucket):
        """Every step's tensor ops are as many whatever N: the N chunk messages are encoded,
        reduced and decoded in one go each (`ChunkLayout`, `reduce_chunk`)."""
        buffer, parameters = bucket.buffer(), bucket.parameters()
        chunks = self._chunks_of(parameters)
        layout = chunks.layout
        quantizer, workers, rank, group = (
            self.params["quantizer"],
            self.ctx.workers,
            self.ctx.rank,
            self.ctx.worker_group,
        )
        corrected = self._worker_update(buffer, parameters) + torch.cat([self.residuals[p] for p in parameters])
        decay = self._decay_update(parameters)
        messages, decoded = layout.compress(corrected)
        self._keep_residual(parameters, corrected, corrected - decoded)
        mine = layout.message_bytes[rank]
        received = torch.empty(workers * mine, dtype=torch.uint8, device=buffer.device)
        self.meter.bytes_sent += chunks.bytes_sent(rank)
        # gloo has all_to_all_single with uneven splits (checked on torch 2.14.1); chunk j to worker j
        future = dist.all_to_all_single(
            received, messages, [mine] * workers, layout.message_bytes, group=group, async_op=True
        ).get_future()

        def reduce_and_gather(_):
            device = buffer.device
            server = [self.server_residuals[p][lo:hi] for p, lo, hi in chunks.owned]
            owned = torch.cat(server) if server else torch.empty(0, device=device)
            message, kept, error = reduce_chunk(
                received.view(workers, mine), owned, layout.groups[rank], quantizer, chunks.index
            )
            for piece, value in zip(server, kept.split([piece.numel() for piece in server])):
                piece.copy_(value)
            if server:
                self._server_error_sum += error.detach()
                self._reductions += 1
            # the all-gather of uneven chunks: each owner's message to every worker (gloo's
            # all_gather wants equal sizes; this sends no padding); waited here, as
            # torch's PowerSGD hook waits for its second all-reduce
            gathered = torch.empty(sum(layout.message_bytes), dtype=torch.uint8, device=device)
            dist.all_to_all_single(
                gathered, message.repeat(workers), layout.message_bytes, [mine] * workers, group=group, async_op=True
            ).wait()
            return self._deliver(buffer, layout.decompress(gathered), decay)

        return future.then(reduce_and_gather)
