"""The root of every config error: `ConfigError` names the field (dotted path) and the value. Defined on the
ground floor (`pipeline.process.config_error`, importable by the storage layer without the config classes) and
re-exported here for the config modules.

The field checks a config's `__post_init__` repeats (`at_least`, `positive`, `in_range`, `one_of`) take the config and
the fields' names and read the values themselves, so the path an error names is always the field checked: the
config class's `SECTION` (its place in the job config: `train`, `loss.distill`; "" for a step program's own
top-level fields) joined with the name. `default_choice` declares a choice registry's default type.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pipeline.process.config_error import ConfigError, require

__all__ = ["ConfigError", "at_least", "default_choice", "field_path", "in_range", "one_of", "positive", "require"]


def field_path(cfg: object, name: str) -> str:
    """The dotted path of field `name` of `cfg`: its class's `SECTION` (a ClassVar, "" if none) joined with it."""
    section = getattr(type(cfg), "SECTION", "")
    return f"{section}.{name}" if section else name


def at_least(cfg: object, low: float, *names: str, or_null: bool = False) -> None:
    """ConfigError `<path>=<value>: must be >= <low>` (`… or null`, None allowed, with `or_null`) for the first of
    the fields `names` (checked in order) that is below `low`."""
    for name in names:
        value = getattr(cfg, name)
        ok = (or_null and value is None) or value >= low
        require(ok, field_path(cfg, name), value, f"must be >= {low}" + (" or null" if or_null else ""))


def positive(cfg: object, *names: str) -> None:
    """ConfigError `<path>=<value>: must be > 0` for the first of the fields `names` (in order) that is not."""
    for name in names:
        value = getattr(cfg, name)
        require(value > 0, field_path(cfg, name), value, "must be > 0")


def in_range(cfg: object, low: float, high: float, *names: str) -> None:
    """ConfigError `<path>=<value>: must be in [<low>, <high>]` for the first of the fields `names` (in order)
    outside `low <= field <= high`."""
    for name in names:
        value = getattr(cfg, name)
        require(low <= value <= high, field_path(cfg, name), value, f"must be in [{low}, {high}]")


def one_of(cfg: object, name: str, choices: Collection[Any]) -> None:
    """ConfigError `<path>=<value>: one of <choices>` unless the field is one of `choices`."""
    value = getattr(cfg, name)
    require(value in choices, field_path(cfg, name), value, f"one of {choices}")


def default_choice(name: str) -> Any:
    """A choice registry's `default_choice_name` classmethod answering `name` (the type a config section without
    `type:` gets): `default_choice_name = default_choice("rloo")` in the registry's body."""
    return classmethod(lambda cls: name)
