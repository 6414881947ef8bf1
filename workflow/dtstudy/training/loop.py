"""The training loop of one worker, in the spirit of torchvision's
references/classification/train.py: set up, then one epoch function and one validation
function per epoch; every knob comes from the run config and the strategy object does
everything strategy-specific (the loop never branches on its name).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import BatchSampler, DistributedSampler

from dtstudy.common.timing import StepTimer, clock_for
from dtstudy.config.study_config import per_worker_batch
from dtstudy.data.augment import BATCH_NORM, Draws
from dtstudy.data.checks import check_loader
from dtstudy.data.loading import EVAL_BATCH, iterate_batches, load_split
from dtstudy.runspec import RunSpec
from dtstudy.strategies.base import DistContext, Strategy
from dtstudy.strategies.registry import get_strategy
from dtstudy.tracking.live_run import LiveRun, start_live_run
from dtstudy.tracking.provenance import environment
from dtstudy.tracking.run_outputs import write_checkpoint, write_metrics
from dtstudy.training import checkpoint
from dtstudy.training.checkpoint import LoopState, Preemption
from dtstudy.training.compute import Compute
from dtstudy.training.lr_schedule import LRSchedule, make_schedule
from dtstudy.training.measurements import WorkerLog, summarize
from dtstudy.training.models import build_model, inference_layout
from dtstudy.training.stragglers import Straggler


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def choose_kernels(deterministic: bool, device: torch.device) -> None:
    """train.deterministic on a GPU: deterministic kernels (the same seed gives the same
    numbers on the same GPU), or cuDNN's autotuned fastest ones. Before the first kernel runs:
    cuBLAS reads its workspace setting when it starts. The CPU's kernels are deterministic
    already and are left alone. metrics.json's `environment.kernels` records what was set."""
    if device.type != "cuda":
        return
    if deterministic:
        # cuBLAS is deterministic with a fixed workspace only (torch's reproducibility notes)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic
    # warn_only: an op without a deterministic kernel (e.g. adaptive average pooling's
    # backward on CUDA) warns instead of stopping the run
    torch.use_deterministic_algorithms(deterministic, warn_only=True)


def make_optimizer_factory(train: dict):
    def make_optimizer(parameters):
        # lr is set by the schedule every step (strategy.update). fused: one kernel for the
        # whole update instead of ~5 ops per tensor (on one core the per-tensor ops are a large
        # share of LeNet-5's loop: benchmarks/optimizer_step.py measures it); the same formula.
        return torch.optim.SGD(
            parameters,
            lr=0.0,
            momentum=train["momentum"],
            weight_decay=train["weight_decay"],
            nesterov=train["nesterov"],
            fused=True,
        )

    return make_optimizer


def make_criterion(train: dict) -> nn.Module:
    return nn.CrossEntropyLoss(label_smoothing=train["label_smoothing"])


def epoch_batches(dataset, batch_sampler: BatchSampler, skip: int = 0, draws: Draws | None = None):
    """(inputs, labels) batches: in-memory data sets are indexed directly (no per-image
    Python work; on the CPU, as before any pipeline existed), file-backed ones come from their
    split's persistent DataLoader (`loader` config: worker processes, pinned memory), already
    on the run's device and normalised there, augmented with `draws` (the run's seed and the
    epoch: data.augment.Draws). `skip`: leave out the epoch's first batches (a resumed run),
    without loading them."""
    if skip:
        batch_sampler = list(itertools.islice(batch_sampler, skip, None))
    if getattr(dataset, "is_in_memory", True):
        for indices in batch_sampler:
            yield dataset.batch(torch.as_tensor(indices))
    else:
        yield from dataset.batches(batch_sampler, draws)


@torch.no_grad()
def distributed_top1(
    model: nn.Module, dataset, ctx: DistContext, batch_size: int = EVAL_BATCH, images: int | None = None
) -> float:
    """Top-1 accuracy of `model` on `dataset` (its first `images` images; None = all), each
    worker scoring a 1/N share."""
    counts = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    shard = list(range(ctx.rank, len(dataset) if images is None else images, ctx.workers))
    if getattr(dataset, "is_in_memory", True):
        batches = iterate_batches(dataset, shard, batch_size, drop_last=False)
    else:  # decoded by the split's loader workers, on the device
        batches = dataset.batches(shard[start : start + batch_size] for start in range(0, len(shard), batch_size))
    with inference_layout(model) as model:
        for inputs, labels in batches:
            predictions = model(inputs.to(ctx.device)).argmax(dim=1)
            counts[0] += (predictions == labels.to(ctx.device)).sum()
            counts[1] += len(labels)
    if ctx.workers > 1:
        dist.all_reduce(counts, group=ctx.worker_group)
    return (counts[0] / counts[1]).item()


class Progress:
    """Rank 0 prints an epoch/step line with the rate every `every` steps."""

    def __init__(self, ctx: DistContext, every: int, steps_per_epoch: int, epochs: int):
        self.enabled = ctx.rank == 0
        self.every, self.steps_per_epoch, self.epochs = every, steps_per_epoch, epochs
        self.window_start, self.window_images = time.perf_counter(), 0

    def step(self, epoch: int, step_in_epoch: int, images: int, loss: torch.Tensor, lr: float) -> bool:
        """Count the step's images; True when this step printed a line (rank 0)."""
        self.window_images += images
        if not self.enabled or (step_in_epoch + 1) % self.every:
            return False
        now = time.perf_counter()
        rate = self.window_images / (now - self.window_start)
        print(
            f"epoch {epoch + 1}/{self.epochs} step {step_in_epoch + 1}/{self.steps_per_epoch} "
            f"loss {loss.item():.4f} lr {lr:.4g} {rate:.0f} img/s (this worker)",
            flush=True,
        )
        self.window_start, self.window_images = now, 0
        return True

    def say(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)


@dataclass
class WorkerRun:
    """What one worker trains with: built once by `set_up`, read by the epoch function."""

    spec: RunSpec
    ctx: DistContext
    strategy: Strategy
    model: nn.Module
    module: nn.Module  # what the forward pass runs on (the strategy may wrap the model)
    criterion: nn.Module
    train_set: object
    val_set: object
    meta: dict
    sampler: DistributedSampler
    batch_sampler: BatchSampler
    schedule: LRSchedule
    straggler: Straggler
    progress: Progress
    preemption: Preemption
    tracker: LiveRun
    resume: checkpoint.ResumeFiles  # where this worker saves its state and finds an interrupted attempt's
    grid_images: int = 0  # the grid evaluates the first this many validation images (a fixed subset)
    grid_every: int | None = None  # steps between grid evaluations; None = epoch ends only
    compute: Compute | None = None  # precision and layout of the steps
    timer: StepTimer | None = None  # the steps' seconds on the device's clock

    @property
    def steps_per_epoch(self) -> int:
        return len(self.batch_sampler)


def set_up(
    spec: RunSpec,
    ctx: DistContext,
    strategy: Strategy,
    preemption: Preemption,
    tracker: LiveRun,
    resume: checkpoint.ResumeFiles,
) -> WorkerRun:
    cfg, train = spec.config, spec.config["train"]
    seed_everything(spec.seed)
    choose_kernels(train["deterministic"], ctx.device)
    check_loader(cfg["loader"], ctx.device.type)
    train_set = load_split(spec.data_dir, "train", cfg["loader"], ctx.device)
    val_set = load_split(spec.data_dir, "val", cfg["loader"], ctx.device)
    meta = json.loads((Path(spec.data_dir) / "meta.json").read_text())
    model = build_model(cfg["model"], meta["channels"], meta["classes"], meta["height"], cfg["model_options"])
    compute = Compute.from_config(train, ctx.device)
    module = strategy.setup(compute.place(model), make_optimizer_factory(train))
    if compute.grad_scaler is not None and strategy.spec.no_fp16_because:  # the config check refuses it first
        raise ValueError(
            f"train.precision: 'fp16' is not allowed with strategy {strategy.name!r}: "
            f"{strategy.spec.no_fp16_because}; allowed: fp32, bf16"
        )
    strategy.grad_scaler = compute.grad_scaler
    batch_size = per_worker_batch(train, spec.workers)
    # for averaged models' BatchNorm statistics: training's augmentation, the same draws on every rank
    strategy.use_batch_norm_data(train_set, batch_size, Draws(spec.seed, purpose=BATCH_NORM))
    sampler = DistributedSampler(train_set, num_replicas=spec.workers, rank=ctx.rank, shuffle=True, seed=spec.seed)
    batch_sampler = BatchSampler(sampler, batch_size, drop_last=True)
    # the rate of the batch one update really averages: the strategy's rule (Strategy.update_batch)
    schedule = make_schedule(
        train,
        strategy.update_batch(strategy.params, spec.workers, batch_size),
        len(batch_sampler),
        strategy.update_batch_rule,
        strategy.step_limit(strategy.params),
    )
    progress = Progress(ctx, train["log_every"], len(batch_sampler), train["epochs"])
    if not train_set.is_in_memory:  # the loader config's resolved values (workers: null = CPUs - 1)
        progress.say(f"input pipeline: train {train_set.describe()}, val {val_set.describe()}")
    grid_every = train.get("eval_every_steps")  # a grid in steps, whatever N; else a share of the epoch
    if grid_every is None and train["evals_per_epoch"] > 1:
        grid_every = max(1, len(batch_sampler) // train["evals_per_epoch"])
    grid_images = len(val_set) if train["eval_images"] is None else min(train["eval_images"], len(val_set))
    return WorkerRun(
        spec,
        ctx,
        strategy,
        model,
        module,
        make_criterion(train),
        train_set,
        val_set,
        meta,
        sampler,
        batch_sampler,
        schedule,
        Straggler(cfg["stragglers"], spec.workers, ctx.rank, spec.seed),
        progress,
        preemption,
        tracker,
        resume,
        grid_images,
        grid_every,
        compute,
        StepTimer(clock_for(ctx.device)),
    )


def resume_or_start(run: WorkerRun) -> LoopState:
    """The saved state of an interrupted attempt of this run when every worker has one, else a fresh start."""
    spec, ctx, strategy = run.spec, run.ctx, run.strategy
    fresh = LoopState(log=WorkerLog(rank=ctx.rank))
    if not strategy.resumable:
        return fresh
    processes, group = strategy.resume_ranks()  # the workers, and extra processes that save state
    saved = run.resume.load_agreed(ctx.rank, processes, group, run.progress.say)
    if saved is None:
        return fresh
    if saved["position"]["step"] > 0 and strategy.replays_first_step and spec.workers > 1:
        batches = epoch_batches(run.train_set, run.batch_sampler, draws=Draws(spec.seed, 0))
        inputs, labels = next(batches)
        batches.close()
        throwaway_step(run, inputs.to(ctx.device), labels.to(ctx.device))
    state = checkpoint.restore(saved, run.model, strategy, run.straggler, ctx.device)
    if run.compute.grad_scaler is not None:  # fp16: the loss scale goes on where it was
        run.compute.grad_scaler.load_state_dict(saved["grad_scaler"])
    run.progress.say(
        f"resumed from step {state.step} (epoch {state.epoch + 1}, batch {state.step_in_epoch} of it) "
        f"with the state in {run.resume.folder.resume}"
    )
    return state


def throwaway_step(run: WorkerRun, inputs, labels) -> None:
    """One forward/backward whose gradients are dropped, before a resumed run loads its state:
    the set-up a strategy does on its first step (DDP rebuilds its gradient buckets in the
    order gradients became ready) is then the interrupted run's, so the resumed steps reduce
    the same buckets in the same order (PowerSGD's memory is per bucket)."""
    with run.compute.autocast():
        loss = run.criterion(run.module(inputs), labels)
    run.strategy.backward(run.compute.scaled(loss))
    for parameter in run.module.parameters():
        parameter.grad = None
    run.strategy.meter.take()


def train_one_epoch(run: WorkerRun, state: LoopState, epoch: int, start: float) -> None:
    """The epoch's steps from where `state` stands; `state` advances step by step."""
    log = state.log
    run.sampler.set_epoch(epoch)
    first = state.step_in_epoch if epoch == state.epoch else 0
    batches = epoch_batches(run.train_set, run.batch_sampler, skip=first, draws=Draws(run.spec.seed, epoch))
    for step_in_epoch in range(first, run.steps_per_epoch):
        if state.step >= run.schedule.total_steps:
            break
        action = run.preemption.poll(state.step)  # a step boundary, outside the timed step
        if action is not None:
            state.epoch, state.step_in_epoch = epoch, step_in_epoch
            if action == checkpoint.STOP:
                stop_for_preemption(run, state, time.perf_counter() - start)
            save_checkpoint(run, state, time.perf_counter() - start)
        lr = run.schedule(state.step)
        loss, images = timed_step(run, batches, lr, log.record)
        state.losses.append(loss.detach())
        if run.progress.step(epoch, step_in_epoch, images, loss, lr):
            run.tracker.log_metric("train_loss", loss.item(), state.step)  # rank 0, as printed
        state.step += 1
        if grid_point_due(run, step_in_epoch):  # outside the timed step
            evaluate_point(run, state, epoch, start, "grid")
    batches.close()
    run.timer.flush()


def timed_step(run: WorkerRun, batches, lr: float, record) -> tuple[torch.Tensor, int]:
    """One training step, timed on the device's clock (run.timer; no host sync: a GPU's marks
    are read a step later): the wait for the batch and its copy to the device, then forward
    (autocast), backward (of the loss the GradScaler scaled, under fp16) and update, the
    strategy's exchange inside them. `record` gets the step's seconds; returns (loss, images)."""
    run.timer.data_start()
    inputs, labels = next(batches)
    inputs, labels = run.compute.inputs(inputs, run.ctx.device), labels.to(run.ctx.device, non_blocking=True)
    run.timer.step_start()
    run.straggler.delay(run.timer.clock)  # a slow worker's extra compute time
    with run.compute.autocast():
        loss = run.criterion(run.module(inputs), labels)
    run.strategy.backward(run.compute.scaled(loss))
    run.strategy.update(lr)
    run.timer.step_end(run.strategy.meter, len(labels), record)
    return loss, len(labels)


def training_seconds(log: WorkerLog) -> float:
    """This worker's training time so far: its steps and their data loading, without the
    evaluation passes (what time-to-accuracy is measured in)."""
    return sum(log.step_s) + sum(log.data_s)


VALIDATION_METRIC = {"epoch": "val_top1", "grid": "val_top1_grid"}  # MLflow's name of each kind


def evaluate_point(run: WorkerRun, state: LoopState, epoch: int, start: float, kind: str) -> dict:
    """One validation entry, in the history and in MLflow: "epoch" (the whole validation
    split, at an epoch's end) or "grid" (its first train.eval_images images,
    train.evals_per_epoch times an epoch)."""
    run.timer.flush()  # the steps so far, in the training time below
    images = len(run.val_set) if kind == "epoch" else run.grid_images
    top1 = distributed_top1(run.strategy.eval_model(), run.val_set, run.ctx, images=images)
    run.strategy.meter.take()  # evaluation's exchanges are not a training step's
    entry = {
        "kind": kind,
        "epoch": epoch + 1,
        "step": state.step,
        "top1": top1,
        "images": images,
        "train_s": training_seconds(state.log),
        "wall_s": time.perf_counter() - start,
    }
    state.val_history.append(entry)
    run.tracker.log_metric(VALIDATION_METRIC[kind], top1, state.step)
    return entry


def grid_point_due(run: WorkerRun, step_in_epoch: int) -> bool:
    """Whether a grid evaluation follows batch `step_in_epoch`: after every `grid_every`
    batches (train.eval_every_steps; else evals_per_epoch - 1 times an epoch); the epoch's
    end is its last point (1687 steps in 10: points at 168, ..., 1512 and 1687, not also at 1680)."""
    every = run.grid_every
    done = step_in_epoch + 1
    train = run.spec.config["train"]
    return (
        every is not None
        and done % every == 0
        and (train.get("eval_every_steps") is not None or done // every < train["evals_per_epoch"])
        and done < run.steps_per_epoch
    )


def validate(run: WorkerRun, state: LoopState, epoch: int, start: float, last: bool) -> None:
    """The epoch's end: the grid's point (when there is a grid) and the whole split. With a
    grid, the whole split is scored at the end of training only (`last`): the grid already
    has each epoch's end, and 3 whole-split passes cost a 4-epoch run of LeNet-5 about 2%."""
    scored = state.val_history[-1] if state.val_history else None
    # a run that max_steps stops on a grid step has that point already (train_one_epoch's)
    if run.grid_every is not None and not (scored and scored["kind"] == "grid" and scored["step"] == state.step):
        scored = evaluate_point(run, state, epoch, start, "grid")
    entry = scored
    if run.grid_every is None or last:
        entry = evaluate_point(run, state, epoch, start, "epoch")
    on = "" if entry["kind"] == "epoch" else f" (first {entry['images']} images)"
    run.progress.say(
        f"epoch {epoch + 1}/{run.spec.config['train']['epochs']} done: "
        f"val top-1 {entry['top1']:.4f}{on} at {entry['wall_s']:.1f}s"
    )


def save_checkpoint(run: WorkerRun, state: LoopState, elapsed_s: float) -> None:
    """A periodic checkpoint (train.checkpoint_every_min): every worker saves what a preemption
    saves, and training goes on; a rerun of a run that died resumes from it. The barrier:
    no worker goes on (and may save the next one) before every worker has saved this one."""
    path = save_state(run, state, elapsed_s)
    run.progress.say(f"checkpoint at step {state.step}: state saved in {path.parent}")


def save_state(run: WorkerRun, state: LoopState, elapsed_s: float) -> Path:
    """Every worker saves what a resumed run needs (dtstudy.training.checkpoint), then waits until every
    worker's file is written; returns this worker's file."""
    spec, ctx = run.spec, run.ctx
    run.timer.flush()  # every step so far in the saved log
    saved = checkpoint.resumable_state(state, run.model, run.strategy, run.straggler, ctx.device, elapsed_s)
    if run.compute.grad_scaler is not None:
        saved["grad_scaler"] = run.compute.grad_scaler.state_dict()  # numbers only
    path = run.resume.save(ctx.rank, state.step, saved)
    run.strategy.save_extra_processes(state.step, run.preemption.stopping)
    if spec.workers > 1:
        dist.barrier(group=ctx.worker_group)
    return path


def stop_for_preemption(run: WorkerRun, state: LoopState, elapsed_s: float) -> None:
    """The workers agreed to stop here (a preemption). A resumable run: each worker saves its
    state, then rank 0 requeues the job and the others wait until it is gone. Otherwise the run
    fails, saying why: it is never requeued to start again from step 0. Does not return."""
    spec, ctx, strategy, preemption = run.spec, run.ctx, run.strategy, run.preemption
    if not strategy.resumable:
        strategy.abandon()
        raise checkpoint.PreemptedWithoutResume(
            f"{spec.run_name}: preempted at step {state.step} (signal {preemption.signum.name}), and strategy "
            f"{spec.strategy!r} cannot resume: {strategy.not_resumable_because}. The run is not started again "
            "from step 0; give its job the time it needs (launcher.timeout_min, the SLURM time limit) or run "
            "it where it is not preempted"
        )
    preemption.stopping = True
    path = save_state(run, state, elapsed_s)
    if ctx.rank == 0:
        run.progress.say(
            f"preempted at step {state.step} after {elapsed_s:.2f} s of training: "
            f"state saved in {path.parent}; requeueing the job"
        )
        preemption.requeue()
    preemption.wait_for_rank0()


def train_worker(
    spec: RunSpec, ctx: DistContext, preemption: Preemption | None = None, timings: dict | None = None
) -> dict | None:
    """Train on one worker; rank 0 returns the run's metrics (and writes its files).

    With a `preemption` installed, a preempted run saves its state at a step boundary and
    is requeued (resumable strategies), or fails saying why (the others); a run that finds
    its saved state continues from it (see dtstudy.training.checkpoint). `timings`: wall-clock
    stamps of the run so far (the launcher's submission, this process's start), for metrics.json.
    """
    timings = dict(timings or {})
    strategy: Strategy = get_strategy(spec.strategy)(ctx, spec.strategy_params())
    if preemption is None:  # nothing installed: never preempted
        preemption = Preemption(
            ctx.rank,
            spec.workers,
            ctx.worker_group,
            ctx.device,
            spec.config["train"]["preempt_check_every"],
            lockstep=strategy.resumable,
        )
    resume = checkpoint.ResumeFiles.of(spec, stopping=lambda: setattr(preemption, "stopping", True))
    if not ctx.is_worker:  # an extra process: it saves and resumes its own state in the run's files
        strategy.serve(resume)
        return None
    preemption.agree_through(strategy.boundary_agreement())
    tracker = start_live_run(spec) if ctx.rank == 0 else LiveRun.disabled()
    try:
        return _train(spec, ctx, strategy, preemption, tracker, resume, timings)
    except BaseException as error:
        if not preemption.stopping:
            tracker.close("FAILED", f"{type(error).__name__}: {error}")
        raise


def _train(spec, ctx, strategy, preemption, tracker, resume, timings) -> dict | None:
    run = set_up(spec, ctx, strategy, preemption, tracker, resume)
    train = spec.config["train"]
    run.progress.say(
        f"{spec.run_name}: {len(run.train_set)} training images, batch {run.batch_sampler.batch_size}/worker, "
        f"{run.steps_per_epoch} steps/epoch, peak lr {run.schedule.peak_lr:.4g}, device {ctx.device} ({ctx.backend})"
    )
    state = resume_or_start(run)
    timings["training_start"] = time.time()
    start = time.perf_counter() - state.elapsed_s
    for epoch in range(state.epoch, train["epochs"]):
        train_one_epoch(run, state, epoch, start)
        last = epoch == train["epochs"] - 1 or state.step >= run.schedule.total_steps
        validate(run, state, epoch, start, last)
        if last:
            break
    preemption.drain()
    wall_time = time.perf_counter() - start
    timings["training_end"] = time.time()
    final_model = strategy.eval_model()  # collective; before finish(), which may stop servers
    strategy.finish()
    state.log.loss = state.losses_so_far()
    state.log.injected_delay_s = run.straggler.total_s
    state.log.host = socket.gethostname()  # this attempt's: a resumed run may have moved

    logs: list[WorkerLog] = [state.log]
    if spec.workers > 1:  # to rank 0 only: N logs unpickled once, not N times each (N^2 when emulated)
        logs = [None] * spec.workers if ctx.rank == 0 else None  # type: ignore[list-item]
        dist.gather_object(state.log, logs, dst=0, group=ctx.worker_group)
    if ctx.rank != 0:
        return None
    timings["gathered"] = time.time()
    write_checkpoint(spec, final_model, run.meta)
    timings["checkpoint_written"] = time.time()
    metrics = summarize(
        spec,
        logs,
        state.val_history,
        wall_time,
        run.schedule.describe(),
        strategy.summary(),
        environment(ctx.device, ctx.backend, ctx.world_size, ctx.concurrent_ranks),
        timings,
        compute=run.compute.describe(run.timer.clock.kind),
    )
    timings["summarized"] = time.time()
    metrics["mlflow"] = tracker.finish(metrics)  # final metrics logged; the run stays RUNNING
    timings["mlflow_logged"] = time.time()
    write_metrics(spec, metrics)
    tracker.close("FINISHED")  # only once metrics.json, the rule's output, is on disk
    resume.clear()  # the run is complete: nothing to resume any more
    return metrics
