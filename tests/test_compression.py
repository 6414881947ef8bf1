"""Compressed all-reduce: 1-bit quantisation with error feedback (pure functions), and real
N=2 training runs of fp16, bf16, PowerSGD and 1-bit against the plain all-reduce."""

from __future__ import annotations

import pytest
import torch

from conftest import train_run
from dtstudy.strategies.compressed import (
    compress_with_feedback,
    decode,
    dequantize,
    encode,
    pack_signs,
    quantize,
    unpack_signs,
)


def test_signs_pack_eight_to_a_byte_and_unpack():
    values = torch.tensor([1.0, -2.0, 0.0, -0.5, 3.0, 3.0, -1.0, -1.0, 7.0, -7.0])
    packed = pack_signs(values)
    assert packed.dtype == torch.uint8 and packed.tolist() == [0b10101100, 0b10000000]
    assert unpack_signs(packed, 10).tolist() == [1, -1, 1, -1, 1, 1, -1, -1, 1, -1]


def test_quantize_keeps_signs_and_one_scale_per_segment():
    values = torch.tensor([1.0, -3.0, 0.5, -0.5, -0.5, 0.5])
    packed, scales = quantize(values, [2, 4])
    assert scales.tolist() == [2.0, 0.5]
    assert dequantize(packed, scales, [2, 4]).tolist() == [2.0, -2.0, 0.5, -0.5, -0.5, 0.5]
    again, again_scales = decode(encode(packed, scales), segments=2)
    assert torch.equal(again, packed) and torch.equal(again_scales, scales)
    assert encode(packed, scales).numel() == 2 * 4 + 1  # two float scales + 6 signs in one byte


def test_error_feedback_loses_nothing_in_sum():
    """STUDY.md: sum of what was sent plus the residual equals the sum of the true gradients."""
    torch.manual_seed(0)
    sizes = [300, 17, 1000]
    residual = torch.zeros(sum(sizes))
    sent_total, true_total = torch.zeros(sum(sizes)), torch.zeros(sum(sizes))
    for step in range(20):
        gradient = torch.randn(sum(sizes)) * (1 + step % 3)
        packed, scales, residual = compress_with_feedback(gradient, residual, sizes)
        sent_total += dequantize(packed, scales, sizes)
        true_total += gradient
    torch.testing.assert_close(sent_total + residual, true_total, atol=1e-4, rtol=0)
    # teeth: 1 bit per value loses information that only the residual gives back
    assert (sent_total - true_total).abs().max() > 0.1


# ----- real N=2 runs on the tiny study: one full epoch each, shared by the tests below ---------
COMPARED = ["allreduce", "allreduce_fp16", "allreduce_bf16", "allreduce_powersgd", "allreduce_onebit"]


@pytest.fixture(scope="module")
def two_worker_runs(tmp_path_factory, tiny_data):
    """No LR warm-up: with the tiny study's one-epoch warm-up, one epoch barely learns."""
    root = tmp_path_factory.mktemp("compressed")
    return {name: train_run(root, tiny_data, workers=2, batch_size=32, steps=None, strategy=name,
                            warmup_epochs=0)[0]
            for name in COMPARED}


def _lenet_shapes() -> list[torch.Size]:
    from dtstudy.models import build_model

    return [p.shape for p in build_model("lenet5", 1, 10, 28).parameters()]


def _powersgd_numel(shape: torch.Size, rank: int = 2) -> int:
    """What PowerSGD reduces for one gradient: P (n x r) and Q (m x r) of its n x m matrix view,
    or the tensor itself for vectors and matrices where factors would not halve the size."""
    n = shape[0]
    m = shape.numel() // n
    r = min(n, m, rank)
    return (n + m) * r if len(shape) > 1 and 2 * (n + m) * r < n * m else n * m


def test_compressed_strategies_send_fewer_bytes(two_worker_runs):
    shapes = _lenet_shapes()
    plain = two_worker_runs["allreduce"]["bytes_per_step"]
    assert plain == pytest.approx(sum(s.numel() for s in shapes) * 4)  # ring at N=2: the gradient once
    assert two_worker_runs["allreduce_fp16"]["bytes_per_step"] == pytest.approx(plain / 2)
    assert two_worker_runs["allreduce_bf16"]["bytes_per_step"] == pytest.approx(plain / 2)

    # PowerSGD: plain all-reduce before step start_powerSGD_iter (10), P and Q after
    powersgd = two_worker_runs["allreduce_powersgd"]
    skip, steps = powersgd["steady_state_skip"], powersgd["steps"]
    compressed = sum(_powersgd_numel(s) for s in shapes) * 4
    assert compressed < plain / 20
    expected = ((10 - skip) * plain + (steps - 10) * compressed) / (steps - skip)
    assert powersgd["bytes_per_step"] == pytest.approx(expected)

    # 1-bit, all-gather at N=2: the signs (8 per byte) and one float32 scale per parameter tensor
    onebit = two_worker_runs["allreduce_onebit"]["bytes_per_step"]
    assert onebit == pytest.approx(sum(s.numel() for s in shapes) / 8 + 4 * len(shapes), abs=1)
    assert onebit < plain / 30


@pytest.mark.parametrize("name", ["allreduce_fp16", "allreduce_bf16", "allreduce_powersgd"])
def test_compressed_training_reaches_allreduce_accuracy(two_worker_runs, name):
    reference = two_worker_runs["allreduce"]["final_val_top1"]
    assert reference > 0.5  # one epoch of the tiny study learns
    assert two_worker_runs[name]["final_val_top1"] == pytest.approx(reference, abs=0.05)


def test_onebit_training_learns(two_worker_runs):
    """1 bit per value costs accuracy this early in training (see the README's numbers),
    but the error feedback keeps it learning."""
    assert two_worker_runs["allreduce_onebit"]["final_val_top1"] > 0.3
