"""Decoding an image file to an RGB uint8 tensor [3, H, W], one decoder per `loader.decoder`
(`DECODERS`): PIL, torchvision.io (libjpeg-turbo) on the CPU, NVIDIA DALI's fused
decode-and-crop on the CPU (only the training crop's region), or nvJPEG on the GPU in batches.

Real trees are messy (ImageNet's training set has all three): grayscale JPEGs, CMYK JPEGs and
files whose extension lies about their format (a PNG named .JPEG) all decode to RGB, because
every decoder reads the file's bytes, never its name, to choose the format.

torchvision 0.29 marks torchvision.io's decoders deprecated in favour of TorchCodec, which is
not installed here; DECODERS is where a TorchCodec decoder would be added.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import torch

from dtstudy.data.storage import read_file

JPEG_START = b"\xff\xd8"
# JPEG frame headers (SOF0..SOF15, less DHT 0xC4, JPG 0xC8 and DAC 0xCC): they hold height, width, components
_SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_STANDALONE = {0x01, *range(0xD0, 0xD8)}  # markers without a length field (TEM, RST0..7)


def jpeg_frame(data: bytes) -> tuple[int, int, int] | None:
    """(height, width, components) from a JPEG's frame header, or None when `data` is not a
    JPEG with a readable one; reads the headers only (nvJPEG's batches take 3-component files)."""
    if not data.startswith(JPEG_START):
        return None
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker in _SOF_MARKERS:
            if pos + 10 > len(data):
                return None
            height = int.from_bytes(data[pos + 5 : pos + 7], "big")
            width = int.from_bytes(data[pos + 7 : pos + 9], "big")
            return height, width, data[pos + 9]
        if marker == 0xDA:  # start of scan before any frame header: damaged
            return None
        pos += 2 + length
    return None


def decode_pil(source: Path | np.ndarray) -> torch.Tensor:
    """PIL's decoder (torchvision's ImageFolder default): any format PIL reads, any mode, to RGB;
    `source` a file, or its bytes (uint8)."""
    from PIL import Image

    stream = io.BytesIO(source.tobytes()) if isinstance(source, np.ndarray) else source
    with Image.open(stream) as image:
        array = np.asarray(image.convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def decode_torchvision(source: Path | np.ndarray) -> torch.Tensor:
    """torchvision.io on the CPU (libjpeg-turbo for JPEG, also PNG, WebP, GIF), found by the
    file's bytes; the formats it lacks (BMP, PPM, TIFF: ImageFolder's other extensions) via
    PIL. `source` a file, or its bytes (uint8)."""
    from torchvision.io import ImageReadMode, decode_image

    data = read_bytes(source)
    if not data.flags.writeable:  # a shard's read-only map: torch wants tensors it may write (a copy of the bytes)
        data = data.copy()
    try:
        return decode_image(torch.from_numpy(data), mode=ImageReadMode.RGB)
    except RuntimeError:  # "Unsupported image file": not JPEG/PNG/WebP/GIF
        return decode_pil(data)


def read_bytes(source: Path | np.ndarray) -> np.ndarray:
    """A file's bytes as uint8 (bytes already read pass through)."""
    return source if isinstance(source, np.ndarray) else read_file(source)


#: how loader workers start where nothing else is asked for: None, the DataLoader's default (fork on Linux)
FORK = None


class CpuDecoder:
    """Workers decode and transform each image; the batch is uint8 pixels [B, 3, S, S].
    Every decoder's `load` takes an image's encoded bytes (data.storage reads them)."""

    #: the multiprocessing start method its loader workers need (data.feed's DataLoader)
    worker_start_method: str | None = FORK

    def __init__(self, decode):
        self.decode = decode

    def load(self, data: np.ndarray, transform, generator: torch.Generator | None = None):
        image = self.decode(data)
        return transform.apply(image, transform.plan(*image.shape[-2:], generator))

    def collate(self, items: list, transform) -> torch.Tensor:
        return torch.stack(items)

    def finish(self, batch, transform, device: torch.device) -> torch.Tensor:
        """The batch's uint8 pixels on `device` (pinned batches copy asynchronously)."""
        return batch.to(device, non_blocking=True)


class _HeaderPlanDecoder:
    """Workers read each file and draw its crop from the JPEG's header (no pixels decoded
    yet); a batch's 3-component JPEGs are then decoded together, where the subclass does it
    (nvjpeg: on the GPU, in `finish`; dali_cpu: in the worker, in `collate`). Other files (not
    a JPEG, grayscale or CMYK) are decoded by the workers on the CPU as `torchvision` does,
    and joined to the batch (`join`)."""

    worker_start_method: str | None = FORK

    def takes(self, transform) -> bool:
        """Whether this decoder's batch path serves `transform` (else every file is decoded whole)."""
        return True

    def load(self, raw: np.ndarray, transform, generator: torch.Generator | None = None):
        frame = jpeg_frame(raw[:65536].tobytes()) if self.takes(transform) else None
        if frame is None or frame[2] != 3:
            image = decode_torchvision(raw)
            return "pixels", transform.apply(image, transform.plan(*image.shape[-2:], generator))
        return "jpeg", torch.from_numpy(raw), transform.plan(frame[0], frame[1], generator)

    def collate(self, items: list, transform) -> dict:
        pixels = [(i, item[1]) for i, item in enumerate(items) if item[0] == "pixels"]
        jpegs = [(i, item[1], item[2]) for i, item in enumerate(items) if item[0] == "jpeg"]
        return {
            "size": len(items),
            "pixel_slots": torch.tensor([i for i, _ in pixels], dtype=torch.long),
            "pixels": torch.stack([p for _, p in pixels]) if pixels else torch.empty(0, dtype=torch.uint8),
            "jpeg_slots": torch.tensor([i for i, _, _ in jpegs], dtype=torch.long),
            "jpegs": [data for _, data, _ in jpegs],
            "plans": [plan for _, _, plan in jpegs],
        }

    @staticmethod
    def join(batch: dict, decoded: list, transform, device: torch.device) -> torch.Tensor:
        """The batch's uint8 pixels [B, 3, S, S] on `device`: the workers' CPU-decoded images
        and `decoded` (the JPEGs' transformed images, in the batch's JPEG order) in their slots."""
        out = torch.empty((batch["size"], 3, transform.size, transform.size), dtype=torch.uint8, device=device)
        if len(batch["pixel_slots"]):
            out[batch["pixel_slots"].to(device)] = batch["pixels"].to(device, non_blocking=True)
        if decoded:
            out[batch["jpeg_slots"].to(device)] = torch.stack(decoded)
        return out


class NvjpegDecoder(_HeaderPlanDecoder):
    """nvJPEG through torchvision.io.decode_jpeg on the run's GPU: the main process decodes
    the batch's JPEGs in one call on the device and crops, resizes and flips there (the
    workers only read the files and draw the crops). On a CPU device decode_jpeg runs the
    same code with libjpeg-turbo (what the tests check).

    On a GPU the decode runs on a stream of its own. torchvision allocates the decoded
    images on the caller's current stream, then writes them from a private stream that does
    not wait for the caller's: on the training stream, a block freed by the previous step
    but still read by its queued kernels could be handed to the decoder and overwritten
    (pytorch/vision#9606). On the decode stream the images come from that stream's own
    blocks; the training stream waits for the decode (torchvision makes the current stream
    wait for its private one) and each image is recorded as used by the training stream, so
    that its block is not handed out again before the training stream's kernels are done."""

    def __init__(self):
        self._streams: dict[torch.device, object] = {}  # device -> its decode stream

    def finish(self, batch: dict, transform, device: torch.device) -> torch.Tensor:
        decoded = []
        if batch["jpegs"]:
            images = self._decode(batch["jpegs"], device)
            decoded = [transform.apply(image, plan) for image, plan in zip(images, batch["plans"])]
        return self.join(batch, decoded, transform, device)

    def _decode(self, jpegs: list, device: torch.device) -> list:
        from torchvision.io import ImageReadMode, decode_jpeg

        if device.type != "cuda":
            return decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device)
        consumer = torch.cuda.current_stream(device)
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        stream = self._streams[device]
        with torch.cuda.stream(stream):
            images = decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device)
        consumer.wait_stream(stream)
        for image in images:
            image.record_stream(consumer)
        return images


DALI_CHUNK = 16  # JPEGs per DALI run: as fast per image as 64 on 1500x1125 JPEGs, without 64's stalls


class DaliCpuDecoder(_HeaderPlanDecoder):
    """NVIDIA DALI's fused decode-and-crop on the CPU, in the loader workers: of each training
    JPEG only the crop's region is decoded (libjpeg-turbo's partial decoding, as DALI's
    `decoders.image_slice` does it; the rows below the crop are never read), then resized and
    flipped as `torchvision` would: the same pixels as decoding the whole file first. Splits
    whose transform reads the whole image (Resize + CenterCrop) decode as `torchvision` does.

    One DALI pipeline per worker process (its own thread, built on first use: DALI's threads
    do not survive a fork), CPU only: it needs no GPU. Building it still loads the CUDA
    driver (libcuda) where there is one, and a training process on a GPU has initialised
    CUDA before its loaders start their workers: a child forked from it must not call the
    driver. The workers start from a fresh interpreter instead (forkserver: one clean process
    that forks them; the split's items are pickled to them)."""

    worker_start_method = "forkserver"

    def __init__(self):
        self._pipeline = None  # (pid, pipeline)

    def __getstate__(self):  # to a started worker: no pipeline (each builds its own)
        return {"_pipeline": None}

    def takes(self, transform) -> bool:
        return transform.reads_a_region

    def collate(self, items: list, transform) -> torch.Tensor:
        batch = super().collate(items, transform)
        decoded = []
        if batch["jpegs"]:
            regions = self._decode_regions(batch["jpegs"], batch["plans"])
            decoded = [transform.apply_to_region(region, plan) for region, plan in zip(regions, batch["plans"])]
        return self.join(batch, decoded, transform, torch.device("cpu"))

    finish = CpuDecoder.finish  # the workers' batch is pixels already

    def _decode_regions(self, jpegs: list, plans: list) -> list:
        """Each JPEG's crop region (plan's top, left, height, width) as uint8 [3, h, w], decoded
        DALI_CHUNK at a time: DALI's output buffers stay small, where a whole batch of large
        crops makes its first runs grow them for seconds."""
        pipeline = self._pipeline_of_this_process()
        regions = []
        for start in range(0, len(jpegs), DALI_CHUNK):
            chunk = range(start, min(start + DALI_CHUNK, len(jpegs)))
            pipeline.feed_input("jpegs", [jpegs[i].numpy() for i in chunk])
            pipeline.feed_input("anchors", [np.asarray(plans[i][:2].tolist(), dtype=np.int32) for i in chunk])
            pipeline.feed_input("shapes", [np.asarray(plans[i][2:4].tolist(), dtype=np.int32) for i in chunk])
            (decoded,) = pipeline.run()
            regions += [torch.from_numpy(np.array(decoded[k])).permute(2, 0, 1) for k in range(len(chunk))]
        return regions

    def _pipeline_of_this_process(self):
        if self._pipeline is None or self._pipeline[0] != os.getpid():
            self._pipeline = (os.getpid(), _dali_slice_pipeline(DALI_CHUNK))
        return self._pipeline[1]


def _dali_slice_pipeline(batch_size: int):
    """A CPU-only DALI pipeline: (JPEG bytes, anchor (y, x), shape (h, w)) -> RGB HWC uint8 of
    that region, decoded alone; fed and run one batch at a time in the calling thread."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(
        batch_size=batch_size,
        num_threads=1,
        device_id=None,
        prefetch_queue_depth=1,
        exec_async=False,
        exec_pipelined=False,
    )
    def region_of_each():
        jpegs = fn.external_source(name="jpegs")
        anchors = fn.external_source(name="anchors")
        shapes = fn.external_source(name="shapes")
        return fn.decoders.image_slice(jpegs, anchors, shapes, device="cpu", output_type=types.RGB, axis_names="HW")

    pipeline = region_of_each()
    pipeline.build()
    return pipeline


DECODERS = {
    "pil": lambda: CpuDecoder(decode_pil),
    "torchvision": lambda: CpuDecoder(decode_torchvision),
    "nvjpeg": NvjpegDecoder,
    "dali_cpu": DaliCpuDecoder,
}
