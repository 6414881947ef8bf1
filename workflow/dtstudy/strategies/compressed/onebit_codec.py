"""The 1-bit codec of `allreduce_onebit` (Seide et al. 2014): signs packed 8 to a byte and
fp32 reconstruction levels per quantisation group, error feedback, and the chunking of 1-bit
Adam's compressed reduce-scatter (Tang et al. 2021). Pure functions on flat tensors, and
`ChunkLayout`, which encodes and decodes a bucket's N chunk messages in a fixed number of
tensor ops whatever N (the per-chunk functions, `compress_chunk` and `decompress_chunk`, are
its reference: tests/test_onebit_codec.py)."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import torch

from dtstudy.strategies.compressed.spec import ONEBIT_QUANTIZERS

# ----- 1-bit SGD: pure functions on flat tensors split into quantisation groups -------------------
_BIT_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)
QUANTIZERS = ONEBIT_QUANTIZERS


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Booleans 8 to a byte, the first in the high bit, the last byte padded with 0 bits."""
    bits = torch.nn.functional.pad(bits.to(torch.uint8), (0, -bits.numel() % 8)).view(-1, 8)
    return (bits << _BIT_SHIFTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """One bit per value (1 = non-negative), 8 to a byte, first value in the high bit."""
    return pack_bits(values >= 0)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The bits of `pack_signs`' first `numel` values, as booleans (True = non-negative); leading
    dimensions (several messages, one a row) are kept."""
    bits = (packed.unsqueeze(-1) >> _BIT_SHIFTS.to(packed.device)) & 1
    return bits.flatten(-2)[..., :numel].bool()


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


def quantize(
    values: torch.Tensor, groups: list[int], quantizer: str = "column", index: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Signs, packed, and each group's float32 reconstruction values (`index`: `group_index`'s,
    built when not given).

    `column` (Seide et al. 2014): two per group, the mean of its non-negative values and the
    mean of its negative values (groups x 2), so that the group's sum is kept exactly. A zero
    has the non-negative bit and counts in that mean: the sum stays exact, and a group of
    zeros decodes to zeros (an empty side's value is 0 and decodes nothing).
    `tensor`: one per group, its mean absolute value s (the s minimising |x - s sign(x)|^2),
    decoded as +s/-s: the sum is not kept.
    Every group's sums are index_adds over all groups at once, each group's values added in
    order: a group's levels do not depend on what lies around it, so a bucket quantised whole
    and chunk by chunk (chunks ending on group boundaries) get the same levels, bit for bit
    (on a CPU; a GPU's index_add adds in no fixed order)."""
    index = group_index(groups, values.device) if index is None else index
    zeros = torch.zeros(len(groups), dtype=values.dtype, device=values.device)
    sizes = torch.tensor(groups, dtype=values.dtype, device=values.device)
    if quantizer == "tensor":  # summed in float64: a group is a whole tensor, up to millions of values
        scales = zeros.double().index_add(0, index, values.abs().double()) / sizes.clamp(min=1)
        return pack_signs(values), scales.to(torch.float32)
    positive = values >= 0
    positive_sum = zeros.index_add(0, index, torch.where(positive, values, 0.0))
    total = zeros.index_add(0, index, values)
    positive_count = zeros.index_add(0, index, positive.to(values.dtype))
    negative_count = sizes - positive_count
    levels = torch.stack(
        [positive_sum / positive_count.clamp(min=1), (total - positive_sum) / negative_count.clamp(min=1)], dim=1
    )
    return pack_signs(values), levels.to(torch.float32)


def decode_bits(
    bits: torch.Tensor, levels: torch.Tensor, groups: list[int], index: torch.Tensor | None = None
) -> torch.Tensor:
    """The values of sign bits (True = non-negative) and their groups' levels: (positive,
    negative) per group, levels one dimension more than bits (`column`), or one scale, decoded
    +s/-s (`tensor`). A leading dimension of both (several messages, one a row) is kept.
    (index_select, not levels[index]: a few times faster on a CPU.)"""
    index = group_index(groups, levels.device) if index is None else index
    if levels.dim() > bits.dim():
        positive, negative = (side.contiguous().index_select(-1, index) for side in levels.unbind(-1))
        return torch.where(bits, positive, negative)
    return bits.to(torch.float32).mul_(2).sub_(1).mul_(levels.index_select(-1, index))


def dequantize(
    packed: torch.Tensor, levels: torch.Tensor, groups: list[int], index: torch.Tensor | None = None
) -> torch.Tensor:
    """The values `quantize` encoded: per group, levels (positive, negative) or a scale +s/-s."""
    return decode_bits(unpack_bits(packed, sum(groups)), levels, groups, index)


def compress_with_feedback(
    gradient: torch.Tensor,
    residual: torch.Tensor,
    groups: list[int],
    quantizer: str = "column",
    index: torch.Tensor | None = None,
):
    """1-bit quantisation of gradient + residual; returns (packed, levels, new residual), the
    new residual being what the quantisation lost, to be added to the next gradient."""
    corrected = gradient + residual
    if index is None:
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
        return [
            [
                min(hi, start + size) - max(lo, start)
                for start, size in zip(starts, groups)
                if min(hi, start + size) > max(lo, start)
            ]
            for lo, hi in zip(bounds, bounds[1:])
        ]
    cuts = [0]
    for end in ends:
        k = bisect.bisect_left(starts, end)  # starts[k-1] < end <= starts[k]
        cuts.append(k if k < len(starts) and (k == 0 or starts[k] - end < end - starts[k - 1]) else k - 1)
    cuts.append(len(groups))
    return [groups[lo:hi] for lo, hi in zip(cuts, cuts[1:])]


def message_bytes(numel: int, groups: int, per_group: int) -> int:
    """Bytes of `encode`'s message for `numel` values in `groups` groups (nothing for an empty chunk)."""
    return groups * per_group * 4 + -(-numel // 8) if groups else 0


def compress_chunk(
    values: torch.Tensor, groups: list[int], quantizer: str, index: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(message, what it decodes to) of one chunk; an empty chunk is an empty message."""
    if not groups:
        return torch.empty(0, dtype=torch.uint8, device=values.device), values
    packed, levels = quantize(values, groups, quantizer, index)
    return encode(packed, levels), dequantize(packed, levels, groups, index)


def levels_per_group(quantizer: str) -> int:
    """Reconstruction values per group: one scale (`tensor`) or the two means (`column`)."""
    return 1 if quantizer == "tensor" else 2


def decompress_chunk(
    message: torch.Tensor, groups: list[int], quantizer: str, index: torch.Tensor | None
) -> torch.Tensor:
    """The values of `compress_chunk`'s message."""
    if not groups:
        return torch.empty(0, device=message.device)
    return dequantize(*decode(message, len(groups), levels_per_group(quantizer)), groups, index)


def decompress_messages(
    messages: torch.Tensor, groups: list[int], quantizer: str, index: torch.Tensor | None
) -> torch.Tensor:
    """The values of several messages of one chunk, one a row (workers x bytes -> workers x
    values): `decompress_chunk` of every row, in one go."""
    workers, numel = messages.shape[0], sum(groups)
    if not groups:
        return torch.zeros(workers, numel, device=messages.device)
    per_group = levels_per_group(quantizer)
    level_bytes = len(groups) * per_group * 4
    # copied out: a row of the received buffer need not start 4-aligned for the float view
    levels = messages[:, :level_bytes].clone(memory_format=torch.contiguous_format).view(torch.float32)
    levels = levels.view(workers, len(groups), per_group) if per_group > 1 else levels
    return decode_bits(unpack_bits(messages[:, level_bytes:], numel), levels, groups, index)


def reduce_chunk(
    messages: torch.Tensor, residual: torch.Tensor, groups: list[int], quantizer: str, index: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The owner's step of the compressed reduce-scatter (1-bit Adam's server side): the mean
    of the N workers' decoded messages for its chunk (`messages`, workers x bytes, one a row),
    plus the chunk's server residual, is quantised again; returns (message, new server
    residual, its |e|/|v|), the new residual being what this second quantisation lost (the
    second error feedback). The mean is one torch sum over the workers' rows (for N >= 16 not
    bit for bit Python's left-to-right sum of the rows)."""
    mean = decompress_messages(messages, groups, quantizer, index).sum(0) / messages.shape[0]
    corrected = mean + residual
    message, decoded = compress_chunk(corrected, groups, quantizer, index)
    lost = corrected - decoded
    return message, lost, lost.norm() / corrected.norm().clamp(min=1e-30)


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    return counts.cumsum(0) - counts


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The ranges [start, start + length), one after another, as one index tensor."""
    return torch.repeat_interleave(starts - _exclusive_cumsum(lengths), lengths) + torch.arange(int(lengths.sum()))


@dataclass(frozen=True)
class ChunkLayout:
    """A bucket cut into N chunks (`chunk_groups`) and its N chunk messages, `compress_chunk`'s
    one after another, encoded and decoded in a fixed number of tensor ops whatever N: the
    index tensors here, built once per bucket layout (`chunk_layout`), place every sign bit and
    every level's bytes (index tensors, not boolean masks: no host sync on a GPU). Between the
    values and the messages lies the canonical order of the bytes: every chunk's levels (the
    bucket's pieces in order), then every chunk's sign bits, each chunk's padded to a whole
    byte as `pack_signs` pads a message."""

    quantizer: str
    groups: list[list[int]]  # each chunk's quantisation groups (`tensor`: the pieces the cuts leave)
    sizes: list[int]  # values per chunk
    message_bytes: list[int]  # bytes of each chunk's message (0 for an empty chunk)
    pieces: list[int]  # every chunk's groups, chunk after chunk
    index: torch.Tensor  # every value's piece
    level_bytes: int  # the canonical order's levels: its first level_bytes bytes
    sign_bits: int  # the chunks' byte-padded sign bits, after the levels
    sign_positions: torch.Tensor  # each value's place among those sign bits
    to_messages: torch.Tensor  # the messages are canonical[to_messages]
    to_canonical: torch.Tensor  # and the canonical bytes messages[to_canonical]

    def compress(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the N chunk messages concatenated, what they decode to) of the bucket's values: the
        bytes and values of `compress_chunk` chunk after chunk."""
        packed, levels = quantize(values, self.pieces, self.quantizer, self.index)
        bits = unpack_bits(packed, values.numel())
        slots = torch.zeros(self.sign_bits, dtype=torch.uint8, device=values.device)
        slots.scatter_(0, self.sign_positions, bits.to(torch.uint8))
        canonical = torch.cat([levels.reshape(-1).view(torch.uint8), pack_bits(slots)])
        return canonical.index_select(0, self.to_messages), decode_bits(bits, levels, self.pieces, self.index)

    def decompress(self, messages: torch.Tensor) -> torch.Tensor:
        """The bucket's values of the N chunk messages concatenated (`compress`'s layout)."""
        canonical = messages.index_select(0, self.to_canonical)  # a new tensor: its levels are 4-aligned
        per_group = levels_per_group(self.quantizer)
        levels = canonical[: self.level_bytes].view(torch.float32)
        levels = levels.view(-1, per_group) if per_group > 1 else levels
        bits = unpack_bits(canonical[self.level_bytes :], self.sign_bits).index_select(0, self.sign_positions)
        return decode_bits(bits, levels, self.pieces, self.index)


def chunk_layout(groups: list[int], chunks: int, quantizer: str, device=None) -> ChunkLayout:
    """The bucket of quantisation groups `groups` in `chunks` chunks, its index tensors on `device`."""
    per_chunk = chunk_groups(groups, chunks, cut=quantizer == "tensor")
    sizes = [sum(g) for g in per_chunk]
    per_group = levels_per_group(quantizer)
    level_bytes = torch.tensor([len(g) * per_group * 4 for g in per_chunk])
    sign_bytes = torch.tensor([-(-n // 8) for n in sizes])
    # canonical: all levels, then all signs; a message: its chunk's levels, then its signs
    canonical_starts = torch.stack(
        [_exclusive_cumsum(level_bytes), level_bytes.sum() + _exclusive_cumsum(sign_bytes)], 1
    )
    to_messages = _ranges(canonical_starts.view(-1), torch.stack([level_bytes, sign_bytes], 1).view(-1))
    to_canonical = torch.empty_like(to_messages)
    to_canonical[to_messages] = torch.arange(len(to_messages))
    sign_positions = _ranges(8 * _exclusive_cumsum(sign_bytes), torch.tensor(sizes))
    pieces = [size for chunk in per_chunk for size in chunk]
    sent = [message_bytes(n, len(g), per_group) for n, g in zip(sizes, per_chunk)]
    assert sum(sent) == len(to_messages)
    return ChunkLayout(
        quantizer,
        per_chunk,
        sizes,
        sent,
        pieces,
        group_index(pieces, device),
        int(level_bytes.sum()),
        8 * int(sign_bytes.sum()),
        sign_positions.to(device),
        to_messages.to(device),
        to_canonical.to(device),
    )


@dataclass(frozen=True)
class Chunks:
    """One bucket's chunks, as this worker sees them: chunk j is worker j's to reduce."""

    layout: ChunkLayout
    index: torch.Tensor | None  # the group of every value of this worker's chunk (None: an empty chunk)
    owned: list[tuple[torch.Tensor, int, int]]  # (parameter, start, end): the entries of this worker's chunk

    def bytes_sent(self, rank: int) -> int:
        """Chunk j to worker j for every j but this worker's own, then its averaged chunk to the N-1 others."""
        sizes = self.layout.message_bytes
        return sum(sizes) - sizes[rank] + (len(sizes) - 1) * sizes[rank]
