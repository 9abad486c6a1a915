"""The README step-flag tables match the step configs: every flag with its default and docstring, as in the code."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from pipeline import config as C

ROOT = Path(__file__).resolve().parents[1]
STEPS = [
    ("BatchMakerStepConfig", "batches"),
    ("LearnerStepConfig", "learn"),
    ("RolloutStepConfig", "rollout"),
    ("EvaluateStepConfig", "evaluate"),
]
SHARED = {"store", "model", "train", "optimizer", "loss", "curriculum", "inference", "tracker"}


def field_docs() -> dict[str, dict[str, str]]:
    """Attribute docstrings (the string right after a field) per class of the pipeline/config package."""
    docs: dict[str, dict[str, str]] = {}
    nodes = [n for f in sorted((ROOT / "pipeline/config").glob("*.py")) for n in ast.parse(f.read_text()).body]
    for node in nodes:
        if isinstance(node, ast.ClassDef):
            d = {}
            for st, nxt in zip(node.body, node.body[1:], strict=False):
                if (
                    isinstance(st, ast.AnnAssign)
                    and isinstance(st.target, ast.Name)
                    and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    d[st.target.id] = " ".join(nxt.value.value.split())
            docs[node.name] = d
    return docs


def flag_rows() -> list[str]:
    """One README table row per step flag: `| --name | default | docstring |`."""
    docs = field_docs()
    rows = []
    for name, _ in STEPS:
        for f in dataclasses.fields(getattr(C, name)):
            if f.name in SHARED:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            rows.append(f"| `--{f.name}` | `{default!r}` | {docs[name].get(f.name, '')} |")
    return rows


def test_every_step_flag_is_in_the_readme_as_the_code_has_it() -> None:
    readme = (ROOT / "README.md").read_text()
    rows = flag_rows()
    assert len(rows) > 20
    missing = [r for r in rows if r not in readme]
    assert not missing, "README step flags out of date:\n" + "\n".join(missing)
    undocumented = [r for r in rows if r.endswith("|  |")]
    assert not undocumented, "step flags without a docstring:\n" + "\n".join(undocumented)
