"""Decoding an image file to an RGB uint8 tensor [3, H, W], one decoder per `loader.decoder`
(`DECODERS`): PIL, torchvision.io (libjpeg-turbo) on the CPU, or nvJPEG on the GPU in batches.

Real trees are messy (ImageNet's training set has all three): grayscale JPEGs, CMYK JPEGs and
files whose extension lies about their format (a PNG named .JPEG) all decode to RGB, because
every decoder reads the file's bytes, never its name, to choose the format.

torchvision 0.29 marks torchvision.io's decoders deprecated in favour of TorchCodec, which is
not installed here; DECODERS is where a TorchCodec decoder would be added.
"""

from __future__ import annotations

from pathlib import Path

import torch

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


def decode_pil(path: Path) -> torch.Tensor:
    """PIL's decoder (torchvision's ImageFolder default): any format PIL reads, any mode, to RGB."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        array = np.asarray(image.convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def decode_torchvision(path: Path) -> torch.Tensor:
    """torchvision.io on the CPU (libjpeg-turbo for JPEG, also PNG, WebP, GIF), found by the
    file's bytes; the formats it lacks (BMP, PPM, TIFF: ImageFolder's other extensions) via PIL."""
    from torchvision.io import ImageReadMode, decode_image

    data = torch.from_numpy(_read(path))
    try:
        return decode_image(data, mode=ImageReadMode.RGB)
    except RuntimeError:  # "Unsupported image file": not JPEG/PNG/WebP/GIF
        return decode_pil(path)


def _read(path: Path):
    import numpy as np

    return np.fromfile(path, dtype=np.uint8)


class CpuDecoder:
    """Workers decode and transform each image; the batch is uint8 pixels [B, 3, S, S]."""

    def __init__(self, decode):
        self.decode = decode

    def load(self, path: Path, transform, generator: torch.Generator | None = None):
        image = self.decode(path)
        return transform.apply(image, transform.plan(*image.shape[-2:], generator))

    def collate(self, items: list) -> torch.Tensor:
        return torch.stack(items)

    def finish(self, batch, transform, device: torch.device) -> torch.Tensor:
        """The batch's uint8 pixels on `device` (pinned batches copy asynchronously)."""
        return batch.to(device, non_blocking=True)


class NvjpegDecoder:
    """nvJPEG through torchvision.io.decode_jpeg on the run's GPU: workers read each file and
    draw its crop from the JPEG's header (no pixels decoded on the CPU); the main process
    decodes the batch's JPEGs in one call on the device and crops, resizes and flips there.
    Files nvJPEG is not given (not a JPEG, grayscale or CMYK) are decoded by the workers on
    the CPU as `torchvision` does, and joined to the batch. On a CPU device decode_jpeg runs
    the same code with libjpeg-turbo (what the tests check)."""

    def load(self, path: Path, transform, generator: torch.Generator | None = None):
        raw = _read(path)
        frame = jpeg_frame(raw[:65536].tobytes())
        if frame is None or frame[2] != 3:
            image = decode_torchvision(path)
            return "pixels", transform.apply(image, transform.plan(*image.shape[-2:], generator))
        return "jpeg", torch.from_numpy(raw), transform.plan(frame[0], frame[1], generator)

    def collate(self, items: list) -> dict:
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

    def finish(self, batch: dict, transform, device: torch.device) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_jpeg

        out = torch.empty((batch["size"], 3, transform.size, transform.size), dtype=torch.uint8, device=device)
        if len(batch["pixel_slots"]):
            out[batch["pixel_slots"].to(device)] = batch["pixels"].to(device, non_blocking=True)
        if batch["jpegs"]:
            images = decode_jpeg(batch["jpegs"], mode=ImageReadMode.RGB, device=device)
            cropped = [transform.apply(image, plan) for image, plan in zip(images, batch["plans"])]
            out[batch["jpeg_slots"].to(device)] = torch.stack(cropped)
        return out


DECODERS = {
    "pil": lambda: CpuDecoder(decode_pil),
    "torchvision": lambda: CpuDecoder(decode_torchvision),
    "nvjpeg": NvjpegDecoder,
}
