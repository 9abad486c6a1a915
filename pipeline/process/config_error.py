"""`ConfigError`, the one refused-configuration error (exit 2, one line naming the field and the value, never
restarted), and `require`. It lives on the ground floor so that every layer can raise it, the storage layer
included, without importing the configuration classes; `pipeline.config` re-exports both."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the value."""

    def __init__(self, field_name: str, value: Any, why: str) -> None:
        super().__init__(f"{field_name}={value!r}: {why}")
        self.field = field_name
        self.value = value


def require(cond: bool, field_name: str, value: Any, why: str) -> None:
    """Raise `ConfigError(field_name, value, why)` unless `cond` holds."""
    if not cond:
        raise ConfigError(field_name, value, why)
