"""The communication benchmark's kernels: what it times is the strategies' own work."""

from __future__ import annotations

import pytest
from conftest import in_workers


def _powersgd_on_one_bucket(ctx):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    from dtstudy.projection import commbench

    net, _ = commbench._lenet_sized()
    shapes = [p.shape for p in net.parameters()]
    bucket = commbench._OneBucket(list(net.parameters()))
    # the gradients are views of the flat buffer, as in a DDP bucket
    assert all(
        g.data_ptr() == part.data_ptr()
        for g, part in zip(bucket.gradients(), bucket.buffer().split([g.numel() for g in bucket.gradients()]))
    )
    torch.manual_seed(0)
    gradient = torch.randn(bucket.buffer().numel())
    state = PowerSGDState(process_group=dist.group.WORLD, matrix_approximation_rank=2, start_powerSGD_iter=2)
    for _ in range(3):  # two plain all-reduces, then the first compressed step
        bucket.buffer().copy_(gradient)
        powerSGD_hook(state, bucket).wait()
    # torch's hook read the bucket and wrote its result back: the matrices it compressed
    # came back as rank-2 approximations, the vectors (sent whole) unchanged
    for shape, result, original in zip(
        shapes, bucket.gradients(), gradient.split([g.numel() for g in bucket.gradients()])
    ):
        if len(shape) > 1:
            assert torch.linalg.matrix_rank(result.reshape(shape[0], -1)) <= 2
            assert not torch.equal(result.reshape(-1), original)
        else:
            assert torch.equal(result, original)


def test_the_powersgd_kernel_runs_torchs_hook_on_a_ddp_like_bucket(tmp_path):
    in_workers(tmp_path, 1, _powersgd_on_one_bucket)


def _each_compressed_exchange_timed(ctx):
    import torch
    import torch.distributed as dist

    from dtstudy.projection import commbench
    from dtstudy.strategies.compressed.onebit_codec import dequantize, quantization_groups, quantize
    from dtstudy.strategies.registry import STRATEGIES
    from dtstudy.strategies.specs import SPECS

    # fp16: in a group of one, the hook's round trip is the casts alone
    net, _ = commbench._lenet_sized()
    parameters = list(net.parameters())
    strategy = STRATEGIES["allreduce_fp16"](ctx, dict(SPECS["allreduce_fp16"].defaults))
    bucket = commbench._OneBucket(parameters)
    gradient = torch.randn(bucket.buffer().numel())
    bucket.buffer().copy_(gradient)
    strategy.exchange(bucket).wait()
    assert torch.equal(bucket.buffer(), gradient.half().float()) and not torch.equal(bucket.buffer(), gradient)
    # 1-bit: one exchange writes back the 1-bit reconstruction of the gradient (two column
    # means per group, Seide et al.) and keeps what it lost as residuals
    strategy = STRATEGIES["allreduce_onebit"](ctx, dict(SPECS["allreduce_onebit"].defaults))
    strategy.model = net
    strategy.comm_hook()
    bucket.buffer().copy_(gradient)
    strategy.exchange(bucket).wait()
    groups = quantization_groups([p.shape for p in parameters], "column")
    assert len(groups) == 241  # LeNet-5's column groups, as the model counts them
    expected = dequantize(*quantize(gradient, groups, "column"), groups)
    assert torch.allclose(bucket.buffer(), expected)
    assert torch.allclose(torch.cat([strategy.residuals[p] for p in parameters]), gradient - expected)
    # what the benchmark times for each compressed strategy is that strategy's own exchange:
    # its untimed calls first (PowerSGD's plain all-reduces, a warm-up), then `repeats`
    for name in commbench.COMPRESSED:
        cls, calls = STRATEGIES[name], []
        exchange = cls.exchange

        def counted(self, bucket, exchange=exchange, calls=calls):
            calls.append(bucket.buffer().numel())
            return exchange(self, bucket)

        cls.exchange = counted
        try:
            seconds = commbench.exchange_seconds_per_byte(name, dist.group.WORLD, repeats=2)
        finally:
            cls.exchange = exchange
        untimed = SPECS[name].defaults.get("start_powerSGD_iter", 0) + 2
        assert calls == [61706] * (untimed + 2), name
        assert 0 < seconds < 1e-6, name  # per byte: a LeNet-5 gradient in under a quarter of a second
    assert set(commbench.COMPRESSED) == {n for n in STRATEGIES if n.startswith("allreduce_")}


def test_each_compressed_kernel_times_the_strategys_own_exchange(tmp_path):
    """fp16's exchange in a group of one is its casts; 1-bit's is Seide et al.'s reconstruction
    with error feedback; the benchmark's kernel of each compressed strategy is its exchange."""
    in_workers(tmp_path, 1, _each_compressed_exchange_timed)


@pytest.mark.slow
def test_a_failing_process_fails_the_benchmark_instead_of_hanging():
    """Both processes die before they send a result (a negative message size cannot be
    allocated): the benchmark raises, naming the exit codes, instead of waiting on its queue
    for ever (the subprocess's timeout turns such a hang into a failure here)."""
    import os
    import re
    import subprocess
    import sys

    from conftest import REPO

    code = (
        "from dtstudy.projection import commbench\n"
        "if __name__ == '__main__':\n"
        "    commbench.measure(sizes=[-4], repeats=1)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "workflow")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode != 0
    assert "negative dimension" in done.stderr  # the worker's own error, above
    assert re.search(r"a process ended without a result \(rank \d exit code 1", done.stderr), done.stderr[-2000:]
