"""The parameter-server messages: tags, request kinds, and how parameters map onto shards
(`split_contiguous`: each shard a balanced contiguous range of the flattened parameters).

Workers are ranks 0..N-1, shards ranks N..N+S-1; every message is a torch.distributed
point-to-point send over gloo (the job's default group, or a gloo group over all ranks when
the workers use NCCL). Tensors in messages live on the CPU.

    rank 0 -> shard   TAG_SETUP       float64 [numel, momentum, dampening, weight_decay, nesterov]
    rank 0 -> shard   TAG_PARAMETERS  float32 [numel]: the initial values of the shard's slice
    worker -> shard   TAG_REQUEST     float64 [kind, step, read_version, lr, wish]   (kind: PUSH/PULL/DONE/
                                      IDLE/SAVE; a push is tagged by read_version, the step is
                                      informative, except in SAVE: the step saved; wish: a BoundaryAction
                                      code this worker asks for, in a push; in SAVE: the agreed action)
    worker -> shard   TAG_GRADIENT    float32 [numel]: follows every PUSH request
    shard -> worker   TAG_VERSION     float64 [version, boundary step, boundary action]  } the reply to a PULL,
    shard -> worker   TAG_PARAMETERS  float32 [numel]                 } and to a PUSH once the policy allows it
    shard -> worker   TAG_SAVED       float64 [step]: the shard's state of that step is on disk (after SAVE)
    shard -> rank 0   TAG_STATS       float64 [busy_s, wall_s, updates, N, staleness length, ahead length]
                                      then float64 [N + both lengths]: dropped pushes per worker,
                                      gradients per staleness, answered pushes per clocks ahead

A checkpoint (periodic, or a preemption's stop) is agreed through the first shard (rank N), which
sees every worker's clock: a worker's push carries its wish; the first shard answers it with a
boundary, the step max(clocks) + 1 that no worker has passed, in every reply from then on; each
worker stops there, sends SAVE to every shard and saves its own state; a shard saves its own once
all N have sent SAVE, then answers each with TAG_SAVED (see `shard.ShardServer`).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

TAG_SETUP = 101
TAG_REQUEST = 102
TAG_GRADIENT = 103
TAG_VERSION = 104
TAG_PARAMETERS = 105
TAG_STATS = 106
TAG_SAVED = 107

SETUP_FIELDS = ("numel", "momentum", "dampening", "weight_decay", "nesterov")
REQUEST_SIZE = 5
REPLY_HEADER_SIZE = 3  # TAG_VERSION's [version, boundary step, boundary action]
NO_BOUNDARY = -1.0
STATS_HEADER_SIZE = 6
VALUE_DTYPE = torch.float32  # parameters and gradients on the wire


class Kind(enum.IntEnum):
    PUSH = 0  # a gradient follows; the reply carries the parameters for the next step
    PULL = 1  # the current parameters, at once
    DONE = 2  # this worker sends nothing more
    IDLE = 3  # this worker's pushes of the epoch are all sent (it goes to evaluation): no reply
    SAVE = 4  # this worker is at the agreed boundary and pushes nothing until TAG_SAVED comes back


class BoundaryAction(enum.IntEnum):
    """What the workers and shards do at an agreed step boundary (a wish's and a boundary's code;
    the larger wins: a stop is never downgraded)."""

    NONE = 0
    CHECKPOINT = 1  # save, and training goes on
    STOP = 2  # save, and the job is requeued (a preemption)


def request(
    kind: Kind, step: int = 0, read_version: int = 0, lr: float = 0.0, wish: BoundaryAction = BoundaryAction.NONE
) -> torch.Tensor:
    return torch.tensor([float(kind), float(step), float(read_version), lr, float(wish)], dtype=torch.float64)


class Piece(NamedTuple):
    """Values [start, end) of parameter `index` (model order), flattened in its logical order."""

    index: int
    start: int
    end: int


def split_contiguous(sizes: list[int], shards: int) -> list[list[Piece]]:
    """The pieces each shard owns: the parameters' values flattened in model order and cut into
    `shards` contiguous ranges balanced to within one value (the first M % S shards one more),
    as TF's partitioned variables and MXNet's kvstore split big arrays across servers. A
    parameter may span two or more shards; a shard's pieces are in flat order. Every worker
    computes this on its own (from the sizes and the count alone: no randomness); a shard
    learns only its size, from rank 0's TAG_SETUP."""
    total = sum(sizes)
    if not 1 <= shards <= total:
        raise ValueError(
            f"{shards} parameter-server shards but the model has {total} parameter values; "
            f"allowed: 1 to {total} shards (each shard owns at least one value)"
        )
    share, remainder = divmod(total, shards)
    # where each shard's range starts in the flat order; the last entry is the end, `total`
    bounds = [s * share + min(s, remainder) for s in range(shards + 1)]
    owned: list[list[Piece]] = [[] for _ in range(shards)]
    shard, position = 0, 0  # the next value's flat position, and the shard whose range holds it
    for index, size in enumerate(sizes):
        first = position  # the parameter's first value in the flat order
        while position < first + size:
            while bounds[shard + 1] <= position:  # that shard's range is full
                shard += 1
            cut = min(first + size, bounds[shard + 1])
            owned[shard].append(Piece(index, position - first, cut - first))
            position = cut
    return owned
