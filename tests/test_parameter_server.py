"""Parameter-server strategies (ps_sync, ps_backup, ps_async, ssp): the maths checks of
docs/strategies.md ("Parameter servers", "Equivalences the tests check") through the real
training path, the staleness record, and the knob checks."""

from __future__ import annotations

import io
import itertools
import math
import os
import random
import signal
import threading

import pytest
import torch
from conftest import assert_same_parameters, tiny_study, train_run, validated

from dtstudy.errors import ConfigError
from dtstudy.strategies.parameter_server.protocol import split_contiguous
from dtstudy.strategies.parameter_server.shard import ShardServer, UpdatePolicy
from dtstudy.strategies.registry import STRATEGIES

STEPS = 12
TEST_DEADLINE_S = 240  # a hung exchange must not stall the suite until gloo's own timeout


@pytest.fixture(autouse=True)
def deadline():
    """SIGTERM ourselves past the deadline: the launcher then cancels the job and the test fails."""
    timer = threading.Timer(TEST_DEADLINE_S, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    yield
    timer.cancel()


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_data):
    """train_run, each distinct run once per module: run(strategy, workers, batch_size, **knobs)."""
    done = {}

    def run_once(strategy, workers=2, batch_size=32, **knobs):
        key = (strategy, workers, batch_size, tuple(sorted(knobs.items())))
        if key not in done:
            folder = tmp_path_factory.mktemp(strategy)
            done[key] = train_run(
                folder, tiny_data, workers, batch_size, steps=STEPS, strategy=strategy, strategy_params=knobs
            )
        metrics, parameters, _ = done[key]
        return metrics, parameters

    return run_once


@pytest.mark.parametrize("shards", [1, 2, 3])  # 2 and 3 cut LeNet-5's 48000-value layer between shards
def test_ps_sync_equals_allreduce_and_one_worker_with_double_batch(run, shards):
    metrics, parameters = run("ps_sync", shards=shards)
    assert_same_parameters(parameters, run("allreduce")[1], atol=1e-5)
    assert_same_parameters(parameters, run("allreduce", workers=1, batch_size=64)[1], atol=1e-5)

    shard_metrics = metrics["strategy_metrics"]
    assert shard_metrics["updates"] == STEPS * shards
    assert shard_metrics["staleness"] == {"0": 2 * STEPS * shards}  # every step waits for both workers
    values = sum(p.numel() for p in parameters.values())
    # balanced contiguous ranges: the first M % S shards one value more
    assert shard_metrics["shard_numel"] == [values // shards + (s < values % shards) for s in range(shards)]
    assert 0 < shard_metrics["shard_busy_fraction"] < 1
    gradient_bytes = sum(p.numel() for p in parameters.values()) * 4
    assert gradient_bytes < metrics["bytes_per_step"] < gradient_bytes + 100 * shards  # plus request headers
    assert metrics["step_time"]["comm_s"] > 0 and metrics["environment"]["processes"] == 2 + shards


@pytest.mark.slow
def test_ps_backup_without_backups_equals_ps_sync(run):
    _, sync = run("ps_sync", shards=1)
    assert_same_parameters(run("ps_backup", backup=0)[1], sync, atol=1e-5)

    # one backup worker: every push either made an update (alone) or was dropped
    metrics, backup = run("ps_backup", backup=1)
    shard_metrics = metrics["strategy_metrics"]
    assert shard_metrics["updates"] == shard_metrics["gradients_applied"]
    assert shard_metrics["gradients_applied"] + shard_metrics["dropped_gradients"] == 2 * STEPS
    assert shard_metrics["dropped_gradients"] > 0
    assert shard_metrics["images_applied"] == 32 * shard_metrics["gradients_applied"]
    # the rate of the (N-k) b = 32 images an update averages, not of N b = 64
    assert metrics["lr_schedule"]["update_batch"] == 32 and metrics["lr_schedule"]["peak_lr"] == pytest.approx(0.1)
    with pytest.raises(AssertionError):
        assert_same_parameters(backup, sync, atol=1e-5)


@pytest.mark.slow
def test_ps_async_with_one_worker_is_plain_sgd(run):
    metrics, parameters = run("ps_async", workers=1)
    assert_same_parameters(parameters, run("allreduce", workers=1)[1], atol=1e-5)
    assert metrics["strategy_metrics"]["staleness"] == {"0": STEPS}


def test_ps_async_records_staleness(run):
    metrics, parameters = run("ps_async")
    shard_metrics = metrics["strategy_metrics"]
    histogram = {int(value): count for value, count in shard_metrics["staleness"].items()}
    assert shard_metrics["updates"] == 2 * STEPS  # each worker's gradients, one update each
    assert sum(histogram.values()) == shard_metrics["updates"]
    assert max(histogram) > 0 and shard_metrics["staleness_max"] == max(histogram)
    assert shard_metrics["staleness_mean"] == pytest.approx(
        sum(value * count for value, count in histogram.items()) / shard_metrics["updates"]
    )
    # every gradient is its own update, so the parameters leave the synchronous path
    with pytest.raises(AssertionError):
        assert_same_parameters(parameters, run("ps_sync", shards=1)[1], atol=1e-5)


SLOW_RANK_1 = {"ranks": [1], "delay_ms": 150, "distribution": "fixed"}  # rank 0 steps in ~10 ms
PLAIN_SGD_LINEAR = {"momentum": 0.0, "weight_decay": 0.0, "lr_scaling": "linear"}


@pytest.mark.slow
def test_ssp_with_a_straggler_reaches_but_never_exceeds_its_clock_bound(tmp_path, tiny_data):
    """Ho et al. 2013: the fast worker runs up to s clocks ahead of the straggler, never more;
    the version staleness stays within (N-1)(2s+1). ps_async, unbounded, runs further ahead."""
    s = 2
    ssp = train_run(
        tmp_path,
        tiny_data,
        2,
        32,
        steps=STEPS,
        strategy="ssp",
        strategy_params={"staleness": s},
        stragglers=SLOW_RANK_1,
    )[0]["strategy_metrics"]
    assert ssp["updates"] == 2 * STEPS and ssp["dropped_gradients"] == 0
    assert ssp["clock_ahead_max"] == s  # reached: the fast worker waited at s clocks ahead
    assert max(int(ahead) for ahead in ssp["clock_ahead"]) == s
    assert 0 < ssp["staleness_max"] <= (2 - 1) * (2 * s + 1)

    unbounded = train_run(tmp_path, tiny_data, 2, 32, steps=STEPS, strategy="ps_async", stragglers=SLOW_RANK_1)[0][
        "strategy_metrics"
    ]
    assert unbounded["clock_ahead_max"] > s + 2


@pytest.mark.slow
def test_ssp_without_staleness_equals_ps_sync_with_the_linear_rule(tmp_path, tiny_data):
    """ssp with s=0, momentum 0 and the linear rule equals ps_sync: at s=0 every clock is a
    barrier, and N updates of batch b at the rate of b are one update of N b at its rate
    (docs/strategies.md, "Equivalences the tests check")."""
    sync_metrics, sync, _ = train_run(tmp_path, tiny_data, 2, 32, steps=STEPS, strategy="ps_sync", **PLAIN_SGD_LINEAR)
    ssp_metrics, ssp, _ = train_run(
        tmp_path, tiny_data, 2, 32, steps=STEPS, strategy="ssp", strategy_params={"staleness": 0}, **PLAIN_SGD_LINEAR
    )
    assert_same_parameters(ssp, sync, atol=1e-5)
    # each ssp update is one worker's batch, at that batch's rate: half ps_sync's
    assert (ssp_metrics["lr_schedule"]["update_batch"], sync_metrics["lr_schedule"]["update_batch"]) == (32, 64)
    assert ssp_metrics["lr_schedule"]["peak_lr"] == pytest.approx(sync_metrics["lr_schedule"]["peak_lr"] / 2)
    assert ssp_metrics["strategy_metrics"]["updates"] == 2 * STEPS
    assert ssp_metrics["strategy_metrics"]["clock_ahead_max"] == 0


def test_ps_backup_drops_only_pushes_whose_version_was_updated(tmp_path, tiny_data):
    """Chen et al. 2016 / SyncReplicas: a push is tagged by the version it read. The straggler's
    pushes are dropped while the fast worker updates the versions it read; once the fast worker
    is done (it waits at the evaluation), the straggler reads fresh versions and its gradients
    count. A worker's own step counter would drop all of the straggler's pushes."""
    metrics = train_run(
        tmp_path,
        tiny_data,
        2,
        32,
        steps=STEPS,
        strategy="ps_backup",
        strategy_params={"backup": 1},
        stragglers=SLOW_RANK_1,
    )[0]
    shard_metrics = metrics["strategy_metrics"]
    fast, slow = shard_metrics["dropped_by_worker"]
    assert fast == 0  # never dropped for a version it read fresh
    assert 1 <= slow < STEPS
    assert shard_metrics["gradients_applied"] == 2 * STEPS - slow
    assert shard_metrics["images_applied"] == 32 * (2 * STEPS - slow) < metrics["images"]
    assert shard_metrics["dropped_fraction"] == pytest.approx(slow / (2 * STEPS))


# ----- one shard driven in-process: the update policies on scripted arrival orders -------------
class ScriptedShard(ShardServer):
    """A shard whose replies are recorded instead of sent."""

    def __init__(self, workers: int, policy: UpdatePolicy, numel: int = 3):
        super().__init__(workers, None, policy)
        self.start(torch.zeros(numel))
        self.replies: list[tuple[int, int, torch.Tensor]] = []  # worker, version, parameters

    def _reply(self, workers):
        self.replies += [(worker, self.version, self.parameters.detach().clone()) for worker in workers]


def gradient_of(worker: int, parameters: torch.Tensor) -> torch.Tensor:
    """A deterministic gradient that depends on the parameters the worker read."""
    return (worker + 1.0) * parameters + torch.tensor([1.0, -2.0, 0.5]) * (3 * worker - 1.0)


def drive(policy: UpdatePolicy, order: list[int], lr: float, workers: int = 2, even: bool = False) -> ScriptedShard:
    """Workers push in `order`; a worker still waiting for its reply skips its turn. `even`:
    then the workers behind push until every worker has pushed as often (a complete clock)."""
    shard = ScriptedShard(workers, policy)
    holding = {worker: (0, torch.zeros(3)) for worker in range(workers)}  # what each read

    def behind():
        return [w for w in sorted(holding) if shard.clocks[w] < max(shard.clocks)] if even else []

    for worker in itertools.chain(order, iter(lambda: (behind() or [None])[0], None)):
        if worker not in holding:
            continue
        version, parameters = holding.pop(worker)
        answered = len(shard.replies)
        shard.take(worker, version, lr, gradient_of(worker, parameters))
        for replied, version, parameters in shard.replies[answered:]:
            holding[replied] = (version, parameters)
    return shard


def random_order(pushes: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([0, 1, 1, 0, 0]) for _ in range(pushes)]  # bursts of one worker


def test_ssp_unbounded_answers_as_ps_async():
    for seed in range(3):
        order = random_order(40, seed)
        # ssp with s = null (its knobs' defaults otherwise, staleness_lr on as ps_async's)
        ssp = STRATEGIES["ssp"]
        unbounded = drive(ssp.update_policy(_Fake(ssp, ssp.check_params({"staleness": None}, 2))), order, 0.1)
        ps_async = drive(STRATEGIES["ps_async"].update_policy(_Fake(STRATEGIES["ps_async"], {})), order, 0.1)
        assert [(w, v) for w, v, _ in unbounded.replies] == [(w, v) for w, v, _ in ps_async.replies]
        assert torch.equal(unbounded.parameters, ps_async.parameters)
        bounded = drive(UpdatePolicy.asynchronous(1), order, 0.1)
        assert len(bounded.replies) < len(unbounded.replies)  # teeth: a bound makes workers wait


def test_ssp_reads_include_own_updates_and_wait_at_the_bound():
    shard = drive(UpdatePolicy.asynchronous(2), [0, 0, 0, 0, 0], 0.1)
    # worker 0 goes on after its 1st and 2nd push (clock 1, 2 <= 2 ahead of worker 1 at 0), each
    # reply holding its own updates; its 3rd push (clock 3) waits for worker 1
    assert [(w, v) for w, v, _ in shard.replies] == [(0, 1), (0, 2)]
    assert dict(shard.stats.ahead) == {1: 1, 2: 1}
    shard.take(1, 0, 0.1, gradient_of(1, torch.zeros(3)))
    assert shard.replies[2][:2] == (0, 4) and shard.replies[3][:2] == (1, 4)  # both see all 4 updates
    assert shard.stats.staleness == {0: 3, 3: 1}  # worker 1 read version 0, applied at version 3


def test_ssp_without_staleness_equals_ps_sync_on_any_arrival_order():
    for seed in range(3):
        order = random_order(40, seed)
        sync = drive(UpdatePolicy.synchronous(2), order, 0.2, even=True)
        ssp = drive(UpdatePolicy.asynchronous(0), order, 0.1, even=True)  # the rate of b: half N b's
        torch.testing.assert_close(ssp.parameters.data, sync.parameters.data, rtol=1e-6, atol=1e-6)
        assert ssp.stats.updates == 2 * sync.stats.updates > 0
        # teeth: at the same rate as ps_sync, ssp would take twice the step
        doubled = drive(UpdatePolicy.asynchronous(0), order, 0.2, even=True)
        assert not torch.allclose(doubled.parameters.data, sync.parameters.data, atol=1e-3)


def test_ps_backup_tags_pushes_by_the_version_read():
    """Worker 1 reads version 0 and is slow while worker 0 makes updates 0, 1, 2: its push of
    version 0 is dropped and it reads version 3; then it is first for version 3 and its
    gradient makes that update (its own step counter, 1, would have it dropped again), and
    worker 0, which read version 3 too but came second, is dropped."""
    shard = drive(UpdatePolicy.synchronous(1), [0, 0, 0, 1, 1, 0], 0.1)
    assert shard.stats.dropped == [1, 1]
    assert shard.stats.updates == 4 and shard.stats.staleness == {0: 4}
    assert [(w, v) for w, v, _ in shard.replies] == [(0, 1), (0, 2), (0, 3), (1, 3), (1, 4), (0, 4)]


class _Fake:
    """Just enough of a strategy instance to ask for its update policy."""

    def __init__(self, cls, knobs):
        self.params = cls.check_params(knobs, 2)
        self.clock_bound = lambda: cls.clock_bound(self)


def test_ps_backup_closes_a_short_version_when_every_worker_is_idle_or_waiting():
    """At an epoch's end each worker has pushed the same number of steps, but drops leave a
    version short of its quorum: once the others are done with the epoch (IDLE), the shard
    makes that version's update from the gradients it has and answers the waiting worker
    (this hung the default study's ps_backup N=4 run at its first validation)."""
    shard = ScriptedShard(4, UpdatePolicy.synchronous(3))
    for worker in (0, 1, 2):  # version 0 made by the first three
        shard.take(worker, 0, 0.1, gradient_of(worker, torch.zeros(3)))
    shard.take(3, 0, 0.1, gradient_of(3, torch.zeros(3)))  # late: dropped, answered with version 1
    assert shard.version == 1 and shard.stats.dropped == [0, 0, 0, 1]
    shard.take(3, 1, 0.1, gradient_of(3, torch.zeros(3)))  # worker 3's last step: waits for version 1
    assert shard.waiting == [(3, 1)]
    for worker in (0, 1):
        shard.idle.add(worker)
        shard._flush_if_nobody_can_push()
        assert shard.version == 1 and shard.waiting == [(3, 1)]  # worker 2 may still push
    shard.idle.add(2)
    shard._flush_if_nobody_can_push()
    assert shard.version == 2 and shard.waiting == [] and shard.replies[-1][:2] == (3, 2)
    assert shard.stats.updates == 2 and sum(shard.stats.staleness.values()) == 4  # 3 + 1 gradients applied


def test_a_restored_shard_goes_on_as_if_it_had_never_stopped():
    """A shard's state_dict at a step boundary (parameters, momentum, version, clocks, record),
    loaded into a fresh shard: the same pushes then give the same replies, parameters and
    record as the shard that went on. The control: without the optimizer's state (momentum)
    the parameters part."""

    def shard(bound):
        made = ScriptedShard(2, UpdatePolicy.asynchronous(bound, staleness_lr=True))
        made.start(torch.zeros(3), momentum=0.9)
        return made

    def push(target, order):
        for worker in order:
            target.take(worker, max(target.version - worker, 0), 0.1, gradient_of(worker, target.parameters.detach()))

    first = shard(2)
    push(first, [0, 1, 0, 0, 1, 1])
    assert not first.waiting
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # as in its rank file: the optimizer's state holds live tensors
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    restored, forgetful = shard(2), shard(2)
    restored.load_state_dict(saved)
    forgetful.load_state_dict({**saved, "optimizer": shard(2).optimizer.state_dict()})
    later = [0, 0, 1, 0, 1, 1, 0]
    for target in (first, restored, forgetful):
        target.replies.clear()
        push(target, later)
    assert [(w, v) for w, v, _ in restored.replies] == [(w, v) for w, v, _ in first.replies]
    assert torch.equal(restored.parameters, first.parameters)
    assert restored.clocks == first.clocks == [7, 6] and restored.version == first.version == 13
    counts = lambda target: {k: v for k, v in target.stats.state_dict().items() if not k.endswith("_s")}  # noqa: E731
    assert counts(restored) == counts(first) and counts(first)["updates"] == 13  # not the clock's seconds
    assert not torch.allclose(forgetful.parameters, first.parameters, atol=1e-4)


def test_a_shard_refuses_to_save_between_step_boundaries():
    shard = ScriptedShard(2, UpdatePolicy.synchronous(2))
    shard.take(0, 0, 0.1, gradient_of(0, torch.zeros(3)))  # waits for worker 1's gradient of version 0
    with pytest.raises(RuntimeError, match="1 pushes unanswered"):
        shard.state_dict()


def test_the_first_shard_agrees_a_boundary_no_worker_has_passed():
    """A wish in a push: the first shard (only) answers it with the step after the furthest
    clock, until the checkpoint is saved; a second wish meanwhile changes nothing."""
    from dtstudy.strategies.parameter_server.protocol import BoundaryAction

    coordinator = ScriptedShard(2, UpdatePolicy.asynchronous())
    coordinator.coordinator = True
    other = ScriptedShard(2, UpdatePolicy.asynchronous())
    for target in (coordinator, other):
        for worker in (0, 0, 0, 1):
            target.take(worker, 0, 0.1, torch.zeros(3))
        target.take(1, 0, 0.1, torch.zeros(3), wish=BoundaryAction.CHECKPOINT)  # worker 1's clock 2, worker 0's 3
        target.take(0, 0, 0.1, torch.zeros(3), wish=BoundaryAction.STOP)
    assert coordinator.boundary == (4, BoundaryAction.CHECKPOINT)  # max clock 3 when asked, + 1
    assert other.boundary is None


def test_a_worker_acts_at_the_agreed_boundary_and_keeps_a_stronger_wish():
    """The worker's side of the agreement (ShardClient.agree): it acts at the boundary's step
    only, keeps asking for a stop while only a checkpoint was agreed, and a boundary it has
    passed is a protocol error."""
    from dtstudy.strategies.parameter_server.protocol import BoundaryAction
    from dtstudy.strategies.parameter_server.strategy import ShardClient

    client = ShardClient([], None)
    assert client.agree(3, BoundaryAction.STOP) == BoundaryAction.NONE and client.wish == BoundaryAction.STOP
    client.boundary = (5, BoundaryAction.CHECKPOINT)
    assert client.agree(4, BoundaryAction.NONE) == BoundaryAction.NONE
    assert client.agree(5, BoundaryAction.NONE) == BoundaryAction.CHECKPOINT
    assert client.boundary is None and client.wish == BoundaryAction.STOP  # the stop is still wanted
    client.boundary = (7, BoundaryAction.STOP)
    assert client.agree(7, BoundaryAction.NONE) == BoundaryAction.STOP and client.wish == BoundaryAction.NONE
    client.boundary = (6, BoundaryAction.CHECKPOINT)
    with pytest.raises(RuntimeError, match="step 6, has passed"):
        client.agree(7, BoundaryAction.NONE)


def test_implicit_momentum_compensation_hand_computed():
    from dtstudy.strategies.parameter_server.strategy import implicit_momentum_compensation as compensation

    # (1 - mu') / N = 1 - mu: N=4, mu=0.9 -> mu' = 0.6 and the rate x 0.4 / 0.1 = 4
    assert compensation(0.9, 4) == (pytest.approx(0.6), pytest.approx(4.0))
    assert compensation(0.9, 2) == (pytest.approx(0.8), pytest.approx(2.0))
    assert compensation(0.9, 1) == (pytest.approx(0.9), pytest.approx(1.0))  # one worker: plain SGD
    # past N = 1 / (1 - mu) asynchrony alone carries more: no explicit momentum, rate x 1 / (1 - mu)
    assert compensation(0.9, 20) == (0.0, pytest.approx(10.0))
    assert compensation(0.0, 4) == (0.0, 1.0)  # without momentum nothing changes (ssp s=0 = ps_sync)


def test_async_shards_drop_nesterov_with_the_last_of_the_momentum(monkeypatch):
    # train.nesterov with the implicit-momentum compensation: at N=4 the shards keep mu' = 0.6 and
    # Nesterov; at N=20 no explicit momentum is left, and torch's SGD refuses Nesterov without it
    from types import SimpleNamespace

    from dtstudy.strategies.parameter_server.strategy import ParameterServer
    from dtstudy.training.loop import make_optimizer_factory

    built = []
    monkeypatch.setattr(
        ParameterServer, "setup", lambda self, model, make: built.append(make([torch.zeros(1, requires_grad=True)]))
    )
    train = {"momentum": 0.9, "weight_decay": 0.0, "nesterov": True}
    for workers in (4, 20):
        strategy = object.__new__(STRATEGIES["ps_async"])
        strategy.params, strategy.ctx = {"momentum": None, "implicit_momentum": True}, SimpleNamespace(workers=workers)
        strategy.setup(None, make_optimizer_factory(train))
    (at_4,), (at_20,) = (optimizer.param_groups for optimizer in built)
    assert (at_4["momentum"], at_4["nesterov"]) == (pytest.approx(0.6), True)
    assert (at_20["momentum"], at_20["nesterov"]) == (0.0, False)


def test_async_pushes_carry_the_rate_factor():
    # the worker's push is what the shard applies: its rate is the schedule's times the factor
    from types import SimpleNamespace

    from dtstudy.strategies.base import CommMeter

    strategy = object.__new__(STRATEGIES["ps_async"])
    pushed = []
    strategy.meter, strategy.rate_factor = CommMeter(), 4.0
    strategy.client = SimpleNamespace(push=lambda lr: pushed.append(lr) or 0)
    strategy.update(0.025)
    assert pushed == [pytest.approx(0.1)]


def _async_updates_on_a_quadratic(
    implicit_momentum: bool,
    workers: int,
    step: float,
    monkeypatch,
    updates: int = 400,
    problems: int = 1000,
    seed: int = 0,
) -> float:
    """Mean x^2 after `updates` asynchronous updates of f(x) = x^2 / 2 (curvature 1), from x = 1,
    on `problems` independent copies. The update is the shard's: the optimizer ps_async builds
    (its explicit momentum) and the rate each push carries (`step` x its rate factor). Each
    gradient is computed on parameters `tau` updates old, tau geometric with mean N - 1: the
    arrival model of Mitliagkas et al. 2016 (N workers with exponential compute times), under
    which asynchrony adds a momentum of about 1 - 1/N."""
    from types import SimpleNamespace

    from dtstudy.strategies.base import CommMeter
    from dtstudy.strategies.parameter_server.strategy import ParameterServer
    from dtstudy.training.loop import make_optimizer_factory

    factories = []
    monkeypatch.setattr(ParameterServer, "setup", lambda self, model, make: factories.append(make))
    strategy = object.__new__(STRATEGIES["ps_async"])
    strategy.params = {"momentum": None, "implicit_momentum": implicit_momentum}
    strategy.ctx = SimpleNamespace(workers=workers)
    strategy.setup(None, make_optimizer_factory({"momentum": 0.9, "weight_decay": 0.0, "nesterov": False}))
    pushed = []
    strategy.meter, strategy.client = CommMeter(), SimpleNamespace(push=lambda lr: pushed.append(lr) or 0)
    strategy.update(step)  # the rate the shard applies this worker's gradient with

    x = torch.ones(problems, requires_grad=True)
    optimizer = factories[0]([x])
    generator = torch.Generator().manual_seed(seed)
    history = [x.detach().clone()]  # history[-1 - tau]: the parameters tau updates ago
    keep_on = 1.0 - 1.0 / workers
    for _ in range(updates):
        uniform = torch.rand(problems, generator=generator).clamp_min(1e-12)
        tau = (torch.log(uniform) / math.log(keep_on)).floor().long().clamp(max=len(history) - 1)
        x.grad = torch.stack(history)[len(history) - 1 - tau, torch.arange(problems)]
        for group in optimizer.param_groups:
            group["lr"] = pushed[0]
        optimizer.step()
        history = (history + [x.detach().clone()])[-200:]
    return (x.detach() ** 2).mean().item()


def test_implicit_momentum_keeps_asynchronous_updates_stable_where_uncounted_they_diverge(monkeypatch):
    # The feature's reason: at N=4, asynchrony's implicit momentum (about 0.75) on top of the
    # asked 0.9 makes the updates unstable at step sizes where momentum 0.9 alone is not. Counted
    # (the shards' momentum 0.6, the rate x 4, the same long-run step lr / (1 - 0.9)), the
    # updates still converge there. Step 0.05 (x curvature): synchronous momentum 0.9 is stable
    # up to 3.8; measured mean x^2 after 400 updates, seeds 0-2: counted ~1e-10, not counted
    # ~20 (from 1). The control that must fail the same check: implicit_momentum off.
    counted = _async_updates_on_a_quadratic(True, 4, 0.05, monkeypatch)
    not_counted = _async_updates_on_a_quadratic(False, 4, 0.05, monkeypatch)
    assert counted < 1e-6, counted
    assert not not_counted < 1e-6 and not_counted > 1.0, not_counted  # diverged: grew from 1
    # at a small step both converge: the check is about the momentum, not a broken update
    assert _async_updates_on_a_quadratic(False, 4, 0.01, monkeypatch) < 1e-6


def test_registry_and_knob_defaults():
    asynchronous = {"shards": None, "staleness_lr": True, "momentum": None, "implicit_momentum": True}
    defaults = {
        "ps_sync": {"shards": None},
        "ps_backup": {"shards": None, "backup": None, "backup_fraction": None},
        "ps_async": asynchronous,
        "ssp": {**asynchronous, "staleness": 2},
    }
    for name, knobs in defaults.items():
        assert STRATEGIES[name].check_params({}, workers=2) == knobs
        assert STRATEGIES[name].extra_processes({**knobs, "shards": 3}, workers=2) == 3
        with pytest.raises(ValueError, match="one per node"):  # null: the run's nodes decide
            STRATEGIES[name].extra_processes(knobs, workers=2)
    # ps_backup's k when neither knob is given: one
    assert STRATEGIES["ps_backup"].spec.quorum(4, defaults["ps_backup"]) == 3


@pytest.mark.parametrize(
    "launcher, workers, knob, shards",
    [
        ({"cluster": "local"}, 4, None, 1),  # one machine: one shard
        ({"cluster": "slurm", "gpus_per_node": 4}, 8, None, 2),  # 2 nodes of 4 GPUs: one shard on each
        ({"cluster": "slurm", "gpus_per_node": 4}, 2, None, 1),
        ({"cluster": "slurm", "gpus_per_node": 0}, 4, None, 1),  # CPU workers, all on one node
        ({"cluster": "slurm", "workers_per_node": 2, "gpus_per_node": 0}, 6, None, 3),  # CPU workers
        ({"cluster": "slurm", "gpus_per_node": 4}, 8, 3, 3),  # the knob, when set, wins
    ],
)
def test_shards_default_to_one_per_node_of_the_run(launcher, workers, knob, shards):
    """`shards: null` (the default) is one shard per node of the run's job: the run's knobs,
    its processes and its task layout (shards spread one per node) all say so, and the
    performance model's default is the same count for the same nodes."""
    from dtstudy.config.study_config import run_config
    from dtstudy.perfmodel import steps
    from dtstudy.runspec import RunSpec

    knobs = {} if knob is None else {"shards": knob}
    study = validated(
        tiny_study(
            strategies=["ps_async"],
            workers=[workers],
            launcher=launcher,
            strategy_params={"ps_async": knobs},
            train={"batch_size": 8},
        )
    )
    spec = RunSpec("ps_async", workers, 0, run_config(study, "ps_async"), "data", "out")
    assert spec.strategy_params()["shards"] == shards
    assert spec.processes() == workers + shards
    layout = spec.layout()
    assert layout.extras == shards and layout.nodes == spec.nodes()
    if knob is None:
        assert layout.extras_per_node == 1  # one on every node
        per_node = launcher.get("gpus_per_node") or launcher.get("workers_per_node") or workers
        assert steps.shard_count({"shards": None}, machine_of(per_node), workers) == shards
    assert steps.shard_count({"shards": 5}, machine_of(4), 8) == 5


def machine_of(gpus_per_node: int):
    from dtstudy.perfmodel.machine import Link, Machine

    return Machine(gpus_per_node=gpus_per_node, intra=Link(1e10, 1e-6), inter=Link(1e9, 1e-6))


@pytest.mark.parametrize(
    "strategy, knobs, workers, words",
    [
        ("ps_sync", {"shards": 0}, [1, 2], ["strategy_params.ps_sync.shards", "0", ">= 1"]),
        ("ps_async", {"shards": "two"}, [1, 2], ["strategy_params.ps_async.shards", "'two'"]),
        ("ps_backup", {"backup": 2}, [2, 4], ["strategy_params.ps_backup.backup", "2", "N=2"]),
        ("ps_backup", {"backup": -1}, [2], ["strategy_params.ps_backup.backup", "-1"]),
        ("ssp", {"staleness": -1}, [1, 2], ["strategy_params.ssp.staleness", "-1", ">= 0"]),
        ("ssp", {"staleness": 1.5}, [1, 2], ["strategy_params.ssp.staleness", "1.5", "null"]),
        ("ps_async", {"momentum": 1.0}, [2], ["strategy_params.ps_async.momentum", "1.0", "[0, 1)"]),
        ("ps_async", {"staleness_lr": "yes"}, [2], ["strategy_params.ps_async.staleness_lr", "'yes'"]),
        ("ssp", {"implicit_momentum": 1}, [2], ["strategy_params.ssp.implicit_momentum", "1"]),
    ],
)
def test_bad_knobs_are_rejected_before_any_job(strategy, knobs, workers, words):
    study = tiny_study(strategies=[strategy], workers=workers, strategy_params={strategy: knobs})
    with pytest.raises(ConfigError) as err:
        validated(study)
    for word in words:
        assert word in str(err.value)


def test_good_knobs_pass():
    validated(
        tiny_study(
            strategies=["ps_backup", "ssp"],
            workers=[2, 4],
            strategy_params={"ps_backup": {"backup": 1, "shards": 2}, "ssp": {"staleness": 0}},
        )
    )
    validated(
        tiny_study(
            strategies=["ssp", "ps_async"],
            workers=[2],
            strategy_params={
                "ssp": {"staleness": None, "momentum": 0.5},
                "ps_async": {"staleness_lr": True, "momentum": 0},
            },
        )
    )
    # N=1 has nobody to back up: it runs as ps_sync, so the default k=1 fits workers [1, 2, 4]
    validated(tiny_study(strategies=["ps_backup"], workers=[1, 2, 4]))


LENET5_SIZES = [150, 6, 2400, 16, 48000, 120, 10080, 84, 840, 10]  # LeNet-5 on 28x28: 61706 values


@pytest.mark.parametrize("shards", [1, 3, 8, 10, 32])
def test_parameters_split_over_shards_in_balanced_contiguous_ranges(shards):
    """Each shard owns a contiguous range of the parameters flattened in model order, within
    one value of M / S (the first M % S shards one more), and the ranges cover every value once."""
    owned = split_contiguous(LENET5_SIZES, shards)
    total = sum(LENET5_SIZES)
    assert [sum(end - start for _, start, end in pieces) for pieces in owned] == [
        total // shards + (s < total % shards) for s in range(shards)
    ]
    first_value = [sum(LENET5_SIZES[:index]) for index in range(len(LENET5_SIZES))]
    flat_ranges = [
        (first_value[index] + start, first_value[index] + end) for pieces in owned for index, start, end in pieces
    ]
    # in order, each piece where the previous ended, from 0 to M: every value exactly once
    assert [begin for begin, _ in flat_ranges] == [0] + [end for _, end in flat_ranges[:-1]]
    assert flat_ranges[-1][1] == total
    assert all(0 <= start < end <= LENET5_SIZES[index] for pieces in owned for index, start, end in pieces)
    if shards > 1:  # more shards than the big layer fits whole: it is cut between shards
        assert sum(index == 4 for pieces in owned for index, _, _ in pieces) >= 2


def test_every_value_its_own_shard_and_no_more_shards_than_values():
    assert split_contiguous([2, 0, 1], 3) == [[(0, 0, 1)], [(0, 1, 2)], [(2, 0, 1)]]
    with pytest.raises(ValueError, match="4 parameter-server shards but the model has 3 parameter values"):
        split_contiguous([2, 0, 1], 4)
    with pytest.raises(ValueError, match="0 parameter-server shards"):
        split_contiguous([2, 0, 1], 0)


def test_a_push_packs_and_a_reply_unpacks_every_piece_of_split_parameters(monkeypatch):
    """ShardClient.push through the real packing, with the messages captured: the gradients
    sent, shard after shard, are the parameters' gradients flattened in model order (a missing
    one as zeros, non-contiguous ones in their logical order), every gradient is cleared only
    after all its pieces are packed, and the replies' values land where they belong."""
    from types import SimpleNamespace

    from dtstudy.strategies.parameter_server import strategy as ps
    from dtstudy.strategies.parameter_server.protocol import TAG_GRADIENT, TAG_PARAMETERS, TAG_VERSION

    torch.manual_seed(0)
    parameters = [
        torch.nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)),
        torch.nn.Parameter(torch.randn(5)),
        torch.nn.Parameter(torch.randn(3, 4).t()),
    ]
    assert [p.is_contiguous() for p in parameters] == [False, True, False]
    gradients = [torch.randn_like(p) for p in parameters]
    for parameter, gradient in zip(parameters, gradients[:1] + [None] + gradients[2:]):
        parameter.grad = None if gradient is None else gradient.clone()
    expected_sent = torch.cat([gradients[0].reshape(-1), torch.zeros(5), gradients[2].reshape(-1)])
    replied = torch.randn(expected_sent.numel())
    done = SimpleNamespace(wait=lambda: None)
    for shards in (1, 2, 5, 7):
        owned = split_contiguous([p.numel() for p in parameters], shards)
        slices = [
            ps.ShardSlice(2 + shard, [(parameters[i], start, end) for i, start, end in pieces])
            for shard, pieces in enumerate(owned)
        ]
        client = ps.ShardClient(slices, None)
        sent, bounds = [], [0]
        for piece in slices:
            bounds.append(bounds[-1] + piece.numel)

        def isend(tensor, dst, group, tag, sent=sent):
            if tag == TAG_GRADIENT:
                sent.append(tensor.clone())
            return done

        def irecv(tensor, src, group, tag, bounds=bounds):
            if tag == TAG_VERSION:
                tensor.copy_(torch.tensor([1.0, -1.0, 0.0]))
            elif tag == TAG_PARAMETERS:
                shard = src - 2
                tensor.copy_(replied[bounds[shard] : bounds[shard + 1]])
            return done

        monkeypatch.setattr(ps.dist, "isend", isend)
        monkeypatch.setattr(ps.dist, "irecv", irecv)
        client.push(lr=0.1)
        assert torch.equal(torch.cat(sent), expected_sent)
        assert all(p.grad is None for p in parameters)
        assert torch.equal(torch.cat([p.detach().reshape(-1) for p in parameters]), replied)
        assert [piece.read_version for piece in slices] == [1] * shards
        for piece in slices:  # and back: what rank 0 sends a shard at set-up is its range
            piece.pack_parameters()
        assert torch.equal(torch.cat([piece.outgoing for piece in slices]), replied)
        for parameter, gradient in zip(parameters, gradients[:1] + [None] + gradients[2:]):
            parameter.grad = None if gradient is None else gradient.clone()
