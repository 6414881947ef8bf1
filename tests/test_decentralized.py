"""Decentralized strategies: local SGD, EASGD and gossip, through real training runs and, for
the gossip mixing step, in-process gloo workers; and their knob checks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_parameters, in_workers, tiny_study, train_run, validated

from dtstudy.errors import ConfigError
from dtstudy.strategies.gossip.strategy import Gossip, pair_partner, ring_neighbours
from dtstudy.strategies.local.strategy import EASGD, LocalSGD

PLAIN_SGD = {"momentum": 0.0, "weight_decay": 0.0}


@pytest.mark.slow
def test_local_sgd_with_period_1_equals_allreduce(tmp_path, tiny_data):
    """local_sgd with H=1 equals allreduce (plain SGD) (docs/strategies.md, "Equivalences the tests check")."""
    _, allreduce, _ = train_run(tmp_path, tiny_data, workers=2, batch_size=32, steps=8, **PLAIN_SGD)
    metrics, local, _ = train_run(
        tmp_path,
        tiny_data,
        workers=2,
        batch_size=32,
        steps=8,
        strategy="local_sgd",
        strategy_params={"period": 1},
        **PLAIN_SGD,
    )
    assert_same_parameters(local, allreduce, atol=1e-5)
    # averaging the parameters every step moves as many bytes as all-reducing the gradients
    lenet_bytes = sum(p.numel() for p in local.values()) * 4
    assert metrics["bytes_per_step"] == pytest.approx(lenet_bytes)

    # teeth: averaging every 4 steps lets the workers drift apart in between
    _, every_4, _ = train_run(
        tmp_path,
        tiny_data,
        workers=2,
        batch_size=32,
        steps=8,
        strategy="local_sgd",
        strategy_params={"period": 4},
        **PLAIN_SGD,
    )
    with pytest.raises(AssertionError):
        assert_same_parameters(every_4, allreduce, atol=1e-5)


@pytest.mark.slow
def test_local_sgd_warm_up_is_synchronous_sgd(tmp_path, tiny_data):
    """During warm-up (here every step) local_sgd all-reduces gradients: allreduce, momentum included."""
    _, allreduce, _ = train_run(tmp_path, tiny_data, workers=2, batch_size=32, steps=8)
    _, warm, _ = train_run(
        tmp_path,
        tiny_data,
        workers=2,
        batch_size=32,
        steps=8,
        strategy="local_sgd",
        strategy_params={"period": 100, "warmup_steps": 8},
    )
    assert_same_parameters(warm, allreduce, atol=1e-5)


@pytest.mark.slow
def test_easgd_and_gossip_on_one_worker_are_plain_sgd(tmp_path, tiny_data):
    """easgd and gossip on one worker reduce to plain SGD (docs/strategies.md, "Equivalences the tests check")."""
    metrics, sgd, _ = train_run(tmp_path, tiny_data, workers=1, batch_size=32, steps=12)
    for name, params in (("easgd", {"period": 1, "alpha": 1.0}), ("gossip", {})):
        other, state, _ = train_run(
            tmp_path, tiny_data, workers=1, batch_size=32, steps=12, strategy=name, strategy_params=params
        )
        assert_same_parameters(state, sgd, atol=1e-6)
        assert other["train_loss"] == metrics["train_loss"] and other["bytes_per_step"] == 0
        assert other["strategy_metrics"]["consensus_distance"] == [{"step": 12, "distance": 0.0}]


def test_easgd_exchanges_every_period(tmp_path, tiny_data):
    metrics, centre, _ = train_run(
        tmp_path, tiny_data, workers=2, batch_size=32, steps=8, strategy="easgd", strategy_params={"period": 4}
    )
    # the exchange (every 4 steps) all-reduces the parameters once: 2 of 8 steps, ring factor 1 at N=2
    lenet_bytes = sum(p.numel() for p in centre.values()) * 4
    assert metrics["steady_state_skip"] == 4
    assert metrics["bytes_per_step"] == pytest.approx(lenet_bytes / 4)
    # workers drift apart between exchanges
    assert metrics["strategy_metrics"]["consensus_distance"][-1]["distance"] > 0


@pytest.mark.slow
def test_averaged_resnet_gets_batch_norm_statistics_of_its_own(tmp_path, tiny_data):
    """An average of models is evaluated with BatchNorm statistics recomputed for it (the
    mean of the workers' running statistics is not the averaged model's): the checkpoint's
    statistics are those update_bn computes for its parameters on the first batches."""
    from dtstudy.common.run_folder import MODEL
    from dtstudy.config.study_config import run_config
    from dtstudy.data.loading import load_split
    from dtstudy.launch.launcher import run_training_job
    from dtstudy.runspec import RunSpec
    from dtstudy.strategies.base import Strategy
    from dtstudy.training.models import build_model

    batch = 8
    study = validated(
        tiny_study(
            strategies=["local_sgd"],
            workers=[2],
            model="resnet18",
            model_options={"small_input": True},
            strategy_params={"local_sgd": {"period": 3}},
            train={"batch_size": batch, "max_steps": 4},
        )
    )
    spec = RunSpec(
        strategy="local_sgd",
        workers=2,
        seed=0,
        config=run_config(study, "local_sgd"),
        data_dir=str(tiny_data),
        out_dir=str(tmp_path / "run"),
    )
    metrics = run_training_job(spec, tmp_path / "run" / "submitit")
    state = torch.load(tmp_path / "run" / MODEL, weights_only=True)["state_dict"]
    assert metrics["strategy_metrics"]["consensus_distance"][-1]["distance"] > 0  # averaged after 3, apart at 4
    model = build_model("resnet18", 1, 10, 28, {"small_input": True})
    model.load_state_dict(state)
    train_set = load_split(tiny_data, "train")
    count = Strategy.batch_norm_batches * batch
    torch.optim.swa_utils.update_bn(
        [train_set.batch(torch.arange(i, i + batch))[0] for i in range(0, count, batch)], model
    )
    recomputed = model.state_dict()
    statistics = [name for name in state if name.endswith(("running_mean", "running_var"))]
    assert len(statistics) == 2 * 20  # every BatchNorm of ResNet-18
    for name in statistics:
        torch.testing.assert_close(state[name], recomputed[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("workers, expected", [(1, []), (2, [1]), (3, [1, 2]), (5, [1, 4])])
def test_ring_neighbours(workers, expected):
    assert ring_neighbours(0, workers) == expected


def test_pair_partner():
    assert [pair_partner(rank, [2, 0, 3, 1, 4]) for rank in range(5)] == [[2], [3], [0], [1], []]


# ----- one exchange with in-process gloo workers ------------------------------------------------
def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _everyone(tensor: torch.Tensor) -> torch.Tensor:
    """workers x values"""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return torch.stack(gathered)


def _set_up_apart(strategy, ctx, momentum=0.0):
    """A small model with SGD, then parameters and gradients that differ per worker.
    Returns (the common starting point, the parameters)."""
    torch.manual_seed(0)  # the same model everywhere (and the same random pairing seed)
    model = strategy.setup(torch.nn.Linear(6, 4), lambda ps: torch.optim.SGD(ps, lr=0.0, momentum=momentum))
    start = _flat(model.parameters())
    torch.manual_seed(100 + ctx.rank)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter))
            parameter.grad = torch.randn_like(parameter)
    return start, list(model.parameters())


def _consensus(stacked: torch.Tensor) -> float:
    return (stacked - stacked.mean(0)).pow(2).sum(1).mean().item()


def _check_gossip(ctx, topology):
    strategy = Gossip(ctx, Gossip.check_params({"topology": topology}, ctx.workers))
    _, parameters = _set_up_apart(strategy, ctx)
    numel = _flat(parameters).numel()

    # with lr 0 only the mixing acts: the mean stays, the workers' spread never grows, and shrinks
    start = _everyone(_flat(parameters))
    after = start
    for _ in range(3):
        before = after
        strategy.update(0.0)
        after = _everyone(_flat(parameters))
        torch.testing.assert_close(after.mean(0), before.mean(0), atol=1e-6, rtol=0)
        assert _consensus(after) <= _consensus(before) + 1e-9
    assert _consensus(after) < 0.9 * _consensus(start)
    _, sent = strategy.meter.take()
    if topology == "ring":
        assert sent == 3 * 4 * numel * len(ring_neighbours(ctx.rank, ctx.workers))
    else:
        assert sent in (0, 4 * numel, 8 * numel, 12 * numel) and _everyone(torch.tensor([sent])).sum() > 0

    # the mean over workers moves exactly as one SGD step with the averaged gradient
    lr = 0.1
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    before, gradients = _everyone(_flat(parameters)), _everyone(_flat(p.grad for p in parameters))
    strategy.update(lr)
    after = _everyone(_flat(parameters))
    torch.testing.assert_close(after.mean(0), before.mean(0) - lr * gradients.mean(0), atol=1e-6, rtol=0)
    # eval_model is the workers' average, and the consensus distance is recorded
    torch.testing.assert_close(_flat(strategy.eval_model().parameters()), after.mean(0), atol=1e-6, rtol=0)
    assert strategy.summary()["consensus_distance"][-1]["distance"] == pytest.approx(_consensus(after), rel=1e-4)


@pytest.mark.parametrize("topology, workers", [("ring", 4), ("ring", 2), ("random_pairs", 3)])
def test_gossip_mixing_is_doubly_stochastic_and_contracts(tmp_path, topology, workers):
    in_workers(tmp_path, workers, _check_gossip, topology)


def _check_local_sgd(ctx, momentum):
    strategy = LocalSGD(ctx, LocalSGD.check_params({"period": 2}, ctx.workers))
    _, parameters = _set_up_apart(strategy, ctx, momentum)
    lr = 0.1
    strategy.update(lr)  # step 1: local only, the workers drift apart
    assert strategy.meter.take() == (0.0, 0.0)
    assert _consensus(_everyone(_flat(parameters))) > 0

    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    momenta = [strategy.optimizer.state[p]["momentum_buffer"] for p in parameters]
    local_momenta = _flat(momenta) * momentum + _flat(p.grad for p in parameters)
    local_parameters = _flat(parameters) - lr * local_momenta
    strategy.update(lr)  # step 2: local step, then parameters and momentum averaged
    for after, local in ((_flat(parameters), local_parameters), (_flat(momenta), local_momenta)):
        torch.testing.assert_close(
            _everyone(after), _everyone(local).mean(0).expand(ctx.workers, -1), atol=1e-6, rtol=0
        )
    ring = 2 * (ctx.workers - 1) / ctx.workers
    assert strategy.meter.take()[1] == pytest.approx(ring * 4 * 2 * local_parameters.numel())


def test_local_sgd_averages_parameters_and_momentum_every_period(tmp_path):
    in_workers(tmp_path, 3, _check_local_sgd, 0.9)


def _check_easgd(ctx, alpha):
    strategy = EASGD(ctx, EASGD.check_params({"period": 2, "alpha": alpha}, ctx.workers))
    centre, parameters = _set_up_apart(strategy, ctx)
    strategy.update(0.0)  # step 1: no exchange yet
    assert strategy.meter.take() == (0.0, 0.0)
    before = _everyone(_flat(parameters))
    strategy.update(0.0)  # step 2: the elastic exchange
    elastic = alpha * (before - centre)
    torch.testing.assert_close(_everyone(_flat(parameters)), before - elastic, atol=1e-6, rtol=0)
    torch.testing.assert_close(_flat(strategy.eval_model().parameters()), centre + elastic.sum(0), atol=1e-6, rtol=0)
    assert strategy.meter.take()[1] == pytest.approx(2 * (ctx.workers - 1) / ctx.workers * 4 * centre.numel())


def test_easgd_elastic_exchange_moves_workers_and_centre(tmp_path):
    in_workers(tmp_path, 3, _check_easgd, 0.3)


# ----- knob checks before any job starts --------------------------------------------------------
@pytest.mark.parametrize(
    "name, knob, value",
    [
        ("local_sgd", "period", 0),
        ("local_sgd", "warmup_steps", -1),
        ("easgd", "period", 0),
        ("easgd", "alpha", 0),
        ("easgd", "alpha", 1.5),
        ("easgd", "beta", 2),
        ("gossip", "topology", "star"),
        ("allreduce_powersgd", "rank", 0),
        ("allreduce_powersgd", "start_powerSGD_iter", 1),
        ("allreduce_powersgd", "warm_start", "yes"),
    ],
)
def test_bad_knobs_stop_the_study_naming_the_key(name, knob, value):
    config = tiny_study(strategies=[name], strategy_params={name: {knob: value}})
    with pytest.raises(ConfigError, match=rf"strategy_params\.{name}\.{knob}'") as err:
        validated(config)
    assert repr(value) in str(err.value)


@pytest.mark.parametrize(
    "alpha, workers, first_bad, bound", [(1, [1, 2], 2, "0.5"), (0.3, [1, 2, 4], 4, "0.25"), (0.6, [2], 2, "0.5")]
)
def test_easgd_rejects_n_alpha_above_one_before_any_job(alpha, workers, first_bad, bound):
    """c <- (1 - N alpha) c + N alpha mean(x): degenerate at N alpha = 2 (alpha 1, N=2), unstable past."""
    config = tiny_study(strategies=["easgd"], workers=workers, strategy_params={"easgd": {"alpha": alpha}})
    with pytest.raises(ConfigError, match=r"strategy_params\.easgd\.alpha'") as err:
        validated(config)
    message = str(err.value)
    assert repr(alpha) in message and "N*alpha must be <= 1" in message and bound in message
    assert f"1/N = {bound} with N={first_bad} in workers" in message
    # alpha = 1 / N at the largest N is the bound itself: allowed
    validated(tiny_study(strategies=["easgd"], workers=workers, strategy_params={"easgd": {"alpha": 1 / max(workers)}}))


@pytest.mark.parametrize(
    "name, knobs",
    [
        ("local_sgd", {"period": 1, "warmup_steps": 5}),
        ("easgd", {"alpha": 0.5}),
        ("easgd", {"beta": 0.5}),
        ("gossip", {"topology": "random_pairs"}),
        ("allreduce_powersgd", {"rank": 1, "warm_start": False, "use_error_feedback": False, "start_powerSGD_iter": 0}),
    ],
)
def test_good_knobs_pass(name, knobs):
    validated(tiny_study(strategies=[name], strategy_params={name: knobs}))
