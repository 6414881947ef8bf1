"""Compressed all-reduce: 1-bit quantisation with error feedback (pure functions), its two
exchanges (all-gather; compressed reduce-scatter + all-gather) in 2 and 4 gloo processes, what
fp16 and bf16 hand to the all-reduce and deliver in 2, and real N=2 training runs of fp16,
bf16, PowerSGD and 1-bit against the plain all-reduce."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import in_workers, tiny_study, train_run, validated
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from dtstudy.errors import ConfigError
from dtstudy.strategies.compressed import onebit_codec
from dtstudy.strategies.compressed import strategy as compressed
from dtstudy.strategies.compressed.onebit_codec import (
    chunk_groups,
    compress_with_feedback,
    decode,
    dequantize,
    encode,
    pack_signs,
    quantization_groups,
    quantize,
    unpack_signs,
)
from dtstudy.strategies.compressed.strategy import AllReduceOneBit


def test_signs_pack_eight_to_a_byte_and_unpack():
    values = torch.tensor([1.0, -2.0, 0.0, -0.5, 3.0, 3.0, -1.0, -1.0, 7.0, -7.0])
    packed = pack_signs(values)
    assert packed.dtype == torch.uint8 and packed.tolist() == [0b10101100, 0b10000000]
    assert unpack_signs(packed, 10).tolist() == [1, -1, 1, -1, 1, 1, -1, -1, 1, -1]


def test_tensor_quantizer_keeps_signs_and_one_scale_per_tensor():
    values = torch.tensor([1.0, -3.0, 0.5, -0.5, -0.5, 0.5])
    packed, scales = quantize(values, [2, 4], "tensor")
    assert scales.tolist() == [2.0, 0.5]
    assert dequantize(packed, scales, [2, 4]).tolist() == [2.0, -2.0, 0.5, -0.5, -0.5, 0.5]
    again, again_scales = decode(encode(packed, scales), groups=2)
    assert torch.equal(again, packed) and torch.equal(again_scales, scales)
    assert encode(packed, scales).numel() == 2 * 4 + 1  # two float scales + 6 signs in one byte


def test_column_quantizer_keeps_every_columns_sum_zeros_included():
    """Seide et al. 2014: per column, the mean of the non-negative and of the negative values.
    A zero joins the non-negative side and its mean: the column's sum stays exact."""
    weight = torch.tensor(
        [
            [3.0, 0.0, -1.0, -2.0],  # non-negative {3, 0} -> 1.5; negative -> -1.5
            [0.0, 0.0, 0.0, 0.0],  # all zero -> zeros
            [0.0, 1.0, 5.0, 0.0],
        ]
    )  # no negative value -> mean 1.5 everywhere
    bias = torch.tensor([-1.0, 0.0, 2.0])
    groups = quantization_groups([weight.shape, bias.shape], "column")
    assert groups == [4, 4, 4, 3]
    values = torch.cat([weight.reshape(-1), bias])
    packed, levels = quantize(values, groups, "column")
    assert levels.shape == (4, 2)
    decoded = dequantize(packed, levels, groups)
    assert decoded.tolist() == [1.5, 1.5, -1.5, -1.5, 0, 0, 0, 0, 1.5, 1.5, 1.5, 1.5, -1.0, 1.0, 1.0]
    for original, kept in zip(values.split(groups), decoded.split(groups)):
        assert kept.sum().item() == pytest.approx(original.sum().item())
    again, again_levels = decode(encode(packed, levels), groups=4, per_group=2)
    assert torch.equal(again, packed) and torch.equal(again_levels, levels)
    assert encode(packed, levels).numel() == 4 * 2 * 4 + 2  # 2 floats per column + 15 signs in 2 bytes
    # the per-tensor scale loses the sums (here of the weight: 5 kept as 10 x mean|w| signs)
    tensor_packed, scales = quantize(values, [12, 3], "tensor")
    assert dequantize(tensor_packed, scales, [12, 3])[:12].sum().item() != pytest.approx(weight.sum().item())

    torch.manual_seed(0)
    random_values = torch.randn(64 * 30)
    random_groups = quantization_groups([torch.Size([64, 30])], "column")
    column_sums = dequantize(*quantize(random_values, random_groups, "column"), random_groups).view(64, 30).sum(1)
    torch.testing.assert_close(column_sums, random_values.view(64, 30).sum(1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("quantizer", ["column", "tensor"])
def test_error_feedback_loses_nothing_in_sum(quantizer):
    """Sum of what was sent plus the residual equals the sum of the true gradients
    (docs/strategies.md, "Equivalences the tests check")."""
    torch.manual_seed(0)
    shapes = [torch.Size([30, 10]), torch.Size([17]), torch.Size([10, 100])]
    groups = quantization_groups(shapes, quantizer)
    numel = sum(s.numel() for s in shapes)
    residual = torch.zeros(numel)
    sent_total, true_total = torch.zeros(numel), torch.zeros(numel)
    for step in range(20):
        gradient = torch.randn(numel) * (1 + step % 3)
        packed, levels, residual = compress_with_feedback(gradient, residual, groups, quantizer)
        sent_total += dequantize(packed, levels, groups)
        true_total += gradient
    torch.testing.assert_close(sent_total + residual, true_total, atol=1e-4, rtol=0)
    # teeth: 1 bit per value loses information that only the residual gives back
    assert (sent_total - true_total).abs().max() > 0.1


def test_onebit_quantizer_knob_is_checked():
    assert AllReduceOneBit.check_params({}, 2)["quantizer"] == "column"
    with pytest.raises(ConfigError, match=r"strategy_params\.allreduce_onebit\.quantizer'.*'row'"):
        validated(
            tiny_study(strategies=["allreduce_onebit"], strategy_params={"allreduce_onebit": {"quantizer": "row"}})
        )


# ----- the exchange itself, in two gloo processes ------------------------------------------------
def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _mean_over_workers(tensor: torch.Tensor) -> torch.Tensor:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return torch.stack(gathered).mean(0)


def _sends_zeros(values, groups, quantizer="column", index=None):
    packed, levels = _real_quantize(values, groups, quantizer, index)
    return packed, torch.zeros_like(levels)


_real_quantize = compressed.quantize


_real_reduce_chunk = compressed.reduce_chunk


def _drops_server_residual(messages, residual, groups, quantizer, index):
    """A server step that keeps its quantisation error but never adds it back."""
    return _real_reduce_chunk(messages, torch.zeros_like(residual), groups, quantizer, index)


def _server_residual(strategy, parameters) -> torch.Tensor:
    if strategy.params["exchange"] == "allgather":
        return torch.zeros(sum(p.numel() for p in parameters))
    return _flat(strategy.server_residuals[p] for p in parameters)


def _onebit_setup(ctx, model, **params):
    strategy = AllReduceOneBit(ctx, AllReduceOneBit.check_params(params, ctx.workers))
    module = strategy.setup(model, lambda parameters: torch.optim.SGD(parameters, lr=0.0))
    return strategy, module


def _step(strategy, module, parameters, inputs, labels) -> torch.Tensor:
    """One backward through DDP's hook; returns the averaged gradient it left (flat), grads cleared."""
    strategy.backward(F.cross_entropy(module(inputs), labels))
    gradient = _flat(p.grad for p in parameters)
    for parameter in parameters:
        parameter.grad = None
    return gradient


def _check_onebit_exchange(ctx, quantizer, broken, exchange):
    """Every step, each worker's fixed batch: DDP's gradient is what the exchange delivered.
    With e_i worker i's residual and s the server residuals (reduce_scatter; each entry's held
    by its owner, so s is the sum over workers; 0 for allgather), per step
    sent + mean_i e_i' + s' = mean_i g_i + mean_i e_i + s, so that over the steps
    sum of the sent + mean_i e_i + s == sum of the mean true gradients (the residuals persist
    across steps); the replicas get identical gradients; and what is sent tracks the gradient
    (the residuals stay small against the sum; per column they sum to 0). `broken`: "zeros",
    a quantiser sending zeros (the identity still holds, tracking must fail);
    "no_server_residual", a server step that never adds its residual back (the identity must fail)."""
    if broken == "zeros":  # in this worker process only: the strategy's and the codec's chunk quantiser
        compressed.quantize = onebit_codec.quantize = _sends_zeros
    if broken == "no_server_residual":
        compressed.reduce_chunk = _drops_server_residual
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    strategy, module = _onebit_setup(ctx, model, quantizer=quantizer, exchange=exchange)
    parameters = list(model.parameters())
    torch.manual_seed(10 + ctx.rank)
    inputs, labels = torch.randn(8, 6), torch.randint(0, 3, (8,))
    true_gradient = _mean_over_workers(_flat(torch.autograd.grad(F.cross_entropy(model(inputs), labels), parameters)))
    sent_total = torch.zeros_like(true_gradient)
    steps, identity = 40, True
    for step in range(1, steps + 1):
        sent = _step(strategy, module, parameters, inputs, labels)
        assert torch.equal(_mean_over_workers(sent), sent), "the replicas got different gradients"
        sent_total += sent
        kept = _mean_over_workers(_flat(strategy.residuals[p] for p in parameters)) + ctx.workers * _mean_over_workers(
            _server_residual(strategy, parameters)
        )
        identity = identity and torch.allclose(sent_total + kept, step * true_gradient, atol=1e-5, rtol=0)
    assert identity != (broken == "no_server_residual"), f"{exchange}, {quantizer}, {broken}: identity {identity}"
    tracks = (sent_total - steps * true_gradient).norm() < 0.25 * (steps * true_gradient).norm()
    if quantizer == "column":
        residuals = [strategy.residuals] + ([strategy.server_residuals] if exchange == "reduce_scatter" else [])
        column_sums = [
            r[p].view(p.shape[0], -1).sum(1) if p.dim() > 1 else r[p].sum().view(1)
            for r in residuals
            for p in parameters
        ]
        tracks = tracks and bool(torch.cat(column_sums).abs().max() < 1e-5)
    if broken != "no_server_residual":
        assert tracks != (broken == "zeros"), f"{exchange}, {quantizer}, {broken}: tracking the gradient is {tracks}"
    summary = strategy.summary()
    error = summary["quantization_error"]  # mean |e|/|g| over the exchanges
    assert error == pytest.approx(1.0) if broken == "zeros" else 0 < error < 1
    if exchange == "reduce_scatter" and broken is None:
        assert 0 < summary["server_quantization_error"] < 1
        _check_hand_over(ctx, strategy, parameters)


def _check_hand_over(ctx, strategy, parameters):
    """A new bucket layout (here: the bucket's parameters reversed) gives entries new owners:
    each worker's server residual outside its new chunk moves into its worker residual, so
    mean_i e_i + s is unchanged and no worker holds a server residual it no longer reduces."""

    def kept():
        return _mean_over_workers(_flat(strategy.residuals[p] for p in parameters)) + ctx.workers * _mean_over_workers(
            _server_residual(strategy, parameters)
        )

    before = kept()
    assert _server_residual(strategy, parameters).abs().max() > 1e-3  # something to hand over
    chunks = strategy._chunks_of(list(reversed(parameters)))
    torch.testing.assert_close(kept(), before, atol=1e-6, rtol=0)
    owned = {p: (lo, hi) for p, lo, hi in chunks.owned}
    for p in parameters:
        outside = strategy.server_residuals[p].clone()
        lo, hi = owned.get(p, (0, 0))
        outside[lo:hi] = 0
        assert not outside.any(), "a server residual stayed with a worker that no longer reduces it"


@pytest.mark.parametrize("quantizer, broken", [("column", None), ("tensor", None), ("column", "zeros")])
def test_onebit_exchange_keeps_the_residual_and_sends_the_gradient(tmp_path, quantizer, broken):
    in_workers(tmp_path, 2, _check_onebit_exchange, quantizer, broken, "allgather")


@pytest.mark.parametrize(
    "workers, quantizer, broken",
    [
        (2, "column", None),
        (4, "column", None),
        (4, "tensor", None),
        (4, "column", "zeros"),
        (2, "column", "no_server_residual"),
        (4, "tensor", "no_server_residual"),
    ],
)
def test_onebit_reduce_scatter_keeps_both_residuals(tmp_path, workers, quantizer, broken):
    in_workers(tmp_path, workers, _check_onebit_exchange, quantizer, broken, "reduce_scatter")


def test_chunks_are_balanced_and_keep_columns_whole():
    groups = [3, 5, 5, 5, 5, 6, 6, 6, 6, 6]  # 53 values: ends nearest to 13.25, 26.5, 39.75
    assert chunk_groups(groups, 4, cut=False) == [[3, 5, 5], [5, 5], [6, 6, 6], [6, 6]]
    assert chunk_groups([10], 4, cut=False) == [[], [], [10], []]  # fewer columns than workers
    # tensor groups are cut at 13, 26, 40 of 53 values, each piece with its own scale
    assert chunk_groups([30, 23], 4, cut=True) == [[13], [13], [4, 10], [13]]


def _check_bytes(ctx, out):
    """One step of Linear(512, 8) without bias (one bucket: 8 columns of 512, 4096 values);
    rank 0 writes each exchange's bytes sent and ring all-reduce's to `out`."""
    sent = {}
    for exchange in ("allgather", "reduce_scatter"):
        torch.manual_seed(0)
        model = torch.nn.Linear(512, 8, bias=False)
        strategy, module = _onebit_setup(ctx, model, exchange=exchange)
        _step(strategy, module, list(model.parameters()), torch.randn(4, 512), torch.randint(0, 8, (4,)))
        sent[exchange] = strategy.meter.bytes_sent
    sent["ring"] = strategy.bytes_per_step()
    if ctx.rank == 0:
        out.write_text(json.dumps(sent))


def test_onebit_bytes_per_worker(tmp_path):
    """reduce_scatter's ratio to ring all-reduce is the same at N=2 and N=4 (1/32 plus the
    values); allgather's doubles (N/64)."""
    sent = {}
    for workers in (2, 4):
        out = tmp_path / f"bytes-{workers}.json"
        (tmp_path / str(workers)).mkdir()  # a rendezvous of its own
        in_workers(tmp_path / str(workers), workers, _check_bytes, out)
        sent[workers] = json.loads(out.read_text())
    # N=4, reduce_scatter: chunks of 2 columns (1024 values), 2 x 2 x 4 + 1024 / 8 = 144 bytes
    # each; 3 chunks sent + the own averaged one to 3 others: 6 x 144 = 864. allgather: the
    # whole message, 8 x 2 x 4 + 4096 / 8 = 576 bytes, to 3 others: 1728. Ring: 2 x 3/4 x 16384
    assert sent[4] == {"reduce_scatter": 864, "allgather": 1728, "ring": 24576}
    # N=2: chunks of 4 columns, 32 + 256 = 288 bytes, twice: 576 = allgather's at N=2
    assert sent[2] == {"reduce_scatter": 576, "allgather": 576, "ring": 16384}
    ratio = {n: sent[n]["reduce_scatter"] / sent[n]["ring"] for n in sent}
    assert ratio[4] == pytest.approx(ratio[2], rel=1e-9) and ratio[2] < 1 / 32 + 0.004
    assert sent[4]["allgather"] / sent[4]["ring"] == pytest.approx(2 * sent[2]["allgather"] / sent[2]["ring"])


def _check_resume(ctx):
    """Three steps, the state saved, a fourth; a fresh strategy that takes DDP's first step
    (as a resumed run replays it), loads the state and steps gets the fourth step's gradient
    exactly: both residuals came back."""
    torch.manual_seed(10 + ctx.rank)
    inputs, labels = torch.randn(8, 6), torch.randint(0, 3, (8,))

    def fresh():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
        return (*_onebit_setup(ctx, model, exchange="reduce_scatter"), list(model.parameters()))

    strategy, module, parameters = fresh()
    for _ in range(3):
        _step(strategy, module, parameters, inputs, labels)
    saved = strategy.state_dict()
    assert saved.keys() == {"residuals", "server_residuals"}
    assert _mean_over_workers(torch.cat(saved["server_residuals"]).abs()).max() > 1e-3
    fourth = _step(strategy, module, parameters, inputs, labels)

    resumed, resumed_module, resumed_parameters = fresh()
    _step(resumed, resumed_module, resumed_parameters, inputs, labels)  # throwaway, as training.loop.throwaway_step
    resumed.load_state_dict(saved)
    for key in ("residuals", "server_residuals"):
        for loaded, value in zip(resumed.state_dict()[key], saved[key], strict=True):
            assert torch.equal(loaded, value)
    assert torch.equal(_step(resumed, resumed_module, resumed_parameters, inputs, labels), fourth)


def test_onebit_reduce_scatter_resumes_both_residuals(tmp_path):
    in_workers(tmp_path, 2, _check_resume)


def test_onebit_exchange_knob_is_checked():
    assert AllReduceOneBit.check_params({}, 2)["exchange"] == "allgather"
    with pytest.raises(ConfigError, match=r"strategy_params\.allreduce_onebit\.exchange'.*'ring'"):
        validated(
            tiny_study(strategies=["allreduce_onebit"], strategy_params={"allreduce_onebit": {"exchange": "ring"}})
        )


# ----- half precision: what the hook really hands to the all-reduce, in two gloo processes --------
_HALF = {
    "allreduce_fp16": (compressed.AllReduceFP16, torch.float16),
    "allreduce_bf16": (compressed.AllReduceBF16, torch.bfloat16),
}
_OTHER = {"allreduce_fp16": "allreduce_bf16", "allreduce_bf16": "allreduce_fp16"}
# each strategy as shipped (hook None), and the planted bugs: the plain fp32 all-reduce hook
# (nothing compressed, half the bytes still counted), and the other 16-bit cast's hook
_HALF_VARIANTS = {
    "allreduce_fp16": ("allreduce_fp16", None),
    "allreduce_bf16": ("allreduce_bf16", None),
    "allreduce_fp16 with the plain hook": ("allreduce_fp16", default_hooks.allreduce_hook),
    "allreduce_bf16 with the plain hook": ("allreduce_bf16", default_hooks.allreduce_hook),
    "allreduce_fp16 with bf16's hook": ("allreduce_fp16", default_hooks.bf16_compress_hook),
    "allreduce_bf16 with fp16's hook": ("allreduce_bf16", default_hooks.fp16_compress_hook),
}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _check_half_precision(ctx, out):
    """Each variant of _HALF_VARIANTS on a small MLP, each worker its own batch, two steps
    (DDP rebuilds its buckets after the first): the gradient the exchange delivered against
    the mean of the workers' gradients cast to 16 bits (divided by N in that dtype and summed
    in it, as the hook does; then back to fp32), the fp32 mean and the other 16-bit cast's;
    every tensor handed to dist.all_reduce (recorded by a wrapper: its dtype and bytes)
    against the bytes the strategy counted. Rank 0 writes the numbers to `out`."""
    real_all_reduce = dist.all_reduce
    handed = []

    def recording_all_reduce(tensor, *args, **kwargs):
        handed.append((str(tensor.dtype), tensor.numel() * tensor.element_size()))
        return real_all_reduce(tensor, *args, **kwargs)

    torch.manual_seed(10 + ctx.rank)
    inputs, labels = torch.randn(16, 20), torch.randint(0, 4, (16,))
    results = {}
    for variant, (name, hook) in _HALF_VARIANTS.items():
        cls = _HALF[name][0]
        if hook is not None:
            cls = type(f"Broken{cls.__name__}", (cls,), {"compress_hook": staticmethod(hook)})
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        parameters = list(model.parameters())
        local = _flat(torch.autograd.grad(F.cross_entropy(model(inputs), labels), parameters))
        gathered = [torch.empty_like(local) for _ in range(ctx.workers)]
        dist.all_gather(gathered, local)
        fp32_mean = torch.stack(gathered).mean(0)

        def cast_mean(dtype, gathered=gathered):
            return sum(g.to(dtype).div_(ctx.workers) for g in gathered).float()

        strategy = cls(ctx, cls.check_params({}, ctx.workers))
        module = strategy.setup(model, lambda p: torch.optim.SGD(p, lr=0.0))
        steps = []
        for _ in range(2):
            handed.clear()
            dist.all_reduce = recording_all_reduce  # in this worker process only
            try:
                delivered = _step(strategy, module, parameters, inputs, labels)
            finally:
                dist.all_reduce = real_all_reduce
            _, counted = strategy.meter.take()
            steps.append(
                {
                    "vs_own_cast": _max_diff(delivered, cast_mean(_HALF[name][1])),
                    "vs_fp32": _max_diff(delivered, fp32_mean),
                    "vs_other_cast": _max_diff(delivered, cast_mean(_HALF[_OTHER[name]][1])),
                    "handed_dtypes": sorted({dtype for dtype, _ in handed}),
                    "handed_bytes": compressed.ring_allreduce_bytes(sum(b for _, b in handed), ctx.workers),
                    "counted_bytes": counted,
                    "gradient_bytes": local.numel() * 4,
                }
            )
        results[variant] = steps
    if ctx.rank == 0:
        out.write_text(json.dumps(results))


def _half_precision_faults(name: str, step: dict) -> list[str]:
    """What is wrong with one step of a 16-bit strategy's exchange (empty: nothing)."""
    dtype = str(_HALF[name][1])
    faults = []
    if step["vs_own_cast"] != 0:
        faults.append(f"delivered is not the mean of the {dtype} casts (off by {step['vs_own_cast']:.3g})")
    if not step["vs_fp32"] > 0:
        faults.append("delivered is the fp32 mean")
    if not step["vs_other_cast"] > 0:
        faults.append("delivered is the other 16-bit cast's mean")
    if step["handed_dtypes"] != [dtype]:
        faults.append(f"handed {step['handed_dtypes']} to the all-reduce, not {dtype}")
    if step["counted_bytes"] != step["handed_bytes"]:
        faults.append(f"counted {step['counted_bytes']} bytes, handed {step['handed_bytes']}")
    return faults


def test_half_precision_sends_the_16_bit_cast_and_counts_what_it_hands_over(tmp_path):
    """fp16 and bf16 deliver exactly the mean of the workers' gradients cast to their dtype
    (not the fp32 mean, not the other cast's), hand the all-reduce tensors of that dtype only,
    and count the bytes of those tensors (half the fp32 gradient's at N=2). Controls that
    must fail the same check: each strategy with the plain fp32 all-reduce hook (nothing
    compressed; the value and the bytes wrong) and with the other 16-bit cast's hook."""
    out = tmp_path / "half.json"
    in_workers(tmp_path, 2, _check_half_precision, out)
    results = json.loads(out.read_text())
    for variant, (name, hook) in _HALF_VARIANTS.items():
        for step in results[variant]:
            faults = _half_precision_faults(name, step)
            if hook is None:
                assert not faults, f"{variant}: {faults}"
                assert step["counted_bytes"] == step["gradient_bytes"] / 2  # N=2: the 16-bit gradient once
            else:
                assert any("mean of the" in fault for fault in faults), f"{variant} passes: {step}"
                if hook is default_hooks.allreduce_hook:
                    assert any("counted" in fault for fault in faults), f"{variant}'s bytes pass: {step}"


# ----- real N=2 runs on the tiny study: one full epoch each, shared by the tests below ---------
COMPARED = ["allreduce", "allreduce_fp16", "allreduce_bf16", "allreduce_powersgd", "allreduce_onebit"]


@pytest.fixture(scope="module")
def two_worker_runs(tmp_path_factory, tiny_data):
    """No LR warm-up: with the tiny study's one-epoch warm-up, one epoch barely learns."""
    root = tmp_path_factory.mktemp("compressed")
    return {
        name: train_run(root, tiny_data, workers=2, batch_size=32, steps=None, strategy=name, warmup_epochs=0)[0]
        for name in COMPARED
    }


def _lenet_shapes() -> list[torch.Size]:
    from dtstudy.training.models import build_model

    return [p.shape for p in build_model("lenet5", 1, 10, 28).parameters()]


def _powersgd_numel(shape: torch.Size, rank: int = 2) -> int:
    """What PowerSGD reduces for one gradient: P (n x r) and Q (m x r) of its n x m matrix view,
    or the tensor itself for vectors and matrices where factors would not halve the size."""
    n = shape[0]
    m = shape.numel() // n
    r = min(n, m, rank)
    return (n + m) * r if len(shape) > 1 and 2 * (n + m) * r < n * m else n * m


@pytest.mark.slow
def test_compressed_strategies_send_fewer_bytes(two_worker_runs):
    shapes = _lenet_shapes()
    plain = two_worker_runs["allreduce"]["bytes_per_step"]
    assert plain == pytest.approx(sum(s.numel() for s in shapes) * 4)  # ring at N=2: the gradient once
    # the runs' records carry the 16-bit strategies' counted bytes; that these are the bytes
    # really handed to the all-reduce is test_half_precision_sends_the_16_bit_cast_and_counts_what_it_hands_over
    assert two_worker_runs["allreduce_fp16"]["bytes_per_step"] == pytest.approx(plain / 2)
    assert two_worker_runs["allreduce_bf16"]["bytes_per_step"] == pytest.approx(plain / 2)

    # PowerSGD: plain all-reduce before step start_powerSGD_iter (10), P and Q after
    powersgd = two_worker_runs["allreduce_powersgd"]
    skip, steps = powersgd["steady_state_skip"], powersgd["steps"]
    compressed = sum(_powersgd_numel(s) for s in shapes) * 4
    assert compressed < plain / 20
    expected = ((10 - skip) * plain + (steps - 10) * compressed) / (steps - skip)
    assert powersgd["bytes_per_step"] == pytest.approx(expected)

    # 1-bit, all-gather at N=2: the signs (8 per byte) and two float32 values per column
    onebit = two_worker_runs["allreduce_onebit"]["bytes_per_step"]
    columns = len(quantization_groups(shapes, "column"))
    assert columns == 6 + 16 + 120 + 84 + 10 + 5  # output units of LeNet-5's weights, one per bias
    assert onebit == pytest.approx(sum(s.numel() for s in shapes) / 8 + 2 * 4 * columns, abs=1)
    assert onebit < plain / 25


@pytest.mark.parametrize("name", ["allreduce_fp16", "allreduce_bf16", "allreduce_powersgd"])
def test_compressed_training_reaches_allreduce_accuracy(two_worker_runs, name):
    """Compression costs no accuracy on one epoch of the tiny study (within 0.05). This cannot
    tell compression from none (the plain all-reduce passes it too): what fp16 and bf16 send
    is test_half_precision_sends_the_16_bit_cast_and_counts_what_it_hands_over, PowerSGD's
    bytes test_compressed_strategies_send_fewer_bytes."""
    reference = two_worker_runs["allreduce"]["final_val_top1"]
    assert reference > 0.5  # one epoch of the tiny study learns
    assert two_worker_runs[name]["final_val_top1"] == pytest.approx(reference, abs=0.05)


def test_onebit_training_learns(two_worker_runs):
    """1 bit per value costs accuracy this early in training, but the error feedback keeps it
    learning (docs/strategies.md, "Equivalences the tests check")."""
    assert two_worker_runs["allreduce_onebit"]["final_val_top1"] > 0.3


def test_onebit_reduce_scatter_modelled_hand_computed():
    """The spec's model_step: two all-to-alls of M/N (the chunks to their owners, the averaged
    chunks back to every worker), as the strategy sends them."""
    from dtstudy.perfmodel.machine import NO_STRAGGLERS, Link, Machine, Workload
    from dtstudy.strategies import specs

    workload = Workload(parameters=1_000_000, bytes_per_parameter=4, batch=10, compute_s=0.1)
    machine = Machine(gpus_per_node=4, intra=Link(1e-5, 1e9), inter=Link(1e-4, 1e8))
    knobs = {**specs.knob_defaults()["allreduce_onebit"], "exchange": "reduce_scatter"}
    # N=8 = 2 nodes of 4; a chunk's message 1e6/8/8 = 15625 bytes: inside 3*1e-5 + 3*15625/1e9;
    # across, each worker to the 4 of the other node, 4 workers' through a NIC: 4*1e-4 + 4*4*15625/1e8;
    # twice. (allgather: inside 3e-5 + 3.75e-4, across 1e-4 + 5e-3)
    step = specs.model_step("allreduce_onebit", workload, machine, 8, knobs, NO_STRAGGLERS)
    assert step.exchange_s == pytest.approx(2 * (3e-5 + 4.6875e-5 + 4e-4 + 2.5e-3), rel=1e-9)
    # 1e-9 s per byte of the 4e6: (1/2 + 1/2 + 1/8 + 1/2) x 4e-3
    timed = Machine(4, machine.intra, machine.inter, compression_s_per_byte={"allreduce_onebit": 1e-9})
    step = specs.model_step("allreduce_onebit", workload, timed, 8, knobs, NO_STRAGGLERS)
    assert step.exchange_s == pytest.approx(2 * (3e-5 + 4.6875e-5 + 4e-4 + 2.5e-3) + 4e-3 * 1.625, rel=1e-9)
