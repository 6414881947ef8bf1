"""The 1-bit codec of `allreduce_onebit` (Seide et al. 2014): signs packed 8 to a byte and
fp32 reconstruction levels per quantisation group, error feedback, and the chunking of 1-bit
Adam's compressed reduce-scatter (Tang et al. 2021). Pure functions on flat tensors."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import torch

from dtstudy.strategies.specs import ONEBIT_QUANTIZERS

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
