"""The configuration reference, generated from the config dataclasses: `python -m pipeline.config.reference`.

Writes docs/reference/configuration.md: the job config tree (`RLJobConfig`, every field by dotted path), every
registered choice (loss types, inference backends, trackers, job backends) with its own fields, and each step
program's flags; each row gives the field, its type, its default and its meaning (the field's docstring: the
string right after it in the class body). `--check` writes nothing and exits 1 when the file differs from what
would be written or a field has no meaning. `make docs` runs it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import json
import sys
import typing
from pathlib import Path
from typing import Any

import draccus

from pipeline.config.backend import JobBackendConfig
from pipeline.config.job import RLJobConfig
from pipeline.config.model import InferenceConfig
from pipeline.config.programs import ExportConfig, ReplayConfig, ServeConfig
from pipeline.config.rescore import RescoreStepConfig
from pipeline.config.retention import GcStepConfig
from pipeline.config.steps import (
    BatchMakerStepConfig,
    EvaluateCommand,
    EvaluateStepConfig,
    LearnerStepConfig,
    RolloutStepConfig,
    TrackerConfig,
)
from pipeline.config.train import LossConfig

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "docs" / "reference" / "configuration.md"

CHOICES: tuple[tuple[str, type[draccus.ChoiceRegistry], str], ...] = (
    ("loss", LossConfig, "Loss types"),
    ("inference", InferenceConfig, "Inference backends"),
    ("tracker", TrackerConfig, "Trackers"),
    ("backend", JobBackendConfig, "Job backends"),
)
"""(the job config field, the registry, the section title) of every registered choice."""
STEPS: tuple[tuple[str, type], ...] = (
    ("steps.learn", LearnerStepConfig),
    ("steps.make_batches", BatchMakerStepConfig),
    ("steps.rollout", RolloutStepConfig),
    ("steps.evaluate", EvaluateStepConfig),
    ("steps.evaluate", EvaluateCommand),
    ("steps.gc", GcStepConfig),
    ("steps.rescore", RescoreStepConfig),
    ("steps.export", ExportConfig),
    ("steps.replay", ReplayConfig),
    ("steps.serve", ServeConfig),
)
"""(program, config class) of every step program whose config lives in `pipeline.config`."""
SHARED_SECTIONS = frozenset({"store", "model", "train", "optimizer", "loss", "curriculum", "inference", "tracker"})
"""Sections of a step config documented once, in the job config tree."""
_NO_DEFAULT = object()


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring of every field declared in `cls`'s own body (the string right after the field)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)).body
    docs = {}
    for st, nxt in itertools.pairwise(body):
        if (
            isinstance(st, ast.AnnAssign)
            and isinstance(st.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[st.target.id] = " ".join(nxt.value.value.split())
    return docs


def meaning(cls: type, name: str) -> str:
    """The docstring of field `name` of `cls`, from the nearest class of its MRO that declares one ('' if none)."""
    for klass in cls.__mro__:
        doc = field_docs(klass).get(name)
        if doc:
            return doc
    return ""


def type_text(cls: type, name: str) -> str:
    """The field's annotation as written in the source (`int | None`)."""
    for klass in cls.__mro__:
        ann = klass.__dict__.get("__annotations__", {})
        if name in ann:
            a = ann[name]
            return a if isinstance(a, str) else getattr(a, "__name__", str(a))
    return ""


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _dataclass_in(tp: Any) -> tuple[str, type] | None:
    """('', C) for a dataclass type C (also `C | None`), ('{}', C) for `dict[str, C]`, ('[]', C) for `list[C]`."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return "", tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    origin = typing.get_origin(tp)
    if origin in (dict, list) and args and isinstance(args[-1], type) and dataclasses.is_dataclass(args[-1]):
        return ("{}" if origin is dict else "[]"), args[-1]
    if len(args) == 1 and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
        return "", args[0]
    return None


def default_value(f: dataclasses.Field[Any]) -> Any:
    """The field's default (`_NO_DEFAULT` when it has none)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _NO_DEFAULT


def default_text(value: Any) -> str:
    """A default as it would be written in YAML (a section: `—`, its fields follow; a choice: its type)."""
    if value is _NO_DEFAULT:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return f"`{{type: {value.get_choice_name(type(value))}}}`" if isinstance(value, draccus.ChoiceRegistry) else "—"
    if isinstance(value, dict) and value and all(dataclasses.is_dataclass(v) for v in value.values()):
        return "`{" + ", ".join(value) + "}`"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value, default=str)}`"


def _shipped_choices(registry: Any) -> dict[str, Any]:
    """The choices of `registry` that rlpipe ships (a test or a user module may register more in this process:
    they are not part of the reference)."""
    return {
        name: cls
        for name, cls in registry.get_known_choices().items()
        if getattr(cls, "__module__", "").split(".")[0] in ("pipeline", "policy")
    }


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def rows(
    cls: type, prefix: str, missing: list[str], *, flat: frozenset[str] = frozenset(), defaults: Any = None
) -> list[str]:
    """Table rows of every field of `cls` under `prefix`, sections expanded (registered choices: the `type` row
    only; their fields are in the choices part). Fields named in `flat` get one row pointing to the job config.
    `defaults`: the instance whose values are the defaults shown (a section's own default), else the fields'."""
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        value = getattr(defaults, f.name) if defaults is not None else default_value(f)
        path = f"{prefix}{f.name}"
        doc = meaning(cls, f.name)
        if not doc:
            missing.append(f"{cls.__qualname__}.{f.name}")
        inner = _dataclass_in(hints[f.name])
        typ = _escape(type_text(cls, f.name))
        if f.name in flat and inner is not None:
            out.append(f"| `{path}.*` | `{typ}` | — | {_escape(doc)} (see the job config) |")
            continue
        if inner is not None and issubclass(inner[1], draccus.ChoiceRegistry):
            names = ", ".join(f"`{n}`" for n in _shipped_choices(inner[1]))
            see = f"Its fields: see {inner[1].__name__} below."
            out.append(f"| `{path}.type` | {names} | {default_text(value)} | {_escape(doc)} {see} |")
            continue
        out.append(f"| `{path}` | `{typ}` | {default_text(value)} | {_escape(doc)} |")
        if inner is not None:
            key, sub = inner
            sub_prefix = f"{path}.<id>." if key == "{}" else f"{path}[]." if key == "[]" else f"{path}."
            section = value if key == "" and dataclasses.is_dataclass(value) else None
            out.extend(rows(sub, sub_prefix, missing, defaults=section))
    return out


HEADER = "| field | type | default | meaning |\n|---|---|---|---|"


def render() -> tuple[str, list[str]]:
    """(the reference's markdown, the fields without a meaning)."""
    missing: list[str] = []
    parts = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m pipeline.config.reference` (`make docs`) from the dataclasses in",
        "pipeline/config; do not edit by hand: tests/test_config_reference.py fails when this file is stale. -->",
        "",
        "Every field of every config, with its type, default and meaning. A YAML file gives any subset (the rest keep",
        "their defaults); on the command line every field is a dotted flag (`--train.max_lag 2`,",
        "`--cadence.policy_interval 2`). A registered choice is picked by its `type` (`loss: {type: ppo}`,",
        "`--loss.type ppo`); its own fields follow it. `<id>` stands for a key of a mapping (a lesson id), `[]` for",
        "each entry of a list.",
        "",
        "## Job config (`RLJobConfig`)",
        "",
        "`configs/*.yaml`, run by `python -m steps.run --config_path FILE` (`make demo`). "
        + _escape(" ".join((RLJobConfig.__doc__ or "").split())),
        "",
        HEADER,
        *rows(RLJobConfig, "", missing),
        "",
        "## Registered choices",
        "",
    ]
    for field_name, registry, title in CHOICES:
        default = registry.default_choice_name()
        parts += [f"### {title} (`{field_name}.type`, default `{default}`)", ""]
        parts += [_escape(" ".join((registry.__doc__ or "").split())), ""]
        for name, cls in _shipped_choices(registry).items():
            parts += [f"#### `{field_name}: {{type: {name}}}` ({cls.__name__})", ""]
            parts += [_escape(" ".join((cls.__doc__ or "").split())), ""]
            fields = rows(cls, f"{field_name}.", missing)
            parts += [HEADER, *fields, ""] if fields else ["No fields of its own.", ""]
    parts += [
        "## Step programs",
        "",
        "Each step program takes its own config: `python -m PROGRAM --config_path FILE` and/or dotted flags. The job",
        "runner builds them from the job config (`RLJob.to_worker_configs()`); `python -m steps.run step NAME` runs",
        "one step of a job with step-level flag overrides. Sections shared with the job config (`store`, `model`,",
        "`train`, ...) are listed once, above.",
        "",
    ]
    for program, cls in STEPS:
        parts += [f"### `python -m {program}` ({cls.__name__})", ""]
        about = " ".join((cls.__doc__ or "").split()).removeprefix(f"`python -m {program}`").lstrip(":. ")
        parts += [_escape(about[:1].upper() + about[1:]), ""] if about else []
        parts += [HEADER.replace("field", "flag", 1), *rows(cls, "--", missing, flat=SHARED_SECTIONS), ""]
    return "\n".join(parts).rstrip() + "\n", missing


def main(argv: list[str] | None = None) -> int:
    """Write (or with `--check`, compare) docs/reference/configuration.md; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.config.reference", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the file is stale or a field has no meaning")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="the file written (default: %(default)s)")
    args = parser.parse_args(argv)
    text, missing = render()
    if missing:
        print("config fields without a meaning (a docstring right after the field):", *missing, sep="\n  ")
        return 1
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale: run `make docs` (python -m pipeline.config.reference)", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
