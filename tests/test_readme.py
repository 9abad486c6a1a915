"""The step-flag tables (now in the generated docs/reference/configuration.md, not the README) match the step
configs: every flag with its default and docstring, as in the code."""

from __future__ import annotations

import dataclasses

from pipeline import config as C
from pipeline.config import reference

STEPS = ["BatchMakerStepConfig", "LearnerStepConfig", "RolloutStepConfig", "EvaluateStepConfig"]


def flag_rows() -> list[str]:
    """The start of one reference row per step flag: `| `--name` | `type` | default | docstring |`."""
    rows = []
    for name in STEPS:
        cls = getattr(C, name)
        for f in dataclasses.fields(cls):
            if f.name in reference.SHARED_SECTIONS:
                continue
            value = reference.default_value(f)
            typ = reference.type_text(cls, f.name).replace("|", "\\|")
            doc = reference.meaning(cls, f.name).replace("|", "\\|")
            rows.append(f"| `--{f.name}` | `{typ}` | {reference.default_text(value)} | {doc} |")
    return rows


def test_every_step_flag_is_in_the_reference_as_the_code_has_it() -> None:
    text = reference.OUTPUT.read_text()
    rows = flag_rows()
    assert len(rows) > 20
    missing = [r for r in rows if r not in text]
    assert not missing, "docs/reference/configuration.md step flags out of date (run `make docs`):\n" + "\n".join(
        missing
    )
    undocumented = [r for r in rows if r.endswith("|  |")]
    assert not undocumented, "step flags without a docstring:\n" + "\n".join(undocumented)
