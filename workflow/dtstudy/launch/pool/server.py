"""The warm pool's server (`python -m dtstudy.launch.pool.server`, started by the first client):
its main loop, the train, emulate and evaluate requests, and the forked ranks of a run.

It imports torch, the strategies and MLflow once, in `serve`, then forks a job process per
request, which forks one process per rank of a run.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import sys
import time
from pathlib import Path

from dtstudy.common.atomic_files import write_json
from dtstudy.launch import cores
from dtstudy.launch.pool.client import PoolError, apply_environment
from dtstudy.launch.pool.messages import receive, send
from dtstudy.runspec import RunSpec
from dtstudy.tracking.provenance import PINNED_ENV

IDLE_S = 120  # a pool with no work for this long exits
KILL_GRACE_S = 5  # SIGTERM, then SIGKILL, to the ranks of a failed run
SETTLE_S = 1.0  # after a rank fails, how long its peers may take to fail too, before they are stopped
RANKS_FILE = "ranks.json"  # <job id>_ranks.json in a pooled job's log folder: {rank: pid}
# imported once by the server; MLflow's SQL store modules load lazily on a client's first
# call (a delay each client would pay), so they are named here too
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "torchvision",
    "dtstudy.launch.rank_process",
    "dtstudy.training.evaluate",
    "dtstudy.emulation.runner",
    "torch._dynamo",  # DistributedDataParallel's constructor imports it: seconds a run
    "dtstudy.tracking.mlflow_store",
    "mlflow.store.tracking.sqlalchemy_store",
    "mlflow.store.db.utils",
    "sqlalchemy",
    "alembic",
)


def serve(address: str, idle_s: float = IDLE_S) -> None:
    """The pool's main loop (single-threaded, so that forking is safe)."""
    import importlib

    started = time.perf_counter()
    for name in WARM_MODULES:
        importlib.import_module(name)
    print(f"pool {address}: warm in {time.perf_counter() - started:.1f} s (pid {os.getpid()})", flush=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address)
    listener.bind(address)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    jobs: set[int] = set()
    last_work, stopping = time.monotonic(), False
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            for _key, _ in selector.select(timeout=1.0):
                conn, _ = listener.accept()
                message = receive(conn)
                if message is None:
                    conn.close()
                    continue
                if message["kind"] == "stop":
                    send(conn, {"ok": True})
                    conn.close()
                    stopping = True
                    continue
                pid = os.fork()
                if pid == 0:  # the job process
                    listener.close()
                    os._exit(_serve_request(conn, message))
                jobs.add(pid)
                conn.close()
            while jobs:
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                jobs.discard(pid)
            if jobs:
                last_work = time.monotonic()
            elif stopping or time.monotonic() - last_work > idle_s:
                print(f"pool {address}: {'stopped' if stopping else f'idle for {idle_s:.0f} s'}; exiting", flush=True)
                return
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address)


def _serve_request(conn: socket.socket, message: dict) -> int:
    """In a forked job process: do the request, reply, return the exit status."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        handler = {"train": _train, "emulate": _emulate, "evaluate": _evaluate}[message["kind"]]
        send(conn, {"ok": True, **handler(conn, message)})
        return 0
    except BaseException as error:  # the reply says what went wrong; the pool goes on
        with contextlib.suppress(OSError):
            send(conn, {"ok": False, "error": f"{type(error).__name__}: {error}"})
        return 1
    finally:
        conn.close()


def _evaluate(conn: socket.socket, message: dict) -> dict:
    import torch

    from dtstudy.training.evaluate import evaluate_run

    torch.set_num_threads(1)  # the evaluate rule reserves one core
    held = cores.lease(1)  # and takes one no timed run is pinned to
    if held is not None:
        cores.pin(held.cores)
    return {"result": evaluate_run(message["run_dir"], message["data_dir"], message["out"])}


def _emulate(conn: socket.socket, message: dict) -> dict:
    """An emulated run (dtstudy.emulation) in this job process: its output on the client's
    stdout and stderr (their descriptors follow the request), the client's threads (the
    train rule's OMP_NUM_THREADS); ended when the client goes away (a cancelled rule)."""
    import threading

    import torch

    from dtstudy.emulation.runner import run_emulated

    _, fds, _, _ = socket.recv_fds(conn, 1, 2)
    _write_to(*fds)
    apply_environment(message.get("environ", {}))
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    finished = threading.Event()
    threading.Thread(target=_exit_when_closed, args=(conn, finished), daemon=True).start()
    try:
        run_emulated(RunSpec(**message["spec"]))
    except BaseException:
        import traceback

        traceback.print_exc()  # to the client's stderr: the rule's log
        raise
    finally:
        finished.set()
        sys.stdout.flush()
        sys.stderr.flush()
    return {}


def _exit_when_closed(conn: socket.socket, finished) -> None:
    """In an emulated run's job process: end it when its client goes away before the run
    finished (the client sends nothing more, so readable means closed)."""
    import select

    with contextlib.suppress(OSError, ValueError):
        select.select([conn], [], [])
        if not finished.is_set() and _closed(conn, blocking=True):
            os._exit(1)


def _train(conn: socket.socket, message: dict) -> dict:
    """Fork the run's ranks, wait for all of them; stop them all at the first failure or
    when the client disconnects."""
    from dtstudy.common.ports import free_port

    spec = RunSpec(**message["spec"])
    log_dir = Path(message["log_dir"])
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    world_size = spec.layout().world_size
    # distinct cores for the ranks while the run is timed; held until this process and its ranks end
    counts = _cores_per_rank(spec, message.get("environ", {}))
    held = cores.lease(sum(counts))
    rank_cores = cores.split(held.cores, counts) if held is not None else None
    os.environ.pop(PINNED_ENV, None)
    if held is not None:  # every rank's cores, rank by rank
        os.environ[PINNED_ENV] = ",".join(map(str, held.cores))
    timings = {**message["timings"], "pool_job_start": time.time()}
    ranks: dict[int, int] = {}  # pid -> rank
    logs: dict[int, str] = {}
    for rank in range(world_size):
        out = message["rank0_log"] if rank == 0 else str(log_dir / f"{message['job_id']}_rank{rank}.out")
        err = str(log_dir / f"{message['job_id']}_rank{rank}.err")
        logs[rank] = err
        pid = os.fork()
        if pid == 0:
            conn.close()
            if rank_cores is not None:
                cores.pin(rank_cores[rank])
            os._exit(_run_rank(spec, rank, out, err, timings, message.get("environ", {})))
        ranks[pid] = rank
    # which process is which rank, for whoever watches or debugs the run
    write_json(log_dir / f"{message['job_id']}_{RANKS_FILE}", {str(rank): pid for pid, rank in ranks.items()})
    failure = _wait_for_ranks(conn, ranks, logs)
    if failure:
        raise PoolError(f"{spec.run_name}: {failure}")
    return {}


def _cores_per_rank(spec: RunSpec, environ: dict) -> list[int]:
    """The cores each rank of the run is pinned to (dtstudy.launch.cores.cores_per_rank): one
    per CPU worker; a worker that loads with worker processes, or computes on a GPU, gets
    its loader's cores as well (they inherit its pinning)."""
    config = spec.config
    layout = spec.layout()
    loader_workers = config["loader"]["workers"] if config["dataset"]["name"] == "imagefolder" else 0
    on_gpu = _workers_on_gpu(config["launcher"]["device"], environ)
    return cores.cores_per_rank(
        layout.workers, layout.world_size - layout.workers, on_gpu, loader_workers, len(cores.machine_cores())
    )


def _workers_on_gpu(preference: str, environ: dict) -> bool:
    """Whether the run's workers will compute on GPUs (launcher.device, as
    dtstudy.training.compute.pick_device resolves it in the ranks), seen from the job
    process without initialising CUDA, which would break the ranks it forks: `auto` counts
    the GPUs that the client's CUDA_VISIBLE_DEVICES leaves visible through NVML alone.
    torch.cuda.device_count() would fall back to the CUDA runtime where NVML cannot tell
    (MIG devices named by UUID); then, as when NVML is missing, the workers count as CPU
    workers (one core each, as before GPUs were told apart)."""
    if preference != "auto":
        return preference == "cuda"
    import torch

    apply_environment(environ)  # the client's CUDA_VISIBLE_DEVICES; the ranks apply it again
    count_nvml = getattr(torch.cuda, "_device_count_nvml", lambda: -1)
    return torch.backends.cuda.is_built() and count_nvml() > 0


def _wait_for_ranks(conn: socket.socket, ranks: dict[int, int], logs: dict[int, str]) -> str | None:
    """Reap the ranks; at the first that fails, or when the client goes away, stop the rest.
    Returns why the run failed, or None."""
    running = dict(ranks)
    conn.setblocking(False)
    failed: list[tuple[int, int]] = []  # (rank, exit code), in the order they ended
    settle_until = None
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if settle_until is not None and time.monotonic() > settle_until:
                break
            if _closed(conn):
                _stop(running)
                return "the client went away (job cancelled); every rank was stopped"
            time.sleep(0.02)
            continue
        rank = running.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failed.append((rank, code))
            # its peers fail within moments (a closed connection): let them end, so the
            # report can name the rank that died first of all, not a peer that noticed it
            settle_until = settle_until or time.monotonic() + SETTLE_S
    if not failed:
        return None
    others = sorted(running.values())
    _stop(running)
    failed.sort(key=lambda item: item[1] >= 0)  # killed by a signal: the likely cause, first
    rank, code = failed[0]
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    peers = "".join(f"; rank {r} exited with status {c}" for r, c in failed[1:])
    return (
        f"rank {rank} {how}; its stderr: {logs[rank]}{peers}"
        + (f"; ranks {others} were stopped" if others else "")
        + _last_error(logs[rank])
    )


def _last_error(path: str, lines: int = 3) -> str:
    """The end of a failed rank's stderr (its exception), to quote in the run's error."""
    try:
        tail = Path(path).read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return ("\n  " + "\n  ".join(tail)) if tail else ""


def _closed(conn: socket.socket, blocking: bool = False) -> bool:
    try:
        return conn.recv(1, socket.MSG_PEEK | (0 if blocking else socket.MSG_DONTWAIT)) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _stop(running: dict[int, int]) -> None:
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    while running and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.02)
        running.pop(pid, None)
    for pid in list(running):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        running.pop(pid)


def _write_to(stdout_fd: int, stderr_fd: int) -> None:
    """This forked process's stdout and stderr (descriptors 1 and 2, and Python's streams on
    them, line-buffered) become the open files `stdout_fd` and `stderr_fd`, which are closed."""
    for target, fd in ((1, stdout_fd), (2, stderr_fd)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def _run_rank(spec: RunSpec, rank: int, out: str, err: str, timings: dict, environ: dict) -> int:
    """In a forked rank: the client's environment (the pool never touches CUDA, so a rank's
    CUDA_VISIBLE_DEVICES still counts), its output to its log files, then the run's body."""
    import traceback

    apply_environment(environ)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _write_to(*(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) for path in (out, err)))
    try:
        from dtstudy.launch.rank_process import run_forked_process

        run_forked_process(spec, rank, {**timings, "process_start": time.time()})
        return 0
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m dtstudy.launch.pool.server", description="the study's warm pool (server)"
    )
    parser.add_argument("--address", required=True, help="Unix socket to listen on")
    parser.add_argument("--idle-s", type=float, default=IDLE_S, help="exit after this long without work")
    args = parser.parse_args(argv)
    serve(args.address, args.idle_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
