"""`allreduce` with the gradients compressed before the exchange, as DDP communication hooks:
half precision (fp16, bf16), PowerSGD (Vogels et al. 2019) and 1-bit SGD with error
feedback (Seide et al. 2014), exchanged by all-gather or by 1-bit Adam's compressed
reduce-scatter + all-gather (Tang et al. 2021). Each counts the bytes it really sends."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from dtstudy.strategies.specs import ONEBIT_QUANTIZERS
from dtstudy.strategies.allreduce import AllReduce, ring_allreduce_bytes


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
    name = "allreduce_fp16"
    compress_hook = staticmethod(default_hooks.fp16_compress_hook)
    wire_dtype = torch.float16


class AllReduceBF16(HalfPrecisionAllReduce):
    name = "allreduce_bf16"
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

    name = "allreduce_powersgd"
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
            "rng": {"keys": torch.from_numpy(keys.astype("int64")), "position": int(position),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
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
        state.rng.set_state(("MT19937", rng["keys"].numpy().astype("uint32"), rng["position"],
                             rng["has_gauss"], rng["cached_gaussian"]))


# ----- 1-bit SGD: pure functions on flat tensors split into quantisation groups -------------------
_BIT_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)
QUANTIZERS = ONEBIT_QUANTIZERS


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """One bit per value (1 = non-negative), 8 to a byte, first value in the high bit."""
    bits = (values >= 0).to(torch.uint8)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8)).view(-1, 8)
    return (bits << _BIT_SHIFTS.to(values.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The bits of `pack_signs`' first `numel` values, as booleans (True = non-negative)."""
    bits = (packed.unsqueeze(1) >> _BIT_SHIFTS.to(packed.device)) & 1
    return bits.view(-1)[:numel].bool()


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The +1/-1 signs of `pack_signs`' first `numel` values."""
    return unpack_bits(packed, numel).to(torch.float32).mul_(2).sub_(1)


def quantization_groups(shapes: list[torch.Size], quantizer: str) -> list[int]:
    """The sizes of the groups that share reconstruction values, tensor after tensor: `tensor`,
    one group per tensor; `column`, one per slice along a tensor's first dimension (one per
    output unit: the columns of Seide et al.'s weight matrices), a vector being one column."""
    if quantizer not in QUANTIZERS:
        raise ValueError(f"quantizer: {quantizer!r} is not one of {', '.join(QUANTIZERS)}")
    groups = []
    for shape in shapes:
        numel = shape.numel()
        if quantizer == "column" and len(shape) >= 2 and numel:
            groups += [numel // shape[0]] * shape[0]
        else:
            groups.append(numel)
    return groups


def group_index(groups: list[int], device=None) -> torch.Tensor:
    """For every value, the index of its group."""
    return torch.repeat_interleave(torch.arange(len(groups), device=device), torch.tensor(groups, device=device))


def quantize(values: torch.Tensor, groups: list[int], quantizer: str = "column",
             index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Signs, packed, and each group's float32 reconstruction values.

    `column` (Seide et al. 2014): two per group, the mean of its non-negative values and the
    mean of its negative values (groups x 2), so that the group's sum is kept exactly. A zero
    has the non-negative bit and counts in that mean: the sum stays exact, and a group of
    zeros decodes to zeros (an empty side's value is 0 and decodes nothing).
    `tensor`: one per group, its mean absolute value s (the s minimising |x - s sign(x)|^2),
    decoded as +s/-s: the sum is not kept."""
    if quantizer == "tensor":
        scales = torch.stack([group.abs().mean() for group in values.split(groups)]).to(torch.float32)
        return pack_signs(values), scales
    index = group_index(groups, values.device) if index is None else index
    positive = values >= 0
    zeros = torch.zeros(len(groups), dtype=values.dtype, device=values.device)
    positive_sum = zeros.index_add(0, index, torch.where(positive, values, 0.0))
    total = zeros.index_add(0, index, values)
    positive_count = zeros.index_add(0, index, positive.to(values.dtype))
    negative_count = torch.tensor(groups, dtype=values.dtype, device=values.device) - positive_count
    levels = torch.stack([positive_sum / positive_count.clamp(min=1),
                          (total - positive_sum) / negative_count.clamp(min=1)], dim=1)
    return pack_signs(values), levels.to(torch.float32)


def dequantize(packed: torch.Tensor, levels: torch.Tensor, groups: list[int],
               index: torch.Tensor | None = None) -> torch.Tensor:
    """The values `quantize` encoded: per group, levels (positive, negative) or a scale +s/-s."""
    numel = sum(groups)
    if levels.dim() == 1:
        signs = unpack_signs(packed, numel)
        return signs.mul_(levels.repeat_interleave(torch.tensor(groups, device=levels.device)))
    index = group_index(groups, levels.device) if index is None else index
    return torch.where(unpack_bits(packed, numel), levels[index, 0], levels[index, 1])


def compress_with_feedback(gradient: torch.Tensor, residual: torch.Tensor, groups: list[int],
                           quantizer: str = "column", index: torch.Tensor | None = None):
    """1-bit quantisation of gradient + residual; returns (packed, levels, new residual), the
    new residual being what the quantisation lost, to be added to the next gradient."""
    corrected = gradient + residual
    if quantizer == "column" and index is None:
        index = group_index(groups, corrected.device)
    packed, levels = quantize(corrected, groups, quantizer, index)
    return packed, levels, corrected - dequantize(packed, levels, groups, index)


def encode(packed: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """One uint8 message: the float32 levels' bytes first (aligned for decoding), then the signs."""
    return torch.cat([levels.reshape(-1).view(torch.uint8), packed])


def decode(message: torch.Tensor, groups: int, per_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed signs, levels) of `encode`: `per_group` float32 values for each of `groups`."""
    level_bytes = groups * per_group * 4
    levels = message[:level_bytes]
    if levels.storage_offset() % 4:  # a message split out of a concatenation may start unaligned
        levels = levels.clone()
    levels = levels.view(torch.float32)
    return message[level_bytes:], levels.view(groups, per_group) if per_group > 1 else levels


# ----- the compressed reduce-scatter: the bucket in N chunks, chunk j reduced by worker j ----------
def chunk_groups(groups: list[int], chunks: int, cut: bool) -> list[list[int]]:
    """The bucket's quantisation groups dealt into `chunks` contiguous chunks of about n/chunks
    values each. cut=False (`column`): a chunk ends on the group boundary nearest to its
    balanced end, so the columns stay whole; a bucket with fewer groups than chunks (or a
    group larger than n/chunks) leaves some chunks empty, their owners reducing nothing of
    that bucket. cut=True (`tensor`, whose groups are whole tensors): a chunk ends exactly at
    its balanced end, cutting the group there in two, each piece with its own scale."""
    numel = sum(groups)
    ends = [round(j * numel / chunks) for j in range(1, chunks)]
    starts = list(itertools.accumulate(groups, initial=0))
    if cut:
        bounds = [0, *ends, numel]
        return [[min(hi, start + size) - max(lo, start) for start, size in zip(starts, groups)
                 if min(hi, start + size) > max(lo, start)]
                for lo, hi in zip(bounds, bounds[1:])]
    cuts = [0]
    for end in ends:
        k = bisect.bisect_left(starts, end)  # starts[k-1] < end <= starts[k]
        cuts.append(k if k < len(starts) and (k == 0 or starts[k] - end < end - starts[k - 1]) else k - 1)
    cuts.append(len(groups))
    return [groups[lo:hi] for lo, hi in zip(cuts, cuts[1:])]


def message_bytes(numel: int, groups: int, per_group: int) -> int:
    """Bytes of `encode`'s message for `numel` values in `groups` groups (nothing for an empty chunk)."""
    return groups * per_group * 4 + -(-numel // 8) if groups else 0


def compress_chunk(values: torch.Tensor, groups: list[int], quantizer: str,
                   index: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(message, what it decodes to) of one chunk; an empty chunk is an empty message."""
    if not groups:
        return torch.empty(0, dtype=torch.uint8, device=values.device), values
    packed, levels = quantize(values, groups, quantizer, index)
    return encode(packed, levels), dequantize(packed, levels, groups, index)


def levels_per_group(quantizer: str) -> int:
    """Reconstruction values per group: one scale (`tensor`) or the two means (`column`)."""
    return 1 if quantizer == "tensor" else 2


def decompress_chunk(message: torch.Tensor, groups: list[int], quantizer: str,
                     index: torch.Tensor | None) -> torch.Tensor:
    """The values of `compress_chunk`'s message."""
    if not groups:
        return torch.empty(0, device=message.device)
    return dequantize(*decode(message, len(groups), levels_per_group(quantizer)), groups, index)


def reduce_chunk(messages, residual: torch.Tensor, groups: list[int], quantizer: str,
                 index: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The owner's step of the compressed reduce-scatter (1-bit Adam's server side): the mean
    of the N workers' decoded messages for its chunk, plus the chunk's server residual, is
    quantised again; returns (message, new server residual, its |e|/|v|), the new residual
    being what this second quantisation lost (the second error feedback)."""
    mean = sum(decompress_chunk(message, groups, quantizer, index) for message in messages) / len(messages)
    corrected = mean + residual
    message, decoded = compress_chunk(corrected, groups, quantizer, index)
    lost = corrected - decoded
    return message, lost, lost.norm() / corrected.norm().clamp(min=1e-30)


@dataclass(frozen=True)
class Chunks:
    """One bucket's chunks, as this worker sees them: chunk j is worker j's to reduce."""

    sizes: list[int]  # values per chunk
    groups: list[list[int]]  # each chunk's quantisation groups
    index: list[torch.Tensor | None]  # each chunk's group of every value (`column`)
    message_bytes: list[int]  # each chunk's compressed message
    owned: list[tuple[torch.Tensor, int, int]]  # (parameter, start, end): the entries of this worker's chunk

    def bytes_sent(self, rank: int) -> int:
        """Chunk j to worker j for every j but this worker's own, then its averaged chunk to the N-1 others."""
        workers = len(self.sizes)
        return sum(self.message_bytes) - self.message_bytes[rank] + (workers - 1) * self.message_bytes[rank]


class AllReduceOneBit(CompressedAllReduce):
    """1-bit SGD with error feedback, per DDP bucket: add each parameter's kept residual to
    its gradient, send the signs (8 per byte) and the reconstruction values of each group
    (`quantizer`: `column`, two per column, the means of its non-negative and of its negative
    values, Seide et al. 2014; `tensor`, one mean |value| per tensor), keep the quantisation
    error as the new residual. Residuals are kept per parameter, as DDP reorders its buckets
    after the first step. Replicas stay identical: every worker decodes the same messages in
    the same order.

    `exchange: allgather`: every worker gathers all messages and averages the dequantised
    gradients. It sends its message to the N-1 others: (N-1) (n/8 + 4 x values) bytes per
    bucket, against 2 (N-1)/N x 4n for the ring all-reduce of fp32: the ratio is N/64, so
    it saves nothing from N = 64 workers on.
    `exchange: reduce_scatter` (1-bit Adam's compressed all-reduce, Tang et al. 2021): the
    bucket in N chunks (`chunk_groups`), chunk j of every worker's message sent to worker j
    (all_to_all); worker j averages the N decoded chunks, adds its server residual for that
    chunk, quantises again and keeps what that lost as the new server residual; the N
    averaged chunks are then all-gathered (each chunk's message sent by its owner to the N-1
    others). Per step, with e_i worker i's residual and s the server residuals (each entry's
    held by its owner only): sent + mean_i e_i' + s' = mean_i g_i + mean_i e_i + s, so that
    from zero residuals sum_t sent_t + mean_i e_i + s = sum_t mean_i g_i. Bytes: 2 (N-1)/N
    of the compressed bucket plus the chunks' values, 1/32 of ring all-reduce's at any N.
    The server residual is kept per parameter at full size on every worker (zero outside
    its chunks): when DDP's new buckets give an entry another owner, the old owner's server
    residual for it moves into its own worker residual, times N (`_hand_over`).

    `quantization_error` in the summary: the mean over exchanges of |e|/|g|, e the worker's
    quantisation error of g = gradient + residual (the same in both exchanges);
    `server_quantization_error` (reduce_scatter): the same for the owner's second
    quantisation of its averaged chunk plus server residual.
    """

    name = "allreduce_onebit"

    def comm_hook(self):
        self.residuals = {p: torch.zeros(p.numel(), device=p.device) for p in self.model.parameters()
                          if p.requires_grad}
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
        kept = {"residuals": self.residuals}
        if self.params["exchange"] == "reduce_scatter":
            kept["server_residuals"] = self.server_residuals
        return {key: [r.detach().to("cpu", copy=True) for r in residuals.values()] for key, residuals in kept.items()}

    def load_state_dict(self, saved):
        if self.ctx.workers == 1:
            return
        kept = [(self.residuals, "residuals")]
        if self.params["exchange"] == "reduce_scatter":
            kept.append((self.server_residuals, "server_residuals"))
        with torch.no_grad():
            for residuals, key in kept:
                for residual, value in zip(residuals.values(), saved[key], strict=True):
                    residual.copy_(value)

    def summary(self):
        if self.ctx.workers == 1 or not self._exchanges:
            return {}
        summary = {"quantizer": self.params["quantizer"], "exchange": self.params["exchange"],
                   "quantization_error": float(self._error_sum) / self._exchanges}
        if self.params["exchange"] == "reduce_scatter" and self._reductions:
            summary["server_quantization_error"] = float(self._server_error_sum) / self._reductions
        return summary

    def _groups_of(self, parameters) -> tuple[list[int], torch.Tensor | None]:
        key = tuple(id(p) for p in parameters)
        if key not in self._groups:
            quantizer = self.params["quantizer"]
            groups = quantization_groups([p.shape for p in parameters], quantizer)
            index = group_index(groups, parameters[0].device) if quantizer == "column" else None
            self._groups[key] = (groups, index)
        return self._groups[key]

    def exchange(self, bucket):
        if self.params["exchange"] == "reduce_scatter":
            return self._reduce_scatter(bucket)
        buffer, parameters = bucket.buffer(), bucket.parameters()
        groups, index = self._groups_of(parameters)
        quantizer = self.params["quantizer"]
        corrected = buffer + torch.cat([self.residuals[p] for p in parameters])
        packed, levels = quantize(corrected, groups, quantizer, index)
        self._keep_residual(parameters, corrected, corrected - dequantize(packed, levels, groups, index))
        message = encode(packed, levels)
        gathered = [torch.empty_like(message) for _ in range(self.ctx.workers)]
        self.meter.bytes_sent += (self.ctx.workers - 1) * message.numel()
        future = dist.all_gather(gathered, message, group=self.ctx.worker_group, async_op=True).get_future()
        per_group = levels_per_group(quantizer)

        def average(_):
            total = sum(dequantize(*decode(m, len(groups), per_group), groups, index) for m in gathered)
            return buffer.copy_(total.div_(self.ctx.workers))

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
            per_chunk = chunk_groups(groups, workers, cut=quantizer == "tensor")
            sizes = [sum(g) for g in per_chunk]
            device = parameters[0].device
            index = [group_index(g, device) if quantizer == "column" and g else None for g in per_chunk]
            per_group = levels_per_group(quantizer)
            start = sum(sizes[:rank])
            end, owned, offset = start + sizes[rank], [], 0
            for p in parameters:
                lo, hi = max(start, offset), min(end, offset + p.numel())
                if hi > lo:
                    owned.append((p, lo - offset, hi - offset))
                offset += p.numel()
            self._chunks[key] = Chunks(sizes, per_chunk, index,
                                       [message_bytes(n, len(g), per_group) for n, g in zip(sizes, per_chunk)], owned)
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
        buffer, parameters = bucket.buffer(), bucket.parameters()
        chunks = self._chunks_of(parameters)
        quantizer, workers, rank, group = self.params["quantizer"], self.ctx.workers, self.ctx.rank, self.ctx.worker_group
        corrected = buffer + torch.cat([self.residuals[p] for p in parameters])
        messages, decoded = zip(*(compress_chunk(values, groups, quantizer, index) for values, groups, index
                                  in zip(corrected.split(chunks.sizes), chunks.groups, chunks.index)))
        self._keep_residual(parameters, corrected, corrected - torch.cat(decoded))
        mine = chunks.message_bytes[rank]
        received = torch.empty(workers * mine, dtype=torch.uint8, device=buffer.device)
        self.meter.bytes_sent += chunks.bytes_sent(rank)
        # gloo has all_to_all_single with uneven splits (checked on torch 2.14.1); chunk j to worker j
        future = dist.all_to_all_single(received, torch.cat(messages), [mine] * workers, chunks.message_bytes,
                                        group=group, async_op=True).get_future()

        def reduce_and_gather(_):
            device = buffer.device
            server = [self.server_residuals[p][lo:hi] for p, lo, hi in chunks.owned]
            owned = torch.cat(server) if server else torch.empty(0, device=device)
            message, kept, error = reduce_chunk(received.view(workers, mine).unbind(), owned,
                                                chunks.groups[rank], quantizer, chunks.index[rank])
            for piece, value in zip(server, kept.split([piece.numel() for piece in server])):
                piece.copy_(value)
            if server:
                self._server_error_sum += error.detach()
                self._reductions += 1
            # the all-gather of uneven chunks: each owner's message to every worker (gloo's
            # all_gather wants equal sizes; this sends no padding); waited here, as
            # torch's PowerSGD hook waits for its second all-reduce
            gathered = torch.empty(sum(chunks.message_bytes), dtype=torch.uint8, device=device)
            dist.all_to_all_single(gathered, message.repeat(workers), chunks.message_bytes, [mine] * workers,
                                   group=group, async_op=True).wait()
            averaged = [decompress_chunk(m, groups, quantizer, index) for m, groups, index
                        in zip(gathered.split(chunks.message_bytes), chunks.groups, chunks.index)]
            return buffer.copy_(torch.cat(averaged))

        return future.then(reduce_and_gather)
