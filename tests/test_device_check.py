"""The GPU check's own machinery, on the CPU (tests/device/README.md): its record written after
every step, and the recorder that finds a tensor a NCCL collective would refuse. The dry run
of the whole check is tests/test_precision_timing.py's."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "device"))

import compute_check  # noqa: E402
import exchange_check  # noqa: E402


def test_the_record_keeps_what_was_measured_and_decides_each_check_once_its_figures_are_in(tmp_path):
    """A check stopped by its time limit leaves a record: every step rewrites the file, with
    the checks its figures decide so far and `complete` false until the end."""
    path = tmp_path / "compute_check.json"
    record = compute_check.Record(path, device_type="cuda", exchange_runs_planned=2)
    written = json.loads(path.read_text())
    assert not written["complete"] and not written["passed"]
    assert set(written["checks"].values()) == {None}
    record.update(
        images_per_s_ratio=0.97,
        data_share_of_step=0.08,
        start={"pinned_cores": None, "rank0_cores": 16, "check_cores": 16},
    )
    checks = json.loads(path.read_text())["checks"]
    assert checks["images_per_s_ratio_at_least_0.95"] is True and checks["data_share_under_0.05"] is False
    assert checks["study_run_started_unpinned"] is True and checks["test_pass_on_the_runs_device"] is None
    record.update(start={"pinned_cores": [3], "rank0_cores": 1, "check_cores": 16})  # a pooled start: pinned
    assert json.loads(path.read_text())["checks"]["study_run_started_unpinned"] is False
    one = {"strategy": "allreduce", "completed": True, "off_device": {}}
    record.update(exchange_n2=[one])  # one of two runs so far: undecided
    assert json.loads(path.read_text())["checks"]["n2_exchange_on_the_device_for_every_strategy"] is None
    record.update(exchange_n2=[one, {**one, "strategy": "gossip", "off_device": {"broadcast@cpu": 1}}])
    assert json.loads(path.read_text())["checks"]["n2_exchange_on_the_device_for_every_strategy"] is False


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_recorder_names_a_tensor_off_the_device_on_a_group_nccl_would_carry(one_rank_group):
    """As the N = 2 runs on a GPU see it (the workers' device: cuda): a CPU tensor handed to
    the default group or another group NCCL would carry is off the device; on a group made
    with backend="gloo" (a parameter server's shards) it belongs. The wrapped isend is still
    one that P2POp accepts, and uninstalling restores torch.distributed."""
    originals = dist.all_reduce, dist.isend
    recorder = exchange_check.CollectiveRecorder(torch.device("cuda")).install()
    try:
        dist.all_reduce(torch.ones(3))
        dist.broadcast(torch.ones(2), src=0, group=dist.new_group([0]))
        shards = dist.new_group([0], backend="gloo")
        dist.all_reduce(torch.ones(3), group=shards)
        dist.P2POp(dist.isend, torch.ones(1), 0)  # gossip's exchange: the wrapped isend is accepted
    finally:
        recorder.uninstall()
    assert (dist.all_reduce, dist.isend) == originals
    assert recorder.calls == {"all_reduce@cpu": 2, "broadcast@cpu": 1}
    assert recorder.off_device == {"all_reduce@cpu": 1, "broadcast@cpu": 1}
    # the same calls where the workers compute on the CPU: nothing off the device
    cpu = exchange_check.CollectiveRecorder(torch.device("cpu")).install()
    try:
        dist.all_reduce(torch.ones(3))
    finally:
        cpu.uninstall()
    assert cpu.calls == {"all_reduce@cpu": 1} and not cpu.off_device


def test_the_reference_decoder_reads_every_image_as_the_studys_does(tmp_path):
    """The reference loop's decoder (torchvision.io, as the study's loader.decoder: torchvision)
    gives the study's decoder's tensor, RGB uint8 [3, H, W], on a JPEG and a grayscale one.
    (PIL's pixels are the same with this libjpeg-turbo: the two differ in speed, which is what
    the ratio must not measure; the dry run's record names the function that decoded.)"""
    import numpy as np
    from PIL import Image

    from dtstudy.data.decoding import decode_torchvision

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "rgb.jpg", quality=90)
    Image.fromarray(pixels).convert("L").save(tmp_path / "gray.jpg", quality=90)
    for name in ("rgb.jpg", "gray.jpg"):
        decoded = compute_check.read_rgb(str(tmp_path / name))
        assert decoded.shape == (3, 30, 40) and decoded.dtype == torch.uint8
        assert torch.equal(decoded, decode_torchvision(tmp_path / name)), name
