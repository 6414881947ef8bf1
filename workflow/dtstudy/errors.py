"""The error a bad config value raises: one class every module can import without cycles."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value that cannot be used; the message says which key and what is allowed."""
