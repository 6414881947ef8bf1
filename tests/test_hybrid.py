"""hybrid (Krizhevsky 2014): data-parallel layers before the fully connected ones, each fully
connected layer's outputs split over the workers. Its update is allreduce's (docs/strategies.md,
"Equivalences the tests check"), its bytes are the formula's, and its step model is checked by
hand (a specification test: it restates perfmodel.steps.hybrid_step's sum)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_same_parameters, in_workers, read_json, tiny_study, validated

from dtstudy.config.study_config import run_config
from dtstudy.perfmodel import steps
from dtstudy.perfmodel.machine import Link, Machine, Workload
from dtstudy.projection import layer_profiles
from dtstudy.runspec import RunSpec
from dtstudy.strategies import registry, specs
from dtstudy.strategies.allreduce.strategy import AllReduce
from dtstudy.strategies.hybrid.strategy import Hybrid, shard_sizes
from dtstudy.training.loop import train_worker

LENET_LINEAR = ((400, 120), (120, 84), (84, 10))  # LeNet-5 on 28-pixel images
LENET_PARAMETERS, LENET_LINEAR_PARAMETERS = 61706, 59134


class HybridSummed(Hybrid):
    """The control: hybrid with the shards' gradients left as the sum of the N workers'
    per-worker means (the 1/N forgotten), the data-parallel part still averaged."""

    def backward(self, loss) -> None:
        AllReduce.backward(self, loss)


def _train(ctx, spec: RunSpec) -> None:
    torch.set_num_threads(1)
    train_worker(spec, ctx)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    """run(strategy, workers, implementation) -> (final state_dict, metrics.json), each once:
    12 steps of the tiny study through the real training loop on gloo, with config.yaml's
    recipe (linear rule, base_lr 0.2, warm-up, momentum, weight decay, batch 32 per worker)."""
    done = {}
    study = validated(tiny_study(train={"max_steps": 12, "base_lr": 0.2, "warmup_epochs": 0.3}))
    assert study["train"]["lr_scaling"] == "linear" and study["train"]["momentum"] == 0.9

    def run(strategy: str, workers: int, implementation=None):
        key = (strategy, workers, implementation)
        if key not in done:
            folder = tmp_path_factory.mktemp(f"{strategy}-n{workers}")
            config = run_config(study, strategy)
            spec = RunSpec(
                strategy=strategy,
                workers=workers,
                seed=3,
                config=config,
                data_dir=str(tiny_data),
                out_dir=str(folder / "run"),
            )
            saved = registry.STRATEGIES[strategy]
            registry.STRATEGIES[strategy] = implementation or saved
            try:
                (folder / "group").mkdir()
                in_workers(folder / "group", workers, _train, spec)
            finally:
                registry.STRATEGIES[strategy] = saved
            done[key] = (torch.load(spec.folder.model, weights_only=True)["state_dict"], read_json(spec.folder.metrics))
        return done[key]

    return run


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.slow
def test_hybrid_updates_as_allreduce(runs, workers):
    """Split fully connected layers, exchanged activations, the shards' gradients divided by N:
    after 12 steps the same parameters as allreduce's to float tolerance (the sums of the
    fully connected layers run in another order). The control, the same run with the 1/N
    forgotten, lands elsewhere."""
    hybrid, metrics = runs("hybrid", workers)
    allreduce, _ = runs("allreduce", workers)
    assert metrics["steps"] == 12 and metrics["lr_schedule"]["update_batch"] == 32 * workers
    assert_same_parameters(hybrid, allreduce, atol=1e-5)  # the full model, gathered (eval_model)
    summed, _ = runs("hybrid", workers, HybridSummed)
    with pytest.raises(AssertionError):
        assert_same_parameters(summed, allreduce, atol=1e-5)


@pytest.mark.parametrize("workers", [2, 4])
def test_hybrid_bytes_are_the_formula_and_below_allreduce_at_n2(runs, workers):
    """The bytes recorded per step are the formula's (hand-checked at N=2 below); on LeNet-5
    with b=32 they are below allreduce's at N=2. The control is N=4: there N b = 128 rows of
    activations outweigh the fully connected weights (the crossover is near N b = 100 for
    LeNet-5's 400-120-84-10 layers) and the same comparison fails, as the formula says."""
    _, metrics = runs("hybrid", workers)
    _, baseline = runs("allreduce", workers)
    shared = metrics["strategy_metrics"]
    assert shared["model_parallel_layers"] == [list(layer) for layer in LENET_LINEAR]
    assert shared["model_parallel_parameters"] == LENET_LINEAR_PARAMETERS
    other = LENET_PARAMETERS - LENET_LINEAR_PARAMETERS
    expected = steps.hybrid_bytes_per_step(LENET_LINEAR, 32, workers, other, 4)
    assert metrics["bytes_per_step"] == pytest.approx(expected, rel=1e-12)
    assert shared["activation_bytes_per_step"] + shared["gradient_bytes_per_step"] == pytest.approx(expected)
    assert baseline["bytes_per_step"] == pytest.approx(2 * (workers - 1) / workers * LENET_PARAMETERS * 4)
    if workers == 2:
        # by hand: 2 (N-1) x 4 bytes x [32 x 400 + 64 x 60 + 64 x 42 + 32 x 5], plus the
        # 2572 other parameters' ring all-reduce (N-1)/N x 2 x 4 bytes
        assert expected == 8 * (12800 + 3840 + 2688 + 160) + 2572 * 4
        assert metrics["bytes_per_step"] < baseline["bytes_per_step"]
    else:
        with pytest.raises(AssertionError):
            assert metrics["bytes_per_step"] < baseline["bytes_per_step"]
    assert metrics["step_time"]["comm_s"] > 0


class _Head(torch.nn.Module):
    """A convolution and two fully connected layers, `body` then `head` in the forward; the
    module order is the forward's unless `swapped` (then `head` is registered first)."""

    def __init__(self, swapped: bool):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(1, 2, 3)
        layers = {"body": torch.nn.Linear(2 * 26 * 26, 8), "head": torch.nn.Linear(8, 4)}
        for name in ("head", "body") if swapped else ("body", "head"):
            setattr(self, name, layers[name])

    def forward(self, x):
        return self.head(torch.relu(self.body(self.conv(x).flatten(1))))


def _one_step(ctx, swapped: bool) -> None:
    strategy = Hybrid(ctx, {"bucket_cap_mb": 25})
    module = strategy.setup(_Head(swapped), lambda ps: torch.optim.SGD(ps, lr=0.1))
    inputs, labels = torch.randn(4, 1, 28, 28), torch.randint(0, 4, (4,))
    if swapped:
        with pytest.raises(RuntimeError, match="must be, in module order, the chain its forward ends with"):
            module(inputs)
        return
    strategy.backward(torch.nn.functional.cross_entropy(module(inputs), labels))
    strategy.update(0.1)
    assert [tuple(p.shape) for p in strategy.eval_model().parameters()] == [
        (2, 1, 3, 3),
        (2,),
        (8, 1352),
        (8,),
        (4, 8),
        (4,),
    ]


@pytest.mark.parametrize("swapped", [False, True])
def test_a_model_whose_layers_are_not_the_forwards_chain_is_refused(tmp_path, swapped):
    """The fully connected layers are taken in module order: a model registering them in
    another order than its forward runs them fails on its first step, saying why; the same
    model in order (the control) trains and gathers back its full layers."""
    in_workers(tmp_path, 2, _one_step, swapped)


def test_shards_cover_every_output_once():
    assert shard_sizes(10, 4) == [3, 3, 2, 2] and shard_sizes(120, 4) == [30] * 4 and shard_sizes(2, 4) == [1, 1, 0, 0]
    for features, workers in ((10, 4), (84, 8), (1000, 64), (3, 4)):
        assert sum(shard_sizes(features, workers)) == features


# ----- the performance model -------------------------------------------------------------

MACHINE = Machine(gpus_per_node=4, intra=Link(1e-5, 1e10), inter=Link(5e-5, 1e9))


def test_hybrid_step_by_hand():
    """Specification test: restates hybrid_step's sum on LeNet-5's layers, by hand, on one
    node (N=4) and across two (N=8); no layer profile and no fixed overlap, so the whole
    exchange is exposed. The control: the activations counted once (forward only) is not
    what the model gives."""
    workload = Workload(LENET_PARAMETERS, 4, 32, 0.01, linear=LENET_LINEAR)
    a, b = MACHINE.intra, MACHINE.inter
    other = (LENET_PARAMETERS - LENET_LINEAR_PARAMETERS) * 4  # 10288 bytes
    # N=4, one node: all-gathers of 32x400, 128x30 and 128x21 floats, an all-to-all of 32x3
    gathers = sum(3 * a.latency_s + 3 * each / a.bandwidth for each in (32 * 400 * 4, 128 * 30 * 4, 128 * 21 * 4))
    to_rows = 3 * a.latency_s + 3 * 32 * 3 * 4 / a.bandwidth
    gradient = 6 * a.latency_s + 1.5 * other / a.bandwidth  # ring of 4, one bucket
    step = specs.model_step("hybrid", workload, MACHINE, 4)
    assert step.exchange_s == pytest.approx(gradient + 2 * (gathers + to_rows), rel=1e-12)
    assert step.step_s == pytest.approx(0.01 + gradient + 2 * (gathers + to_rows), rel=1e-12)
    assert step.step_s != pytest.approx(0.01 + gradient + gathers + to_rows, rel=1e-6)  # control
    assert step.throughput == pytest.approx(4 * 32 / step.step_s)
    # N=8, two nodes: inside each node as above (3 others), and across: an all-gather brings
    # the 4 other node's messages through the NIC, an all-to-all sends 4 x 4 of them
    gathers = sum(
        3 * a.latency_s + 3 * each / a.bandwidth + b.latency_s + 4 * each / b.bandwidth
        for each in (32 * 400 * 4, 256 * 15 * 4, 256 * 11 * 4)
    )
    to_rows = 3 * a.latency_s + 3 * 256 / a.bandwidth + 4 * b.latency_s + 16 * 256 / b.bandwidth  # 32x2 floats
    gradient = 6 * a.latency_s + 1.5 * other / a.bandwidth + 2 * b.latency_s + other / b.bandwidth
    assert specs.model_step("hybrid", workload, MACHINE, 8).step_s == pytest.approx(
        0.01 + gradient + 2 * (gathers + to_rows), rel=1e-12
    )
    assert specs.model_step("hybrid", workload, MACHINE, 1).step_s == 0.01  # trains unwrapped


def test_hybrid_step_needs_the_fully_connected_layers():
    with pytest.raises(ValueError, match="fully connected layers"):
        specs.model_step("hybrid", Workload(LENET_PARAMETERS, 4, 32, 0.01), MACHINE, 4)
    # a layer profile gives them, and its other tensors are the data-parallel part
    lenet = layer_profiles.load("lenet5", "test")
    assert lenet.linear == LENET_LINEAR
    assert sum(v for v, _ in lenet.without_linear().tensors) == LENET_PARAMETERS - LENET_LINEAR_PARAMETERS
    profiled = Workload(LENET_PARAMETERS, 4, 32, 0.01, layers=lenet)
    assert profiled.fully_connected == LENET_LINEAR and profiled.linear_parameters == LENET_LINEAR_PARAMETERS


@pytest.mark.parametrize(
    "name, workers, pays",
    [
        ("vgg16", 8, True),
        ("resnet50", 8, True),
        ("resnet50", 64, False),
        ("alexnet_small", 2, True),
        ("alexnet_small", 4, True),
        ("lenet5", 2, True),
        ("lenet5", 4, False),
    ],
)
def test_where_hybrid_pays_in_bytes(name, workers, pays):
    """Bytes per step against allreduce's at b=32 on the shipped profiles: VGG-16's and
    alexnet_small's fully connected layers (89% and 93% of their values) make the activations
    cheap; ResNet-50's one 2048x1000 classifier (8% of its values) saves little, and at N=64
    the all-gathered features (N-1) b 2048 outweigh it; LeNet-5's 120-wide first layer is
    cheaper split only while N b < ~100."""
    profile = layer_profiles.load(name, "test")
    parameters = sum(v for v, _ in profile.tensors)
    linear = sum((i + 1) * o for i, o in profile.linear)
    hybrid = steps.hybrid_bytes_per_step(profile.linear, 32, workers, parameters - linear, 4)
    allreduce = 2 * (workers - 1) / workers * parameters * 4
    assert (hybrid < allreduce) is pays
    assert math.isclose(
        linear / parameters,
        {"vgg16": 0.894, "resnet50": 0.080, "alexnet_small": 0.932, "lenet5": 0.958}[name],
        abs_tol=1e-3,
    )
    if name == "alexnet_small":  # docs/strategies.md: about a ninth of allreduce's at N=2, a sixth at N=4
        assert round(allreduce / hybrid) == {2: 9, 4: 6}[workers]


def _fake_run(folder, strategy, workers, throughput, bytes_per_step):
    import json

    folder.mkdir(parents=True)
    step = 64 * workers / throughput
    comm = 0.0005 if workers > 1 else 0.0
    (folder / "metrics.json").write_text(
        json.dumps(
            {
                "strategy": strategy,
                "workers": workers,
                "seed": 0,
                "throughput": throughput,
                "step_time": {"total_s": step, "compute_s": step - comm, "comm_s": comm, "data_s": 0.0},
                "bytes_per_step": bytes_per_step,
                "per_worker_batch": 64,
                "environment": {"oversubscribed": False},
                "strategy_params": {},
            }
        )
    )
    return str(folder / "metrics.json")


def test_the_project_rule_projects_hybrid(tmp_path):
    """The study's `project` rule takes hybrid from its spec: at N=2 on this machine's fitted
    links (hand-computed below, b = 64), and with a model no layer profile fits (LeNet-5 on
    3-channel 32-pixel images) its fully connected layers from a run's model.pt."""
    import json

    from dtstudy.projection import calibration, project
    from dtstudy.training.models import build_model

    metrics = [
        _fake_run(tmp_path / "a1", "allreduce", 1, 8000.0, 0.0),
        _fake_run(tmp_path / "a2", "allreduce", 2, 14000.0, LENET_PARAMETERS * 4.0),
    ]
    bench = {
        "fit": {"allreduce": {"latency_s": 1e-4, "bandwidth": 2e9}, "p2p": {"latency_s": 5e-5, "bandwidth": 2e9}},
        "kernels_s_per_byte": {"server_pass": 5e-11},
        "jitter": {"skew_fraction": 0.0},
        "compute_scale": {"1": 1.0, "2": 1.0},
        "cpu_share": {"1": 1.0, "2": 1.0},
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    config = {
        "model": "lenet5",
        "strategies": ["allreduce", "hybrid"],
        "strategy_params": {},
        "stragglers": {},
        "projection": {"workers": [1, 2, 64], "hardware": "this_machine"},
    }
    rows = project.run_study(
        metrics,
        str(tmp_path / "bench.json"),
        config,
        str(tmp_path / "p.csv"),
        str(tmp_path / "p.md"),
        str(tmp_path / "p.png"),
    )
    assert {(r["strategy"], r["workers"]) for r in rows} == {
        (s, n) for s in ("allreduce", "hybrid") for n in (1, 2, 64)
    }
    exchange = {r["strategy"]: r["step_exchange_s"] for r in rows if r["workers"] == 2}
    # the other layers' 10288 bytes all-reduced by 2 (2 alphas, all the bytes once), and twice
    # (forward, backward) the gathers of 64x400, 128x60 and 128x42 floats and the all-to-all of 64x5
    activations = 4 * 1e-4 + (64 * 400 + 128 * 60 + 128 * 42 + 64 * 5) * 4 / 2e9
    assert exchange["hybrid"] == pytest.approx(2e-4 + 10288 / 2e9 + 2 * activations, rel=1e-9)
    assert (
        "the fully connected layers, (inputs, outputs): [[400, 120], [120, 84], [84, 10]] (the layer profile)"
        in (tmp_path / "p.md").read_text()
    )

    torch.save({"state_dict": build_model("lenet5", 3, 10, 32, {}).state_dict()}, tmp_path / "a1" / "model.pt")
    assert calibration.linear_from_checkpoint(tmp_path / "a1" / "model.pt") == ((576, 120), (120, 84), (84, 10))
    metrics[1] = _fake_run(tmp_path / "b2", "allreduce", 2, 14000.0, 83126 * 4.0)
    rows = project.run_study(
        metrics,
        str(tmp_path / "bench.json"),
        config,
        str(tmp_path / "p.csv"),
        str(tmp_path / "p.md"),
        str(tmp_path / "p.png"),
    )
    assert "[[576, 120], [120, 84], [84, 10]] (the 2-d weights of a run's model.pt)" in (tmp_path / "p.md").read_text()
    assert all(r["throughput"] > 0 for r in rows if r["strategy"] == "hybrid")


def test_the_project_command_needs_a_layer_profile_for_hybrid(tmp_path):
    """`python -m dtstudy project` on a measurement file: without model.layer_profile hybrid's
    fully connected layers are unknown and the command says which key; with one (ResNet-50's,
    the control) it projects hybrid, whose one small classifier leaves it slower than
    allreduce at N=64 on a 10 Gbit/s network. A model named like a shipped profile takes
    that profile without the key (the same projection)."""
    import yaml

    from dtstudy.errors import ConfigError
    from dtstudy.projection import project

    measured = {
        "model": {"name": "my_resnet50", "parameters": 25557032, "bytes_per_parameter": 4},
        "per_worker_batch": 64,
        "throughput": {1: 52.4, 8: 378},
    }
    hardware = {"gpus_per_node": 8, "inter_node": {"bandwidth_gbit_s": 10, "latency_us": 50}}
    (tmp_path / "H.yaml").write_text(yaml.safe_dump(hardware))
    (tmp_path / "M.yaml").write_text(yaml.safe_dump(measured))
    args = (str(tmp_path / "M.yaml"), str(tmp_path / "H.yaml"), "allreduce,hybrid", "1,8,64")
    with pytest.raises(ConfigError, match="key 'model.layer_profile' is missing; hybrid need"):
        project.run_command(*args, str(tmp_path / "p.csv"))
    measured["model"]["layer_profile"] = "resnet50"
    (tmp_path / "M.yaml").write_text(yaml.safe_dump(measured))
    rows = {(r["strategy"], r["workers"]): r for r in project.run_command(*args, str(tmp_path / "p.csv"))}
    assert rows[("hybrid", 64)]["throughput"] < rows[("allreduce", 64)]["throughput"]
    measured["model"] = {"name": "resnet50", "parameters": 25557032, "bytes_per_parameter": 4}
    (tmp_path / "M.yaml").write_text(yaml.safe_dump(measured))
    named = {(r["strategy"], r["workers"]): r for r in project.run_command(*args, str(tmp_path / "p.csv"))}
    assert named[("hybrid", 64)]["throughput"] == rows[("hybrid", 64)]["throughput"]
