"""The interface every distributed training strategy implements.

The training loop (dtstudy.training.loop) runs, on each of the N workers:

    module = strategy.setup(model, make_optimizer)      # once
    every step:  loss = criterion(module(x), y)          # under autocast (train.precision)
                 strategy.backward(loss)                 # gradients (+ overlapped exchange); fp16: the scaled loss
                 strategy.update(lr)                     # apply the update (+ exchange), via step_optimizer
                 strategy.meter.take_pending()           # comm/wait spans (device clock) and bytes of the step
    every epoch: strategy.eval_model()                   # the parameters to evaluate
    at the end:  strategy.eval_model()                   # the parameters to checkpoint
                 strategy.finish(); strategy.summary()

and `strategy.serve()` on the extra processes a strategy asks for with `extra_processes`
(parameter-server shards), which are ranks N..N+extra-1 of the same job. The loop never
branches on the strategy's name.

Preemption and checkpoints (dtstudy.training.checkpoint): a `resumable` strategy's workers
agree on a step boundary (an all-reduce over the worker group, or the strategy's own
`boundary_agreement`), save the model, the optimizer and `state_dict()` there (and its extra
processes their own state: `save_extra_processes`), and a requeued or restarted run continues
after `load_state_dict`. A run of any other strategy is never started again from step 0: on
preemption rank 0 calls `abandon()` and the run fails, saying why it cannot resume.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from dtstudy.common.timing import Clock, HostClock, Mark, PendingExchange, clock_for
from dtstudy.strategies.spec import StrategySpec

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
#: what the workers agree on at a step boundary (boundary_agreement; dtstudy.training.checkpoint)
STOP, CHECKPOINT = "stop", "checkpoint"


@dataclass
class DistContext:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    workers: int  # N, the data-parallel workers; ranks >= workers are a strategy's extra processes
    local_rank: int
    device: torch.device
    backend: str
    worker_group: Any = None  # process group of the N workers (None = the default group)
    comm_timeout_s: float = 1800.0  # the longest a wait on a peer may take (launcher.comm_timeout_s)
    startup_timeout_s: float = 1800.0  # waits that may legitimately be long (start-up, evaluation)
    gloo_loop_nice: int | str = 0  # gloo's event loops of groups made later run at it (launcher.gloo_loop_nice)
    #: the job's ranks that compute at the same time on this machine (None: all, each its own
    #: process); an emulated run's are threads taking turns: 1
    concurrent_ranks: int | None = None

    @property
    def is_worker(self) -> bool:
        return self.rank < self.workers


@dataclass
class CommMeter:
    """Communication/wait seconds and bytes sent by this worker since the last `take`.

    Seconds are spans between two marks of the device's clock (dtstudy.common.timing):
    a span that starts with a mark taken when the exchange is called starts when the device
    has done the work queued before it, not when the host got there. `seconds` holds any
    measured otherwise (added as they are)."""

    seconds: float = 0.0
    bytes_sent: float = 0.0
    _clock: Clock | Callable[[], float] = field(default=time.perf_counter, repr=False)
    spans: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        if not isinstance(self._clock, Clock):  # a bare host clock (a function of no arguments)
            self._clock = HostClock(self._clock)

    @property
    def clock(self) -> Clock:
        return self._clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        self._clock = clock

    def add_span(self, start: Mark, end: Mark) -> None:
        """Count the device's time between two marks of `clock` as exchange/wait."""
        self.spans.append((start, end))

    def take_pending(self) -> PendingExchange:
        """What was measured since the last take, its spans still unread (the training loop
        reads them a step later, so that the host need not wait for the device)."""
        taken = PendingExchange(self._clock, self.spans, self.seconds, self.bytes_sent)
        self.spans, self.seconds, self.bytes_sent = [], 0.0, 0.0
        return taken

    def take(self) -> tuple[float, float]:
        """(seconds, bytes) since the last take, read now (on a GPU: waits for the device)."""
        taken = self.take_pending()
        return taken.comm_seconds(), taken.bytes_sent

    def timed(self):
        """Context manager counting the device's time of its block as exchange/wait: from the
        work queued before it to the work queued in it."""
        meter = self

        class _Timer:
            def __enter__(self):
                self.start = meter._clock.mark()

            def __exit__(self, *exc):
                meter.add_span(self.start, meter._clock.mark())

        return _Timer()


class Strategy(ABC):
    """One distributed training strategy (see the module docstring for the call order)."""

    #: its spec (its family's `spec` module, torch-free): its name, its knobs and their checks,
    #: the processes it needs, its performance model
    spec: ClassVar[type[StrategySpec]]
    #: its name in the registry, its spec's (a subclass that gives no spec keeps its parent's)
    name: ClassVar[str]
    #: a preempted run can save its state at a step boundary and continue from it: the workers
    #: agree on the boundary (`boundary_agreement`) and every process that holds state saves
    #: it there (model, optimizer, `state_dict()`; extra processes: `save_extra_processes`).
    #: False: a preempted run fails (it is never started again from step 0)
    resumable: ClassVar[bool] = False
    #: why not (in the error of a preempted run)
    not_resumable_because: ClassVar[str] = "it declares no resumable state"
    #: a resumed run first does one throwaway forward/backward (see dtstudy.training.loop.throwaway_step)
    replays_first_step: ClassVar[bool] = False
    #: the learning-rate rule: how many images one update averages (see `update_batch`)
    update_batch_rule: ClassVar[str] = "N*b: one update averages the gradients of the N workers' batches"
    #: the evaluated model is an average of the workers' models (or a centre variable): its
    #: BatchNorm statistics are recomputed on training batches (`recompute_batch_norm`)
    averages_models: ClassVar[bool] = False
    #: batches of the training set (the same ones on every worker) that recompute them
    batch_norm_batches: ClassVar[int] = 16

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "spec" in cls.__dict__:  # the name is typed once, in the spec
            cls.name = cls.spec.name

    def __init__(self, ctx: DistContext, params: dict[str, Any]):
        self.ctx = ctx
        self.params = params
        self.meter = CommMeter(_clock=clock_for(ctx.device))
        self.optimizer: torch.optim.Optimizer | None = None
        #: train.precision fp16: the loop's torch.amp.GradScaler (the loop scales the loss;
        #: `step_optimizer` unscales, skips a step with inf/NaN gradients, updates the scale).
        #: A strategy whose update does not go through `step_optimizer` says why in its spec
        #: (StrategySpec.no_fp16_because) and the config check refuses fp16 for it
        self.grad_scaler = None

    # ----- its knobs: its spec's (torch-free, checked before any job starts) ----------------
    @classmethod
    def check_params(cls, params: dict[str, Any], workers: int) -> dict[str, Any]:
        """The knobs with defaults filled in, checked for N=workers (see StrategySpec)."""
        return cls.spec.check_params(params, workers)

    @classmethod
    def update_batch(cls, params: dict[str, Any], workers: int, per_worker_batch: int) -> int:
        """The images one update of the parameters averages: the learning rate is that
        batch's (train.lr_scaling applied to it). Synchronous strategies: N*b."""
        return workers * per_worker_batch

    @classmethod
    def extra_processes(cls, params: dict[str, Any], workers: int) -> int:
        return cls.spec.extra_processes(params, workers)

    @classmethod
    def step_limit(cls, params: dict[str, Any]) -> int | None:
        """The steps its runs stop after, besides train.max_steps (None: no limit of its own)."""
        return cls.spec.step_limit(params)

    # ----- the training loop's calls ----------------------------------------------------
    @abstractmethod
    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        """Place the model, build what the strategy needs; return the module to run forward on."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def update(self, lr: float) -> None:
        """Apply this step's update with learning rate `lr` (default: the local optimizer)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.step_optimizer()
        self.optimizer.zero_grad(set_to_none=True)

    def step_optimizer(self) -> None:
        """The local optimizer's step, through the GradScaler when there is one (fp16)."""
        if self.grad_scaler is None:
            self.optimizer.step()
        else:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()

    @abstractmethod
    def eval_model(self) -> nn.Module:
        """The model whose parameters are evaluated and checkpointed (a collective call)."""

    def use_batch_norm_data(self, dataset, batch_size: int, draws=None) -> None:
        """The training set, given by the loop after `setup`: a strategy that `averages_models`
        recomputes the averaged model's BatchNorm statistics on its first batches, augmented
        as training augments them with `draws` (data.augment.Draws of the run's seed)."""
        self.batch_norm_data = (dataset, batch_size, draws)

    def recompute_batch_norm(self, model: nn.Module) -> None:
        """Running BatchNorm statistics of `model` recomputed (torch.optim.swa_utils.update_bn)
        over the first `batch_norm_batches` batches of the training set, in data-set order,
        through the training transform (as the running statistics of a model trained alone are
        gathered: the same preprocessing for every strategy) with the same draws on every
        worker, so every worker gets the same statistics. An average of models is not a model
        whose statistics are the average of theirs (Izmailov et al. 2018). No-op for a model
        without BatchNorm or before `use_batch_norm_data`."""
        data = getattr(self, "batch_norm_data", None)
        if data is None or not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            return
        dataset, batch_size, draws = data
        count = min(len(dataset), self.batch_norm_batches * batch_size)
        batches = (
            dataset.batch(torch.arange(start, min(start + batch_size, count)), draws)[0]
            for start in range(0, count, batch_size)
        )
        torch.optim.swa_utils.update_bn(batches, model, device=self.ctx.device)

    def finish(self) -> None:
        """Called once after the last step on every worker (e.g. to stop servers)."""

    def summary(self) -> dict[str, Any]:
        """Strategy-specific results for metrics.json (e.g. a staleness histogram). Called on
        rank 0 alone, after the other workers are done: no collectives here. Numeric
        entries also become MLflow metrics."""
        return {}

    # ----- preemption (dtstudy.training.checkpoint) ---------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs besides the model's and the optimizer's state for an
        exact continuation (step counters, error-feedback residuals, generators...); tensors,
        numbers, strings, lists and dicts of them only (loaded with weights_only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what `state_dict` returned, after `setup` (tensors arrive on the CPU)."""

    def boundary_agreement(self) -> Callable[[int, str | None], str | None] | None:
        """How the workers agree on the step boundary of a checkpoint or a stop. None: every
        train.preempt_check_every steps an all-reduce (MAX) over the worker group (lockstep
        workers). Else a function called on every worker before each step with (steps done,
        what this worker asks for: "checkpoint", "stop" or None) that returns the action agreed
        for this boundary ("checkpoint", "stop" or None), the same step and action on every
        worker (e.g. agreed through a parameter-server shard)."""
        return None

    def resume_ranks(self) -> tuple[int, Any]:
        """(processes, group): the ranks 0..processes-1 that each save a rank file of a
        checkpoint, and a process group over them in which they agree on the step to resume
        from (dtstudy.training.checkpoint.load_agreed). The N workers by default."""
        return self.ctx.workers, self.ctx.worker_group

    def save_extra_processes(self, step: int, stopping: bool) -> None:
        """Every worker, at an agreed boundary after saving its own file: the extra processes
        save their state of `step` (returns once they have); `stopping`: the job is then
        requeued (a preemption) rather than going on (a periodic checkpoint)."""

    def abandon(self) -> None:
        """Rank 0 of a preempted run that cannot resume, just before it fails: let the extra
        processes end once rank 0 is gone (the other workers' exchanges then fail)."""

    def serve(self, files=None) -> None:
        """Body of an extra process (rank >= N). `files`: the run's resume files
        (dtstudy.training.checkpoint.ResumeFiles) where it saves and finds its state."""
        raise NotImplementedError(f"strategy {self.name!r} starts no extra processes")
