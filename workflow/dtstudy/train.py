"""The training loop of one worker, and the job that submitit runs in every task.

One readable loop in the spirit of torchvision's references/classification/train.py: every
knob comes from the run config, the strategy object does everything strategy-specific.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import submitit
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from . import data as data_module
from . import resume
from .config import ConfigError, global_batch_size, per_worker_batch
from .files import atomic_write, write_json
from .layout import TaskLayout
from .models import build_model
from .resume import Preemption
from .schedule import make_schedule
from .strategies import DistContext, Strategy, get_strategy
from .stragglers import Straggler, slow_ranks

METRICS_FILE = "metrics.json"
CHECKPOINT_FILE = "model.pt"


@dataclass
class RunSpec:
    """Everything one training run (strategy x N x seed) depends on."""

    strategy: str
    workers: int
    seed: int
    config: dict  # dtstudy.config.run_config(...) of the study
    data_dir: str
    out_dir: str
    tracking_uri: str | None = None  # resolved MLflow URI; None = no MLflow logging

    @property
    def run_name(self) -> str:
        return f"{self.strategy}-n{self.workers}-seed{self.seed}"

    def strategy_params(self) -> dict:
        cls = get_strategy(self.strategy)
        return cls.check_params(self.config["strategy_params"].get(self.strategy, {}), self.workers)

    def processes(self) -> int:
        return self.workers + get_strategy(self.strategy).extra_processes(self.strategy_params(), self.workers)

    def layout(self) -> TaskLayout:
        """How the N workers and the strategy's extra processes spread over the job's nodes
        (the launcher submits this layout; every task maps itself to its rank with it)."""
        launcher = self.config["launcher"]
        extras = self.processes() - self.workers
        if launcher["cluster"] == "local":
            return TaskLayout(self.workers, extras)
        per_node = launcher["gpus_per_node"] or launcher["workers_per_node"]
        try:
            return TaskLayout.over_nodes(self.workers, extras, per_node)
        except ValueError:
            raise ConfigError(
                f"config key 'workers': N={self.workers} does not spread evenly over "
                f"{math.ceil(self.workers / per_node)} nodes of "
                f"{per_node} workers (launcher.gpus_per_node / launcher.workers_per_node); "
                "use N <= that or a multiple of it"
            ) from None


@dataclass
class WorkerLog:
    """Per-step measurements of one worker (seconds, bytes, images)."""

    rank: int
    loss: list[float] = field(default_factory=list)
    data_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)  # forward + backward + update, exchange included
    comm_s: list[float] = field(default_factory=list)  # the exchange/wait part of step_s
    bytes_sent: list[float] = field(default_factory=list)
    images: list[int] = field(default_factory=list)
    injected_delay_s: float = 0.0  # straggler injection, inside step_s

    def steady(self, skip: int) -> dict:
        """Steady-state figures, leaving out the first `skip` steps."""
        sl = slice(skip, None)
        steps = len(self.step_s[sl])
        wall = sum(self.step_s[sl]) + sum(self.data_s[sl])
        mean = lambda values: sum(values[sl]) / steps  # noqa: E731
        comm = mean(self.comm_s)
        return {
            "throughput": sum(self.images[sl]) / wall,
            "total_s": mean(self.step_s),
            "compute_s": mean(self.step_s) - comm,
            "comm_s": comm,
            "data_s": mean(self.data_s),
            "bytes_per_step": mean(self.bytes_sent),
        }


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def make_optimizer_factory(train: dict):
    def make_optimizer(parameters):
        # lr is set by the schedule every step (strategy.update)
        return torch.optim.SGD(parameters, lr=0.0, momentum=train["momentum"], weight_decay=train["weight_decay"])

    return make_optimizer


def epoch_batches(dataset, batch_sampler: BatchSampler, loader_workers: int = 2, skip: int = 0):
    """(inputs, labels) batches: in-memory data sets are indexed directly (no per-image
    Python work), file-backed ones go through a DataLoader with worker processes. `skip`:
    leave out the epoch's first batches (a resumed run), without loading them."""
    if skip:
        batch_sampler = list(itertools.islice(batch_sampler, skip, None))
    if getattr(dataset, "is_in_memory", True):
        for indices in batch_sampler:
            yield dataset.batch(torch.as_tensor(indices))
    else:
        yield from DataLoader(dataset, batch_sampler=batch_sampler, num_workers=loader_workers)


@torch.no_grad()
def distributed_top1(model: nn.Module, dataset, ctx: DistContext, batch_size: int = 512) -> float:
    """Top-1 accuracy of `model` on `dataset`, each worker scoring a 1/N share."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    shard = list(range(ctx.rank, len(dataset), ctx.workers))
    for inputs, labels in data_module.iterate_batches(dataset, shard, batch_size, drop_last=False):
        predictions = model(inputs.to(ctx.device)).argmax(dim=1)
        counts[0] += (predictions == labels.to(ctx.device)).sum()
        counts[1] += len(labels)
    if ctx.workers > 1:
        dist.all_reduce(counts, group=ctx.worker_group)
    model.train()
    return (counts[0] / counts[1]).item()


class Progress:
    """Rank 0 prints an epoch/step line with the rate every `every` steps."""

    def __init__(self, ctx: DistContext, every: int, steps_per_epoch: int, epochs: int):
        self.enabled = ctx.rank == 0
        self.every, self.steps_per_epoch, self.epochs = every, steps_per_epoch, epochs
        self.window_start, self.window_images = time.perf_counter(), 0

    def step(self, epoch: int, step_in_epoch: int, images: int, loss: torch.Tensor, lr: float) -> None:
        self.window_images += images
        if not self.enabled or (step_in_epoch + 1) % self.every:
            return
        now = time.perf_counter()
        rate = self.window_images / (now - self.window_start)
        print(
            f"epoch {epoch + 1}/{self.epochs} step {step_in_epoch + 1}/{self.steps_per_epoch} "
            f"loss {loss.item():.4f} lr {lr:.4g} {rate:.0f} img/s (this worker)",
            flush=True,
        )
        self.window_start, self.window_images = now, 0

    def say(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)


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


def losses_so_far(state: LoopState, losses: list[torch.Tensor]) -> list[float]:
    """This worker's loss per step: earlier attempts' and this attempt's (still on the device)."""
    return state.saved_losses + (torch.stack(losses).float().cpu().tolist() if losses else [])


def resumable_state(state: LoopState, losses: list[torch.Tensor], model: nn.Module, strategy: Strategy,
                    straggler: Straggler, ctx: DistContext, elapsed_s: float) -> dict:
    """Everything a worker needs to continue exactly where it is (a step boundary)."""
    log = dataclasses.asdict(state.log)
    log["loss"] = losses_so_far(state, losses)
    return {
        "position": {"epoch": state.epoch, "step_in_epoch": state.step_in_epoch, "step": state.step},
        "elapsed_s": elapsed_s,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": strategy.optimizer.state_dict() if strategy.optimizer is not None else None,
        "strategy": strategy.state_dict(),
        "rng": rng_states(ctx.device),
        "log": log,
        "val_history": state.val_history,
        "straggler": {"rng": straggler.rng.getstate(), "total_s": straggler.total_s},
    }


def restore(saved: dict, model: nn.Module, strategy: Strategy, straggler: Straggler, ctx: DistContext) -> LoopState:
    model.load_state_dict(saved["model"])
    if saved["optimizer"] is not None:
        strategy.optimizer.load_state_dict(saved["optimizer"])
    strategy.load_state_dict(saved["strategy"])
    straggler.rng.setstate(_as_tuples(saved["straggler"]["rng"]))
    straggler.total_s = saved["straggler"]["total_s"]
    set_rng_states(saved["rng"], ctx.device)
    log = WorkerLog(**saved["log"])
    losses, log.loss = log.loss, []
    position = saved["position"]
    return LoopState(log=log, epoch=position["epoch"], step_in_epoch=position["step_in_epoch"],
                     step=position["step"], elapsed_s=saved["elapsed_s"], saved_losses=losses,
                     val_history=saved["val_history"])


def throwaway_step(module: nn.Module, strategy: Strategy, criterion, inputs, labels) -> None:
    """One forward/backward whose gradients are dropped, before a resumed run loads its state:
    the set-up a strategy does on its first step (DDP rebuilds its gradient buckets in the
    order gradients became ready) is then the interrupted run's, so the resumed steps reduce
    the same buckets in the same order (PowerSGD's memory is per bucket)."""
    strategy.backward(criterion(module(inputs), labels))
    for parameter in module.parameters():
        parameter.grad = None
    strategy.meter.take()


def train_worker(spec: RunSpec, ctx: DistContext, preemption: Preemption | None = None) -> dict | None:
    """Train on one worker; rank 0 returns the run's metrics (and writes its files).

    With a `preemption` installed, a preempted run saves its state at a step boundary and
    is requeued (resumable strategies), or is requeued to start again (the others); a run
    that finds its saved state continues from it (see dtstudy.resume).
    """
    cfg, train = spec.config, spec.config["train"]
    strategy: Strategy = get_strategy(spec.strategy)(ctx, spec.strategy_params())
    if preemption is None:  # nothing installed: never preempted
        preemption = Preemption(ctx.rank, spec.workers, ctx.worker_group, ctx.device,
                                train["preempt_check_every"], lockstep=strategy.resumable)
    if not ctx.is_worker:
        strategy.serve()
        return None

    seed_everything(spec.seed)
    train_set = data_module.load_split(spec.data_dir, "train")
    val_set = data_module.load_split(spec.data_dir, "val")
    meta = json.loads((Path(spec.data_dir) / "meta.json").read_text())
    model = build_model(cfg["model"], meta["channels"], meta["classes"], meta["height"], cfg["model_options"])
    module = strategy.setup(model, make_optimizer_factory(train))
    strategy.use_batch_norm_data(train_set, per_worker_batch(train, spec.workers))  # for averaged models' BN
    criterion = nn.CrossEntropyLoss()

    batch_size = per_worker_batch(train, spec.workers)
    sampler = DistributedSampler(train_set, num_replicas=spec.workers, rank=ctx.rank, shuffle=True, seed=spec.seed)
    batch_sampler = BatchSampler(sampler, batch_size, drop_last=True)
    steps_per_epoch = len(batch_sampler)
    # the rate of the batch one update really averages: the strategy's rule (Strategy.update_batch)
    schedule = make_schedule(train, strategy.update_batch(strategy.params, spec.workers, batch_size),
                             steps_per_epoch, strategy.update_batch_rule)
    total_steps = schedule.total_steps

    straggler = Straggler(cfg["stragglers"], spec.workers, ctx.rank)
    progress = Progress(ctx, train["log_every"], steps_per_epoch, train["epochs"])
    progress.say(
        f"{spec.run_name}: {len(train_set)} training images, batch {batch_size}/worker, "
        f"{steps_per_epoch} steps/epoch, peak lr {schedule.peak_lr:.4g}, device {ctx.device} ({ctx.backend})"
    )
    identity = resume.run_identity(spec)
    state = LoopState(log=WorkerLog(rank=ctx.rank))
    saved = None
    if strategy.resumable:
        saved = resume.load_agreed(spec.out_dir, identity, ctx.rank, spec.workers, ctx.worker_group, progress.say)
    if saved is not None:
        if saved["position"]["step"] > 0 and strategy.replays_first_step and spec.workers > 1:
            batches = epoch_batches(train_set, batch_sampler)
            inputs, labels = next(batches)
            batches.close()
            throwaway_step(module, strategy, criterion, inputs.to(ctx.device), labels.to(ctx.device))
        state = restore(saved, model, strategy, straggler, ctx)
        del saved
        progress.say(f"resumed from step {state.step} (epoch {state.epoch + 1}, batch {state.step_in_epoch} of it) "
                     f"with the state in {resume.resume_dir(spec.out_dir)}")
    log, val_history = state.log, state.val_history
    losses: list[torch.Tensor] = []
    step = state.step
    start = time.perf_counter() - state.elapsed_s
    for epoch in range(state.epoch, train["epochs"]):
        sampler.set_epoch(epoch)
        first = state.step_in_epoch if epoch == state.epoch else 0
        batches = epoch_batches(train_set, batch_sampler, skip=first)
        for step_in_epoch in range(first, steps_per_epoch):
            if step >= total_steps:
                break
            if preemption.requested(step):  # a step boundary, outside the timed step
                if not strategy.resumable:
                    requeue_from_scratch(spec, strategy, preemption, progress)
                state.epoch, state.step_in_epoch, state.step = epoch, step_in_epoch, step
                elapsed = time.perf_counter() - start
                save_and_requeue(spec, ctx, preemption, progress, identity,
                                 resumable_state(state, losses, model, strategy, straggler, ctx, elapsed))
            t_data = time.perf_counter()
            inputs, labels = next(batches)
            inputs, labels = inputs.to(ctx.device, non_blocking=True), labels.to(ctx.device, non_blocking=True)
            t_step = time.perf_counter()
            lr = schedule(step)
            straggler.delay()  # a slow worker's extra compute time
            loss = criterion(module(inputs), labels)
            strategy.backward(loss)
            strategy.update(lr)
            ctx.synchronize()
            t_end = time.perf_counter()
            comm_s, sent = strategy.meter.take()
            losses.append(loss.detach())
            log.data_s.append(t_step - t_data)
            log.step_s.append(t_end - t_step)
            log.comm_s.append(comm_s)
            log.bytes_sent.append(sent)
            log.images.append(len(labels))
            progress.step(epoch, step_in_epoch, len(labels), loss, lr)
            step += 1
        batches.close()
        top1 = distributed_top1(strategy.eval_model(), val_set, ctx)
        strategy.meter.take()  # evaluation's exchanges are not a training step's
        val_history.append({"epoch": epoch + 1, "step": step, "top1": top1, "wall_s": time.perf_counter() - start})
        progress.say(f"epoch {epoch + 1}/{train['epochs']} done: val top-1 {top1:.4f} at {val_history[-1]['wall_s']:.1f}s")
        if step >= total_steps:
            break
    preemption.drain()
    wall_time = time.perf_counter() - start
    final_model = strategy.eval_model()  # collective; before finish(), which may stop servers
    strategy.finish()
    log.loss = losses_so_far(state, losses)
    log.injected_delay_s = straggler.total_s

    logs: list[WorkerLog] = [None] * spec.workers  # type: ignore[list-item]
    if spec.workers > 1:
        dist.all_gather_object(logs, log, group=ctx.worker_group)
    else:
        logs = [log]
    if ctx.rank != 0:
        return None
    metrics = summarize(spec, ctx, logs, val_history, wall_time, schedule.describe(), strategy.summary())
    write_run(spec, metrics, final_model, meta)
    resume.clear(spec.out_dir)  # the run is complete: nothing to resume any more
    return metrics


def save_and_requeue(spec: RunSpec, ctx: DistContext, preemption: Preemption, progress: Progress,
                     identity: dict, saved: dict) -> None:
    """The workers agreed to stop here (a preemption): each saves its state, then rank 0
    requeues the job and the others wait until it is gone. Does not return."""
    preemption.stopping = True
    step = saved["position"]["step"]
    path = resume.save_rank(spec.out_dir, ctx.rank, identity, step, saved)
    if spec.workers > 1:
        dist.barrier(group=ctx.worker_group)  # every rank's file is written
    if ctx.rank == 0:
        progress.say(f"preempted at step {step} after {saved['elapsed_s']:.2f} s of training: "
                     f"state saved in {path.parent}; requeueing the job")
        preemption.requeue()
    preemption.wait_for_rank0()


def requeue_from_scratch(spec: RunSpec, strategy: Strategy, preemption: Preemption, progress: Progress) -> None:
    """Rank 0 of a preempted run whose strategy cannot resume: requeue the job without any
    state (the requeued run starts from step 0). Does not return."""
    progress.say(f"preempted: strategy {spec.strategy} cannot resume exactly ({strategy.not_resumable_because}); "
                 "the job is requeued and training starts again from step 0")
    strategy.abandon()
    preemption.requeue()


def summarize(spec, ctx, logs, val_history, wall_time, lr_schedule, strategy_summary) -> dict:
    """metrics.json's content (see README: 'What a training run records')."""
    from .provenance import environment

    train = spec.config["train"]
    steps = min(len(worker.step_s) for worker in logs)
    skip = min(train["steady_state_skip"], steps // 2)
    per_worker = [worker.steady(skip) for worker in logs]
    mean = lambda key: sum(w[key] for w in per_worker) / len(per_worker)  # noqa: E731
    losses_per_step = [sum(w.loss[i] for w in logs) / len(logs) for i in range(steps)]
    target = spec.config["target_accuracy"]
    reached = [v["wall_s"] for v in val_history if v["top1"] >= target]
    return {
        "strategy": spec.strategy,
        "workers": spec.workers,
        "seed": spec.seed,
        "run_name": spec.run_name,
        "throughput": sum(w["throughput"] for w in per_worker),
        "throughput_per_worker": [w["throughput"] for w in per_worker],
        "steady_state_skip": skip,
        "step_time": {key: mean(key) for key in ("total_s", "compute_s", "comm_s", "data_s")},
        "step_time_per_worker": per_worker,
        "bytes_per_step": mean("bytes_per_step"),
        "steps": steps,
        "images": sum(sum(w.images) for w in logs),
        "epochs_run": len(val_history),
        "global_batch": global_batch_size(train, spec.workers),
        "per_worker_batch": per_worker_batch(train, spec.workers),
        "lr_schedule": {"rule": train["lr_scaling"], "base_lr": train["base_lr"],
                        "reference_batch": train["lr_reference_batch"], **lr_schedule},
        "train_loss": losses_per_step,
        "val": val_history,
        "final_val_top1": val_history[-1]["top1"] if val_history else None,
        "target_accuracy": target,
        "time_to_accuracy_s": reached[0] if reached else None,
        "wall_time_s": wall_time,
        "strategy_params": spec.strategy_params(),
        "stragglers": {
            "ranks": slow_ranks(spec.config["stragglers"], spec.workers),
            "injected_delay_s": [worker.injected_delay_s for worker in logs],
        },
        "strategy_metrics": strategy_summary,
        "config": spec.config,
        "environment": environment(ctx.device, ctx.backend, ctx.world_size),
    }


def write_run(spec: RunSpec, metrics: dict, eval_model: nn.Module, meta: dict) -> None:
    """The final checkpoint, the MLflow child run, then metrics.json last (the rule's output)."""
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = {
        "model": spec.config["model"],
        "model_options": spec.config["model_options"],
        "in_channels": meta["channels"],
        "num_classes": meta["classes"],
        "image_size": meta["height"],
        "state_dict": {k: v.detach().cpu() for k, v in eval_model.state_dict().items()},
        "run_name": spec.run_name,
    }
    atomic_write(out / CHECKPOINT_FILE, lambda stream: torch.save(checkpoint, stream))
    if spec.tracking_uri is not None:
        from .tracking import log_training_run

        metrics["mlflow"] = log_training_run(spec.tracking_uri, spec.config["tracking"]["experiment"], metrics)
    write_json(out / METRICS_FILE, metrics)


class TrainingJob(submitit.helpers.Checkpointable):
    """The callable that submitit runs in each task (worker or extra process) of a run.

    Checkpointable: on SIGUSR2 (time-out or preemption) the run saves its state at a step
    boundary and rank 0 requeues the job through submitit, which pickles `checkpoint()`;
    the requeued job resumes from the saved state (dtstudy.resume).
    """

    def __init__(self, spec: RunSpec):
        self.spec = spec

    def __call__(self) -> dict | None:
        launcher = self.spec.config["launcher"]
        from .distributed import init_from_submitit

        ctx = init_from_submitit(self.spec.layout(), launcher["device"], launcher["timeout_min"])
        if ctx is None:  # an idle slot of the job's task layout
            return None
        preemption = Preemption(ctx.rank, self.spec.workers, ctx.worker_group, ctx.device,
                                self.spec.config["train"]["preempt_check_every"],
                                lockstep=get_strategy(self.spec.strategy).resumable).install()
        try:
            metrics = train_worker(self.spec, ctx, preemption)
            preemption.ignore_late_signals()
            return metrics
        except Exception as error:
            if preemption.ends_quietly():  # rank 0 requeues the job (its exchanges fail once it is gone)
                raise SystemExit(f"rank {ctx.rank}: preempted; stopped "
                                 f"({type(error).__name__}: {str(error).splitlines()[0][:200]})") from error
            raise
        finally:
            dist.destroy_process_group()

    def checkpoint(self) -> submitit.helpers.DelayedSubmission:
        """What submitit pickles for the requeued job: the job itself. The training state is
        in the run's resume folder, written by every worker before rank 0 requeues."""
        return submitit.helpers.DelayedSubmission(TrainingJob(self.spec))
