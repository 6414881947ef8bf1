"""Preemption-safe training: the resume files of a run, and what a task does on SIGUSR2.

SLURM (ahead of the time limit, or on preemption) and submitit's local controller (a
`signal_delay_s` before `timeout_min`) send SIGUSR2 to every task of a job. submitit's own
handler would act at once, in the middle of whatever the training loop does; instead each
task only notes the signal (`Preemption`), and the training loop acts at a step boundary:

1. the workers agree on the flag at a step boundary: every `train.preempt_check_every` steps
   an all-reduce MAX of one number over the worker group, started there and read `every`
   steps later, so that no worker waits for the others in it; or the strategy's own
   agreement (`Strategy.boundary_agreement`: the parameter servers agree through their
   first shard, their workers not being in step);
2. if set, every process that holds state writes it to its rank file (`RunFolder.rank_file`,
   atomically; the workers, and the strategy's extra processes such as parameter-server
   shards, `Strategy.save_extra_processes`), the workers meet in a barrier, then rank 0 calls
   submitit's handler: that pickles `TrainingJob.checkpoint()` (the job itself; the state is
   on disk, not in the pickle), requeues the job and exits. The other ranks block until rank
   0 is gone, then exit (SystemExit: no result pickle), so that the job does not end before
   it is requeued;
3. the requeued job finds a complete set of rank files of the same run (same identity:
   run name, N, seed, config hash; same step on every rank) and continues from there;
   anything else is reported and ignored (training starts from step 0).

A strategy that is not `resumable` is never requeued to start again from step 0: on
preemption its run fails (`PreemptedWithoutResume`), saying why and what to change.

Periodic checkpoints (`train.checkpoint_every_min`) save the same state at a step boundary
without stopping: rank 0's clock says when, and the workers agree on it the same way (the
all-reduce's value: 0 go on, 1 checkpoint, 2 stop). A run that died for any reason (a lost
process, a killed job, a crashed node) then resumes from its last checkpoint when it is started
again: Snakemake's --rerun-incomplete, a SLURM requeue, or the same `dtstudy train` by hand.
Each rank keeps its last two files (`RunFolder.rank_file`, `previous_rank_file`), each written atomically,
and a run resumes from the newest step that every rank has: a crash while the ranks write a
checkpoint leaves the previous one usable. Each file starts with the sha256 of what follows
it: a file damaged on disk (truncated, or bytes changed that torch would still load) is
detected, the previous checkpoint is used instead, and the log says which file and why.

The training loop removes the folder after metrics.json is written, so a finished run's
rerun starts from step 0; so does a run whose resume folder was removed (`clear`: delete
`RunFolder.resume` to start a failed run afresh) or whose config changed (its identity).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import io
import os
import random
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtstudy.common.atomic_files import atomic_write
from dtstudy.common.run_folder import RunFolder
from dtstudy.config import study_config
from dtstudy.strategies.base import CHECKPOINT, STOP  # what the workers agree on at a step boundary
from dtstudy.strategies.specs import get_spec
from dtstudy.training.measurements import WorkerLog

FORMAT = 2  # of the rank files; a file of another format is not used
HEADER = b"dtstudy-resume sha256 "  # then the hex digest of the rest of the file, and a newline
_CODES = {CHECKPOINT: 1, STOP: 2}  # the agreed flag is their maximum: a stop wins
_ACTIONS = {code: action for action, code in _CODES.items()}


def clear(folder: RunFolder) -> None:
    """Remove the run's resume state (call before a fresh submission of the run)."""
    shutil.rmtree(folder.resume, ignore_errors=True)


def run_identity(spec) -> dict:
    """What a rank file must match to be resumed from: the same run with the same config, its
    operational keys left out (a longer time limit or more requeues keep the checkpoint)."""
    return {
        "run_name": spec.run_name,
        "strategy": spec.strategy,
        "workers": spec.workers,
        "seed": spec.seed,
        "config_sha256": study_config.results_sha256(spec.config),
        "state_layout": get_spec(spec.strategy).state_layout,
    }


class PreemptedWithoutResume(RuntimeError):
    """A preempted run whose strategy cannot resume: it fails rather than starting again from step 0."""


def save_rank(folder: RunFolder, rank: int, identity: dict, step: int, state: dict) -> Path:
    """Write this rank's state (atomically), keeping its previous file as `previous_rank_file`."""
    payload = {"format": FORMAT, "identity": identity, "rank": rank, "step": step, "state": state}
    path = folder.rank_file(rank)
    if path.exists():
        os.replace(path, folder.previous_rank_file(rank))
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    header = HEADER + hashlib.sha256(data).hexdigest().encode() + b"\n"
    return atomic_write(path, lambda stream: stream.write(header + data))


def read_rank(folder: RunFolder, rank: int, identity: dict, ranks: int | None = None) -> tuple[dict | None, int, str]:
    """(state, step, "") from this rank's file when it belongs to this run, else
    (None, -1, why not). Also checks that every other rank's file is there (`ranks`: the
    processes that save one, Strategy.resume_ranks; None: the N workers)."""
    path = folder.rank_file(rank)
    if not path.exists():
        return None, -1, f"{path.name} is missing"
    ranks = identity["workers"] if ranks is None else ranks
    missing = [folder.rank_file(r).name for r in range(ranks) if not folder.rank_file(r).exists()]
    if missing:
        return None, -1, f"incomplete set, {', '.join(missing)} missing"
    return _read_file(path, rank, identity)


def _read_file(path: Path, rank: int, identity: dict) -> tuple[dict | None, int, str]:
    raw = path.read_bytes()
    header, _, data = raw.partition(b"\n")
    if not header.startswith(HEADER):
        return None, -1, f"{path.name} is unreadable (not a resume file of format {FORMAT})"
    saved_digest, digest = header[len(HEADER) :].decode(errors="replace"), hashlib.sha256(data).hexdigest()
    if saved_digest != digest:  # truncated, or changed on disk since it was written
        return (
            None,
            -1,
            (f"{path.name} is damaged (sha256 {digest[:12]}... of its contents, {saved_digest[:12]}... when saved)"),
        )
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # written whole but not by torch.save: say so, never use it
        return None, -1, f"{path.name} is unreadable ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or not {"state", "step"} <= payload.keys():
        return None, -1, f"{path.name} is not a resume file of format {FORMAT}"
    theirs = payload.get("identity") or {}
    differing = sorted(key for key in identity if theirs.get(key) != identity[key])
    if differing or payload.get("rank") != rank:
        what = ", ".join(f"{key} {theirs.get(key)!r} (this run: {identity[key]!r})" for key in differing) or "rank"
        return None, -1, f"{path.name} was written by another run: {what}"
    return payload["state"], int(payload["step"]), ""


def load_agreed(folder: RunFolder, identity: dict, rank: int, workers: int, group, say: Callable[[str], None]):
    """This process's saved state at the newest step every process has a valid file of, else None.

    `workers`: the processes that save a rank file (ranks 0..workers-1: the N workers, and a
    strategy's extra processes that hold state, Strategy.resume_ranks); a collective over
    `group`, their group (each calls it once, before training). When there was state but it
    is not used, `say` (rank 0's progress output) tells why, and the folder is removed so
    that it cannot be picked up later.
    """
    state, step, reason = read_rank(folder, rank, identity, workers) if folder.resume.exists() else (None, -1, "")
    states = {step: state} if step >= 0 else {}
    previous = folder.previous_rank_file(rank)
    if previous.exists():  # a checkpoint that some rank may not have replaced yet
        older, older_step, _ = _read_file(previous, rank, identity)
        if older_step >= 0:
            states.setdefault(older_step, older)
    verdicts = [(step, reason, sorted(states))]
    if workers > 1:
        verdicts = [None] * workers
        dist.all_gather_object(verdicts, (step, reason, sorted(states)), group=group)
    common = set.intersection(*(set(usable) for _, _, usable in verdicts))
    reasons = [f"rank {r}: {why}" for r, (_, why, _) in enumerate(verdicts) if why]
    if common:
        if reasons:  # a newest file was unusable: the previous checkpoint is used, and the log says so
            say(
                f"resume state in {folder.resume}: {'; '.join(reasons)}; resuming from the previous checkpoint, "
                f"at step {max(common)}"
            )
        return states[max(common)]
    steps = {s for s, _, _ in verdicts}
    if not reasons and any(s >= 0 for s in steps):
        reasons = [
            "the ranks saved different steps: "
            + ", ".join(f"rank {r} step {s}" for r, (s, _, _) in enumerate(verdicts))
        ]
    if reasons:
        say(f"resume state in {folder.resume} not used ({'; '.join(reasons)}): training starts from step 0")
        if workers > 1:
            dist.barrier(group=group)  # every rank has read its file before rank 0 removes them
        if rank == 0:
            clear(folder)
    return None


@dataclass(frozen=True)
class ResumeFiles:
    """A run's resume files as one of its processes uses them, built once per process: a worker,
    or a strategy's extra process (a parameter-server shard: it saves its own rank file at the
    workers' boundaries and takes part in `load_agreed`)."""

    folder: RunFolder
    identity: dict
    #: called once the process has saved its state for a stop and waits for rank 0 to go: from
    #: then on its peers' ends are expected (its Preemption is stopping), not a lost process.
    #: (Its own SIGUSR2 handler may not have run: Python runs it only between bytecodes, and
    #: the process may sit in one long wait.)
    stopping: Callable[[], None] = lambda: None

    @classmethod
    def of(cls, spec, stopping: Callable[[], None] = lambda: None) -> ResumeFiles:
        """The files of run `spec` (a RunSpec), matched against its identity."""
        return cls(spec.folder, run_identity(spec), stopping)

    def save(self, rank: int, step: int, state: dict) -> Path:
        return save_rank(self.folder, rank, self.identity, step, state)

    def load_agreed(self, rank: int, processes: int, group, say: Callable[[str], None] = lambda _message: None):
        return load_agreed(self.folder, self.identity, rank, processes, group, say)

    def clear(self) -> None:
        clear(self.folder)


# ----- a worker's place in training, as saved and restored ----------------------------


@dataclass
class LoopState:
    """Where a worker's training stands: what a resumed run continues from."""

    log: WorkerLog
    epoch: int = 0  # the epoch the next step belongs to
    step_in_epoch: int = 0  # its batch within the epoch (the batches before it are done)
    step: int = 0  # steps done
    elapsed_s: float = 0.0  # training wall time of earlier attempts
    saved_losses: list[float] = field(default_factory=list)  # losses of earlier attempts
    val_history: list[dict] = field(default_factory=list)
    losses: list = field(default_factory=list)  # this attempt's losses, still tensors on the device

    def losses_so_far(self) -> list[float]:
        """This worker's loss per step: earlier attempts' and this attempt's."""
        return self.saved_losses + (torch.stack(self.losses).float().cpu().tolist() if self.losses else [])


def rng_states(device: torch.device) -> dict:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(_as_tuples(states["python"]))
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def _as_tuples(value):
    """random.getstate() is nested tuples; make sure it is again after a save and load."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def resumable_state(state: LoopState, model, strategy, straggler, device: torch.device, elapsed_s: float) -> dict:
    """Everything a worker needs to continue exactly where it is (a step boundary)."""
    log = dataclasses.asdict(state.log)
    log["loss"] = state.losses_so_far()
    return {
        "position": {"epoch": state.epoch, "step_in_epoch": state.step_in_epoch, "step": state.step},
        "elapsed_s": elapsed_s,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": strategy.optimizer.state_dict() if strategy.optimizer is not None else None,
        "strategy": strategy.state_dict(),
        "rng": rng_states(device),
        "log": log,
        "val_history": state.val_history,
        "straggler": {"rng": straggler.rng.getstate(), "total_s": straggler.total_s},
    }


def restore(saved: dict, model, strategy, straggler, device: torch.device) -> LoopState:
    """Load what `resumable_state` saved into the model, strategy and straggler; the loop's state."""
    model.load_state_dict(saved["model"])
    if saved["optimizer"] is not None:
        strategy.optimizer.load_state_dict(saved["optimizer"])
    strategy.load_state_dict(saved["strategy"])
    straggler.rng.setstate(_as_tuples(saved["straggler"]["rng"]))
    straggler.total_s = saved["straggler"]["total_s"]
    set_rng_states(saved["rng"], device)
    log = WorkerLog(**saved["log"])
    losses, log.loss = log.loss, []
    position = saved["position"]
    return LoopState(
        log=log,
        epoch=position["epoch"],
        step_in_epoch=position["step_in_epoch"],
        step=position["step"],
        elapsed_s=saved["elapsed_s"],
        saved_losses=losses,
        val_history=saved["val_history"],
    )


# ----- the preemption signal ------------------------------------------------------------


def preemption_signal() -> signal.Signals:
    """The signal submitit treats as time-out/preemption (SUBMITIT_PREEMPT_SIGNAL, default USR2)."""
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))


class Preemption:
    """Notes the preemption signal in one task; the training loop asks at step boundaries.

    `install` replaces the signal's handler (submitit's, installed before our callable runs)
    by one that only sets a flag, and keeps submitit's to call later (`requeue`).
    """

    def __init__(
        self,
        rank: int,
        workers: int,
        group,
        device: torch.device,
        every: int,
        lockstep: bool,
        checkpoint_every_s: float | None = None,
    ):
        self.rank, self.workers, self.group, self.every = rank, workers, group, every
        # a resumable run: its workers agree on a boundary (by a collective, or `agreement`)
        self.lockstep = lockstep
        self.agreement: Callable[[int, str | None], str | None] | None = None  # agree_through
        # periodic checkpoints (resumable strategies only): rank 0's clock
        self.checkpoint_every_s = checkpoint_every_s if lockstep and rank == 0 else None
        self._next_checkpoint: float | None = None
        self.signalled = False  # this task got the signal
        self.stopping = False  # the workers agreed to stop (or rank 0 is requeueing)
        self.signum = preemption_signal()
        self.submitit_handler: Any = None
        self._flag = torch.zeros(1, device=device)
        self._store = None  # a client of rank 0's TCP store, to notice when rank 0 is gone
        self._pending = None  # the flag all-reduce in flight

    def install(self, wait_on_store: bool | None = None) -> Preemption:
        """Take over the signal. `wait_on_store`: how a rank other than 0 notices that rank 0
        is gone after a stop: a barrier over the workers (gloo notices a closed peer at once)
        or, for NCCL (which notices only at its time-out), a wait on rank 0's TCP store, whose
        connection is opened now, while rank 0 surely runs. None: by the backend."""
        self.submitit_handler = signal.signal(self.signum, self._note)
        waits = self.lockstep and 0 < self.rank < self.workers  # the only ranks that call wait_for_rank0
        if wait_on_store is None:
            wait_on_store = dist.get_backend() != "gloo"
        if waits and wait_on_store:
            self._store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=datetime.timedelta(minutes=5),
            )
        return self

    def _note(self, signum, frame) -> None:  # no I/O here: it runs wherever the loop is
        self.signalled = True

    def agree_through(self, agreement: Callable[[int, str | None], str | None] | None) -> None:
        """The strategy's own agreement on boundaries (Strategy.boundary_agreement; None: the
        all-reduce), asked at every step boundary instead of the all-reduce."""
        self.agreement = agreement if self.lockstep else None

    def poll(self, step: int) -> str | None:
        """At a step boundary, before step `step`: STOP, CHECKPOINT or None, the same answer on
        every worker.

        Lockstep strategies: every `every` steps each worker starts an all-reduce (MAX) of its
        flag without waiting for it, and reads the previous one's result, started `every`
        steps ago: a worker ahead of the others by less than `every` steps (local SGD between
        its exchanges, gossip, a straggler's partners) never waits here, so no wait moves out
        of the timed steps into this untimed check. A signal stops the run within 2 x `every`
        steps; a checkpoint rank 0's clock calls for is taken as late. With the strategy's own
        `agreement`, it is asked at every boundary with what this worker wants. Strategies
        that cannot resume: rank 0 alone looks at its own flag (no collective), and no
        checkpoints."""
        if self.agreement is not None:
            return self.agreement(step, STOP if self.signalled else CHECKPOINT if self._checkpoint_due() else None)
        if not self.lockstep:
            return STOP if self.rank == 0 and self.signalled else None
        if step % self.every:
            return None
        if self.workers == 1:
            return STOP if self.signalled else CHECKPOINT if self._checkpoint_due() else None
        agreed = 0
        if self._pending is not None:
            self._pending.wait()
            agreed = int(self._flag.item())
        self._pending = None
        if agreed < _CODES[STOP]:
            wanted = STOP if self.signalled else CHECKPOINT if self._checkpoint_due() else None
            self._flag.fill_(float(_CODES.get(wanted, 0)))
            self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return _ACTIONS.get(agreed)

    def _checkpoint_due(self) -> bool:
        """Rank 0: is a periodic checkpoint due? (The clock starts at the first call, when training starts.)"""
        if self.checkpoint_every_s is None:
            return False
        now = time.monotonic()
        if self._next_checkpoint is None:
            self._next_checkpoint = now + self.checkpoint_every_s
        if now < self._next_checkpoint:
            return False
        self._next_checkpoint = now + self.checkpoint_every_s
        return True

    def drain(self) -> None:
        """After the last step: complete the all-reduce still in flight (every worker started it)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def requeue(self) -> None:
        """Rank 0: call submitit's handler (checkpoint() pickled, job requeued, exit). Does not return."""
        self.stopping = True
        handler = self.submitit_handler
        if callable(handler):
            handler(self.signum, None)
        raise RuntimeError(f"preempted (signal {self.signum.name}) but no submitit handler requeued the job")

    def wait_for_rank0(self) -> None:
        """Ranks other than 0: block until rank 0 has requeued the job and exited, then exit."""
        self.stopping = True
        try:
            if self._store is not None:  # a key nobody sets: fails when rank 0's store closes
                self._store.wait([f"dtstudy/preempted/never-set/{self.rank}"], datetime.timedelta(days=1))
            elif self.workers > 1:
                dist.barrier(group=self.group)  # rank 0 never joins: fails once it is gone
        except Exception:
            pass
        raise SystemExit(f"rank {self.rank}: preempted; rank 0 saved the run and requeued the job")

    def ignore_late_signals(self) -> None:
        """The run is over (metrics written): a signal now changes nothing. SLURM's signal timer
        is coarse, so SIGUSR2 may come while the task exits; Python's finalization restores the
        default action (terminate) of every signal it handles, which would kill the finished
        task and mark the job FAILED. An ignored signal stays ignored."""
        signal.signal(self.signum, signal.SIG_IGN)

    def ends_quietly(self) -> bool:
        """After a preemption, a rank other than 0 whose communication fails (rank 0 is gone)
        ends by SystemExit rather than as a failed task."""
        return self.rank != 0 and (self.signalled or self.stopping)
