"""`allreduce_onebit` against two plain-torch references of error-feedback 1-bit compression,
N workers simulated in one process on the study's own shards, seeds, model and schedule:
scaled-sign EF-SGD (Karimireddy et al. 2019, Alg. 2 as their code runs it: the worker's
momentum, lr-scaled, plus its residual, compressed per tensor to mean|u| sign(u)) and Seide et
al. 2014's per-column 1-bit quantiser with error feedback (two reconstruction values per
column, the means of its non-negative and of its negative entries). The planted-bug control
is the strategy's old placement: the gradient compressed, the momentum applied to the decoded
average (docs/strategies.md, `allreduce_onebit`)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from conftest import dataset_config, tiny_study, train_run, validated
from torch.utils.data import BatchSampler, DistributedSampler

from dtstudy.config.study_config import run_config
from dtstudy.data.loading import load_split
from dtstudy.training.lr_schedule import make_schedule
from dtstudy.training.models import build_model

WORKERS = 4


# ----- the two quantisers, written apart from dtstudy.strategies.compressed.onebit_codec ---------------------
def scaled_sign(u: torch.Tensor) -> torch.Tensor:
    """Karimireddy et al. 2019: ||u||_1 / d * sign(u), one scale per tensor."""
    return u.abs().mean() * torch.sign(u)


def seide_column(u: torch.Tensor) -> torch.Tensor:
    """Seide et al. 2014: per column (here a tensor's slice along its first dimension, one per
    output unit; a vector is one column), each entry replaced by the mean of the column's
    entries on its side of 0 (a zero on the non-negative side)."""
    columns = u.reshape(u.shape[0], -1) if u.dim() > 1 else u.reshape(1, -1)
    upper = columns >= 0
    count = upper.sum(1, keepdim=True)
    high = torch.where(upper, columns, 0.0).sum(1, keepdim=True) / count.clamp(min=1)
    low = torch.where(upper, 0.0, columns).sum(1, keepdim=True) / (columns.shape[1] - count).clamp(min=1)
    return torch.where(upper, high, low).reshape(u.shape)


@dataclass(frozen=True)
class Rule:
    """How N simulated workers exchange. compress None: the plain all-reduce (torch's momentum SGD)."""

    compress: Callable[[torch.Tensor], torch.Tensor] | None
    momentum_first: bool = True  # compress the worker's momentum; False: its gradient, momentum after
    lr_scaled: bool = False  # the residual in update units (e + lr m), as Karimireddy et al.
    decay_sent: bool = False  # weight decay in what is compressed (Karimireddy et al.'s code)


RULES = {
    "allreduce": Rule(None),
    "karimireddy": Rule(scaled_sign, lr_scaled=True, decay_sent=True),
    "seide": Rule(seide_column),
    # the strategy's old placement, the planted bug: the batch's gradient compressed, the
    # optimizer's momentum and weight decay applied to the decoded average
    "gradient_first": Rule(seide_column, momentum_first=False),
}


def simulate(rule: Rule, data_dir, train: dict, seed: int, workers: int = WORKERS) -> torch.nn.Module:
    """One run of `workers` data-parallel workers in this process, as the training loop sets it
    up: the model built after seeding, worker r's batches from DistributedSampler(rank=r), the
    schedule of the N*b batch; returns the trained model."""
    train_set = load_split(data_dir, "train")
    random.seed(seed)
    torch.manual_seed(seed)
    model = build_model("lenet5", train_set.channels, train_set.num_classes, train_set.images.shape[-1])
    params = list(model.parameters())
    samplers = [
        DistributedSampler(train_set, num_replicas=workers, rank=r, shuffle=True, seed=seed) for r in range(workers)
    ]
    batches = [BatchSampler(s, train["batch_size"], drop_last=True) for s in samplers]
    schedule = make_schedule(train, workers * train["batch_size"], len(batches[0]))
    beta, decay, nesterov = train["momentum"], train["weight_decay"], train["nesterov"]

    def momentum_step(buffer: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        buffer.mul_(beta).add_(value)
        return value + beta * buffer if nesterov else buffer.clone()

    zeros = [torch.zeros_like(p) for p in params]
    residual = [[z.clone() for z in zeros] for _ in range(workers)]
    worker_momentum = [[z.clone() for z in zeros] for _ in range(workers)]
    shared_momentum = [z.clone() for z in zeros]  # the average's (plain, old placement) or weight decay's
    criterion = torch.nn.CrossEntropyLoss()
    step = 0
    for epoch in range(train["epochs"]):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        epoch_batches = [iter(b) for b in batches]
        for _ in range(len(batches[0])):
            if step >= schedule.total_steps:
                break
            lr = schedule(step)
            gradients = []
            for r in range(workers):
                inputs, labels = train_set.batch(torch.as_tensor(next(epoch_batches[r])))
                gradients.append(torch.autograd.grad(criterion(model(inputs), labels), params))
            with torch.no_grad():
                for j, p in enumerate(params):
                    if rule.compress is None:
                        mean = sum(g[j] for g in gradients) / workers
                        update = momentum_step(shared_momentum[j], mean + decay * p)
                    elif rule.momentum_first:
                        decoded = 0
                        for r in range(workers):
                            value = gradients[r][j] + decay * p if rule.decay_sent else gradients[r][j]
                            u = momentum_step(worker_momentum[r][j], value)
                            u = (lr * u if rule.lr_scaled else u) + residual[r][j]
                            q = rule.compress(u)
                            residual[r][j] = u - q
                            decoded = decoded + q
                        update = decoded / workers / (lr if rule.lr_scaled else 1.0)
                        if not rule.decay_sent:
                            update = update + momentum_step(shared_momentum[j], decay * p)
                    else:
                        decoded = 0
                        for r in range(workers):
                            u = gradients[r][j] + residual[r][j]
                            q = rule.compress(u)
                            residual[r][j] = u - q
                            decoded = decoded + q
                        update = momentum_step(shared_momentum[j], decoded / workers + decay * p)
                    p.sub_(lr * update)
            step += 1
    return model


@torch.no_grad()
def top1(model: torch.nn.Module, data_dir) -> float:
    val = load_split(data_dir, "val")
    inputs, labels = val.batch(torch.arange(len(val)))
    return (model.eval()(inputs).argmax(1) == labels).float().mean().item()


def _max_difference(model: torch.nn.Module, state: dict) -> float:
    return max((p - state[name]).abs().max().item() for name, p in model.state_dict().items())


def _share_apart(model: torch.nn.Module, state: dict, rounding: float = 1e-6) -> float:
    """The share of the parameters' entries further than `rounding` from `state`'s."""
    apart = sum(int(((p - state[name]).abs() > rounding).sum()) for name, p in model.state_dict().items())
    return apart / sum(p.numel() for p in model.state_dict().values())


# ----- the strategy is the reference, step by step -------------------------------------------------
DEFAULT_RECIPE = {
    "base_lr": 0.2,
    "lr_scaling": "linear",
    "warmup_epochs": 0.3,
    "momentum": 0.9,
    "weight_decay": 5.0e-4,
}  # config/config.yaml's train section


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.slow
def test_onebit_steps_as_the_seide_reference(tmp_path, tiny_data, nesterov):
    """One epoch of the tiny study at N=4 (14 steps) through the real path (submitit, gloo, DDP's
    hook) ends on the parameters of the per-column reference that compresses each worker's
    momentum, up to rounding: all but a few entries within 1e-6 (measured: every entry within
    3e-8 on an AMD EPYC; with Nesterov on an Intel Xeon, 0.6% of them up to 9e-5 away, where
    a near-zero entry's sign came out the other way at step 6, so that the quantiser gave it
    the column's other level, and the difference spread from there). The other rules differ in
    most entries: the old placement (gradient compressed, momentum after) and the scaled sign
    (per tensor), by about 1e-2."""
    recipe = {**DEFAULT_RECIPE, "nesterov": nesterov}
    _, state, _ = train_run(
        tmp_path, tiny_data, workers=WORKERS, batch_size=32, steps=None, strategy="allreduce_onebit", **recipe
    )
    study = validated(
        tiny_study(strategies=["allreduce_onebit"], workers=[WORKERS], train={"batch_size": 32, **recipe})
    )
    train = run_config(study, "allreduce_onebit")["train"]
    models = {
        name: simulate(RULES[name], tiny_data, train, seed=0) for name in ("seide", "gradient_first", "karimireddy")
    }
    apart = {name: _share_apart(model, state) for name, model in models.items()}
    furthest = {name: _max_difference(model, state) for name, model in models.items()}
    print(f"nesterov {nesterov}: entries beyond 1e-6 {apart}, furthest {furthest}")
    assert apart["seide"] < 0.05 and furthest["seide"] < 1e-3, f"the strategy is not the reference: {apart}, {furthest}"
    for control in ("gradient_first", "karimireddy"):
        assert apart[control] > 0.5 and furthest[control] > 1e-3, f"{control} is close to the strategy: {apart}"


# ----- the default study: where the accuracy goes, strategy and references side by side ------------
SEEDS = (0, 1)  # config/config.yaml's


@pytest.fixture(scope="module")
def default_study(tmp_path_factory):
    """config/config.yaml's data set (all of Fashion-MNIST) and train section, at N=4."""
    import yaml
    from conftest import REPO

    from dtstudy.data.prepare import prepare

    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    out = tmp_path_factory.mktemp("default") / "fashion_mnist"
    prepare(dataset_config(**config["dataset"]), out)
    study = validated({**config, "strategies": ["allreduce_onebit"], "workers": [WORKERS]})
    return out, run_config(study, "allreduce_onebit")["train"]


@pytest.mark.slow
def test_onebit_accuracy_against_both_references(tmp_path, default_study):
    """The default study's recipe (LeNet-5, all of Fashion-MNIST, 1 epoch, batch 32 per worker,
    lr 0.2 at 256 scaled linearly, 0.3 epoch of warm-up, cosine, momentum 0.9) at N=4, seeds
    0 and 1 (deterministic: the CPU's kernels and gloo's order are): the strategy (the real
    path) lands with both references, Karimireddy et al.'s scaled sign and Seide et al.'s
    columns, each compressing the worker's momentum: its mean over the seeds within 0.05 of
    each's, the references' own spread from seed to seed. The old placement (gradient
    compressed, momentum after) lands more than that tolerance below all three: how far depends
    on how the machine's kernels round (measured: 0.35 below on one AMD EPYC, one of its seeds
    at chance; 0.13 below on an Intel Xeon; 0.084 below on another AMD EPYC, where the test's
    earlier margin of 0.1 failed at e69745b as after it). What all three still
    lose against the plain all-reduce (more than 0.04, so not within docs' 3 points) is what
    error-feedback 1-bit compression costs in one epoch of this recipe: the two references
    are written apart from the strategy and from each other. About 6 min on 2 shared cores."""
    data, train = default_study
    accuracy = {name: [top1(simulate(rule, data, train, seed), data) for seed in SEEDS] for name, rule in RULES.items()}
    recipe = {
        key: train[key]
        for key in ("epochs", "base_lr", "lr_scaling", "warmup_epochs", "momentum", "weight_decay", "nesterov")
    }
    runs = [
        train_run(
            tmp_path,
            data,
            workers=WORKERS,
            batch_size=train["batch_size"],
            steps=None,
            seed=seed,
            strategy="allreduce_onebit",
            **recipe,
        )[0]
        for seed in SEEDS
    ]
    accuracy["strategy"] = [run["final_val_top1"] for run in runs]
    mean = {name: sum(values) / len(values) for name, values in accuracy.items()}
    print(
        {name: [round(v, 4) for v in values] for name, values in accuracy.items()},
        "quantization_error",
        [round(run["strategy_metrics"]["quantization_error"], 3) for run in runs],
    )
    for reference in ("karimireddy", "seide"):
        assert mean["strategy"] == pytest.approx(mean[reference], abs=0.05), accuracy
    assert mean["gradient_first"] < min(mean["strategy"], mean["karimireddy"], mean["seide"]) - 0.05, accuracy
    for compressed in ("strategy", "karimireddy", "seide"):
        assert mean[compressed] < mean["allreduce"] - 0.04, accuracy


# ----- the momentum buffers travel with a resumed run ------------------------------------------
def _check_momentum_resume(ctx, exchange):
    """Three steps with momentum and weight decay, the state saved, a fourth; a fresh strategy
    that replays DDP's first step, loads the state and steps delivers the fourth step's update
    exactly; one that loads all but the momentum buffers (the planted bug) does not."""
    import torch.nn.functional as F

    from dtstudy.strategies.compressed.strategy import AllReduceOneBit

    torch.manual_seed(10 + ctx.rank)
    inputs, labels = torch.randn(8, 6), torch.randint(0, 3, (8,))

    def fresh():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
        strategy = AllReduceOneBit(ctx, AllReduceOneBit.check_params({"exchange": exchange}, ctx.workers))
        module = strategy.setup(model, lambda p: torch.optim.SGD(p, lr=0.0, momentum=0.9, weight_decay=0.01))
        return strategy, module

    def step(strategy, module):
        strategy.backward(F.cross_entropy(module(inputs), labels))
        update = torch.cat([p.grad.reshape(-1) for p in strategy.model.parameters()])
        strategy.update(0.1)
        return update

    strategy, module = fresh()
    assert all(group["momentum"] == 0 and group["weight_decay"] == 0 for group in strategy.optimizer.param_groups)
    for _ in range(3):
        step(strategy, module)
    saved = strategy.state_dict()
    assert {"velocities", "decay_velocities"} <= saved.keys()
    parameters = [p.detach().clone() for p in strategy.model.parameters()]
    fourth = step(strategy, module)
    for drop in ((), ("velocities", "decay_velocities")):
        resumed, resumed_module = fresh()
        step(resumed, resumed_module)  # throwaway, as training.loop.throwaway_step
        with torch.no_grad():
            for p, value in zip(resumed.model.parameters(), parameters):
                p.copy_(value)
        resumed.load_state_dict(
            {key: value for key, value in saved.items() if key not in drop}
            | {key: [torch.zeros_like(v) for v in saved[key]] for key in drop}
        )
        assert torch.equal(step(resumed, resumed_module), fourth) == (not drop), drop


@pytest.mark.parametrize("exchange", ["allgather", "reduce_scatter"])
def test_onebit_resumes_its_momentum(tmp_path, exchange):
    from conftest import in_workers

    in_workers(tmp_path, 2, _check_momentum_resume, exchange)
