"""The warm pool's client side: the pool's address for a study and this code, starting the
pool (the server), and asking it for a run (its ranks, or an emulated run), an evaluation
or its stop.

This module imports neither torch nor MLflow: clients (the submitit task, the evaluate
command) stay light; the server (dtstudy.launch.pool.server) imports them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dtstudy.launch.pool.messages import receive, send
from dtstudy.runspec import RunSpec

START_TIMEOUT_S = 120  # how long a client waits for a new pool to answer
PACKAGE_DIR = Path(__file__).resolve().parents[2]  # dtstudy: its code version, its PYTHONPATH


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


# ----- requests ------------------------------------------------------------------------------


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
            [sys.executable, "-m", "dtstudy.launch.pool.server", "--address", address],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C on Snakemake ends runs, not the shared pool
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_DIR.parent), os.environ.get("PYTHONPATH")])),
            },
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise PoolError(
                    f"the warm pool exited at start (status {server.returncode}); "
                    f"its log: {log_path or address + '.log'}"
                )
            sock = _try_connect(address)
            if sock is not None:
                return sock
            time.sleep(0.05)
        server.kill()
        raise PoolError(
            f"the warm pool did not answer within {START_TIMEOUT_S} s; its log: {log_path or address + '.log'}"
        )


def _request(address: str, message: dict, output: bool = False) -> dict:
    """Send `message`, and with `output` this process's stdout and stderr descriptors after
    it (for the job to write to); the pool's reply, PoolError when it failed."""
    with connect(address) as sock:
        send(sock, message)
        if output:
            sys.stdout.flush()
            sys.stderr.flush()
            socket.send_fds(sock, [b"\0"], [sys.stdout.fileno(), sys.stderr.fileno()])
        reply = receive(sock)
    if reply is None:
        raise PoolError(
            f"the warm pool closed the connection during {message['kind']!r} (it died?); its log: {address}.log"
        )
    if not reply.get("ok"):
        raise PoolError(reply.get("error", "unknown error"))
    return reply


def request_training(
    address: str,
    spec: RunSpec,
    job_id: str,
    rank0_log: str,
    log_dir: str,
    timings: dict,
    environ: dict[str, str | None] | None = None,
) -> dict:
    """Run `spec` in the pool; rank 0 appends its output to `rank0_log`, its stderr and the
    other ranks' output go to `<log_dir>/<job_id>_rank<r>.out/.err`. The ranks set `environ`
    (None: unset) before they start: the pool may have been started by another run's task.
    Returns rank 0's metrics."""
    _request(
        address,
        {
            "kind": "train",
            "spec": spec.__dict__,
            "job_id": job_id,
            "rank0_log": rank0_log,
            "log_dir": log_dir,
            "timings": {**timings, "task_start": time.time()},
            "environ": environ or {},
        },
    )
    return json.loads(spec.folder.metrics.read_text())  # rank 0 wrote it; a failure raised above


def request_emulated_run(address: str, spec: RunSpec, environ: dict[str, str | None] | None = None) -> dict:
    """Run `spec` emulated (dtstudy.emulation: its N logical workers in one process) in a
    process the pool forks, which writes to this process's stdout and stderr (their file
    descriptors travel with the request) and sets `environ` (the job's OMP_NUM_THREADS) first.
    Returns the run's metrics (metrics.json)."""
    _request(address, {"kind": "emulate", "spec": spec.__dict__, "environ": environ or {}}, output=True)
    return json.loads(spec.folder.metrics.read_text())  # the run wrote it; a failure raised above


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
