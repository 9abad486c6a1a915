"""The step-flag tables (now in the generated docs/reference/configuration.md, not the README) match the step
configs: every flag with its default and docstring, as in the code."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

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


def test_every_make_target_with_a_help_line_has_its_readme_row() -> None:
    """The README's "Makefile targets" table lists exactly the targets `make help` lists, each with its help text."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    helps = dict(re.findall(r"^([a-zA-Z_-]+):.*?## (.*)$", (root / "Makefile").read_text(), re.M))
    readme = (root / "README.md").read_text()
    table = readme[readme.index("## Makefile targets") :]
    rows = dict(re.findall(r"^\| `make ([a-zA-Z_-]+)` \| (.*) \|$", table, re.M))
    assert sorted(rows) == sorted(helps), (sorted(set(helps) - set(rows)), sorted(set(rows) - set(helps)))
    wrong = {t: (rows[t], h) for t, h in helps.items() if rows[t] != h}
    assert not wrong, f"README rows that differ from `make help`: {wrong}"


def _link_targets(page: Path) -> set[Path]:
    """The files `page`'s markdown links point to (relative links, anchors dropped), resolved."""
    targets = re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", page.read_text())
    return {(page.parent / t).resolve() for t in targets if "://" not in t}


def test_every_docs_page_is_linked_from_the_readme_and_the_docs_index() -> None:
    """Every page under docs/ (guides, reference, design, and the pages beside them) is linked from README.md and
    from docs/README.md, the docs index: a new page cannot go unlisted."""
    root = Path(__file__).resolve().parents[1]
    index = root / "docs" / "README.md"
    pages = sorted(p.resolve() for p in (root / "docs").rglob("*.md") if p != index)
    assert {p.parent.name for p in pages} >= {"guides", "reference", "design"}
    unlinked = [
        f"{source.relative_to(root)} does not link {page.relative_to(root)}"
        for source in (root / "README.md", index)
        for page in pages
        if page not in _link_targets(source)
    ]
    assert not unlinked, "docs pages missing from an index:\n" + "\n".join(unlinked)


def test_every_readme_table_row_has_its_headers_cells() -> None:
    """No README table row with more or fewer cells than its header (a broken row renders as garbage)."""
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[1] / "README.md").read_text().splitlines()
    bad, width = [], None
    for i, line in enumerate(lines, 1):
        if not line.startswith("|"):
            width = None
            continue
        cells = len(line.replace("\\|", "").strip().strip("|").split("|"))
        if width is None:
            width = cells
        elif cells != width:
            bad.append(f"README.md:{i}: {cells} cells, the header has {width}: {line[:120]}")
    assert not bad, "\n".join(bad)
