"""The compressed reduce-scatter's codec in one go (`ChunkLayout`, `reduce_chunk`) against its
per-chunk reference functions (`compress_chunk`, `decompress_chunk`), on LeNet-5's bucket
layouts: the same bytes and the same values, bit for bit, and as many tensor ops at N=64 as
at N=4. Planting an off-by-one in `chunk_layout` (a chunk's sign bits one slot late, its
level bytes one byte late, or its sign bytes counted n // 8 + 1) fails the first test."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtstudy.strategies.compressed.onebit_codec import (
    chunk_groups,
    chunk_layout,
    compress_chunk,
    decompress_chunk,
    decompress_messages,
    group_index,
    quantization_groups,
    reduce_chunk,
)

LENET5 = [(6, 1, 5, 5), (6,), (16, 6, 5, 5), (16,), (120, 400), (120,), (84, 120), (84,), (10, 84), (10,)]
BUCKETS = {
    "whole model, DDP's reversed order": LENET5[::-1],
    "the last layer": [(10, 84), (10,)],  # 11 columns: empty chunks from N=16 on (`column`)
    "a bias alone": [(10,)],  # 10 values: empty chunks from N=16 on (`tensor` too)
}
WORKERS = [1, 3, 4, 16, 64]


def _values(shapes, seed: int) -> torch.Tensor:
    """A bucket's flat values: every tensor its own scale, a run of exact zeros in each."""
    generator = torch.Generator().manual_seed(seed)
    parts = []
    for shape in shapes:
        part = torch.randn(torch.Size(shape).numel(), generator=generator) * 10 ** torch.randint(
            -3, 2, (1,), generator=generator
        )
        part[: part.numel() // 7] = 0.0
        parts.append(part)
    return torch.cat(parts)


def _index(groups: list[int]) -> torch.Tensor | None:
    return group_index(groups) if groups else None


def _layout(bucket: str, quantizer: str, workers: int):
    shapes = BUCKETS[bucket]
    groups = quantization_groups([torch.Size(s) for s in shapes], quantizer)
    return shapes, groups, chunk_layout(groups, workers, quantizer)


@pytest.mark.parametrize("quantizer", ["column", "tensor"])
@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("bucket", list(BUCKETS))
@pytest.mark.slow
def test_layout_sends_and_decodes_what_the_per_chunk_functions_do(bucket, quantizer, workers):
    shapes, groups, layout = _layout(bucket, quantizer, workers)
    assert layout.groups == chunk_groups(groups, workers, cut=quantizer == "tensor")
    values = _values(shapes, seed=workers)
    chunk_values = values.split(layout.sizes)
    reference = [compress_chunk(v, g, quantizer, _index(g)) for v, g in zip(chunk_values, layout.groups)]
    messages, decoded = layout.compress(values)
    assert [m.numel() for m, _ in reference] == layout.message_bytes
    assert torch.equal(messages, torch.cat([m for m, _ in reference]))
    assert torch.equal(decoded, torch.cat([d for _, d in reference]))
    # the all-gathered messages: each chunk's from its owner, here from other values than ours
    others = [
        compress_chunk(v, g, quantizer, _index(g))[0]
        for v, g in zip(_values(shapes, seed=100 + workers).split(layout.sizes), layout.groups)
    ]
    gathered = torch.cat(others)
    expected = torch.cat([decompress_chunk(m, g, quantizer, _index(g)) for m, g in zip(others, layout.groups)])
    assert torch.equal(layout.decompress(gathered), expected)
    assert torch.equal(layout.decompress(messages), decoded)
    if (len(groups) if quantizer == "column" else values.numel()) < workers:
        assert 0 in layout.message_bytes, "the case of empty chunks is not exercised"


@pytest.mark.parametrize("quantizer", ["column", "tensor"])
@pytest.mark.parametrize("workers", WORKERS)
def test_owner_decodes_every_workers_message_of_its_chunk_at_once(quantizer, workers):
    """The owners j of the whole model's bucket and of the last layer's (with empty chunks): the
    N workers' messages of chunk j as received (one buffer, a row each, rows not 4-aligned)
    decode to `decompress_chunk` of each, and `reduce_chunk` quantises their mean (a torch sum
    over the rows) plus the server residual as `compress_chunk` does."""
    for bucket in ("whole model, DDP's reversed order", "the last layer"):
        shapes, _, layout = _layout(bucket, quantizer, workers)
        workers_values = [_values(shapes, seed=seed).split(layout.sizes) for seed in range(workers)]
        residual = _values(shapes, seed=-1) / 100
        empty = [j for j, size in enumerate(layout.sizes) if not size]
        # every owner up to N=16; at N=64 (time) the first, second, middle and last and an empty chunk's
        owners = range(workers) if workers <= 16 else sorted({0, 1, workers // 2, workers - 1, *empty[:1]})
        for owner in owners:
            groups, size, mine = layout.groups[owner], layout.sizes[owner], layout.message_bytes[owner]
            index = _index(groups)
            rows = [compress_chunk(values[owner], groups, quantizer, index)[0] for values in workers_values]
            received = torch.cat([torch.zeros(1, dtype=torch.uint8), *rows])[
                1:
            ]  # unaligned, as a row of a buffer may be
            decoded = decompress_messages(received.view(workers, mine), groups, quantizer, index)
            each = [decompress_chunk(m, groups, quantizer, index) for m in rows]
            assert torch.equal(decoded, torch.stack(each))
            start = sum(layout.sizes[:owner])
            server = residual[start : start + size]
            message, lost, error = reduce_chunk(received.view(workers, mine), server, groups, quantizer, index)
            corrected = torch.stack(each).sum(0) / workers + server
            expected_message, expected_decoded = compress_chunk(corrected, groups, quantizer, index)
            assert torch.equal(message, expected_message) and torch.equal(lost, corrected - expected_decoded)
            assert 0 <= error.item() < 1


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def _ops_per_bucket(quantizer: str, workers: int) -> Counter:
    """The tensor ops of one worker's bucket: its N chunk messages encoded, the owner's reduce
    of the N messages of its chunk, the N gathered chunks decoded."""
    shapes, _, layout = _layout("whole model, DDP's reversed order", quantizer, workers)
    values = _values(shapes, seed=0)
    owner = max(range(workers), key=layout.sizes.__getitem__)
    groups, mine = layout.groups[owner], layout.message_bytes[owner]
    index, residual = _index(groups), torch.zeros(layout.sizes[owner])
    with _CountOps() as counted:
        messages, _ = layout.compress(values)
        received = messages[sum(layout.message_bytes[:owner]) :][:mine].repeat(workers)
        reduce_chunk(received.view(workers, mine), residual, groups, quantizer, index)
        layout.decompress(messages)
    return counted.ops


@pytest.mark.parametrize("quantizer", ["column", "tensor"])
def test_tensor_ops_per_bucket_do_not_grow_with_n(quantizer):
    """Planted: `reduce_chunk` decoding the N messages one by one, as it did, fails this."""
    assert _ops_per_bucket(quantizer, 64) == _ops_per_bucket(quantizer, 4)
