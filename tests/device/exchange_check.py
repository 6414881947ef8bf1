"""Every strategy's exchange at N = 2 on the run's device, for the compute check
(tests/device/README.md, "What one GPU proves").

NCCL refuses two ranks on one GPU, so the check runs N = 2 with both workers on the one GPU
and the process group over gloo, which carries CUDA tensors in its collectives (broadcast,
all-reduce, all-gather, all-to-all, reduce-scatter: copied through pinned host memory). The
ranks' DistContext still names NCCL as the backend (on a GPU), so that each strategy takes
the path it takes on a cluster (the parameter servers' shards on their own gloo group). The
check builds each rank's group itself, as dtstudy.launch.process_group.join_process_group
does apart from the backend: the package has no setting for gloo on GPUs, since only this
check needs it.

`CollectiveRecorder` wraps torch.distributed's collective and point-to-point calls in each
rank: it counts every call by operation and device, and lists every tensor handed to a group
that NCCL would carry (any group not made with backend="gloo") that is not on the workers'
device: NCCL refuses those. gloo's send and recv read and write the tensor's memory from the
host, which a CUDA tensor's is not, so the recorder copies a CUDA tensor of a point-to-point
call through host memory (gossip's exchange); NCCL moves it on the device.

Each strategy's ranks are processes of a forkserver that imported torch and the package
once and never touched CUDA (the check's own process has: forking it would not do).
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import multiprocessing
import os
import time
import traceback
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "reduce",
    "gather",
    "scatter",
)
POINT_TO_POINT = ("send", "recv", "isend", "irecv")
# P2POp checks its operation against distributed_c10d's own isend and irecv: wrapped there too
WRAPPED_IN_C10D = ("isend", "irecv")


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


class _StagedReceive:
    """A receive into host memory whose wait copies what arrived into the device tensor."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor):
        self.work, self.host, self.target = work, host, target

    def wait(self, *args, **kwargs):
        done = self.work.wait(*args, **kwargs)
        self.target.copy_(self.host)
        return done


class CollectiveRecorder:
    """See the module docstring. `device`: the workers' device."""

    def __init__(self, device: torch.device):
        self.device_type = device.type
        self.calls: Counter = Counter()  # "operation@device" -> calls
        self.off_device: Counter = Counter()  # "operation@device" handed to a group NCCL would carry
        self.staged = 0  # point-to-point calls copied through host memory (gloo's send/recv)
        self._gloo_groups: list = []
        self._originals: list[tuple[object, str, object]] = []

    def install(self) -> CollectiveRecorder:
        for name in COLLECTIVES + POINT_TO_POINT:
            self._replace(dist, name, self._wrap(name, getattr(dist, name)))
        for name in WRAPPED_IN_C10D:
            self._replace(c10d, name, getattr(dist, name))
        new_group = dist.new_group

        def recorded_new_group(*args, **kwargs):
            group = new_group(*args, **kwargs)
            if kwargs.get("backend") == "gloo":  # its own gloo group beside NCCL: CPU tensors belong there
                self._gloo_groups.append(group)
            return group

        self._replace(dist, "new_group", recorded_new_group)
        return self

    def uninstall(self) -> None:
        for module, name, original in reversed(self._originals):
            setattr(module, name, original)
        self._originals = []

    def summary(self) -> dict:
        return {"calls": dict(self.calls), "off_device": dict(self.off_device), "staged_point_to_point": self.staged}

    def _replace(self, module, name: str, replacement) -> None:
        self._originals.append((module, name, getattr(module, name)))
        setattr(module, name, replacement)

    def _wrap(self, name: str, original):
        signature = inspect.signature(original)

        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            tensors = [t for value in bound.arguments.values() for t in _tensors(value)]
            on_gloo = any(bound.arguments.get("group") is group for group in self._gloo_groups)
            for tensor in tensors:
                key = f"{name}@{tensor.device.type}"
                self.calls[key] += 1
                if tensor.device.type != self.device_type and not on_gloo:
                    self.off_device[key] += 1
            if name in POINT_TO_POINT and tensors and tensors[0].device.type != "cpu":
                return self._staged(name, original, bound, tensors[0])
            return original(*bound.args, **bound.kwargs)

        return call

    def _staged(self, name: str, original, bound, tensor: torch.Tensor):
        self.staged += 1
        host = tensor.detach().to("cpu")
        bound.arguments["tensor"] = host
        result = original(*bound.args, **bound.kwargs)
        if name == "recv":
            tensor.copy_(host)
        elif name == "irecv":
            return _StagedReceive(result, host, tensor)
        return result


def run_rank(spec, rank: int, device_type: str, init_method: str, log: str, results) -> None:
    """One rank of a strategy's N = 2 run (a forkserver's child): its group over gloo, its
    tensors on `device_type`, the recorder installed; what it saw goes to `results`."""
    from dtstudy.strategies.base import DistContext
    from dtstudy.training.loop import train_worker

    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, 1)
    os.dup2(target, 2)
    layout = spec.layout()
    workers_device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    device = workers_device if rank < layout.workers else torch.device("cpu")  # shards compute on the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    recorder = CollectiveRecorder(workers_device).install()
    launcher = spec.config["launcher"]
    outcome = {"rank": rank, "ok": False, "error": None}
    try:
        timeout = datetime.timedelta(seconds=launcher["comm_timeout_s"])
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=layout.world_size, timeout=timeout
        )
        worker_group = (
            dist.new_group(list(range(layout.workers)), timeout=timeout) if layout.world_size > layout.workers else None
        )
        ctx = DistContext(
            rank=rank,
            world_size=layout.world_size,
            workers=layout.workers,
            local_rank=rank,
            device=device,
            backend="nccl" if device_type == "cuda" else "gloo",
            worker_group=worker_group,
            comm_timeout_s=launcher["comm_timeout_s"],
            startup_timeout_s=launcher["timeout_min"] * 60,
        )
        metrics = train_worker(spec, ctx)
        if metrics is not None:
            outcome["final_train_loss"] = metrics["train_loss"][-1] if metrics.get("train_loss") else None
            outcome["bytes_per_step"] = metrics.get("bytes_per_step")
        outcome["ok"] = True
    except BaseException as error:  # reported, not raised: the parent names the rank and its log
        traceback.print_exc()
        outcome["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        recorder.uninstall()
        results.put({**outcome, **recorder.summary()})


def forkserver():
    """The multiprocessing context the ranks start from: a forkserver that has imported torch
    and the training code (CUDA untouched), so each rank starts in a fraction of a second."""
    here = Path(__file__).resolve().parent
    # the forkserver is a fresh interpreter: it finds this module and the package on PYTHONPATH
    paths = [str(here), str(here.parents[1] / "workflow"), os.environ.get("PYTHONPATH")]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        [
            "torch",
            "torch.distributed",
            "torchvision",
            "dtstudy.training.loop",
            "dtstudy.strategies.registry",
            Path(__file__).stem,
        ]
    )
    return context


def run_strategy(context, label: str, spec, device_type: str, logs: Path, limit_s: float) -> dict:
    """A strategy's N = 2 run, its ranks' reports merged; ranks still running after `limit_s`
    are stopped and the run reported as timed out."""
    from dtstudy.common.ports import free_port

    layout = spec.layout()
    logs.mkdir(parents=True, exist_ok=True)
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    processes = [
        context.Process(
            target=run_rank,
            args=(spec, rank, device_type, init_method, str(logs / f"rank{rank}.log"), results),
            daemon=True,
        )
        for rank in range(layout.world_size)
    ]
    for process in processes:
        process.start()
    reports = []
    while len(reports) < len(processes) and time.monotonic() - start < limit_s:
        with contextlib.suppress(Exception):
            reports.append(results.get(timeout=1.0))
        if len(reports) < len(processes) and not any(p.is_alive() for p in processes) and results.empty():
            break  # a rank died without a report (killed, crashed in C++)
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()
    calls, off_device = Counter(), Counter()
    for report in reports:
        calls.update(report["calls"])
        off_device.update(report["off_device"])
    seconds = time.monotonic() - start
    reported = {report["rank"] for report in reports}
    errors = {str(r["rank"]): r["error"] + _last_lines(logs / f"rank{r['rank']}.log") for r in reports if not r["ok"]}
    errors.update(
        {
            str(rank): f"no report (exit code {processes[rank].exitcode})" + _last_lines(logs / f"rank{rank}.log")
            for rank in range(layout.world_size)
            if rank not in reported
        }
    )
    rank0 = next((r for r in reports if r["rank"] == 0), {})
    return {
        "strategy": label,
        "workers": layout.workers,
        "processes": layout.world_size,
        "completed": not errors,
        "errors": errors,
        "seconds": round(seconds, 2),
        "timed_out": len(reported) < layout.world_size and seconds >= limit_s,
        "collectives": dict(sorted(calls.items())),
        "off_device": dict(sorted(off_device.items())),
        "staged_point_to_point": sum(r["staged_point_to_point"] for r in reports),
        "final_train_loss": rank0.get("final_train_loss"),
        "bytes_per_step": rank0.get("bytes_per_step"),
    }


def _last_lines(log: Path, lines: int = 3) -> str:
    """The end of a failed rank's log (its exception), to quote in the record."""
    try:
        tail = log.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return f"; {log}: " + " | ".join(tail) if tail else ""
