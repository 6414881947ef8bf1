"""Writing results safely: a file appears whole under its name, or not at all."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Call write(binary stream) on a temporary file beside `path`, then rename it into place.

    A stream rather than a path, because torch.save records the file's name inside its
    archive: writing through the temporary name would make reruns differ byte for byte.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json(path: str | Path, obj) -> Path:
    return atomic_write(path, lambda stream: stream.write((json.dumps(obj, indent=1) + "\n").encode()))


def write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda stream: stream.write(text.encode()))
