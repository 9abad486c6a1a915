"""Command-line overrides draccus does not resolve the way a user means them, applied to the config file's
mapping before draccus parses (`steps.cli.parse_config` calls `resolve_overrides` for every step program and for
`python -m steps.run`).

- Switching a registered choice (`--loss.type gspo`, `--inference.type levanter`, `--tracker.type json`,
  `--backend.type ray`, any `draccus.ChoiceRegistry` field) to a type other than the config file's starts from
  the new type's own defaults: the file's fields of that section are not applied (further `--loss.field v`
  flags are, on top). One log line names the file's fields that were set aside: those the new type does not
  have (dropped) and those it has but whose file value differs from its default (reset). A `--X.type` equal to
  the file's type changes nothing: the file's fields are kept.
- A field of one entry of a dict of dataclasses (`--curriculum.lessons.cats.chat true`,
  `--curriculum.lessons.cats.sampling_params.n_prompts 8`), which draccus cannot address, is written into the
  file's mapping. The entry must exist (else a ConfigError naming the flag and the known ids). A lesson's
  `sampling_params` / `eval_sampling_params` that the file leaves unset starts from the curriculum's
  `default_sampling` / `eval_sampling` (what an unset one means), so one flag changes one value.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import types
from collections.abc import Iterator, Sequence
from typing import Any, Union, get_args, get_origin, get_type_hints

import draccus
from draccus import cfgparsing
from draccus.choice_types import CHOICE_TYPE_KEY, ChoiceRegistryBase
from draccus.options import config_type

from pipeline.config.base import ConfigError

logger = logging.getLogger("rlpipe.config")

CONFIG_FLAG = "config_path"
INHERITED_SECTIONS = {"sampling_params": "default_sampling", "eval_sampling_params": "eval_sampling"}
"""An entry's optional section (key) that, unset, means its parent's section (value): an override of one of its
fields starts from the parent's section."""


@dataclasses.dataclass(frozen=True)
class Section:
    """A field of the config tree that draccus's flags do not fully cover."""

    path: tuple[str, ...]
    """The field's dotted path, split (`("curriculum", "lessons")`)."""
    kind: str
    """'choice' (a ChoiceRegistry field) or 'dict' (a dict of dataclasses)."""
    cls: type
    """The choice base class, or the dict's value class."""
    parent: type
    """The dataclass that holds the field."""


def _unwrap(tp: Any) -> Any:
    """X for `X | None`."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    return tp


def sections(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[Section]:
    """The choice fields and dict-of-dataclass fields of config class `cls`, through its nested dataclasses."""
    if len(prefix) > 8 or not dataclasses.is_dataclass(cls):
        return
    try:
        hints = get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: draccus reports it when it parses
        return
    for f in dataclasses.fields(cls):
        tp = _unwrap(hints.get(f.name, f.type))
        path = (*prefix, f.name)
        if isinstance(tp, type) and issubclass(tp, ChoiceRegistryBase):
            yield Section(path, "choice", tp, cls)
        elif get_origin(tp) is dict and len(get_args(tp)) == 2:
            value = _unwrap(get_args(tp)[1])
            if isinstance(value, type) and dataclasses.is_dataclass(value):
                yield Section(path, "dict", value, cls)
        elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from sections(tp, path)


def _flags(argv: Sequence[str]) -> Iterator[tuple[int, int, str, str | None]]:
    """(index, number of arguments, flag name without `--`, value) of each `--flag value` / `--flag=value`."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            i += 1
            continue
        if "=" in arg:
            name, value = arg[2:].split("=", 1)
            yield i, 1, name, value
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            yield i, 2, arg[2:], argv[i + 1]
            i += 2
        else:
            yield i, 1, arg[2:], None
            i += 1


def _node(mapping: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(key)
    return mapping


def _default_encoded(cls: type, name: str) -> Any:
    """The encoded default of field `name` of dataclass `cls` (None if it has none)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return draccus.encode(f.default)
            if f.default_factory is not dataclasses.MISSING:
                return draccus.encode(f.default_factory())
    return None


def _field_defaults(cls: type) -> dict[str, Any]:
    """Field name -> default (dataclasses.MISSING where there is none) of dataclass `cls`."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = dataclasses.MISSING
    return out


def _switch_choice(mapping: dict[str, Any], section: Section, new_type: str, flagged: set[str]) -> bool:
    """Reset the file's section at `section.path` to `new_type`'s defaults if that changes its type; True if
    it did (one log line names the file's values set aside, but not the fields in `flagged`, which the command
    line sets)."""
    parent = _node(mapping, section.path[:-1])
    body = parent.get(section.path[-1]) if isinstance(parent, dict) else None
    if not isinstance(body, dict):
        return False
    base: Any = section.cls
    old_type = body.get(CHOICE_TYPE_KEY, base.default_choice_name())
    if str(old_type) == new_type:
        return False
    try:
        new_cls = base.get_choice_class(new_type)
    except KeyError:
        return False  # draccus names the unknown choice
    name = ".".join(section.path)
    defaults = _field_defaults(new_cls)
    kept = [k for k in body if k != CHOICE_TYPE_KEY and k not in flagged]
    dropped = [k for k in kept if k not in defaults]
    reset = [k for k in kept if k in defaults and body[k] != defaults[k]]
    parent[section.path[-1]] = {}
    if dropped or reset:
        parts = []
        if reset:
            changes = ", ".join(f"{name}.{k} (file {body[k]!r} -> {defaults[k]!r})" for k in reset)
            parts.append(f"reset to its defaults: {changes}")
        if dropped:
            parts.append(f"dropped, not fields of {new_type}: " + ", ".join(f"{name}.{k}={body[k]!r}" for k in dropped))
        logger.warning(
            "%s.type %s (command line) replaces the config file's %s; %s; give --%s.FIELD flags to set them",
            name,
            new_type,
            old_type,
            "; ".join(parts),
            name,
        )
    else:
        logger.info("%s.type %s (command line) replaces the config file's %s", name, new_type, old_type)
    return True


def _set_entry_field(mapping: dict[str, Any], section: Section, flag: str, rest: list[str], raw: str | None) -> None:
    """Write `--<section>.<id>.<field…> raw` into the file's mapping (ConfigError for an unknown id)."""
    name = ".".join(section.path)
    entries = _node(mapping, section.path)
    entries = entries if isinstance(entries, dict) else {}
    key = rest[0]
    if key not in entries:
        known = ", ".join(sorted(map(str, entries))) or "none"
        raise ConfigError(flag, raw, f"no entry {key!r} in {name} (known ids: {known})")
    if raw is None:
        raise ConfigError(flag, raw, "expects a value")
    if len(rest) == 1:
        entries[key] = cfgparsing.parse_string(raw)
        return
    if not isinstance(entries[key], dict):
        entries[key] = {}
    node = entries[key]
    for depth, part in enumerate(rest[1:-1]):
        child = node.get(part)
        if child is None and depth == 0 and part in INHERITED_SECTIONS:
            parent = _node(mapping, section.path[:-1])
            inherited = parent.get(INHERITED_SECTIONS[part]) if isinstance(parent, dict) else None
            if inherited is None:
                inherited = _default_encoded(section.parent, INHERITED_SECTIONS[part])
            child = copy.deepcopy(inherited) if isinstance(inherited, dict) else {}
        elif child is None:
            child = {}
        if not isinstance(child, dict):
            raise ConfigError(flag, raw, f"{name}.{key}.{'.'.join(rest[1 : depth + 2])} is not a section")
        node[part] = child
        node = child
    node[rest[-1]] = cfgparsing.parse_string(raw)


def _load(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        loaded = cfgparsing.load_config(f, file=path)
    return loaded if isinstance(loaded, dict) else {}


def resolve_overrides(config_class: type, argv: Sequence[str]) -> tuple[dict[str, Any] | None, list[str]]:
    """(the config file's mapping with the command line's choice switches and dict-entry fields applied, the
    arguments left for draccus), or (None, argv unchanged) when there is nothing to apply. With a mapping, the
    arguments hold no `--config_path`: the caller hands draccus the mapping as the config file."""
    args = list(argv)
    found = list(sections(config_class))
    choices = {".".join(s.path) + ".type": s for s in found if s.kind == "choice"}
    dicts = [s for s in found if s.kind == "dict"]
    config_path: str | None = None
    switches: dict[str, tuple[Section, str]] = {}
    entries: list[tuple[Section, str, list[str], str | None]] = []
    taken: set[int] = set()
    for index, count, name, value in _flags(args):
        if name == CONFIG_FLAG:
            config_path = value
        elif name in choices and value is not None:
            switches[name] = (choices[name], str(cfgparsing.parse_string(value)))
        else:
            for s in dicts:
                prefix = ".".join(s.path) + "."
                if name.startswith(prefix) and len(name) > len(prefix):
                    entries.append((s, name, name[len(prefix) :].split("."), value))
                    taken.update(range(index, index + count))
                    break
    if not entries and (not switches or config_path is None):
        return None, args
    if config_path is not None:
        mapping = _load(config_path)
    else:
        try:
            mapping = draccus.encode(config_class())
        except Exception:  # a config class with required fields: no defaults to start from
            mapping = {}
    changed = False
    for section, new_type in switches.values():
        prefix = ".".join(section.path) + "."
        flagged = {n[len(prefix) :].split(".")[0] for _, _, n, _ in _flags(args) if n.startswith(prefix)}
        changed = _switch_choice(mapping, section, new_type, flagged) or changed
    for section, flag, rest, raw in entries:
        _set_entry_field(mapping, section, flag, rest, raw)
    if not changed and not entries:
        return None, args
    rest_args: list[str] = []
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if i in taken:
            continue
        if arg == f"--{CONFIG_FLAG}":
            skip = True
            continue
        if arg.startswith(f"--{CONFIG_FLAG}="):
            continue
        rest_args.append(arg)
    return mapping, rest_args


def dump_yaml(mapping: dict[str, Any]) -> str:
    """`mapping` as the YAML text of a config file draccus reads back the same."""
    with config_type("yaml"):
        return cfgparsing.save_config(mapping) or ""
