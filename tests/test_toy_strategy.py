"""Adding a strategy is one spec, one class that names it and a line in each of the two tables
(docs/adding-a-strategy.md): a toy strategy added that way, and nowhere else, trains through the
real training loop and is projected by the performance model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_parameters, in_workers, tiny_study, validated
from torch import nn

from dtstudy.config.study_config import run_config
from dtstudy.perfmodel import steps
from dtstudy.perfmodel.collectives import allreduce_time
from dtstudy.perfmodel.machine import Link, Machine, Workload
from dtstudy.perfmodel.waits import synchronous_wait
from dtstudy.projection import project
from dtstudy.runspec import RunSpec
from dtstudy.strategies import registry, specs
from dtstudy.strategies.base import OptimizerFactory, Strategy
from dtstudy.training.loop import train_worker

TOY = "toy_mean"


# ----- the spec: its name, family, knobs (none), performance model -----------------------


class ToyMeanSpec(specs.StrategySpec):
    name = TOY
    family = "synchronous"

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        """The whole gradient all-reduced after backward: nothing hidden."""
        if workers == 1:
            return steps.alone(cls.name, workload, stragglers)
        exchange = allreduce_time(workload.model_bytes, workers, machine, messages=10)  # one message per tensor
        return steps.finish(
            cls.name,
            workload,
            workers,
            workload.compute_s,
            exchange,
            exchange,
            straggler=synchronous_wait(stragglers, workers),
        )


# ----- the class file: the exchange ------------------------------------------------------


class ToyMean(Strategy):
    """After backward, every gradient all-reduced (summed) and divided by N, one tensor at a
    time, then each worker's own optimizer: synchronous SGD without DDP's buckets."""

    spec = ToyMeanSpec  # its name is the spec's
    resumable = True

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        self.model = model.to(self.ctx.device)
        self.optimizer = make_optimizer(self.model.parameters())
        return self.model

    def update(self, lr: float) -> None:
        with self.meter.timed():
            for parameter in self.model.parameters():
                if self.ctx.workers > 1:
                    dist.all_reduce(parameter.grad)
                    parameter.grad /= self.ctx.workers
                    self.meter.bytes_sent += parameter.grad.numel() * parameter.grad.element_size()
        super().update(lr)

    def eval_model(self) -> nn.Module:
        return self.model


@pytest.fixture
def toy_registered(monkeypatch):
    """The spec's line in SPECS and the class's in STRATEGIES, as docs/adding-a-strategy.md says (undone after)."""
    monkeypatch.setitem(registry.STRATEGIES, TOY, ToyMean)
    monkeypatch.setitem(specs.SPECS, TOY, ToyMeanSpec)


def _train(ctx, spec: RunSpec) -> None:
    torch.set_num_threads(1)
    train_worker(spec, ctx)


def _run_spec(study: dict, strategy: str, tiny_data, out) -> RunSpec:
    config = run_config(study, "allreduce")
    config["strategy_params"] = {strategy: {}}
    return RunSpec(strategy=strategy, workers=2, seed=3, config=config, data_dir=str(tiny_data), out_dir=str(out))


class ToySum(ToyMean):
    """The control: the toy with a bug, the gradients summed and not averaged."""

    def update(self, lr: float) -> None:
        for parameter in self.model.parameters():
            dist.all_reduce(parameter.grad)
        Strategy.update(self, lr)


@pytest.mark.slow
def test_a_toy_strategy_trains_like_allreduce_at_n2(toy_registered, monkeypatch, tmp_path, tiny_data):
    """The toy's maths is allreduce's (the mean gradient, every step): through the real loop,
    with the study's default learning-rate scaling, both end at the same parameters; the toy
    with a bug (sum, not mean) does not."""
    study = validated(tiny_study(train={"max_steps": 8}))
    assert study["train"]["lr_scaling"] == "linear"  # the users' setting
    runs = {
        name: _run_spec(study, strategy, tiny_data, tmp_path / name)
        for name, strategy in (("toy", TOY), ("allreduce", "allreduce"), ("buggy", TOY))
    }
    assert runs["toy"].strategy_params() == {}  # no knobs: the schema has none for it
    for name, implementation in (("toy", ToyMean), ("allreduce", None), ("buggy", ToySum)):
        if implementation:
            monkeypatch.setitem(registry.STRATEGIES, TOY, implementation)
        (tmp_path / f"group-{name}").mkdir()
        in_workers(tmp_path / f"group-{name}", 2, _train, runs[name])
    final = {name: torch.load(spec.folder.model, weights_only=True)["state_dict"] for name, spec in runs.items()}
    assert_same_parameters(final["toy"], final["allreduce"], atol=1e-5)
    with pytest.raises(AssertionError):
        assert_same_parameters(final["buggy"], final["allreduce"], atol=1e-5)
    assert runs["toy"].folder.metrics.exists()


def test_a_toy_strategy_is_projected_from_its_spec(toy_registered):
    """The projection takes the toy's step from its spec alone: compute plus a hierarchical
    all-reduce of the whole gradient in ten messages, nothing hidden (hand-computed)."""
    workload = Workload(parameters=100_000, bytes_per_parameter=4, batch=32, compute_s=0.01)
    machine = Machine(gpus_per_node=4, intra=Link(1e-5, 1e10), inter=Link(5e-5, 1e9))
    rows = project.project(workload, machine, [TOY], [1, 4, 8], {TOY: {}}, "toy machine")
    step = {row["workers"]: row["step_s"] for row in rows}
    assert step[1] == pytest.approx(0.01)
    # N=4, one node: a ring of 4, 2*3 steps of 10 messages, 2*3/4 of 4e5 bytes at 1e10 B/s
    assert step[4] == pytest.approx(0.01 + 6 * 10 * 1e-5 + 1.5 * 4e5 / 1e10, rel=1e-12)
    # N=8, two nodes: that ring inside, then a ring of 2 nodes, 2 steps of 10 messages, 4e5 at 1e9 B/s
    assert step[8] == pytest.approx(0.01 + 6 * 10 * 1e-5 + 1.5 * 4e5 / 1e10 + 2 * 10 * 5e-5 + 4e5 / 1e9, rel=1e-12)
    assert [row["throughput"] for row in rows if row["workers"] == 8] == [pytest.approx(8 * 32 / step[8])]
    assert {row["overlap"] for row in rows} == {"none"}


def test_an_unregistered_strategy_is_refused_by_name():
    """Without its spec entry the toy is unknown to the config check and the projection."""
    config = validated(tiny_study())
    config["strategies"] = [TOY]
    from dtstudy.checks import check_config
    from dtstudy.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"strategies\[0\].*{TOY}.*allowed: allreduce"):
        check_config(config, check_data=False)
