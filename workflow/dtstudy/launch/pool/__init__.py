"""The study's warm pool on this machine: one server process that imports torch, the
strategies and MLflow once, then forks every local run's N + S processes (and every
evaluation) on request, so that a run costs what its training costs, not seconds of start-up.

- One pool per study folder (the working directory, by path and inode) and code version:
  its Unix socket's name is a hash of them, so an edited package, another study or a folder
  made again never reuses a stale pool.
- The first request starts it (`connect`, under a lock); it ends after `IDLE_S` seconds
  without work, or on `python -m dtstudy pool stop` (the Snakefile's onsuccess/onerror).
- A request is served by a forked "job" process; a training job forks one process per
  rank, watches them and the client's connection, and stops every rank as soon as one dies
  or the client goes away (a cancelled submitit job): a lost worker ends its run in seconds.
- Nothing of a run is kept in the server: each job process loads its data and model anew.

This module imports neither torch nor MLflow at the top: clients (the submitit task, the
evaluate command) stay light; the server imports them in `serve`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dtstudy.launch import cores
from dtstudy.atomic_files import write_json
from dtstudy.runspec import RunSpec

IDLE_S = 120  # a pool with no work for this long exits
START_TIMEOUT_S = 120  # how long a client waits for a new pool to answer
KILL_GRACE_S = 5  # SIGTERM, then SIGKILL, to the ranks of a failed run
SETTLE_S = 1.0  # after a rank fails, how long its peers may take to fail too, before they are stopped
RANKS_FILE = "ranks.json"  # <job id>_ranks.json in a pooled job's log folder: {rank: pid}
PACKAGE_DIR = Path(__file__).resolve().parents[2]  # dtstudy: its code version, its PYTHONPATH
# imported once by the server; MLflow's SQL store modules load lazily on a client's first
# call (~0.8 s), so they are named here too
WARM_MODULES = ("torch", "torch.distributed", "torchvision", "dtstudy.launch.rank_process", "dtstudy.training.evaluate",
                "dtstudy.tracking.mlflow_store", "mlflow.store.tracking.sqlalchemy_store", "mlflow.store.db.utils",
                "sqlalchemy", "alembic")


class PoolError(RuntimeError):
    """A pooled run or evaluation failed; the message says which rank and where its log is."""


# ----- addresses -------------------------------------------------------------------------

def code_version() -> str:
    """A fingerprint of the package's sources and the interpreter: a pool of other code is not
    used. The interpreter is its environment and binary, not the name it was started by:
    Snakemake runs as `python3`, the rules as `python`, and both must find the same pool."""
    digest = hashlib.sha256(f"{sys.prefix}\0{os.path.realpath(sys.executable)}".encode())
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(PACKAGE_DIR)}:{stat.st_mtime_ns}:{stat.st_size}".encode())
    return digest.hexdigest()[:16]


def pool_address(study_dir: str | Path | None = None) -> str:
    """The socket of the pool of `study_dir` (default: the working directory) and this code.
    The folder counts by its identity too (device and inode): a folder deleted and made again
    at the same path is another study, which must not meet a pool whose working directory
    is the deleted one (its relative paths would find nothing)."""
    study = Path(study_dir or os.getcwd()).resolve()
    identity = study.stat()
    key = hashlib.sha256(f"{study}\0{identity.st_dev}:{identity.st_ino}\0{code_version()}".encode()).hexdigest()[:20]
    # in /tmp: a Unix socket path must stay under ~100 bytes, study folders may be deep
    folder = Path(tempfile.gettempdir()) / f"dtstudy-pool-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return str(folder / f"{key}.sock")


# ----- messages: 4-byte length + JSON ------------------------------------------------------

def send(sock: socket.socket, message: dict) -> None:
    payload = json.dumps(message).encode()
    sock.sendall(struct.pack("!I", len(payload)) + payload)


def receive(sock: socket.socket) -> dict | None:
    """The next message, or None when the other side closed the connection."""
    header = _read_exactly(sock, 4)
    if header is None:
        return None
    payload = _read_exactly(sock, struct.unpack("!I", header)[0])
    return None if payload is None else json.loads(payload)


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ----- client side ---------------------------------------------------------------------------

def apply_environment(environ: dict[str, str | None]) -> None:
    """Set these variables in this process (None: unset)."""
    for key, value in environ.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _try_connect(address: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        return sock
    except OSError as error:
        sock.close()
        if error.errno in (errno.ENOENT, errno.ECONNREFUSED):
            return None
        raise


def connect(address: str, log_path: str | Path | None = None) -> socket.socket:
    """A connection to the pool at `address`, starting the pool first if none answers."""
    sock = _try_connect(address)
    if sock is not None:
        return sock
    with open(f"{address}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one starter; the others wait for it here
        sock = _try_connect(address)
        if sock is not None:
            return sock
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address)  # a dead pool's socket
        log = open(log_path or f"{address}.log", "ab")
        server = subprocess.Popen(
            [sys.executable, "-m", "dtstudy.launch.pool", "--address", address],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C on Snakemake ends runs, not the shared pool
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_DIR.parent),
                                                                            os.environ.get("PYTHONPATH")]))},
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise PoolError(f"the warm pool exited at start (status {server.returncode}); "
                                f"its log: {log_path or address + '.log'}")
            sock = _try_connect(address)
            if sock is not None:
                return sock
            time.sleep(0.05)
        server.kill()
        raise PoolError(f"the warm pool did not answer within {START_TIMEOUT_S} s; its log: {log_path or address + '.log'}")


def _request(address: str, message: dict) -> dict:
    with connect(address) as sock:
        send(sock, message)
        reply = receive(sock)
    if reply is None:
        raise PoolError(f"the warm pool closed the connection during {message['kind']!r} (it died?); "
                        f"its log: {address}.log")
    if not reply.get("ok"):
        raise PoolError(reply.get("error", "unknown error"))
    return reply


def request_training(address: str, spec: RunSpec, job_id: str, rank0_log: str, log_dir: str, timings: dict,
                     environ: dict[str, str | None] | None = None) -> dict:
    """Run `spec` in the pool; rank 0 appends its output to `rank0_log`, its stderr and the
    other ranks' output go to `<log_dir>/<job_id>_rank<r>.out/.err`. The ranks set `environ`
    (None: unset) before they start: the pool may have been started by another run's task.
    Returns rank 0's metrics."""
    _request(address, {"kind": "train", "spec": spec.__dict__, "job_id": job_id, "rank0_log": rank0_log,
                        "log_dir": log_dir, "timings": {**timings, "task_start": time.time()},
                        "environ": environ or {}})
    return json.loads(spec.metrics_path.read_text())  # rank 0 wrote it; a failure raised above


def request_evaluation(address: str, run_dir: str, data_dir: str, out: str) -> dict:
    return _request(address, {"kind": "evaluate", "run_dir": run_dir, "data_dir": data_dir, "out": out})["result"]


def stop(address: str) -> bool:
    """Ask the pool at `address` to exit once its jobs are done; False when none runs."""
    sock = _try_connect(address)
    if sock is None:
        return False
    with sock:
        send(sock, {"kind": "stop"})
        receive(sock)
    return True


# ----- server side ---------------------------------------------------------------------------

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
        handler = {"train": _train, "evaluate": _evaluate}[message["kind"]]
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
        cores.pin(held.cores[0])
    return {"result": evaluate_run(message["run_dir"], message["data_dir"], message["out"])}


def _train(conn: socket.socket, message: dict) -> dict:
    """Fork the run's ranks, wait for all of them; stop them all at the first failure or
    when the client disconnects."""
    from dtstudy.launch.ports import free_port

    spec = RunSpec(**message["spec"])
    log_dir = Path(message["log_dir"])
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    world_size = spec.layout().world_size
    # distinct cores for the ranks while the run is timed; held until this process and its ranks end
    held = cores.lease(world_size)
    os.environ.pop(cores.PINNED_ENV, None)
    if held is not None:
        os.environ[cores.PINNED_ENV] = ",".join(map(str, held.cores))
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
            if held is not None:
                cores.pin(held.cores[rank])
            os._exit(_run_rank(spec, rank, out, err, timings, message.get("environ", {})))
        ranks[pid] = rank
    # which process is which rank, for whoever watches or debugs the run
    write_json(log_dir / f"{message['job_id']}_{RANKS_FILE}", {str(rank): pid for pid, rank in ranks.items()})
    failure = _wait_for_ranks(conn, ranks, logs)
    if failure:
        raise PoolError(f"{spec.run_name}: {failure}")
    return {}


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
    return (f"rank {rank} {how}; its stderr: {logs[rank]}{peers}"
            + (f"; ranks {others} were stopped" if others else "") + _last_error(logs[rank]))


def _last_error(path: str, lines: int = 3) -> str:
    """The end of a failed rank's stderr (its exception), to quote in the run's error."""
    try:
        tail = Path(path).read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return ("\n  " + "\n  ".join(tail)) if tail else ""


def _closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
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


def _run_rank(spec: RunSpec, rank: int, out: str, err: str, timings: dict, environ: dict) -> int:
    """In a forked rank: the client's environment (the pool never touches CUDA, so a rank's
    CUDA_VISIBLE_DEVICES still counts), its output to its log files, then the run's body."""
    import traceback

    apply_environment(environ)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
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

    parser = argparse.ArgumentParser(prog="python -m dtstudy.launch.pool", description="the study's warm pool (server)")
    parser.add_argument("--address", required=True, help="Unix socket to listen on")
    parser.add_argument("--idle-s", type=float, default=IDLE_S, help="exit after this long without work")
    args = parser.parse_args(argv)
    serve(args.address, args.idle_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
