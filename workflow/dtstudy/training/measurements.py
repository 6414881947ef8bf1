"""What a worker measures per step, and the run's summary that becomes metrics.json."""

from __future__ import annotations

from dataclasses import dataclass, field

from dtstudy.common.intervals import median_interval
from dtstudy.config.study_config import global_batch_size, per_worker_batch
from dtstudy.strategies.specs import get_spec
from dtstudy.training.stragglers import slow_ranks

MIN_WINDOWS = 5  # a run too short for this many windows of timing_window_steps gets shorter windows


def timed_window(wanted: int, cycle: int, steady_steps: int) -> int:
    """The steps of a timed window: `wanted` (train.timing_window_steps) rounded up to whole
    cycles of the strategy's exchange (StrategySpec.exchange_cycle: local SGD's period), so
    that every window holds the exchanges' share of a long run, where a window of 5 steps
    would hold one average of a period of 8 or none and its median would miss the share.
    Shorter where `steady_steps` give fewer than MIN_WINDOWS windows: whole cycles while one
    fits, one cycle while two windows do, else as many steps as fit."""
    window = -(-wanted // cycle) * cycle
    fit = steady_steps // MIN_WINDOWS
    if window <= fit:
        return window
    if fit >= cycle:
        return fit // cycle * cycle
    return cycle if steady_steps >= 2 * cycle else max(1, fit)


@dataclass
class WorkerLog:
    """Per-step measurements of one worker (seconds, bytes, images)."""

    rank: int
    loss: list[float] = field(default_factory=list)
    data_s: list[float] = field(default_factory=list)
    # seconds on the device's clock (dtstudy.common.timing): CUDA events on a GPU
    step_s: list[float] = field(default_factory=list)  # forward + backward + update, exchange included
    comm_s: list[float] = field(default_factory=list)  # the exchange/wait part of step_s
    bytes_sent: list[float] = field(default_factory=list)
    images: list[int] = field(default_factory=list)
    injected_delay_s: float = 0.0  # straggler injection, inside step_s
    host: str = ""  # where the worker ran its last attempt (a multi-node job's ranks on several)

    def record(self, data_s: float, step_s: float, comm_s: float, bytes_sent: float, images: int) -> None:
        self.data_s.append(data_s)
        self.step_s.append(step_s)
        self.comm_s.append(comm_s)
        self.bytes_sent.append(bytes_sent)
        self.images.append(images)

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

    def window_throughputs(self, skip: int, window_steps: int) -> list[float]:
        """Images/s of this worker in consecutive windows of `window_steps` steps after the
        first `skip` (a last, shorter window is left out: every window weighs the same)."""
        windows = []
        for start in range(skip, len(self.step_s) - window_steps + 1, window_steps):
            end = start + window_steps
            wall = sum(self.step_s[start:end]) + sum(self.data_s[start:end])
            windows.append(sum(self.images[start:end]) / wall)
        return windows


def run_windows(logs: list[WorkerLog], skip: int, window_steps: int) -> list[float]:
    """The run's throughput (all workers) per timed window: window k of every worker summed,
    as the run's throughput sums the workers'."""
    per_worker = [worker.window_throughputs(skip, window_steps) for worker in logs]
    count = min(len(windows) for windows in per_worker)
    return [sum(windows[k] for windows in per_worker) for k in range(count)]


def summarize(
    spec,
    logs: list[WorkerLog],
    val_history: list[dict],
    wall_time: float,
    lr_schedule: dict,
    strategy_summary: dict,
    environment: dict,
    timings: dict,
    compute: dict | None = None,
) -> dict:
    """metrics.json's content (see docs/running-locally.md: 'What a run records'). `compute`:
    what the steps ran with (dtstudy.training.compute.Compute.describe)."""
    train = spec.config["train"]
    steps = min(len(worker.step_s) for worker in logs)
    # the steady state begins after the strategy's own transient too (PowerSGD's plain steps)
    transient, cycle = get_spec(spec.strategy).exchange_cycle(spec.strategy_params())
    skip = min(max(train["steady_state_skip"], transient), steps // 2)
    per_worker = [worker.steady(skip) for worker in logs]
    window_steps = timed_window(train["timing_window_steps"], cycle, steps - skip)
    windows = run_windows(logs, skip, window_steps)
    window_stats = median_interval([windows])
    mean = lambda key: sum(w[key] for w in per_worker) / len(per_worker)  # noqa: E731
    losses_per_step = [sum(w.loss[i] for w in logs) / len(logs) for i in range(steps)]
    target = spec.config["target_accuracy"]
    epochs = [v for v in val_history if v.get("kind", "epoch") == "epoch"]
    grid = [v for v in val_history if v.get("kind") == "grid"]
    # time-to-accuracy: the first measured point at or above the target, on the finer grid
    # when there is one; nothing is interpolated between points
    measured = grid or epochs
    reached = [v["train_s"] for v in measured if v["top1"] >= target]
    return {
        "strategy": spec.strategy,
        "variant": spec.variant,  # the variant of the strategy this run is of (config `variants`), or null
        "workers": spec.workers,
        "seed": spec.seed,
        "run_name": spec.run_name,
        "kind": spec.kind,  # scaling or accuracy (dtstudy.config.run_kinds): which tables take this run
        "throughput": sum(w["throughput"] for w in per_worker),
        "throughput_per_worker": [w["throughput"] for w in per_worker],
        # repeated timed windows of the steady state: their median and its bootstrap 95% CI
        "throughput_windows": windows,
        "timing_window_steps": window_steps,
        "throughput_median": window_stats.value,
        "throughput_ci95": [window_stats.low, window_stats.high],
        "steady_state_skip": skip,
        "step_time": {key: mean(key) for key in ("total_s", "compute_s", "comm_s", "data_s")},
        "step_time_per_worker": per_worker,
        "bytes_per_step": mean("bytes_per_step"),
        "steps": steps,
        "images": sum(sum(w.images) for w in logs),
        "epochs_run": max((v["epoch"] for v in val_history), default=0),  # each epoch end has a point
        "global_batch": global_batch_size(train, spec.workers),
        "per_worker_batch": per_worker_batch(train, spec.workers),
        "lr_schedule": {
            "rule": train["lr_scaling"],
            "base_lr": train["base_lr"],
            "reference_batch": train["lr_reference_batch"],
            **lr_schedule,
        },
        "train_loss": losses_per_step,
        "val": epochs,
        "val_grid": grid,
        "final_val_top1": epochs[-1]["top1"] if epochs else None,
        "target_accuracy": target,
        "time_to_accuracy_s": reached[0] if reached else None,
        "time_to_accuracy_basis": (
            f"training seconds (evaluations left out) to the first of {len(measured)} "
            f"validation points on {measured[0]['images']} images at or above the target"
            if measured
            else "no validation point"
        ),
        "wall_time_s": wall_time,
        "timings": timings,
        "strategy_params": spec.strategy_params(),
        "stragglers": {
            "ranks": slow_ranks(spec.config["stragglers"], spec.workers, spec.seed),
            "injected_delay_s": [worker.injected_delay_s for worker in logs],
        },
        "strategy_metrics": strategy_summary,
        # precision, layout, the clock the step times were read on (the GPU's kernel choices:
        # environment.kernels)
        "compute": compute,
        "config": spec.config,
        # rank 0's; which host each worker ran on beside it (a multi-node job spans several)
        "environment": {**environment, "worker_hosts": [worker.host for worker in logs]},
    }
