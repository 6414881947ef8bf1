"""Preemption-safe training: SIGUSR2 to a running job's tasks (what SLURM and submitit's local
controller send ahead of a time limit) saves the run's state at a step boundary, rank 0
requeues the job, and the requeued job continues exactly where it stopped. The parameter
servers too (their shards save their own state), and a crashed run started again continues
from its last periodic checkpoint; a strategy that cannot resume fails instead of starting
again from step 0."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_same_parameters, tiny_study, validated

from dtstudy.common.run_folder import METRICS, MODEL
from dtstudy.config.study_config import deep_merge
from dtstudy.runspec import RunSpec
from dtstudy.training import checkpoint

JOB_DEADLINE_S = 180  # a hung job must fail the test, not stall the suite
PROGRESS = re.compile(r"^epoch (\d+)/\d+ step (\d+)/(\d+) ", re.M)


def make_spec(
    root: Path,
    data_dir,
    strategy="allreduce",
    workers=2,
    batch_size=32,
    steps=60,
    epochs=3,
    stragglers=None,
    strategy_params=None,
    **train,
) -> RunSpec:
    """conftest.train_run's run (lr_scaling none, base_lr 0.1) over several epochs, with
    progress every 5 steps and the preemption check every 5 steps (28 steps per epoch at
    N=2, batch 32: a stop is never at an epoch boundary)."""
    from dtstudy.config.study_config import run_config

    study = validated(
        tiny_study(
            strategies=[strategy],
            workers=[workers],
            stragglers=stragglers or {},
            strategy_params={strategy: strategy_params or {}},
            train={
                "epochs": epochs,
                "batch_size": batch_size,
                "max_steps": steps,
                "lr_scaling": "none",
                "base_lr": 0.1,
                "log_every": 5,
                "preempt_check_every": 5,
                **train,
            },
        )
    )
    out = root / f"{strategy}-n{workers}"
    return RunSpec(
        strategy=strategy,
        workers=workers,
        seed=0,
        config=run_config(study, strategy),
        data_dir=str(data_dir),
        out_dir=str(out),
    )


def submit(spec: RunSpec):
    """The launcher's submission (submitit LocalExecutor, one task per process), returning
    the job so that the test can signal its tasks. Unlike launcher.run it leaves the resume
    folder alone."""
    from dtstudy.launch.job import TrainingJob
    from dtstudy.launch.launcher import free_port, make_executor

    os.environ["MASTER_PORT"] = str(free_port())
    return make_executor(spec, spec.folder.job_logs).submit(TrainingJob(spec))


def task_pids(job) -> list[int]:
    """The job's task processes: the children of its local controller (job id = its pid)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == int(job.job_id):  # the field after the state is the parent pid
            pids.append(int(stat.parent.name))
    return pids


def log_of(job) -> str:
    path = Path(job.paths.stdout)  # task 0 (rank 0), every attempt appended
    return path.read_text() if path.exists() else ""


def wait_until(condition, what: str, job, timeout_s: float = JOB_DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        ended = job.done()
        if ended or time.monotonic() > deadline:
            if not ended:
                job.cancel(check=False)
            errors = "".join(path.read_text()[-2000:] for path in sorted(Path(job.paths.folder).glob("*_log.err")))
            pytest.fail(
                f"{'job ended' if ended else 'timed out'} waiting for {what}; rank 0's log:\n{log_of(job)}"
                f"\ntasks' stderr:\n{errors}"
            )
        time.sleep(0.02)


def preempt_after_progress(job, lines: int = 1) -> None:
    """Once rank 0 has printed `lines` progress lines, SIGUSR2 to every task, as SLURM does."""
    wait_until(lambda: len(PROGRESS.findall(log_of(job))) >= lines, "training progress", job)
    pids = task_pids(job)
    assert pids, "no task processes found"
    for pid in pids:
        os.kill(pid, signal.SIGUSR2)


def finish(job, spec: RunSpec):
    """Wait for the job; (metrics, final parameters, rank 0's log)."""
    wait_until(job.done, "the job to end", job)
    metrics = job.results()[0]
    out = Path(spec.out_dir)
    assert (out / METRICS).exists()
    return metrics, torch.load(out / MODEL, weights_only=True)["state_dict"], log_of(job)


def global_steps(log: str) -> list[int]:
    """The global step (1-based) of each progress line in `log`."""
    return [(int(epoch) - 1) * int(per_epoch) + int(step) for epoch, step, per_epoch in PROGRESS.findall(log)]


# uniform random delays on rank 1: the straggler's generator is state to resume, and the
# slower steps leave time to signal the job part-way
SLOW = {"ranks": [1], "delay_ms": 30, "distribution": "uniform", "seed": 3}


@pytest.mark.parametrize(
    "strategy, lines",
    [
        ("allreduce", 1),
        # PowerSGD compresses from step 10 on, with error feedback and warm-started Q kept per
        # DDP bucket: stopping after step 15 saves that memory, and the resumed run must reduce
        # the same buckets (it replays DDP's first step) for it to stay right
        ("allreduce_powersgd", 3),
    ],
)
@pytest.mark.slow
def test_preempted_sync_run_resumes_exactly(tmp_path, tiny_data, strategy, lines):
    steps = 60
    reference_spec = make_spec(tmp_path / "whole", tiny_data, strategy=strategy, steps=steps, stragglers=SLOW)
    reference_job = submit(reference_spec)  # alongside: only the numbers are compared
    spec = make_spec(tmp_path / "preempted", tiny_data, strategy=strategy, steps=steps, stragglers=SLOW)
    job = submit(spec)
    preempt_after_progress(job, lines)
    metrics, params, log = finish(job, spec)
    reference, reference_params, _ = finish(reference_job, reference_spec)

    # the run really stopped part-way and the requeued job went on from the saved step
    stopped = re.search(r"preempted at step (\d+) after ([\d.]+) s", log)
    resumed = re.search(r"^resumed from step (\d+) ", log, re.M)
    assert stopped and resumed, log
    k = int(resumed.group(1))
    assert int(stopped.group(1)) == k and 5 * lines <= k < steps and k % 5 == 0
    after = global_steps(log[resumed.end() :])
    assert after and min(after) > k, "steps done before the preemption were run again"

    # ... and ended where the uninterrupted run ended, step for step
    assert metrics["steps"] == reference["steps"] == steps
    assert metrics["images"] == reference["images"]  # no step counted twice
    assert metrics["train_loss"] == reference["train_loss"]
    assert [v["top1"] for v in metrics["val"]] == [v["top1"] for v in reference["val"]]
    assert metrics["stragglers"] == reference["stragglers"]  # the delays drawn after the resume too
    assert metrics["strategy_metrics"] == reference["strategy_metrics"]
    assert_same_parameters(params, reference_params, atol=1e-7)
    # wall time adds up over the attempts
    assert metrics["wall_time_s"] > float(stopped.group(2))
    assert [v["wall_s"] for v in metrics["val"]] == sorted(v["wall_s"] for v in metrics["val"])
    # the state is gone once metrics.json is written
    assert not spec.folder.resume.exists()


def stop_and_resume(log: str, steps: int) -> int:
    """The step a preempted run stopped at and its requeued job resumed from (the same), after
    checking that no step before it ran again."""
    stopped = re.search(r"preempted at step (\d+) after ([\d.]+) s", log)
    resumed = re.search(r"^resumed from step (\d+) ", log, re.M)
    assert stopped and resumed, log
    k = int(resumed.group(1))
    assert int(stopped.group(1)) == k and 0 < k < steps, (k, steps)
    after = global_steps(log[resumed.end() :])
    assert after and min(after) > k, "steps done before the preemption were run again"
    return k


def without_timings(strategy_metrics: dict) -> dict:
    """The shards' record less what the clock measured (their busy fractions)."""
    return {key: value for key, value in strategy_metrics.items() if not key.startswith("shard_busy")}


@pytest.mark.slow
def test_preempted_ps_sync_run_resumes_exactly(tmp_path, tiny_data):
    """ps_sync with 2 shards: the workers agree on the boundary through the first shard, every
    worker and shard saves its own file, and the requeued run ends where an uninterrupted run
    of the same seed ends, step for step, the shards' record (updates, versions, staleness) too."""
    steps, knobs = 60, {"shards": 2}
    reference_spec = make_spec(
        tmp_path / "whole", tiny_data, strategy="ps_sync", steps=steps, stragglers=SLOW, strategy_params=knobs
    )
    reference_job = submit(reference_spec)
    spec = make_spec(
        tmp_path / "preempted", tiny_data, strategy="ps_sync", steps=steps, stragglers=SLOW, strategy_params=knobs
    )
    job = submit(spec)
    preempt_after_progress(job)
    metrics, params, log = finish(job, spec)
    reference, reference_params, _ = finish(reference_job, reference_spec)

    k = stop_and_resume(log, steps)
    print(f"ps_sync: preempted and resumed at step {k} of {steps}")
    assert metrics["steps"] == reference["steps"] == steps
    assert metrics["images"] == reference["images"]
    assert metrics["train_loss"] == reference["train_loss"]
    assert [v["top1"] for v in metrics["val"]] == [v["top1"] for v in reference["val"]]
    assert metrics["stragglers"] == reference["stragglers"]
    shards = metrics["strategy_metrics"]
    assert without_timings(shards) == without_timings(reference["strategy_metrics"])
    assert shards["updates"] == 2 * steps and shards["staleness"] == {"0": 2 * 2 * steps}  # 2 shards, 2 workers
    assert_same_parameters(params, reference_params, atol=1e-7)
    assert not spec.folder.resume.exists()


@pytest.mark.parametrize("strategy", ["ps_async", "ssp", "ps_backup"])
@pytest.mark.slow
def test_preempted_asynchronous_ps_run_continues_from_the_saved_step(tmp_path, tiny_data, strategy):
    """ps_async, ssp and ps_backup (arrival order, hence the numbers, vary from run to run): the
    requeued run goes on from the saved step, not from 0, and its shard from the saved version
    and clocks: over both attempts every planned gradient is taken exactly once."""
    steps = 60
    spec = make_spec(tmp_path, tiny_data, strategy=strategy, steps=steps, stragglers=SLOW)
    job = submit(spec)
    preempt_after_progress(job)
    metrics, _, log = finish(job, spec)

    k = stop_and_resume(log, steps)
    print(f"{strategy}: preempted and resumed at step {k} of {steps}")
    assert metrics["steps"] == steps and len(metrics["train_loss"]) == steps
    assert metrics["images"] == 2 * 32 * steps  # no step counted twice, none left out
    shard = metrics["strategy_metrics"]
    # one shard, every gradient its own update (ps_backup at N=2: or dropped): a shard that
    # restarted at version 0 would count only the 2 (steps - k) after the resume, workers that
    # restarted at step 0 2 (steps + k)
    assert shard["updates"] == shard["gradients_applied"]
    assert shard["gradients_applied"] + shard["dropped_gradients"] == 2 * steps
    assert sum(shard["staleness"].values()) == shard["gradients_applied"]
    assert sum(shard["clock_ahead"].values()) == 2 * steps  # every push answered once
    if strategy == "ssp":  # the clocks went on: the bound held over both attempts
        assert shard["clock_ahead_max"] <= 2
    assert not spec.folder.resume.exists()


def task_ranks(job) -> dict[int, int]:
    """rank -> pid of a local job's tasks (one node: the task number is the rank)."""
    ranks = {}
    for pid in task_pids(job):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"SUBMITIT_LOCAL_GLOBALID="):
                ranks[int(entry.split(b"=", 1)[1])] = pid
    return ranks


@pytest.mark.slow
def test_a_crashed_ps_run_started_again_resumes_from_its_last_periodic_checkpoint(tmp_path, tiny_data):
    """ps_sync with periodic checkpoints (every step boundary past 0.1 s of training): its shard
    is killed after a checkpoint, the job fails; the same run submitted again finds every
    worker's and the shard's file and ends exactly where an uninterrupted run ends."""
    steps = 80  # of 84 in the 3 epochs
    train = {"checkpoint_every_min": 0.002}
    reference_spec = make_spec(tmp_path / "whole", tiny_data, strategy="ps_sync", steps=steps, stragglers=SLOW, **train)
    reference_job = submit(reference_spec)
    spec = make_spec(tmp_path / "crashed", tiny_data, strategy="ps_sync", steps=steps, stragglers=SLOW, **train)
    job = submit(spec)
    wait_until(lambda: len(re.findall(r"checkpoint at step (\d+)", log_of(job))) >= 2, "two checkpoints", job)
    ranks = task_ranks(job)
    assert sorted(ranks) == [0, 1, 2], ranks
    os.kill(ranks[2], signal.SIGKILL)  # the shard
    deadline = time.monotonic() + JOB_DEADLINE_S
    while not job.done() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job.done() and not spec.folder.metrics.exists()
    saved = [int(step) for step in re.findall(r"checkpoint at step (\d+)", log_of(job))]
    assert spec.folder.rank_file(2).exists()  # the shard's own file

    again = submit(spec)  # a fresh submission of the same run (as snakemake --rerun-incomplete)
    metrics, params, log = finish(again, spec)
    reference, reference_params, _ = finish(reference_job, reference_spec)
    resumed = re.search(r"^resumed from step (\d+) ", log, re.M)
    assert resumed, log
    step = int(resumed.group(1))
    assert saved[-1] <= step < steps, (step, saved)
    print(f"ps_sync: shard killed after the checkpoint at step {saved[-1]}, resumed from step {step}")
    assert min(global_steps(log[resumed.end() :])) > step
    assert metrics["steps"] == steps and metrics["train_loss"] == reference["train_loss"]
    assert [v["top1"] for v in metrics["val"]] == [v["top1"] for v in reference["val"]]
    assert without_timings(metrics["strategy_metrics"]) == without_timings(reference["strategy_metrics"])
    assert_same_parameters(params, reference_params, atol=1e-7)
    assert not spec.folder.resume.exists()


def test_a_preempted_run_that_cannot_resume_fails_saying_why(tmp_path, tiny_data):
    """A strategy that is not resumable: at the agreed stop rank 0 lets the extra processes go
    (abandon) and the run fails with the strategy, the reason and what to do; it is never
    requeued to start again from step 0."""
    from types import SimpleNamespace

    from dtstudy.strategies.registry import STRATEGIES
    from dtstudy.training import loop

    calls = []
    strategy = SimpleNamespace(
        resumable=False,
        not_resumable_because="its state lives on a remote server",
        abandon=lambda: calls.append("abandon"),
    )
    preemption = SimpleNamespace(signum=signal.SIGUSR2, stopping=False, requeue=lambda: calls.append("requeue"))
    run = SimpleNamespace(
        spec=make_spec(tmp_path, tiny_data, strategy="no_exchange"), ctx=None, strategy=strategy, preemption=preemption
    )
    with pytest.raises(checkpoint.PreemptedWithoutResume) as failure:
        loop.stop_for_preemption(run, checkpoint.LoopState(log=None, step=17), 1.0)
    assert calls == ["abandon"]  # no requeue, no state saved
    message = str(failure.value)
    assert "preempted at step 17 (signal SIGUSR2)" in message and "'no_exchange' cannot resume" in message
    assert "its state lives on a remote server" in message and "launcher.timeout_min" in message
    assert not run.spec.folder.resume.exists()
    # every shipped strategy resumes (the parameter servers too): none of them fails this way
    assert [name for name, cls in STRATEGIES.items() if not cls.resumable] == []


@pytest.mark.slow
def test_unusable_resume_state_is_reported_and_not_used(tmp_path, tiny_data):
    """A run finding rank files it cannot trust trains from step 0, says why, removes them."""
    spec = make_spec(tmp_path, tiny_data, steps=10, epochs=1)
    folder = spec.folder.resume
    folder.mkdir(parents=True)
    checkpoint.save_rank(spec.folder, 0, {**checkpoint.run_identity(spec), "seed": 7}, 5, {})
    (folder / "rank1.pt").write_bytes(b"not a torch file")
    metrics, _, log = finish(submit(spec), spec)
    assert re.search(
        r"resume state in \S+ not used \(rank 0: rank0.pt was written by another run: seed 7 "
        r"\(this run: 0\); rank 1: rank1.pt is unreadable",
        log,
    ), log
    assert "resumed from" not in log
    assert metrics["steps"] == 10 and len(metrics["train_loss"]) == 10
    assert not folder.exists()


# ----- the resume files themselves (no job) ------------------------------------------------
def _say():
    said = []
    return said, said.append


def test_resume_files_are_used_only_when_complete_and_of_this_run(tmp_path, tiny_data):
    spec = make_spec(tmp_path, tiny_data, workers=1)
    identity = checkpoint.run_identity(spec)
    said, say = _say()
    assert checkpoint.load_agreed(spec.folder, identity, 0, 1, None, say) is None and said == []  # nothing there

    checkpoint.save_rank(spec.folder, 0, identity, 20, {"x": torch.arange(3)})
    state = checkpoint.load_agreed(spec.folder, identity, 0, 1, None, say)
    assert torch.equal(state["x"], torch.arange(3)) and said == []

    other = make_spec(tmp_path, tiny_data, workers=1, base_lr=0.2)  # same run name, other config
    assert checkpoint.load_agreed(other.folder, checkpoint.run_identity(other), 0, 1, None, say) is None
    assert "written by another run: config_sha256" in said[-1] and "starts from step 0" in said[-1]
    assert not spec.folder.resume.exists()  # removed, never picked up later

    # a longer time limit, more requeues, another MLflow server (the operational keys) keep the checkpoint
    launched_otherwise = dataclasses.replace(
        spec,
        config=deep_merge(
            spec.config,
            {"launcher": {"timeout_min": 600, "max_requeues": 9}, "tracking": {"uri": "http://login2:5000"}},
        ),
    )
    checkpoint.save_rank(spec.folder, 0, identity, 20, {"x": torch.arange(3)})
    state = checkpoint.load_agreed(spec.folder, checkpoint.run_identity(launched_otherwise), 0, 1, None, say)
    assert state is not None and torch.equal(state["x"], torch.arange(3))
    checkpoint.clear(spec.folder)

    two = checkpoint.run_identity(make_spec(tmp_path, tiny_data, workers=2))
    checkpoint.save_rank(spec.folder, 0, two, 20, {})
    state, step, why = checkpoint.read_rank(spec.folder, 0, two)
    assert state is None and why == "incomplete set, rank1.pt missing"

    checkpoint.save_rank(spec.folder, 1, two, 20, {})
    spec.folder.rank_file(0).write_bytes(spec.folder.rank_file(0).read_bytes()[:100])  # cut short
    state, step, why = checkpoint.read_rank(spec.folder, 0, two)
    assert state is None and why.startswith("rank0.pt is damaged")
    assert checkpoint.read_rank(spec.folder, 1, two)[1] == 20

    checkpoint.clear(spec.folder)
    assert not spec.folder.resume.exists()


def test_a_parameter_server_file_of_the_older_state_layout_is_not_resumed_from(tmp_path, tiny_data):
    """A ps_sync rank file written before the shards saved flat ranges (no state_layout in its
    identity) starts the run afresh, saying why, instead of failing on a size mismatch; an
    allreduce file without the key (its state never changed layout) is still resumed."""
    said, say = _say()
    ps = make_spec(tmp_path / "ps", tiny_data, strategy="ps_sync", workers=1)
    identity = checkpoint.run_identity(ps)
    assert identity["state_layout"] == "flat-range"
    older = {key: value for key, value in identity.items() if key != "state_layout"}
    checkpoint.save_rank(ps.folder, 0, older, 20, {"x": torch.arange(3)})
    assert checkpoint.load_agreed(ps.folder, identity, 0, 1, None, say) is None
    assert "written by another run: state_layout None (this run: 'flat-range')" in said[-1]
    checkpoint.save_rank(ps.folder, 0, identity, 20, {"x": torch.arange(3)})  # control: this layout resumes
    assert torch.equal(checkpoint.load_agreed(ps.folder, identity, 0, 1, None, say)["x"], torch.arange(3))

    allreduce = make_spec(tmp_path / "ar", tiny_data, workers=1)
    identity = checkpoint.run_identity(allreduce)
    assert identity["state_layout"] is None
    checkpoint.save_rank(
        allreduce.folder,
        0,
        {key: value for key, value in identity.items() if key != "state_layout"},
        20,
        {"x": torch.arange(3)},
    )
    assert torch.equal(checkpoint.load_agreed(allreduce.folder, identity, 0, 1, None, say)["x"], torch.arange(3))


def test_a_damaged_checkpoint_is_detected_and_the_previous_one_used(tmp_path, tiny_data):
    """Bytes of a rank file changed on disk where torch still loads it: its checksum names it,
    the run resumes from the previous checkpoint, and the log says so."""
    import io

    spec = make_spec(tmp_path, tiny_data, workers=1)
    identity = checkpoint.run_identity(spec)
    checkpoint.save_rank(spec.folder, 0, identity, 10, {"x": torch.full((64,), 1.5)})
    checkpoint.save_rank(spec.folder, 0, identity, 20, {"x": torch.full((64,), 2.5)})
    path = spec.folder.rank_file(0)
    raw = path.read_bytes()
    value, damaged = torch.tensor([2.5]).numpy().tobytes(), torch.tensor([7.0]).numpy().tobytes()
    at = raw.index(value * 64)
    path.write_bytes(raw[:at] + damaged + raw[at + 4 :])

    # the control: torch alone loads the damaged file, with a changed value and no complaint
    body = path.read_bytes().partition(b"\n")[2]
    loaded = torch.load(io.BytesIO(body), weights_only=True)["state"]["x"]
    assert loaded[0] == 7.0 and torch.all(loaded[1:] == 2.5)

    said, say = _say()
    state = checkpoint.load_agreed(spec.folder, identity, 0, 1, None, say)
    assert torch.equal(state["x"], torch.full((64,), 1.5))  # step 10's, the previous checkpoint
    assert len(said) == 1 and re.search(
        r"rank 0: rank0.pt is damaged \(sha256 \w+\.\.\. of its contents, "
        r"\w+\.\.\. when saved\); resuming from the previous checkpoint, "
        r"at step 10",
        said[0],
    ), said
    # both damaged: nothing usable, training starts from step 0 and the folder is removed
    checkpoint.save_rank(spec.folder, 0, identity, 30, {"x": torch.zeros(2)})
    for file in (path, spec.folder.previous_rank_file(0)):
        file.write_bytes(file.read_bytes()[:-10])
    assert checkpoint.load_agreed(spec.folder, identity, 0, 1, None, say) is None
    assert "rank0.pt is damaged" in said[-1] and "training starts from step 0" in said[-1]
    assert not spec.folder.resume.exists()


WAITER = r"""
import datetime, os, sys, time
import torch, torch.distributed as dist
from dtstudy.training.checkpoint import Preemption

rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(minutes=2))
preemption = Preemption(rank, 2, None, torch.device("cpu"), every=1, lockstep=True).install(wait_on_store=True)
dist.barrier()
if rank == 0:
    time.sleep(0.5)
    os._exit(144)  # as submitit's local requeue: rank 0's process is gone
start = time.monotonic()
try:
    preemption.wait_for_rank0()
finally:
    print(f"waited {time.monotonic() - start:.1f} s", flush=True)
"""


@pytest.mark.slow
def test_waiting_on_rank0s_store_ends_when_rank0_is_gone(tmp_path):
    """The wait of ranks other than 0 with NCCL (no GPUs here: forced on gloo) ends by
    SystemExit soon after rank 0 exits, and not before."""
    import subprocess
    import sys

    from dtstudy.launch.launcher import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", WAITER, str(rank)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in (0, 1)
    ]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert ranks[0].returncode == 144
    assert ranks[1].returncode == 1, outputs[1]
    assert "rank 1: preempted; rank 0 saved the run and requeued the job" in outputs[1][1]
    waited = float(re.search(r"waited ([\d.]+) s", outputs[1][0]).group(1))
    assert 0.3 < waited < 30


FINISHED_TASK = r"""
import sys, torch
from dtstudy.training.checkpoint import Preemption

preemption = Preemption(0, 1, None, torch.device("cpu"), every=1, lockstep=False).install(wait_on_store=False)
if sys.argv[1] == "over":
    preemption.ignore_late_signals()
print("ready", flush=True)
"""


@pytest.mark.parametrize("run_over, survives", [(False, False), (True, True)])
def test_a_signal_while_a_finished_task_exits_does_not_kill_it(run_over, survives):
    """SLURM's coarse signal timer can send SIGUSR2 while a finished task exits; Python's
    finalization restores the signal's default action (terminate), which failed the job.
    The task is sent the signal over and over until it is gone."""
    import subprocess
    import sys

    task = subprocess.Popen(
        [sys.executable, "-c", FINISHED_TASK, "over" if run_over else "running"], stdout=subprocess.PIPE, text=True
    )
    assert task.stdout.readline().strip() == "ready"
    while task.poll() is None:
        try:
            os.kill(task.pid, signal.SIGUSR2)
        except ProcessLookupError:
            break
        time.sleep(0.0005)
    assert (task.wait() == 0) is survives, task.returncode
