"""Process-group set-up of a run's processes (submitit tasks, one per GPU, or a warm pool's
forked workers), and the watch each process keeps on its peers so that a lost one ends the run.

Two bounds keep a run from outliving a lost process (config/README.md, `launcher.comm_timeout_s`):

- every collective and point-to-point wait of the run's groups ends in an error after
  `launcher.comm_timeout_s` (the process-group time-out, independent of the job's time
  limit); joining the group (the rendezvous) may take up to the job's time limit, but a
  rank whose node gets no answer at all from MASTER_ADDR fails after `comm_timeout_s`,
  naming its host and the address (`wait_for_master`);
- `PeerWatch`: each process announces itself in the job's TCP store and beats there every
  second; a thread in every process checks the others, and a peer whose process is gone
  (same host) or that has not beaten for half of `comm_timeout_s` (a frozen process or
  node; before any wait on it times out), without having said that it leaves, is lost: the
  watching process records who (dtstudy.runspec.lost_rank_path, read by the launcher), says
  so on its stderr, kills the peer if it is a frozen process on this host (nothing else
  would: submitit's local controller waits for every task) and exits with status 1. Its own
  peers then see it gone in turn, so every process of the run ends within seconds; on SLURM,
  srun --kill-on-bad-exit ends the job's other tasks as well. A process that fails because a
  peer's connection closed looks for the cause before it exits: a peer on its host by its
  process, one on another host (a node lost whole) by its heartbeats, which takes up to half
  of `comm_timeout_s`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from dtstudy.common.atomic_files import write_json, write_text
from dtstudy.common.ports import free_port
from dtstudy.gloo_loops import lower_gloo_event_loops
from dtstudy.runspec import TaskLayout
from dtstudy.strategies.base import DistContext
from dtstudy.training.compute import pick_device


def rendezvous_port(job_env, is_master: bool, timeout_s: float) -> int:
    """MASTER_PORT of this attempt of a SLURM job: the master task binds a port free on its
    node and leaves it in the job folder (a shared file system, as submitit requires); the
    other tasks read it there. A port derived from the job id alone (submitit's default) can
    be taken on a shared node; a port chosen on the login node says nothing about the nodes."""
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")  # a requeued job rendezvouses anew
    path = Path(job_env.paths.folder) / f"{job_env.job_id}.attempt{attempt}.port"
    if is_master:
        port = free_port("")
        write_text(path, str(port))
        return port
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no MASTER_PORT from the master task in {path} after {timeout_s:.0f} s")
        time.sleep(0.2)
    return int(path.read_text())


def init_from_submitit(
    layout: TaskLayout,
    device_preference: str,
    timeout_min: int = 30,
    comm_timeout_s: float = 45,
    gloo_loop_nice: int | str = 0,
    port_from_master_task: bool = False,
) -> DistContext | None:
    """Join the job's process group: gloo on CPU (one torch thread per worker), NCCL on GPU.

    `layout` (RunSpec.layout) maps the job's tasks to ranks: workers first, then a
    strategy's extra processes. Returns None in an idle task (a spare slot of a multi-node
    layout), which then has nothing to do. `port_from_master_task` (the run's launch
    backend's): the master task picks MASTER_PORT on its node (`rendezvous_port`).
    """
    import submitit

    job_env = submitit.JobEnvironment()
    rank = layout.rank_of_task(job_env.global_rank)
    if rank is None:
        return None
    if port_from_master_task:
        os.environ["MASTER_PORT"] = str(rendezvous_port(job_env, job_env.global_rank == 0, timeout_min * 60))
    # MASTER_ADDR (the first node), and locally MASTER_PORT as the launcher pinned it
    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    return join_process_group(
        layout, rank, env.local_rank, device_preference, timeout_min, comm_timeout_s, gloo_loop_nice
    )


def join_process_group(
    layout: TaskLayout,
    rank: int,
    local_rank: int,
    device_preference: str,
    timeout_min: float,
    comm_timeout_s: float = 45,
    gloo_loop_nice: int | str = 0,
) -> DistContext:
    """Join the run's process group as `rank` (MASTER_ADDR/MASTER_PORT in the environment):
    gloo on CPU (one torch thread per worker), NCCL on GPU. The rendezvous may take up to
    `timeout_min` (tasks start when the scheduler starts them); every wait after it, at
    most `comm_timeout_s`. gloo's event loops run at `gloo_loop_nice`
    (`lower_gloo_event_loops`)."""
    workers = layout.workers
    workers_device = pick_device(device_preference, local_rank, layout.workers_per_node)
    # every rank must name the same backend; a strategy's extra processes (parameter-server
    # shards) still compute on the CPU and talk over a gloo group of their own
    backend = "nccl" if workers_device.type == "cuda" else "gloo"
    device = workers_device if rank < workers else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # a CPU worker stands for one GPU: one thread each, so N workers use N cores
        torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(layout.world_size))
    if rank != 0:  # a master this rank can never reach is an error now, not at the job's time limit
        wait_for_master(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, comm_timeout_s, timeout_min * 60
        )
    # the store of the rendezvous waits as long as the job may; the groups' waits are bounded
    # apart from it (a lost peer must not hold the others for the job's time limit)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        layout.world_size,
        is_master=rank == 0,
        timeout=datetime.timedelta(minutes=timeout_min),
        multi_tenant=True,
    )
    timeout = datetime.timedelta(seconds=comm_timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=layout.world_size, timeout=timeout)
    worker_group = None
    if layout.world_size > workers:  # strategies with extra processes get a workers-only group
        # a new group takes the backend's default time-out (30 min), not the default group's
        worker_group = dist.new_group(list(range(workers)), timeout=timeout)
    lower_gloo_event_loops(gloo_loop_nice)
    return DistContext(
        rank=rank,
        world_size=layout.world_size,
        workers=workers,
        local_rank=local_rank,
        device=device,
        backend=backend,
        worker_group=worker_group,
        comm_timeout_s=comm_timeout_s,
        startup_timeout_s=timeout_min * 60,
        gloo_loop_nice=gloo_loop_nice,
    )


class MasterUnreachable(RuntimeError):
    """A rank cannot reach the rendezvous (MASTER_ADDR:MASTER_PORT) from its node."""


def wait_for_master(master: str, port: int, rank: int, unreachable_s: float, timeout_s: float) -> None:
    """Wait until rank 0's store at `master`:`port` takes a connection from this node. A refused
    connection is a master not listening yet (tasks start when the scheduler starts them): wait
    up to `timeout_s`, as the rendezvous does. No answer at all (no route to the address, or
    packets dropped) for `unreachable_s` (launcher.comm_timeout_s) means the address is one this
    node cannot reach (the first node's name resolving to an interface the others have no route
    to, a port closed between nodes): a MasterUnreachable naming this host and the address,
    where torch's store would wait out the job's time limit."""
    here = socket.gethostname()
    try:
        address = socket.getaddrinfo(master, port, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as error:
        raise MasterUnreachable(f"rank {rank} on {here}: MASTER_ADDR {master!r} does not resolve ({error})") from None
    named = master if master == address else f"{master} ({address})"
    started = time.monotonic()
    answered = False  # the address's host refused: it is reachable, its master not yet listening
    while True:
        try:
            socket.create_connection((address, port), timeout=min(5.0, unreachable_s)).close()
            return
        except ConnectionRefusedError:
            answered = True
            failure = "connection refused"
        except OSError as error:  # no route, host unreachable, timed out
            failure = str(error) or type(error).__name__
        waited = time.monotonic() - started
        if (not answered and waited >= unreachable_s) or waited >= timeout_s:
            raise MasterUnreachable(
                f"rank {rank} on {here} cannot reach MASTER_ADDR {named} port {port} (rank 0's store) after "
                f"{waited:.0f} s: {failure}. Every node must reach the job's first node at that address: "
                "check that its host name resolves to an interface the other nodes can route to "
                "(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name the interface the process groups use) and "
                "that TCP ports between the nodes are open (docs/cluster.md, 'Multi-node runs')"
            )
        time.sleep(0.5)


# ----- the watch over a run's processes --------------------------------------------------

HEARTBEAT_S = 1.0  # how often a process beats in the store and looks at its peers
STORE_GONE_GRACE_S = 5.0  # rank 0's store unreachable this long (it hosts it): rank 0 is lost
LOSS_SETTLE_S = 2.0  # a failing process looks this long for a peer that was killed (the cause)


class PeerWatch:
    """This process's watch over the run's other processes (see the module docstring).

    `quiet()`: true while this process is stopping on purpose (a preemption: rank 0 requeues
    and its peers end after it), when peers leave without saying so."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        comm_timeout_s: float,
        log: str,
        record: str | Path,
        quiet: Callable[[], bool] = lambda: False,
    ):
        self.rank, self.world_size, self.limit_s = rank, world_size, comm_timeout_s
        # unseen this long: lost, before a wait on it times out (so that it is named, and killed)
        self.unseen_limit_s = comm_timeout_s / 2
        self.log, self.record, self.quiet = log, Path(record), quiet
        self.peers = [r for r in range(world_size) if r != rank]
        self._beats = {r: 0 for r in self.peers}
        self._seen = {r: time.monotonic() for r in self.peers}  # when its beat last changed
        self._info: dict[int, dict] = {}  # host, pid, log of each peer, once announced
        self._left = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PeerWatch:
        if self.world_size == 1:
            return self
        self.store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=max(self.limit_s, 10)),
        )
        me = {"host": socket.gethostname(), "pid": os.getpid(), "log": self.log}
        self.store.set(f"dtstudy/peer/{self.rank}", json.dumps(me))
        self.store.add(f"dtstudy/beat/{self.rank}", 1)
        self._thread = threading.Thread(target=self._watch, name="dtstudy-peer-watch", daemon=True)
        self._thread.start()
        return self

    def leave(self) -> None:
        """This process ends as planned (its run is done, or it was preempted): its peers
        may see it gone. Call before the process exits."""
        self._stop_watching("left")

    def fail(self) -> None:
        """This process fails (an exception; often a peer's loss, seen as a closed connection):
        say so, so that its peers do not take it for the lost one, and name a peer that is
        gone without a word (killed), if any."""
        if not self._stop_watching("failed"):
            return
        # a killed peer's sockets close before its process shows as gone: look again for a
        # moment. A peer on another host (a node lost whole) shows only by its heartbeats
        # stopping: look until they would have been missed that long.
        with contextlib.suppress(Exception):  # where each peer is: those announced since the watch last looked
            self._check()
        remote = any(self._info.get(r, {}).get("host") != socket.gethostname() for r in self.peers)
        deadline = time.monotonic() + (self.unseen_limit_s + 2 * HEARTBEAT_S if remote else LOSS_SETTLE_S)
        with contextlib.suppress(Exception):
            while True:
                lost = [(r, why) for r, why, failed in self._check() if not failed]
                if lost:
                    self._record(*lost[0])
                    return
                if self._every_peer_said() or time.monotonic() >= deadline:
                    return  # each peer failed or left itself, or none went: this process's own error
                time.sleep(LOSS_SETTLE_S / 20)

    def _every_peer_said(self) -> bool:
        """Whether every peer has said that it failed or left (so none was killed)."""
        return all(
            self.store.check([f"dtstudy/failed/{r}"]) or self.store.check([f"dtstudy/left/{r}"]) for r in self.peers
        )

    def _stop_watching(self, how: str) -> bool:
        if self._left.is_set() or self._thread is None:
            return False
        self._left.set()
        with contextlib.suppress(Exception):  # rank 0's store already gone: rank 0 is done or requeueing
            self.store.set(f"dtstudy/{how}/{self.rank}", "1")
        self._thread.join(timeout=2 * HEARTBEAT_S)
        return True

    def _check(self) -> list[tuple[int, str, bool]]:
        """(rank, why, whether it said it failed) of each peer gone without having left."""
        self.store.add(f"dtstudy/beat/{self.rank}", 1)
        now = time.monotonic()
        for r in self.peers:
            beat = self.store.add(f"dtstudy/beat/{r}", 0)  # reads without blocking
            if beat != self._beats[r]:
                self._beats[r], self._seen[r] = beat, now
            if r not in self._info and self.store.check([f"dtstudy/peer/{r}"]):
                self._info[r] = json.loads(self.store.get(f"dtstudy/peer/{r}"))
        gone = [(r, self._why_lost(self._info.get(r), now - self._seen[r])) for r in self.peers]
        # read after the observation: a peer that left or failed said so before it went
        return [
            (r, why, self.store.check([f"dtstudy/failed/{r}"]))
            for r, why in gone
            if why and not self.store.check([f"dtstudy/left/{r}"])
        ]

    def _watch(self) -> None:
        store_gone_since = None
        while not self._left.wait(HEARTBEAT_S):
            try:
                gone = self._check()
                store_gone_since = None
            except Exception as error:  # rank 0 hosts the store: it is gone
                store_gone_since = store_gone_since or time.monotonic()
                if time.monotonic() - store_gone_since < STORE_GONE_GRACE_S:
                    continue  # it may be done, and this process about to leave too
                gone = [(0, f"the job's store on rank 0 is unreachable ({type(error).__name__})", False)]
            if gone and not self._left.is_set() and not self.quiet():
                gone.sort(key=lambda item: item[2])  # killed before failed: the cause, not a consequence
                self._record(gone[0][0], gone[0][1])
                for rank, _, _ in gone:  # a frozen peer on this host: nothing else ends it
                    peer = self._info.get(rank)
                    if peer is not None and peer["host"] == socket.gethostname() and _alive(peer["pid"]):
                        with contextlib.suppress(OSError):
                            os.kill(peer["pid"], signal.SIGKILL)
                print(f"dtstudy: rank {self.rank} stops the run", file=sys.stderr, flush=True)
                sys.stdout.flush()
                # the main thread may be blocked in a collective for up to comm_timeout_s: end
                # now, non-zero, so that the scheduler (srun --kill-on-bad-exit) and the peers see it
                os._exit(1)

    def _why_lost(self, peer: dict | None, unseen_s: float) -> str | None:
        if peer is not None and peer["host"] == socket.gethostname() and not _alive(peer["pid"]):
            return f"its process {peer['pid']} on {peer['host']} is gone"
        if unseen_s > self.unseen_limit_s:
            return (
                f"no heartbeat for {unseen_s:.0f} s (half of launcher.comm_timeout_s: {self.limit_s:g}): "
                "its process or node is frozen or gone"
            )
        return None

    def _record(self, rank: int, why: str) -> None:
        """Say which peer was lost; the first process of the run to see a loss writes the record."""
        log = self._info.get(rank, {}).get("log")
        print(f"dtstudy: rank {rank} was lost: {why}; its log: {log or 'unknown'}", file=sys.stderr, flush=True)
        claim = json.dumps({"rank": rank, "why": why, "log": log, "seen_by": self.rank, "time": time.time()})
        try:
            first = self.store.compare_set("dtstudy/lost", "", claim).decode() == claim
        except Exception:  # no store: rank 0 is lost, unless a peer recorded a loss before it went
            first = not self.record.exists()
        if first:
            with contextlib.suppress(OSError):
                write_json(self.record, json.loads(claim))


def _alive(pid: int) -> bool:
    """Whether process `pid` (on this host) still runs; a zombie (exited, not yet reaped) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
