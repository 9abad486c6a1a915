"""The root of every config error: `ConfigError` names the field (dotted path) and the value. Defined on the
ground floor (`pipeline.process.config_error`, importable by the storage layer without the config classes) and
re-exported here for the config modules."""

from __future__ import annotations

from pipeline.process.config_error import ConfigError, require

__all__ = ["ConfigError", "require"]
