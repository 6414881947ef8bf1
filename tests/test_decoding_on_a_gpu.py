"""What the GPU decoders ask of the pipeline, checked on the CPU:

- nvJPEG: torchvision's batched CUDA decode allocates its images on the caller's current
  stream and writes them from a private stream that does not wait for it, so the decode runs
  on a stream of its own, the training stream waits for it and records each image as used
  (a recording stand-in of torch's stream API and of the CUDA decode);
- DALI in loader workers: the workers of a split whose decoder runs DALI start from a fresh
  interpreter (forkserver), not forked from a training process that has initialised CUDA.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch
from PIL import Image

from dtstudy.data import decoding


class StreamLog:
    """A recording stand-in of torch.cuda's streams: which stream is current, who waits for
    whom, which stream each image is recorded on, and where each decode ran."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.made = 0
        self.current = self.Stream(self, "training")

    class Stream:
        def __init__(self, log: StreamLog, name: str):
            self.log, self.name = log, name

        def wait_stream(self, other) -> None:
            self.log.calls.append(("wait", self.name, other.name))

    def new_stream(self, device=None):
        self.made += 1
        return self.Stream(self, f"stream {self.made}")

    @contextlib.contextmanager
    def use(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before


def _jpeg(seed: int) -> torch.Tensor:
    data = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(data, "JPEG")
    return torch.frombuffer(bytearray(data.getvalue()), dtype=torch.uint8)


def test_nvjpeg_decodes_on_its_own_stream_and_the_training_stream_waits_for_it(monkeypatch):
    import torchvision.io

    log = StreamLog()
    cpu_decode = torchvision.io.decode_jpeg

    def cuda_decode(jpegs, mode, device):
        assert device.type == "cuda"
        log.calls.append(("decode", log.current.name))
        return cpu_decode(jpegs, mode=mode, device="cpu")

    monkeypatch.setattr(torchvision.io, "decode_jpeg", cuda_decode)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: log.current)
    monkeypatch.setattr(torch.cuda, "Stream", log.new_stream)
    monkeypatch.setattr(torch.cuda, "stream", log.use)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda image, stream: log.calls.append(("record", stream.name)))

    decoder, jpegs = decoding.NvjpegDecoder(), [_jpeg(0), _jpeg(1)]
    for _ in range(2):  # two batches: one decode stream for both
        images = decoder._decode(jpegs, torch.device("cuda", 0))
        assert [tuple(image.shape) for image in images] == [(3, 20, 30)] * 2
    once = [("decode", "stream 1"), ("wait", "training", "stream 1"), ("record", "training"), ("record", "training")]
    assert log.calls == once * 2
    assert log.made == 1 and log.current.name == "training"


@pytest.fixture(scope="module")
def prepared_tree(tmp_path_factory):
    from conftest import dataset_config
    from test_image_pipeline import write_messy_tree

    from dtstudy.data.prepare import prepare

    tree = write_messy_tree(tmp_path_factory.mktemp("tree") / "tree", per_class=4, seed=0)
    out = tmp_path_factory.mktemp("prepared")
    prepare(
        dataset_config(name="imagefolder", root=str(tree), val_fraction=0.25, test_fraction=0.25, image_size=16), out
    )
    return out


def _parent(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize("decoder, start", [("dali_cpu", "forkserver"), ("torchvision", None)])
@pytest.mark.slow
def test_dali_workers_start_from_a_fresh_interpreter_not_a_fork_of_the_training_process(prepared_tree, decoder, start):
    """The declared start method reaches the split's DataLoader, and its workers are not the
    training process's children (forked from it, CUDA state and all); the CPU decoders keep
    the cheap fork (the control: their workers are its children)."""
    import os

    from test_image_pipeline import loader_config

    from dtstudy.data.loading import load_split

    assert decoding.DECODERS[decoder]().worker_start_method == start
    train = load_split(prepared_tree, "train", loader_config(workers=1, decoder=decoder))
    inputs, _ = next(iter(train.batches([range(4)])))
    assert inputs.shape == (4, 3, 16, 16)
    loader = train._feed.loader
    context = loader.multiprocessing_context
    assert (context.get_start_method() if context is not None else None) == start
    (worker,) = loader._iterator._workers
    assert (_parent(worker.pid) == os.getpid()) == (start is None)
