"""The one place a run's launch backend is chosen: launcher.cluster's value -> its backend. Every
other module asks the backend what the kind means, never compares launcher.cluster itself
(tests/test_launch_backends.py holds them to it)."""

from __future__ import annotations

from dtstudy.errors import ConfigError
from dtstudy.launch_backends.base import LaunchBackend
from dtstudy.launch_backends.emulate import EMULATE
from dtstudy.launch_backends.local import LOCAL
from dtstudy.launch_backends.slurm import SLURM

#: every launch backend, by the value of launcher.cluster that selects it (the schema's enum)
BACKENDS: dict[str, LaunchBackend] = {backend.kind: backend for backend in (LOCAL, SLURM, EMULATE)}


def launch_backend(config: dict) -> LaunchBackend:
    """The backend of a study or run config's launcher.cluster; ConfigError naming the key when
    it names none (the schema refuses it first, when the config is read)."""
    kind = config["launcher"]["cluster"]
    try:
        return BACKENDS[kind]
    except (KeyError, TypeError):  # TypeError: an unhashable value
        raise ConfigError(
            f"config key 'launcher.cluster': {kind!r} is not a launch backend; allowed: {', '.join(BACKENDS)}"
        ) from None
