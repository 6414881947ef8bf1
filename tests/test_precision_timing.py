"""How a step computes and how it is timed: train.precision through autocast (fp16 with a
GradScaler, refused where a strategy cannot step through it) and recorded in metrics.json;
the step's data / compute / exchange split read on the device's clock, driven here by a fake
event clock whose device runs the work the host queued, later (as a GPU does)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from conftest import in_workers, tiny_study, train_run, validated
from torch import nn

from dtstudy.common.timing import HostClock, StepTimer
from dtstudy.errors import ConfigError
from dtstudy.strategies.base import CommMeter, DistContext, Strategy
from dtstudy.strategies.registry import get_strategy
from dtstudy.strategies.specs import SPECS
from dtstudy.training.compute import Compute
from dtstudy.training.loop import make_criterion, make_optimizer_factory, timed_step
from dtstudy.training.measurements import WorkerLog
from dtstudy.training.models import build_model

TRAIN = {"momentum": 0.9, "weight_decay": 5e-4, "nesterov": False, "label_smoothing": 0.0}
NO_STRAGGLERS = SimpleNamespace(delay=lambda clock: None)  # a worker that is not slowed


def worker_run(strategy, model, compute: Compute, timer: StepTimer | None = None) -> SimpleNamespace:
    """What dtstudy.training.loop.timed_step reads of a WorkerRun."""
    module = strategy.setup(compute.place(model), make_optimizer_factory(TRAIN))
    strategy.grad_scaler = compute.grad_scaler
    return SimpleNamespace(
        ctx=strategy.ctx,
        strategy=strategy,
        module=module,
        criterion=make_criterion(TRAIN),
        compute=compute,
        straggler=NO_STRAGGLERS,
        timer=timer or StepTimer(HostClock()),
    )


def cpu_context(workers: int = 1) -> DistContext:
    return DistContext(
        rank=0, world_size=workers, workers=workers, local_rank=0, device=torch.device("cpu"), backend="gloo"
    )


def batch(seed: int = 0, size: int = 16):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 1, 28, 28, generator=generator), torch.randint(0, 10, (size,), generator=generator)


# ----- precision -------------------------------------------------------------------------


def forward_dtypes(precision: str) -> set[torch.dtype]:
    """The dtypes LeNet-5's convolutions and linear layers compute in during a training step."""
    torch.manual_seed(0)
    model = build_model("lenet5", 1, 10, 28)
    seen = set()
    for layer in model.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            layer.register_forward_hook(lambda _m, _i, output: seen.add(output.dtype))
    run = worker_run(
        get_strategy("no_exchange")(cpu_context(), {"steps": 10}),
        model,
        Compute(precision, "contiguous", torch.device("cpu")),
    )
    timed_step(run, iter([batch()]), 0.1, WorkerLog(rank=0).record)
    return seen


def test_the_step_computes_in_the_configured_precision():
    assert forward_dtypes("bf16") == {torch.bfloat16}
    assert forward_dtypes("fp16") == {torch.float16}
    assert forward_dtypes("fp32") == {torch.float32}  # the control: no autocast at all


class SkipsTheScaler(get_strategy("no_exchange")):
    """The planted bug: an update that steps the optimizer itself, past the GradScaler."""

    def step_optimizer(self):
        self.optimizer.step()


def after_one_fp16_step(strategy_class, inputs, labels) -> dict:
    torch.manual_seed(0)
    run = worker_run(
        strategy_class(cpu_context(), {"steps": 10}),
        build_model("lenet5", 1, 10, 28),
        Compute("fp16", "contiguous", torch.device("cpu")),
    )
    timed_step(run, iter([(inputs, labels)]), 0.1, WorkerLog(rank=0).record)
    return {name: p.detach().clone() for name, p in run.module.named_parameters()}


def test_fp16_steps_through_the_grad_scaler_as_the_reference_loop_does():
    """An fp16 step is torch's AMP recipe (autocast, scaler.scale(loss).backward(),
    scaler.step, scaler.update) to the last bit; a strategy that steps its optimizer past the
    scaler applies gradients 65536 times too large and must fail the same comparison."""
    inputs, labels = batch()
    torch.manual_seed(0)
    model = build_model("lenet5", 1, 10, 28)
    optimizer = make_optimizer_factory(TRAIN)(model.parameters())
    for group in optimizer.param_groups:
        group["lr"] = 0.1
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = make_criterion(TRAIN)(model(inputs), labels)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    reference = dict(model.named_parameters())

    ours = after_one_fp16_step(get_strategy("no_exchange"), inputs, labels)
    for name, value in ours.items():
        torch.testing.assert_close(value, reference[name].detach(), rtol=0, atol=0, msg=name)
    wrong = after_one_fp16_step(SkipsTheScaler, inputs, labels)
    assert any(not torch.equal(wrong[name], reference[name].detach()) for name in wrong)
    assert max((wrong[n] - reference[n].detach()).abs().max().item() for n in wrong) > 1.0  # scaled, not rounding


def test_fp16_is_refused_where_a_strategy_cannot_step_through_the_scaler():
    # every strategy is either allowed or refused with its reason; the loss-scaled gradients
    # reach the shards (parameter servers) or an error-feedback memory (PowerSGD, 1-bit)
    refused = {name for name, spec in SPECS.items() if spec.no_fp16_because}
    assert {"ps_sync", "ps_backup", "ps_async", "ssp", "allreduce_powersgd", "allreduce_onebit"} <= refused
    assert not refused & {
        "allreduce",
        "allreduce_fp16",
        "allreduce_bf16",
        "local_sgd",
        "easgd",
        "gossip",
        "no_exchange",
    }
    with pytest.raises(ConfigError) as error:
        validated(tiny_study(strategies=["allreduce", "ps_sync"], train={"precision": "fp16"}))
    message = str(error.value)
    assert "'train.precision'" in message and "'fp16'" in message and "'ps_sync'" in message
    assert "allowed with it: fp32, bf16" in message
    # the controls: the same strategy in bf16, and fp16 where the update steps through the scaler
    validated(tiny_study(strategies=["ps_sync"], train={"precision": "bf16"}))
    validated(tiny_study(strategies=["allreduce", "local_sgd", "gossip"], train={"precision": "fp16"}))


def test_the_precision_and_layout_are_what_ran_and_what_metrics_json_records(tmp_path, tiny_data):
    """Through the study's own path (two gloo workers, DDP): bf16 and fp32 runs of the same seed
    start from the same parameters and batches; bf16's losses are fp32's to bf16's precision,
    not to the last bit (the control: had autocast not run, they would be identical)."""
    bf16, _, _ = train_run(tmp_path, tiny_data, workers=2, batch_size=32, steps=6, precision="bf16")
    fp32, _, _ = train_run(tmp_path / "fp32", tiny_data, workers=2, batch_size=32, steps=6)
    assert bf16["compute"] == {
        "precision": "bf16",
        "autocast_dtype": "bfloat16",
        "grad_scaler": None,
        "memory_format": "contiguous",
        "timing_clock": "host",
    }
    assert fp32["compute"]["precision"] == "fp32" and fp32["compute"]["autocast_dtype"] is None
    assert bf16["config"]["train"]["precision"] == "bf16"
    assert bf16["train_loss"] != fp32["train_loss"]
    assert bf16["train_loss"][0] == pytest.approx(fp32["train_loss"][0], rel=2e-2)  # bf16: 8 bits of mantissa


# ----- timing on the device's clock ----------------------------------------------------------

LOAD_S, COPY_S, FORWARD_S, BACKWARD_S, EXCHANGE_S = 0.002, 0.001, 0.010, 0.020, 0.005


class FakeDevice:
    """A device that runs queued work in order, after the host queued it: `host` is the host's
    clock, `free` when the device will have done everything queued so far."""

    def __init__(self):
        self.host = self.free = 0.0

    def launch(self, seconds: float) -> None:
        """Queue `seconds` of work (the host goes on at once, as after a kernel launch or an NCCL call)."""
        self.free = max(self.free, self.host) + seconds

    def block(self, seconds: float) -> None:
        """A blocking exchange (gloo on host memory): the host waits for the device, then the network."""
        self.host = max(self.host, self.free) + seconds

    def load(self) -> None:
        """A batch: the loader's wait on the host, then the copy to the device, queued."""
        self.host += LOAD_S
        self.launch(COPY_S)


class FakeEventClock:
    """An event recorded now is stamped when the device reaches it: after the queued work."""

    lag, kind = 1, "fake_events"  # read a step late, as CUDA events are

    def __init__(self, device: FakeDevice):
        self.device = device

    def mark(self) -> float:
        return max(self.device.host, self.device.free)

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def sleep(self, seconds: float) -> None:
        """As CudaClock's: the host waits for the queued work, then sleeps."""
        self.device.host = max(self.device.host, self.device.free) + seconds


class HostStamps(FakeEventClock):
    """The planted bug: the host's time when the work was queued (a timer without an event)."""

    def mark(self) -> float:
        return self.device.host


class Queued(torch.autograd.Function):
    """Identity whose forward and backward queue FORWARD_S and BACKWARD_S of device work."""

    @staticmethod
    def forward(ctx, x, device):
        ctx.device = device
        device.launch(FORWARD_S)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.device.launch(BACKWARD_S)
        return grad, None


class FakeModel(nn.Module):
    def __init__(self, device: FakeDevice):
        super().__init__()
        self.linear, self.device = nn.Linear(4, 3), device

    def forward(self, x):
        return Queued.apply(self.linear(x), self.device)  # backward: queued work, then the gradients


def fake_batches(device: FakeDevice):
    generator = torch.Generator().manual_seed(0)
    while True:
        device.load()
        yield torch.randn(8, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def install_fake_exchange(name: str, strategy, device: FakeDevice, patch: pytest.MonkeyPatch) -> None:
    """Give the strategy's own exchange EXCHANGE_S of device time, where it spends it: queued
    on the device (NCCL: all-reduce, gossip's point-to-point) or blocking the host (the
    parameter servers' gloo messages). The timing code under test is the strategy's own."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from dtstudy.strategies.gossip import strategy as gossip
    from dtstudy.strategies.local import strategy as local

    if name == "allreduce":

        def hook(state, bucket):  # after the bucket's last gradient: DDP's all-reduce of it
            device.launch(EXCHANGE_S)
            return default_hooks.allreduce_hook(state.ctx.worker_group, bucket)

        strategy.comm_hook = lambda: hook
    elif name == "local_sgd":
        real = local.average_over_workers
        patch.setattr(
            local, "average_over_workers", lambda tensors, group: (device.launch(EXCHANGE_S), real(tensors, group))[1]
        )
    elif name == "easgd":
        real_all_reduce = dist.all_reduce
        patch.setattr(
            dist, "all_reduce", lambda tensor, **kw: (device.launch(EXCHANGE_S), real_all_reduce(tensor, **kw))[1]
        )
    elif name == "gossip":
        patch.setattr(gossip, "gossip_average", lambda parameters, peers, group: (device.launch(EXCHANGE_S), 0)[1])
    elif name == "ps_sync":
        strategy.client = SimpleNamespace(push=lambda lr: (device.block(EXCHANGE_S), 0)[1])
    else:
        raise ValueError(name)


PARAMS = {
    "allreduce": {},
    "local_sgd": {"period": 1, "warmup_steps": 1},
    "easgd": {"period": 1},
    "gossip": {},
    "ps_sync": {},
}
STEPS = 4


def split_of_steps(name: str, ctx: DistContext, exchange_clock) -> WorkerLog:
    """STEPS steps of strategy `name` at N=2 (a one-process group: the exchanges are real and
    trivial, their device time the fake's), the loop's marks on the fake event clock and the
    strategy's on `exchange_clock`; the log after the timer was flushed."""
    device = FakeDevice()
    ctx = dataclasses.replace(ctx, workers=2)  # every exchange path is taken
    cls = get_strategy(name)
    params = cls.check_params(PARAMS[name], 2)
    if name == "ps_sync":  # no shard processes: the push is the fake's, the timing the strategy's
        strategy = object.__new__(cls)
        Strategy.__init__(strategy, ctx, params)
        strategy.setup = lambda model, make: setattr(strategy, "model", model) or model
    else:
        strategy = cls(ctx, params)
    with pytest.MonkeyPatch.context() as patch:
        install_fake_exchange(name, strategy, device, patch)
        torch.manual_seed(0)
        run = worker_run(
            strategy,
            FakeModel(device),
            Compute("fp32", "contiguous", torch.device("cpu")),
            StepTimer(FakeEventClock(device)),
        )
        strategy.meter.clock = exchange_clock(device)
        log, batches = WorkerLog(rank=0), fake_batches(device)
        for step in range(STEPS):
            timed_step(run, batches, 0.1, log.record)
            assert len(log.step_s) == step  # read a step late: the host never waited for the device
        run.timer.flush()
    return log


BLOCKING = {"ps_sync"}  # its exchange blocks the host: nothing is queued ahead of the next batch


def check_split(log: WorkerLog, blocking: bool) -> None:
    """Each step as the fake device ran it: exchange EXCHANGE_S, compute forward + backward,
    data the batch's load and copy; from the second step on the load hides behind the work
    the host queued, unless the exchange blocked the host until the device was done."""
    assert len(log.step_s) == STEPS
    assert log.comm_s == pytest.approx([EXCHANGE_S] * STEPS, abs=1e-12)
    compute = [step - comm for step, comm in zip(log.step_s, log.comm_s)]
    assert compute == pytest.approx([FORWARD_S + BACKWARD_S] * STEPS, abs=1e-12)
    later = LOAD_S + COPY_S if blocking else COPY_S
    assert log.data_s == pytest.approx([LOAD_S + COPY_S] + [later] * (STEPS - 1), abs=1e-12)


def _splits(ctx: DistContext) -> None:
    for name in PARAMS:
        check_split(split_of_steps(name, ctx, FakeEventClock), name in BLOCKING)
        # the planted bug: the exchange stamped with the host's time when it was queued. Queued
        # on the device it measures 0; blocking, it also counts the compute queued before it
        wrong = split_of_steps(name, ctx, HostStamps)
        with pytest.raises(AssertionError):
            check_split(wrong, name in BLOCKING)
        expected = COPY_S + FORWARD_S + BACKWARD_S + EXCHANGE_S if name in BLOCKING else 0.0  # all queued work
        assert wrong.comm_s == pytest.approx([expected] * STEPS, abs=1e-12), name


def test_each_strategy_times_its_exchange_after_the_work_queued_before_it(tmp_path):
    in_workers(tmp_path, 1, _splits)


class HostSleep(FakeEventClock):
    """The planted bug: a straggler that sleeps on the host only, while the device runs on."""

    def sleep(self, seconds: float) -> None:
        self.device.host += seconds


DELAY_S = 0.015  # under the 30 ms of work a step queues: a host-only sleep hides behind it


def straggler_steps(clock_class) -> WorkerLog:
    """STEPS steps of a straggling worker (a fixed DELAY_S a step) on a fake device whose
    clock is `clock_class`; the log after the timer was flushed."""
    from dtstudy.training.stragglers import Straggler

    device = FakeDevice()
    torch.manual_seed(0)
    run = worker_run(
        get_strategy("no_exchange")(cpu_context(), {"steps": 10}),
        FakeModel(device),
        Compute("fp32", "contiguous", torch.device("cpu")),
        StepTimer(clock_class(device)),
    )
    stragglers = validated(tiny_study(stragglers={"ranks": [0], "delay_ms": DELAY_S * 1000}))["stragglers"]
    run.straggler = Straggler(stragglers, workers=1, rank=0, run_seed=0)
    log, batches = WorkerLog(rank=0), fake_batches(device)
    for _ in range(STEPS):
        timed_step(run, batches, 0.1, log.record)
    run.timer.flush()
    assert run.straggler.total_s == pytest.approx(STEPS * DELAY_S)
    return log


def test_a_stragglers_delay_is_on_the_devices_timeline_not_hidden_behind_queued_work():
    """A slow worker's step, as the device ran it, is its compute plus the delay, every step;
    a delay slept on the host only (the planted bug) vanishes behind the work still queued."""
    log = straggler_steps(FakeEventClock)
    assert [step - comm for step, comm in zip(log.step_s, log.comm_s)] == pytest.approx(
        [FORWARD_S + BACKWARD_S + DELAY_S] * STEPS, abs=1e-12
    )
    hidden = straggler_steps(HostSleep)
    assert hidden.step_s[1:] == pytest.approx([FORWARD_S + BACKWARD_S] * (STEPS - 1), abs=1e-12)


def test_the_host_clock_is_read_as_each_step_ends():
    """The CPU's clock (kernels run as they are called): lag 0, every step recorded at its end."""
    clock = HostClock(iter([0.0, 0.5, 2.0]).__next__)
    meter, log, timer = CommMeter(), WorkerLog(rank=0), StepTimer(clock)
    timer.data_start()
    timer.step_start()
    meter.add_span(1.0, 1.25)
    timer.step_end(meter, 8, log.record)
    assert (log.data_s, log.step_s, log.comm_s, log.images) == ([0.5], [1.5], [0.25], [8])


@pytest.mark.slow
def test_a_preempted_fp16_run_resumes_with_its_loss_scale(tmp_path, tiny_data):
    """fp16's GradScaler is part of a resumable run's state: the requeued job goes on with the
    scale (and its growth counter) where the stop left it, so it ends where the uninterrupted run
    ends, loss for loss. The stop comes after step 30, past the scale's first halvings (LeNet-5
    here overflows at 65536 around step 16 and again around step 27): a requeued job that
    started a new scaler would skip other steps and end elsewhere (checked by hand by dropping
    the scaler's restore in dtstudy.training.loop.resume_or_start: this test then fails)."""
    from test_resume import SLOW, finish, make_spec, preempt_after_progress, submit

    reference_spec = make_spec(tmp_path / "whole", tiny_data, steps=60, stragglers=SLOW, precision="fp16")
    reference_job = submit(reference_spec)
    spec = make_spec(tmp_path / "preempted", tiny_data, steps=60, stragglers=SLOW, precision="fp16")
    job = submit(spec)
    preempt_after_progress(job, 6)
    metrics, params, log = finish(job, spec)
    reference, reference_params, _ = finish(reference_job, reference_spec)
    assert "resumed from step" in log, log
    assert metrics["compute"]["grad_scaler"]["final_scale"] < 65536.0, "the scale never moved: nothing was shown"
    assert metrics["train_loss"] == reference["train_loss"]
    assert metrics["compute"] == reference["compute"]
    for name in params:
        torch.testing.assert_close(params[name], reference_params[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_the_gpu_compute_check_runs_dry_on_the_cpu(tmp_path):
    """tests/device/compute_check.py's every step apart from CUDA (the GPU check cannot run in
    CI): the JPEG tree, the study's run through `python3 -m dtstudy train` started as a cluster
    task starts (one fresh submitit task, not pinned), the reference loop decoding with the
    study's decoder (and PIL's figure beside it), the in-process epochs timed from outside, and
    every cluster strategy at N = 2 over gloo with its tensors on the run's device, in a record
    written as it goes. On the CPU's clock the steps' parts must already sum to the epoch timed
    from outside."""
    import json
    import subprocess
    import sys

    import yaml
    from conftest import REPO

    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "tests/device/compute_check.py",
            "--dry-run",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads((out / "compute_check.json").read_text())
    assert record["dry_run"] and record["complete"] and record["compute"]["precision"] == record["precision"] == "fp32"
    assert set(record["checks"]) == {
        "study_run_started_unpinned",
        "images_per_s_ratio_at_least_0.95",
        "data_share_under_0.05",
        "step_parts_sum_to_events_within_0.05",
        "test_pass_on_the_runs_device",
        "straggler_delay_on_the_device_timeline",
        "n2_exchange_on_the_device_for_every_strategy",
    }
    # started as a cluster task starts: a fresh task, nothing pinned, every core the check has
    assert record["start"]["local_processes"] == "tasks" and record["start"]["pinned_cores"] is None
    assert record["checks"]["study_run_started_unpinned"]
    # the reference decodes as the study does (tests/test_device_check.py: read_rgb gives the
    # study's torchvision decoder's pixels), PIL's figure beside it
    assert record["study_decoder"] == "torchvision" and record["reference_decoder"].endswith(".read_rgb")
    assert record["reference_beside_decoder"] == "torchvision.datasets.folder.default_loader"
    assert len(record["reference_images_per_s"]) == 2 and record["study_images_per_s"] > 0
    assert record["reference_pil_images_per_s"] > 0 and record["images_per_s_ratio_to_pil_reference"] > 0
    # every strategy of the cluster study (and gossip's random pairs) at N = 2, its exchange
    # seen on the device (on the CPU: the CPU), nothing handed to a collective off it
    cluster = yaml.safe_load((REPO / "config" / "cluster.yaml").read_text())["strategies"]
    runs = {run["strategy"]: run for run in record["exchange_n2"]}
    assert list(runs) == [*cluster, "gossip_random_pairs"] and record["exchange_runs_planned"] == len(runs)
    for name, run in runs.items():
        assert run["completed"] and run["workers"] == 2 and not run["off_device"], (name, run)
        assert run["collectives"] and all(key.endswith("@cpu") for key in run["collectives"]), (name, run)
    assert runs["allreduce_onebit"]["collectives"].get("all_gather@cpu")  # its exchange, not only the loop's
    assert runs["gossip"]["collectives"].get("isend@cpu") and runs["local_sgd"]["collectives"].get("all_reduce@cpu")
    assert record["checks"]["n2_exchange_on_the_device_for_every_strategy"]
    # on the CPU's clock too: the test pass ran where the run trained, the delay is added in full
    assert record["checks"]["test_pass_on_the_runs_device"] and record["evaluation"]["test_images"] > 0
    assert record["checks"]["straggler_delay_on_the_device_timeline"]
    assert record["epochs_timed_outside"][0]["steps"] == record["steps"]
    assert record["step_parts_sum_error"] < 0.05
