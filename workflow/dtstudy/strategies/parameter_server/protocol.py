"""The parameter-server messages: tags, request kinds, and how parameters map onto shards.

Workers are ranks 0..N-1, shards ranks N..N+S-1; every message is a torch.distributed
point-to-point send over gloo (the job's default group, or a gloo group over all ranks when
the workers use NCCL). Tensors in messages live on the CPU.

    rank 0 -> shard   TAG_SETUP       float64 [numel, momentum, dampening, weight_decay, nesterov]
    rank 0 -> shard   TAG_PARAMETERS  float32 [numel]: the initial values of the shard's slice
    worker -> shard   TAG_REQUEST     float64 [kind, step, read_version, lr]   (kind: PUSH/PULL/DONE/STOP;
                                      a push is tagged by read_version, the step is informative)
    worker -> shard   TAG_GRADIENT    float32 [numel]: follows every PUSH request
    shard -> worker   TAG_VERSION     float64 [version]      } the reply to a PULL, and to a PUSH
    shard -> worker   TAG_PARAMETERS  float32 [numel]        } once the shard's policy allows it
    shard -> rank 0   TAG_STATS       float64 [busy_s, wall_s, updates, N, staleness length, ahead length]
                                      then float64 [N + both lengths]: dropped pushes per worker,
                                      gradients per staleness, answered pushes per clocks ahead
"""

from __future__ import annotations

import enum

import torch

TAG_SETUP = 101
TAG_REQUEST = 102
TAG_GRADIENT = 103
TAG_VERSION = 104
TAG_PARAMETERS = 105
TAG_STATS = 106

SETUP_FIELDS = ("numel", "momentum", "dampening", "weight_decay", "nesterov")
REQUEST_SIZE = 4
STATS_HEADER_SIZE = 6
VALUE_DTYPE = torch.float32  # parameters and gradients on the wire


class Kind(enum.IntEnum):
    PUSH = 0  # a gradient follows; the reply carries the parameters for the next step
    PULL = 1  # the current parameters, at once
    DONE = 2  # this worker sends nothing more
    STOP = 3  # rank 0 only: the job is preempted and requeued; the shard ends once rank 0 is gone
    IDLE = 4  # this worker's pushes of the epoch are all sent (it goes to evaluation): no reply


def request(kind: Kind, step: int = 0, read_version: int = 0, lr: float = 0.0) -> torch.Tensor:
    return torch.tensor([float(kind), float(step), float(read_version), lr], dtype=torch.float64)


def split_by_size(sizes: list[int], shards: int) -> list[list[int]]:
    """Indices of the tensors each shard owns (in model order), balanced by size: the largest
    tensor first, each to the least loaded shard (ties: the lowest shard)."""
    if shards > len(sizes):
        raise ValueError(f"{shards} parameter-server shards but the model has only {len(sizes)} parameter tensors")
    loads = [0] * shards
    owned: list[list[int]] = [[] for _ in range(shards)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        shard = min(range(shards), key=lambda s: (loads[s], s))
        owned[shard].append(index)
        loads[shard] += sizes[index]
    return [sorted(indices) for indices in owned]
