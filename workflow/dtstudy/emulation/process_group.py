"""The emulated process group: N logical workers, one thread each, in one process.

A `dist.ProcessGroup` written in Python and registered as the backend "emulated"
(`dist.Backend.register_backend`), on the model of torch's own test helper
(torch/testing/_internal/distributed/multi_threaded_pg.py, internal API, hence this copy):
torch.distributed's state (`distributed_c10d._world`) is made thread-local, so each thread's
`dist.*` calls, DDP's C++ reducer and its communication hooks see their own rank and groups,
and the strategies run their own exchange code unchanged.

Every collective is matched across the group's threads by its sequence number in the group;
the last thread to arrive does the maths on every thread's tensors, and the collective ends
on every participant's clock at max(arrival times) + the performance model's time for it
(`costs`, dtstudy.emulation.clock.ExchangeCosts). A thread that arrives earlier gives the baton
away until then (dtstudy.emulation.scheduler). Point-to-point messages go into the receiver's
mailbox, arriving at the sender's time + the link's time for their bytes (behind earlier
messages on a shared link: ExchangeCosts.deliver); a receive waits for one (the earliest to
arrive, for a receive from any source).
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceScatterOptions,
    _create_work_from_future,
)

BACKEND = "emulated"

_REDUCTIONS: dict[Any, Callable[[torch.Tensor], torch.Tensor]] = {
    dist.ReduceOp.SUM: lambda stacked: stacked.sum(dim=0),
    dist.ReduceOp.AVG: lambda stacked: stacked.mean(dim=0),
    dist.ReduceOp.PRODUCT: lambda stacked: stacked.prod(dim=0),
    dist.ReduceOp.MIN: lambda stacked: stacked.min(dim=0).values,
    dist.ReduceOp.MAX: lambda stacked: stacked.max(dim=0).values,
}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _reduce(tensors: list[torch.Tensor], op) -> torch.Tensor:
    """The reduction of one tensor over the ranks, in rank order (as a fixed-order reduction)."""
    op = getattr(op, "op", op)  # options hold a ReduceOp; the table is by its RedOpType
    if op not in _REDUCTIONS:
        raise NotImplementedError(f"reduce op {op} is not emulated; emulated: SUM, AVG, PRODUCT, MIN, MAX")
    return _REDUCTIONS[op](torch.stack(tensors))


# ----- which thread is which rank -------------------------------------------------------------

_thread = threading.local()


def current_rank() -> int:
    """The global rank of the logical worker this thread runs."""
    return _thread.rank


def bind_thread(rank: int) -> None:
    _thread.rank = rank


@dataclass
class _ThreadWorld:
    """torch.distributed's process-group state of one thread (distributed_c10d._World's fields)."""

    default_pg: Any = None
    pg_map: dict = field(default_factory=dict)
    pg_names: dict = field(default_factory=dict)
    pg_group_ranks: dict = field(default_factory=dict)
    pg_backend_config: dict = field(default_factory=dict)
    group_count: int = 0
    tags_to_pg: dict = field(default_factory=dict)
    pg_to_tag: dict = field(default_factory=dict)
    pg_coalesce_state: dict = field(default_factory=dict)
    comms: list = field(default_factory=list)


class ThreadLocalWorld:
    """Stands in for distributed_c10d._world: each thread sees its own _ThreadWorld."""

    def __init__(self):
        object.__setattr__(self, "_local", threading.local())

    def _get(self) -> _ThreadWorld:
        local = object.__getattribute__(self, "_local")
        if not hasattr(local, "world"):
            local.world = _ThreadWorld()
        return local.world

    def __getattr__(self, name):
        return getattr(self._get(), name)

    def __setattr__(self, name, value):
        setattr(self._get(), name, value)

    @property
    def pg_config_info(self) -> list:
        return []


@contextlib.contextmanager
def installed(world: EmulatedWorld):
    """torch.distributed made thread-local for the emulated run `world` (one at a time per process)."""
    global _active
    if _active is not None:
        raise RuntimeError("an emulated run is already active in this process")
    c10d = dist.distributed_c10d
    saved = c10d._world
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # group names per thread
    c10d._world = ThreadLocalWorld()
    # autograd runs backward on the calling thread: DDP's hooks then issue collectives as the worker's rank
    autograd_threads = torch.autograd.set_multithreading_enabled(False)
    _active = world
    try:
        yield world
    finally:
        _active = None
        autograd_threads.__exit__(None, None, None)
        c10d._world = saved
        torch._C._distributed_c10d._set_thread_isolation_mode(False)


_active: EmulatedWorld | None = None


# ----- what the threads share ------------------------------------------------------------------


@dataclass
class _Collective:
    size: int
    data: list = field(default_factory=list)
    members: list = field(default_factory=list)  # global ranks, in arrival order
    arrivals: list = field(default_factory=list)
    nbytes: int = 0
    done: bool = False
    end: float = 0.0
    left: int = 0

    def __post_init__(self):
        self.data = [None] * self.size


@dataclass
class _Message:
    src: int  # the sender's rank in the group
    tag: int
    tensor: torch.Tensor
    arrival: float


class EmulatedWorld:
    """The run's shared state: the scheduler (the clocks), the collectives in flight, the
    mailboxes, and the performance model's costs of each exchange."""

    def __init__(self, scheduler, costs):
        self.scheduler = scheduler
        self.costs = costs
        self._collectives: dict[tuple[str, int], _Collective] = {}
        # (group, receiver's rank in it) -> tag -> its messages in the order sent
        self._mail: dict[tuple[str, int], dict[int, list[_Message]]] = defaultdict(lambda: defaultdict(list))
        self.collectives = 0  # how many ran (a cost figure)

    def collective(self, group: str, sequence: int, size: int) -> _Collective:
        key = (group, sequence)
        if key not in self._collectives:
            self._collectives[key] = _Collective(size)
        return self._collectives[key]

    def arrival(self, nbytes: int, src: int, dst: int) -> float:
        """When a message that global rank `src` sends now reaches `dst`: after its links' time,
        queued behind earlier messages on shared links where the costs model them (`deliver`)."""
        sent = self.scheduler.time[src]
        deliver = getattr(self.costs, "deliver", None)
        return deliver(nbytes, src, dst, sent) if deliver else sent + self.costs.message(nbytes, src, dst)

    def leave(self, group: str, sequence: int) -> None:
        collective = self._collectives[(group, sequence)]
        collective.left += 1
        if collective.left == collective.size:
            del self._collectives[(group, sequence)]


def _done(result=None):
    future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


class _SendWork(dist.Work):
    """A send: its buffer is free once the bytes are on the wire (the sender's clock moves to
    the message's arrival when it waits)."""

    def __init__(self, arrival: float, tensors):
        super().__init__()
        self.arrival, self.tensors = arrival, tensors

    def wait(self, timeout=None) -> bool:
        scheduler, rank = _active.scheduler, current_rank()
        scheduler.advance(rank, self.arrival - scheduler.time[rank])
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(self.tensors)
        return future


class _RecvWork(dist.Work):
    """A receive: waits (gives the baton away) until a matching message is in the mailbox."""

    def __init__(self, group: EmulatedProcessGroup, tensors, src: int | None, tag: int):
        super().__init__()
        self.tensors, self.src, self.tag = tensors, src, tag
        # its key now, on the receiving thread: the readiness check runs on whichever thread
        # passes the baton, whose torch.distributed state is its own
        self.mailbox = (group.group_name, group.rank())
        self.source: int | None = None

    def _match(self) -> _Message | None:
        tagged = _active._mail[self.mailbox][self.tag]
        found = tagged if self.src is None else [m for m in tagged if m.src == self.src]
        if not found:
            return None
        # from one source: the first sent (messages of a pair keep their order); from any:
        # the first to arrive on the cluster's clock, ties by rank
        return found[0] if self.src is not None else min(found, key=lambda m: (m.arrival, m.src))

    def wait(self, timeout=None) -> bool:
        if self.source is not None:
            return True
        scheduler, rank = _active.scheduler, current_rank()

        def arrival():  # when this receive may complete: its message's arrival, not before this thread's time
            message = self._match()
            return None if message is None else max(message.arrival, scheduler.time[rank])

        scheduler.wait_until(rank, arrival)  # also when the message is there: an earlier one may still come
        message = self._match()
        _active._mail[self.mailbox][self.tag].remove(message)
        with torch.no_grad():
            self.tensors[0].copy_(message.tensor)
        self.source = message.src
        scheduler.time[rank] = max(scheduler.time[rank], message.arrival)
        return True

    def is_completed(self) -> bool:
        return self.source is not None

    def _source_rank(self) -> int:
        self.wait()
        return self.source

    # a parameter-server shard asks its receive from any worker for the sender (torch's
    # C++ binding would not reach a Python work's source)
    source_rank = _source_rank

    def get_future(self):
        self.wait()
        future = torch.futures.Future()
        future.set_result(self.tensors)
        return future


class EmulatedProcessGroup(dist.ProcessGroup):
    """One thread's view of one group of the emulated run (see the module docstring)."""

    def __init__(self, rank: int, size: int, world: EmulatedWorld):
        super().__init__(rank, size)
        self._rank, self._size, self._world = rank, size, world
        self._sequence = 0
        self._name: str | None = None
        self._globals: dict[int, int] = {}  # group rank -> global rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:
        return BACKEND

    supports_coalescing = False  # batch_isend_irecv then sends and receives one by one

    def _get_backend(self, device):
        """The group is its own backend for every device (torch asks it what it supports)."""
        return self

    @property
    def group_name(self) -> str:
        # a group's name and ranks never change once torch registered it: looked up once (each
        # lookup goes through the thread-local world, and a parameter server asks at every message)
        if self._name is None:
            self._name = dist.distributed_c10d._world.pg_names[self]
        return self._name

    @property
    def pg_name(self) -> str:
        return self.group_name

    def __repr__(self):
        return f"EmulatedProcessGroup(rank {self._rank} of {self._size})"

    def _global(self, group_rank: int) -> int:
        if group_rank not in self._globals:
            self._globals[group_rank] = (
                dist.get_global_rank(self, group_rank)
                if self is not dist.distributed_c10d._world.default_pg
                else group_rank
            )
        return self._globals[group_rank]

    # ----- the collectives -------------------------------------------------------------------
    def _collective(self, kind: str, data, nbytes: int, maths: Callable[[list], None], result=None):
        """Join collective number `_sequence` of this group with this rank's `data`; the last to
        arrive runs `maths` on every rank's data. Ends on the clock at max(arrivals) + its cost."""
        world, scheduler, me = self._world, self._world.scheduler, current_rank()
        sequence, name = self._sequence, self.group_name
        self._sequence += 1
        shared = world.collective(name, sequence, self._size)
        shared.data[self._rank] = data
        shared.members.append(me)
        shared.arrivals.append(scheduler.time[me])
        shared.nbytes = max(shared.nbytes, nbytes)
        if len(shared.members) == self._size:
            with torch.no_grad():
                maths(shared.data)
            shared.end = max(shared.arrivals) + world.costs.collective(kind, shared.nbytes, sorted(shared.members))
            shared.done = True
            world.collectives += 1
            scheduler.touch(shared.members)  # the members waiting in it may go on now
        else:
            scheduler.wait_until(me, lambda: shared.end if shared.done else None)
        scheduler.time[me] = max(scheduler.time[me], shared.end)
        world.leave(name, sequence)
        return _done(data if result is None else result)

    def allreduce(self, tensors, opts=AllreduceOptions()):
        op = opts.reduceOp

        def maths(data):
            for i in range(len(data[0])):
                reduced = _reduce([ranks[i] for ranks in data], op)
                for ranks in data:
                    ranks[i].detach().copy_(reduced)

        return self._collective("allreduce", tensors, _nbytes(tensors), maths)

    def allreduce_coalesced(self, tensors, opts=AllreduceCoalescedOptions()):
        return self.allreduce(tensors, opts)

    def barrier(self, opts=BarrierOptions()):
        return self._collective("barrier", None, 0, lambda data: None)

    def broadcast(self, tensors, opts=BroadcastOptions()):
        root = opts.rootRank

        def maths(data):
            for i, source in enumerate(data[root]):
                for rank, ranks in enumerate(data):
                    if rank != root:
                        ranks[i].detach().copy_(source)

        return self._collective("broadcast", tensors, _nbytes(tensors), maths)

    def allgather(self, output_lists, inputs, opts=AllgatherOptions()):
        def maths(data):
            # one C++ loop of copies per output list: N^2 copies, O(N) Python calls
            for i in range(len(data[0][1])):
                sources = [ranks_inputs[i] for _, ranks_inputs in data]
                for outputs, _ in data:
                    torch._foreach_copy_([output.detach() for output in outputs[i]], sources)

        return self._collective("allgather", (output_lists, inputs), _nbytes(inputs), maths, output_lists)

    def gather(self, output_lists, inputs, opts=GatherOptions()):
        root = opts.rootRank

        def maths(data):  # only the root has output lists (the others pass none)
            root_outputs = data[root][0]
            for i in range(len(data[0][1])):
                torch._foreach_copy_(
                    [output.detach() for output in root_outputs[i]], [ranks_inputs[i] for _, ranks_inputs in data]
                )

        return self._collective("gather", (output_lists, inputs), _nbytes(inputs), maths, output_lists)

    def all_gather_single(self, output, input, opts=AllgatherOptions()):
        def maths(data):
            # the N inputs laid end to end once, then one copy into each output: O(N) tensor
            # ops, not N^2 copies of one chunk (hybrid's activations at N = 256)
            gathered = torch.cat([rank_input.detach().reshape(-1) for _, rank_input in data])
            for rank_output, _ in data:
                rank_output.detach().copy_(gathered.view(rank_output.shape))

        return self._collective("allgather", (output, input), _nbytes([input]), maths, [output])

    def _allgather_base(self, output, input, opts=AllgatherOptions()):
        return self.all_gather_single(output, input, opts)

    def reduce_scatter(self, outputs, input_lists, opts=ReduceScatterOptions()):
        op = opts.reduceOp

        def maths(data):
            for i in range(len(data[0][0])):
                for rank, (ranks_outputs, _) in enumerate(data):
                    ranks_outputs[i].detach().copy_(_reduce([inputs[i][rank] for _, inputs in data], op))

        return self._collective("reduce_scatter", (outputs, input_lists), _nbytes(outputs), maths, outputs)

    def reduce_scatter_single(self, output, input, opts=ReduceScatterOptions()):
        op = opts.reduceOp
        # (a ReduceOp compares equal to a RedOpType only from its own side: not `op in (...)`)
        if not (op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG):
            return self.reduce_scatter([output], [list(input.chunk(self._size))], opts)

        def maths(data):
            # the N whole inputs summed into one (at least fp32), then each rank's chunk of it:
            # O(N) tensor ops and no N x N stack (hybrid's activation gradients at N = 256)
            first = data[0][1].detach().reshape(-1)
            wide = torch.promote_types(first.dtype, torch.float32) if first.is_floating_point() else first.dtype
            total = first.to(wide, copy=True)
            for _, rank_input in data[1:]:
                total.add_(rank_input.detach().reshape(-1))
            if op == dist.ReduceOp.AVG:
                total.div_(len(data))
            chunks = total.view(len(data), -1)
            for rank, (rank_output, _) in enumerate(data):
                rank_output.detach().copy_(chunks[rank].view(rank_output.shape))

        return self._collective("reduce_scatter", (output, input), _nbytes([output]), maths, [output])

    def _reduce_scatter_base(self, output, input, opts=ReduceScatterOptions()):
        return self.reduce_scatter_single(output, input, opts)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=AllToAllOptions()):
        size = self._size

        def pieces(tensor, splits):
            splits = list(splits) if splits is not None and len(splits) else [tensor.shape[0] // size] * size
            return tensor.split(splits)

        def even(splits) -> bool:
            return splits is None or not len(splits) or len(set(splits)) == 1

        def maths(data):
            if all(even(inp_splits) and even(out_splits) for _, _, out_splits, inp_splits in data):
                # equal pieces: every input as (destination, piece) stacked by source, and each
                # output the column of its destination, O(N) tensor ops, not N^2 pieces
                stacked = torch.stack([inp.detach().reshape(size, -1) for _, inp, _, _ in data])
                for dest, (out, _, _, _) in enumerate(data):
                    out.detach().copy_(stacked[:, dest].reshape(out.shape))
                return
            sent = [pieces(inp, inp_splits) for _, inp, _, inp_splits in data]
            for dest, (out, _, out_splits, _) in enumerate(data):
                torch._foreach_copy_(
                    [piece.detach() for piece in pieces(out, out_splits)],
                    [pieces_of_src[dest] for pieces_of_src in sent],
                )

        # timed as every worker sending its 1/N of the input to each of the others
        return self._collective(
            "alltoall", (output, input, output_splits, input_splits), _nbytes([input]) // size, maths, [output]
        )

    def alltoall(self, outputs, inputs, opts=AllToAllOptions()):
        def maths(data):
            for dest, (outs, _) in enumerate(data):
                torch._foreach_copy_([out.detach() for out in outs], [ins[dest] for _, ins in data])

        return self._collective(
            "alltoall", (outputs, inputs), max((_nbytes([t]) for t in inputs), default=0), maths, outputs
        )

    # ----- point to point --------------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        me, receiver = current_rank(), self._global(dst)
        nbytes = _nbytes(tensors)
        arrival = self._world.arrival(nbytes, me, receiver)
        self._world._mail[(self.group_name, dst)][tag].append(
            _Message(self._rank, tag, tensors[0].detach().clone(), arrival)
        )
        self._world.scheduler.touch((receiver,))  # a receive it waits in may match this message
        return _SendWork(arrival, tensors)

    def recv(self, tensors, src: int, tag: int = 0):
        return _RecvWork(self, tensors, src, tag)

    def recv_anysource(self, tensors, tag: int = 0):
        return _RecvWork(self, tensors, None, tag)


def _create(prefix_store, rank: int, size: int, timeout):
    if _active is None:
        raise RuntimeError(f"backend {BACKEND!r}: no emulated run is active (dtstudy.emulation.runner)")
    return EmulatedProcessGroup(rank, size, _active)


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
