"""Where an imagefolder split's encoded images are read from: the tree's own
files (`FileStore`), or tar shards that `prepare_data` packs them into (`ShardStore`,
`dataset.shard_mb`), for shared file systems that serve a few large files far better than
a million small ones (every open of a small file is a metadata request to the file server).

The shards are plain tar files in WebDataset's layout (members `<key>.<ext>` and
`<key>.cls`, one key per image, in the split's order), so `tar` and the `webdataset`
library read them too. The study reads each image by its byte offset (`shards.json`), not
as a stream: the training loop's samplers decide which images each worker gets in which
order (the same for every strategy, resumable mid-epoch), which a stream's shuffle buffer
would not reproduce. So reads stay random, but within a few large files.
"""

from __future__ import annotations

import functools
import io
import json
import os
import shutil
import tarfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

from dtstudy.common.atomic_files import atomic_write, write_json

SHARDS_DIR = "shards"
SHARDS_INDEX = "shards.json"
LABEL_SUFFIX = ".cls"
MAX_OPEN_SHARDS = 256  # per process


def read_file(path: Path) -> np.ndarray:
    """A file's bytes, as uint8."""
    return np.fromfile(path, dtype=np.uint8)


class FileStore:
    """Each image in its own file of the tree, at root / path."""

    def __init__(self, root: Path, paths: list[str]):
        self.root, self.paths = Path(root), paths

    def read(self, i: int) -> np.ndarray:
        """Image i's encoded bytes, as uint8."""
        return read_file(self.root / self.paths[i])


class ShardStore:
    """A split's images packed in tar shards: image i is `size` bytes at `offset` of shard
    `shard`. Each process (loader workers are processes) keeps the shards it reads open, the
    MAX_OPEN_SHARDS it read last: ImageNet in 64 MB shards is over 2000 files, and a
    process may have 1024 open."""

    def __init__(self, folder: Path, files: list[str], locations: list[list[int]]):
        self.folder, self.files, self.locations = Path(folder), files, locations
        self._open = None  # (pid, {shard: file descriptor}, least recently read first)

    def read(self, i: int) -> np.ndarray:
        shard, offset, size = self.locations[i]
        data = os.pread(self._descriptor(shard), size, offset)
        if len(data) != size:
            raise OSError(
                f"shard '{self.folder / self.files[shard]}' ends before byte {offset + size} "
                f"(image {i} of the split); rerun prepare_data"
            )
        return np.frombuffer(data, dtype=np.uint8)

    def _descriptor(self, shard: int) -> int:
        pid = os.getpid()
        if self._open is None or self._open[0] != pid:  # a forked worker opens its own
            self._open = (pid, OrderedDict())
        descriptors = self._open[1]
        if shard in descriptors:
            descriptors.move_to_end(shard)
            return descriptors[shard]
        if len(descriptors) == MAX_OPEN_SHARDS:
            os.close(descriptors.popitem(last=False)[1])
        descriptors[shard] = os.open(self.folder / self.files[shard], os.O_RDONLY)
        return descriptors[shard]

    def __getstate__(self):  # to a spawned worker: the locations, not this process's descriptors
        return {**self.__dict__, "_open": None}

    def __del__(self):
        if self._open is not None and self._open[0] == os.getpid():
            for descriptor in self._open[1].values():
                os.close(descriptor)


def shard_store(data_dir: Path, meta: dict, split: str) -> ShardStore | None:
    """The shards of a prepared split, or None when prepare_data left the images in the tree."""
    if meta.get("shards") is None:
        return None
    index = json.loads((Path(data_dir) / SHARDS_INDEX).read_text())
    return ShardStore(Path(data_dir) / SHARDS_DIR, index["files"], index["locations"][split])


def write_shards(root: Path, splits: dict[str, list], out_dir: Path, shard_mb: float) -> dict:
    """Pack each split's files (root / path, in the split's order) into tar shards of about
    `shard_mb` MB under out_dir/shards/, each written whole or not at all, and write
    out_dir/shards.json (shard files, and each image's shard, byte offset and size).
    Returns meta.json's `shards` entry."""
    folder = Path(out_dir) / SHARDS_DIR
    remove_shards(out_dir)  # a previous preparation's
    limit = shard_mb * 2**20
    files, locations = [], {}
    for split, samples in splits.items():
        locations[split] = []
        start, first = 0, len(files)  # first: this split's first shard
        while start < len(samples):
            stop, size = start, 0
            while stop < len(samples) and (stop == start or size < limit):
                size += os.path.getsize(root / samples[stop][0])
                stop += 1
            name = f"{split}-{len(files) - first:06d}.tar"
            atomic_write(
                folder / name, functools.partial(_write_tar, root=root, samples=samples, start=start, stop=stop)
            )
            offsets = _data_offsets(folder / name)
            locations[split] += [[len(files), *offsets[_key(i) + _suffix(samples[i][0])]] for i in range(start, stop)]
            files.append(name)
            print(f"prepare imagefolder: {split} shard {name}: images {start + 1}-{stop} of {len(samples)}", flush=True)
            start = stop
    write_json(Path(out_dir) / SHARDS_INDEX, {"shard_mb": shard_mb, "files": files, "locations": locations})
    return {"shard_mb": shard_mb, "count": len(files), "folder": SHARDS_DIR}


def remove_shards(out_dir: Path) -> None:
    """Delete the shards (and their index) a preparation wrote into out_dir, if any."""
    (Path(out_dir) / SHARDS_INDEX).unlink(missing_ok=True)
    shutil.rmtree(Path(out_dir) / SHARDS_DIR, ignore_errors=True)


def _key(i: int) -> str:
    return f"{i:08d}"


def _suffix(path: str) -> str:
    """The member's extension: the file's own, lower-case (WebDataset picks decoders by it)."""
    return Path(path).suffix.lower() or ".bin"


def _write_tar(stream, root: Path, samples: list, start: int, stop: int) -> None:
    with tarfile.open(fileobj=stream, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(start, stop):
            path, label = samples[i]
            data = (root / path).read_bytes()
            for name, payload in ((_key(i) + _suffix(path), data), (_key(i) + LABEL_SUFFIX, str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(payload), 0o444
                tar.addfile(info, io.BytesIO(payload))


def _data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Member name -> (byte offset of its data, size), read back from the shard's headers."""
    with tarfile.open(path) as tar:
        return {member.name: (member.offset_data, member.size) for member in tar.getmembers()}
