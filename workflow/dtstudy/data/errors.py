"""DataConfigError, the error of a dataset config value that cannot work (every data module raises it)."""

from __future__ import annotations

from dtstudy.errors import ConfigError


class DataConfigError(ConfigError):
    """A dataset config value that cannot work; the message names the key and the fix."""
