"""What a GPU run asks of every strategy, checked on the CPU at N = 2 (emulated: the real loop
and strategies, every exchange through the emulated process group):

- every tensor handed to a collective of the workers' group is on the run's device (NCCL
  refuses host memory). On the CPU the run's device and the host are the same memory, so the
  run computes on a stand-in accelerator, `cpu:0`: a `HostTensors` mode follows where each
  tensor would live on a GPU (made without the run's device, `.cpu()`, or computed from such
  tensors only: the host), and a recorder of the emulated group's collectives names every
  host tensor handed to one. Object collectives (gather_object...) and the parameter
  servers' own gloo group (host messages, as on a cluster) are exempt;
- with `train.memory_format: channels_last`, the 4-d parameters stay channels_last through
  every exchange, each gradient has its parameter's strides when the update runs (the fused
  CUDA SGD kernel refuses other pairs), and the run ends where its contiguous run ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import traceback

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_parameters, in_workers
from test_emulation import emulated_run
from torch.overrides import TorchFunctionMode

from dtstudy.strategies.registry import STRATEGIES

#: the stand-in accelerator: a tensor made with device=cpu:0 reports `cpu` as any other, so
#: only the factory's argument tells the run's device from the host's memory
RUN_DEVICE = torch.device("cpu", 0)
_HOST = "_dtstudy_on_host"

#: knobs with which each strategy exchanges within the runs' few steps (the rest: defaults);
#: every registered strategy runs at least once
CASES = [
    ("allreduce", {}),
    ("ps_sync", {}),
    ("ps_backup", {"backup": 1}),
    ("ps_async", {}),
    ("ssp", {}),
    ("local_sgd", {"period": 2, "warmup_steps": 1}),
    ("easgd", {"period": 2}),
    ("gossip", {"topology": "ring"}),
    ("gossip", {"topology": "random_pairs"}),
    ("allreduce_fp16", {}),
    ("allreduce_bf16", {}),
    ("allreduce_powersgd", {"start_powerSGD_iter": 2}),
    ("allreduce_onebit", {"exchange": "allgather"}),
    ("allreduce_onebit", {"exchange": "reduce_scatter"}),
    ("hybrid", {}),
    ("no_exchange", {}),
]
IDS = [
    name + "".join(f"-{value}" for key, value in knobs.items() if key in ("topology", "exchange"))
    for name, knobs in CASES
]
STEPS = 5


def test_the_cases_cover_every_registered_strategy():
    assert {name for name, _ in CASES} == set(STRATEGIES)


# ----- where each tensor would live on a GPU ---------------------------------------------------


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def on_host(tensor: torch.Tensor) -> bool:
    return getattr(tensor, _HOST, False)


class HostTensors(TorchFunctionMode):
    """Tags each tensor that a run on an accelerator would hold in host memory: made by a
    factory without the run's device (torch.tensor([...]), torch.zeros(n), device="cpu"),
    moved by .cpu() or .to(a host device), or computed from host tensors alone. Every other
    tensor (made on the run's device, computed from one, or made by C++ such as autograd's
    gradients) counts as on the device. A move between the two makes a copy, as on a GPU."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def _placement(self, func, args, kwargs) -> bool | None:
        """True: the result is in host memory; False: on the device; None: as its inputs."""
        if func is torch.Tensor.cpu:
            return True
        if func is torch.Tensor.to:
            device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
            return None if device is None else device != self.device
        if kwargs.get("device", None) is not None:
            return torch.device(kwargs["device"]) != self.device
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        if not inputs:
            return True  # a factory on the default device: the host
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        placement = self._placement(func, args, kwargs)
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        if placement is None:
            placement = bool(inputs) and all(on_host(t) for t in inputs)
        moves = func in (torch.Tensor.to, torch.Tensor.cpu)
        if isinstance(result, torch.Tensor) and moves and result is args[0] and on_host(result) != placement:
            result = result.clone()  # a move between host and device is a copy on a GPU
        for tensor in _tensors(result):
            if not any(tensor is t for t in inputs):  # in place: the memory stays where it was
                setattr(tensor, _HOST, placement)
        return result


# ----- a recorder of the emulated group's collectives -------------------------------------------

#: the emulated group's methods that move tensors (barrier moves none)
COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "allgather",
    "gather",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_single",
    "all_to_all_single",
    "alltoall",
    "send",
    "recv",
    "recv_anysource",
)
#: torch's object collectives serialise to a tensor on the device NCCL wants, by themselves
OBJECT_COLLECTIVES = (
    "gather_object",
    "all_gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)


def _caller() -> str:
    """The innermost frame of the package's own code (not the emulated group's)."""
    for frame in reversed(traceback.extract_stack()):
        if "dtstudy" in frame.filename and "emulation" not in frame.filename:
            return f"{frame.filename.rsplit('dtstudy/', 1)[-1]}:{frame.lineno} {frame.line}"
    return "?"


@dataclasses.dataclass
class Record:
    """What one run showed: tensors checked in collectives of device groups and the host ones
    among them; 4-d parameters checked at updates and their layout problems."""

    checked: int = 0
    host: list = dataclasses.field(default_factory=list)
    host_groups: set = dataclasses.field(default_factory=set)  # names of the gloo groups' stand-ins
    layouts_checked: int = 0
    layout: list = dataclasses.field(default_factory=list)
    channels_last_seen: bool = False  # a 4-d parameter with several channels was channels_last


def _watched(cls, record: Record, channels_last: bool):
    """`cls` checking, at each update, that every 4-d gradient has its parameter's strides
    (before: the fused CUDA SGD kernel refuses other pairs) and, in a channels_last run, that
    every 4-d parameter is still channels_last (after: the update's exchange has run)."""

    class Watched(cls):
        def setup(self, model, make_optimizer):
            self._watched = super().setup(model, make_optimizer)
            self._updates = 0
            return self._watched

        def update(self, lr):
            self._updates += 1
            four_d = [(name, p) for name, p in self._watched.named_parameters() if p.dim() == 4]
            for name, p in four_d:
                if p.grad is not None and p.grad.stride() != p.stride():
                    record.layout.append(
                        f"update {self._updates}: {name}'s gradient has strides "
                        f"{p.grad.stride()}, the parameter {p.stride()}"
                    )
            super().update(lr)
            for name, p in four_d:
                record.layouts_checked += 1
                is_channels_last = p.is_contiguous(memory_format=torch.channels_last)
                record.channels_last_seen |= is_channels_last and p.shape[1] > 1
                if channels_last and not is_channels_last:
                    record.layout.append(
                        f"after update {self._updates}: {name} is not channels_last (strides {p.stride()})"
                    )

    Watched.__name__ = cls.__name__
    return Watched


@contextlib.contextmanager
def on_the_stand_in(record: Record, channels_last: bool = False):
    """Emulated runs on the stand-in accelerator, as a GPU cluster's NCCL run makes them
    (ctx.backend 'nccl': a parameter server moves its host messages in a gloo group of its
    own), every collective of a device group checked and every update watched, into `record`."""
    from dtstudy.emulation import process_group, runner
    from dtstudy.training import loop

    exempt = threading.local()

    def checked(method_name):
        method = getattr(process_group.EmulatedProcessGroup, method_name)

        def collective(group, *args, **kwargs):
            if not getattr(exempt, "on", False) and group.group_name not in record.host_groups:
                for tensor in _tensors(args):
                    record.checked += 1
                    if on_host(tensor):
                        record.host.append(
                            f"{method_name} of a {tuple(tensor.shape)} {tensor.dtype} tensor in host "
                            f"memory, from {_caller()}"
                        )
            return method(group, *args, **kwargs)

        return collective

    def exempted(function):
        def call(*args, **kwargs):
            exempt.on = True
            try:
                return function(*args, **kwargs)
            finally:
                exempt.on = False

        return call

    new_group, train_worker, get_strategy = dist.new_group, runner.train_worker, loop.get_strategy

    def new_group_of_the_run(*args, backend=None, **kwargs):
        group = new_group(*args, **kwargs)  # the emulated backend for every group
        if backend == "gloo":
            record.host_groups.add(group.group_name)
        return group

    def train_on_the_stand_in(spec, ctx, **kwargs):
        with HostTensors(RUN_DEVICE):
            return train_worker(spec, dataclasses.replace(ctx, backend="nccl"), **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        for name in COLLECTIVES:
            patch.setattr(process_group.EmulatedProcessGroup, name, checked(name))
        for name in OBJECT_COLLECTIVES:
            patch.setattr(dist, name, exempted(getattr(dist, name)))
        patch.setattr(dist, "new_group", new_group_of_the_run)
        patch.setattr(runner, "pick_device", lambda preference, local_rank: RUN_DEVICE)
        patch.setattr(runner, "train_worker", train_on_the_stand_in)
        patch.setattr(loop, "get_strategy", lambda name: _watched(get_strategy(name), record, channels_last))
        yield record


@pytest.fixture(scope="module")
def stand_in_runs(tmp_path_factory, tiny_data):
    """case, memory format -> (metrics, final parameters, Record) of its emulated run on the
    stand-in, each run once for the module's tests."""
    runs = {}

    def run(strategy: str, knobs: dict, memory_format: str):
        key = (strategy, repr(knobs), memory_format)
        if key not in runs:
            with on_the_stand_in(Record(), memory_format == "channels_last") as record:
                metrics, state, _ = emulated_run(
                    tmp_path_factory.mktemp(strategy),
                    tiny_data,
                    workers=2,
                    batch_size=16,
                    steps=STEPS,
                    strategy=strategy,
                    strategy_params=knobs,
                    memory_format=memory_format,
                )
            runs[key] = metrics, state, record
        return runs[key]

    return run


def test_the_stand_in_tells_host_tensors_from_the_run_devices():
    """The rules the recorder relies on, one by one (a GPU run's placement)."""
    with HostTensors(RUN_DEVICE):
        on_device = torch.zeros(3, device=RUN_DEVICE)
        made_on_host = [
            torch.tensor([1]),
            torch.zeros(2),
            torch.ones(2, device="cpu"),
            on_device.cpu(),
            torch.tensor([1]) + 1,
            torch.arange(3).to(torch.float64),
        ]
        made_on_device = [
            on_device + 1,
            torch.empty_like(on_device),
            on_device[1:],
            on_device.view(3, 1),
            torch.tensor([1]).to(RUN_DEVICE),
            torch.tensor([1], device=RUN_DEVICE),
            on_device * torch.tensor(2.0),
            torch.cat([on_device, on_device]),
        ]
        host = torch.zeros(2)
        host.copy_(on_device[:2])  # in place: still host memory
    assert all(on_host(t) for t in made_on_host)
    assert not any(on_host(t) for t in made_on_device)
    assert on_host(host)


# ----- (a) every collective's tensors on the run's device ------------------------------------------


@pytest.mark.parametrize("strategy, knobs", CASES, ids=IDS)
def test_every_collective_gets_tensors_on_the_runs_device(stand_in_runs, strategy, knobs):
    metrics, _, record = stand_in_runs(strategy, knobs, "channels_last")
    assert metrics["steps"] == STEPS
    assert record.checked > 0  # the recorder is in the path (the evaluation's counts, at least)
    assert record.host == [], "host tensors in collectives of the device's group:\n" + "\n".join(record.host)


@pytest.mark.parametrize(
    "made", ["torch.tensor([0])", "torch.zeros(1, device='cpu')", "torch.zeros(1, device=self.ctx.device).cpu()"]
)
def test_a_host_tensor_planted_in_an_exchange_is_named(tmp_path, tiny_data, monkeypatch, made):
    """The teeth: a broadcast of a tensor made on the host, planted in allreduce's set-up, is
    named with the line that handed it over; the same tensor moved to the run's device is not."""
    from dtstudy.strategies.allreduce.strategy import AllReduce

    setup = AllReduce.setup

    def planted(self, model, make_optimizer):
        module = setup(self, model, make_optimizer)
        stray = eval(made)
        dist.broadcast(stray, src=0, group=self.ctx.worker_group)  # the planted exchange
        dist.broadcast(stray.to(self.ctx.device), src=0, group=self.ctx.worker_group)  # moved first: fine
        return module

    monkeypatch.setattr(AllReduce, "setup", planted)
    with on_the_stand_in(Record()) as record:
        emulated_run(tmp_path, tiny_data, workers=2, batch_size=16, steps=2)
    assert len(record.host) == 2, record.host  # one per worker, the moved copy not among them
    assert all(line.startswith("broadcast of a (1,)") for line in record.host)


# ----- (b) channels_last kept through every exchange ------------------------------------------------


@pytest.mark.parametrize("strategy, knobs", CASES, ids=IDS)
def test_channels_last_survives_every_exchange_and_ends_where_contiguous_ends(stand_in_runs, strategy, knobs):
    metrics, channels_last, record = stand_in_runs(strategy, knobs, "channels_last")
    assert metrics["compute"]["memory_format"] == "channels_last"
    assert record.layouts_checked > 0 and record.channels_last_seen
    assert record.layout == [], "\n".join(record.layout)
    _, contiguous, control = stand_in_runs(strategy, knobs, "contiguous")
    assert not control.channels_last_seen  # control: the check tells the layouts apart
    assert_same_parameters(channels_last, contiguous, atol=1e-5)


def _averages_in_place_without_a_device_sync(ctx):
    from dtstudy.strategies.local.strategy import average_over_workers

    def refuse(*args, **kwargs):
        raise AssertionError("the exchange synchronized the device")

    # this worker process only: an accelerator that may not be waited for
    torch.accelerator.is_available, torch.accelerator.synchronize, torch.cuda.synchronize = (
        (lambda: True),
        refuse,
        refuse,
    )
    weight = torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)
    values, storage = weight.clone(), weight.data_ptr()
    average_over_workers([weight], ctx.worker_group)
    assert torch.equal(weight, values) and weight.data_ptr() == storage  # one worker: its own values, in place
    assert weight.is_contiguous(memory_format=torch.channels_last)


def test_local_averaging_never_waits_for_the_device(tmp_path):
    """local SGD's exchange queues its all-reduce behind the step's work, as every other
    exchange does: torch's average_parameters synchronized the whole device first."""
    in_workers(tmp_path, 1, _averages_in_place_without_a_device_sync)
