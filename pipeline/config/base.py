"""The root of every config error: `ConfigError` names the field (dotted path) and the value."""

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
