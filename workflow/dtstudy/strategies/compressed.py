"""`allreduce` with the gradients compressed before the exchange, as DDP communication hooks:
half precision (fp16, bf16), PowerSGD (Vogels et al. 2019) and 1-bit SGD with error
feedback (Seide et al. 2014). Each counts the bytes it really sends."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from ..strategy_specs import ONEBIT_QUANTIZERS
from .allreduce import AllReduce, ring_allreduce_bytes


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
    levels = message[:level_bytes].view(torch.float32)
    return message[level_bytes:], levels.view(groups, per_group) if per_group > 1 else levels


class AllReduceOneBit(CompressedAllReduce):
    """1-bit SGD with error feedback, per DDP bucket: add each parameter's kept residual to
    its gradient, send the signs (8 per byte) and the reconstruction values of each group
    (`quantizer`: `column`, two per column, the means of its non-negative and of its negative
    values, Seide et al. 2014; `tensor`, one mean |value| per tensor), keep the quantisation
    error as the new residual; every worker gathers all messages (all-gather) and averages
    the dequantised gradients, in the same order everywhere, so the replicas stay identical.
    Residuals are kept per parameter, as DDP reorders its buckets after the first step.

    Bytes: an all-gather sends this worker's message to the N-1 others: (N-1) (numel/8 + 4 x
    values) per bucket, against 2 (N-1)/N x 4 numel for the ring all-reduce of fp32: the
    ratio is N/64, so the all-gather saves nothing from N = 64 workers on (README).
    `quantization_error` in the summary: the mean over exchanges of |e|/|g|, e the
    quantisation error of g = gradient + residual.
    """

    name = "allreduce_onebit"

    def comm_hook(self):
        self.residuals = {p: torch.zeros(p.numel(), device=p.device) for p in self.model.parameters()
                          if p.requires_grad}
        self._groups: dict[tuple[int, ...], tuple[list[int], torch.Tensor | None]] = {}
        self._error_sum, self._exchanges = 0.0, 0
        return super().comm_hook()

    def state_dict(self):
        if self.ctx.workers == 1:
            return {}
        return {"residuals": [residual.detach().cpu() for residual in self.residuals.values()]}  # model order

    def load_state_dict(self, saved):
        if self.ctx.workers == 1:
            return
        with torch.no_grad():
            for residual, value in zip(self.residuals.values(), saved["residuals"], strict=True):
                residual.copy_(value)

    def summary(self):
        if self.ctx.workers == 1 or not self._exchanges:
            return {}
        return {"quantizer": self.params["quantizer"], "quantization_error": float(self._error_sum) / self._exchanges}

    def _groups_of(self, parameters) -> tuple[list[int], torch.Tensor | None]:
        key = tuple(id(p) for p in parameters)
        if key not in self._groups:
            quantizer = self.params["quantizer"]
            groups = quantization_groups([p.shape for p in parameters], quantizer)
            index = group_index(groups, parameters[0].device) if quantizer == "column" else None
            self._groups[key] = (groups, index)
        return self._groups[key]

    def exchange(self, bucket):
        buffer, parameters = bucket.buffer(), bucket.parameters()
        sizes = [p.numel() for p in parameters]
        groups, index = self._groups_of(parameters)
        quantizer = self.params["quantizer"]
        corrected = buffer + torch.cat([self.residuals[p] for p in parameters])
        packed, levels = quantize(corrected, groups, quantizer, index)
        residual = corrected - dequantize(packed, levels, groups, index)
        self._error_sum += (residual.norm() / corrected.norm().clamp(min=1e-30)).detach()  # no host sync here
        self._exchanges += 1
        self.residuals.update(zip(parameters, residual.split(sizes)))
        message = encode(packed, levels)
        gathered = [torch.empty_like(message) for _ in range(self.ctx.workers)]
        self.meter.bytes_sent += (self.ctx.workers - 1) * message.numel()
        future = dist.all_gather(gathered, message, group=self.ctx.worker_group, async_op=True).get_future()
        per_group = 1 if quantizer == "tensor" else 2

        def average(_):
            total = sum(dequantize(*decode(m, len(groups), per_group), groups, index) for m in gathered)
            return buffer.copy_(total.div_(self.ctx.workers))

        return future.then(average)
