"""The code's shape, checked so it stays true: imports point one way (`schemas` <- `pipeline` <- `policy` <-
`steps`), `schemas` and `pipeline` never import JAX, and no import cycle exists among the modules of these
packages, counting imports at any depth (inside functions too); and every module is named in the map of where
things live, docs/design/architecture.md, in the section of its package or subpackage; and no class is over 400
lines and no module over 600 unless its module docstring says why, in a paragraph beginning "Size:"."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("schemas", "pipeline", "policy", "steps")
JAX_MODULES = ("jax", "jaxlib", "equinox", "haliax", "levanter", "optax")


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in LAYERS:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name `module` imports, at any depth of its source."""
    names: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{a.name}" for a in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        targets = {resolve(n) for n in _imported_names(module, path)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles_at_any_depth() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (imports inside functions counted):\n" + "\n".join(map(str, cycles))


def test_layers_import_one_way() -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = [
        f"{m} -> {t}"
        for m, targets in _graph().items()
        for t in targets
        if rank[t.split(".")[0]] > rank[m.split(".")[0]]
    ]
    assert not upward, "imports against the layering schemas <- pipeline <- policy <- steps:\n" + "\n".join(upward)


def test_schemas_and_pipeline_never_import_jax() -> None:
    mods = _modules()
    offenders = [
        f"{m} imports {n}"
        for m, path in mods.items()
        if m.split(".")[0] in ("schemas", "pipeline")
        for n in _imported_names(m, path)
        if n.split(".")[0] in JAX_MODULES
    ]
    assert not offenders, "\n".join(offenders)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


ARCHITECTURE = ROOT / "docs" / "design" / "architecture.md"
SUBPACKAGE_BULLET = re.compile(r"- \*\*`([a-z_]+)/`\*\*")


def _map_blocks(text: str) -> dict[tuple[str, str | None], str]:
    """The map cut into blocks, keyed by (package, first-level subpackage or None).

    A package's section runs from its `## `pkg/`` heading to the next `## ` heading. Inside it, a bullet starting
    `- **`sub/`**` (its indented continuation lines included) is the block of subpackage `sub`; everything else in
    the section (paragraphs, other bullets) is the block of the package's own top-level modules."""
    blocks: dict[tuple[str, str | None], str] = {}
    package: str | None = None
    key: str | None = None
    for line in text.splitlines():
        if line.startswith("## "):
            named = [p for p in LAYERS if f"`{p}/`" in line]
            package, key = (named[0] if named else None), None
            continue
        if package is None:
            continue
        if line.startswith("- "):
            match = SUBPACKAGE_BULLET.match(line)
            key = match.group(1) if match else None
        elif not line.startswith(" "):
            key = None  # a blank line or a paragraph ends a bullet
        blocks[(package, key)] = blocks.get((package, key), "") + line + "\n"
    return blocks


def _named_in_map(module: Path, blocks: dict[tuple[str, str | None], str]) -> bool:
    """`pkg/name.py`: "`name.py`" in the package's own block; `pkg/sub/name.py`: in the `sub/` bullet;
    `pkg/sub/deeper/name.py`: in the `sub/` bullet, after "`deeper/`"."""
    package, *folders, name = module.relative_to(ROOT).parts
    text = blocks.get((package, folders[0] if folders else None), "")
    at = 0
    for folder in folders[1:]:
        at = text.find(f"`{folder}/`", at)
        if at < 0:
            return False
    return f"`{name}`" in text[at:]


def test_every_module_is_named_in_the_architecture_map() -> None:
    blocks = _map_blocks(ARCHITECTURE.read_text())
    modules = sorted(p for pkg in LAYERS for p in (ROOT / pkg).rglob("*.py") if p.name != "__init__.py")
    assert len(modules) > 100
    missing = [str(p.relative_to(ROOT)) for p in modules if not _named_in_map(p, blocks)]
    assert not missing, (
        "modules docs/design/architecture.md does not name (`pkg/name.py`: in the `## `pkg/`` section outside its "
        "subpackage bullets; `pkg/sub/name.py`: in the `- **`sub/`**` bullet; `pkg/sub/deeper/name.py`: in that "
        "bullet after `deeper/`):\n" + "\n".join(missing)
    )


def test_the_map_rule_reads_sections_and_bullets() -> None:
    text = "## `pipeline/`: x\n\nTop `a.py`.\n\n- **`store/`**: `b.py`, `launchers/` (`c.py`)\n  `d.py`\n- `e.py`\n"
    blocks = _map_blocks(text)
    for path, named in [
        ("pipeline/a.py", True),
        ("pipeline/e.py", True),
        ("pipeline/b.py", False),
        ("pipeline/store/b.py", True),
        ("pipeline/store/d.py", True),
        ("pipeline/store/a.py", False),
        ("pipeline/store/launchers/c.py", True),
        ("pipeline/store/launchers/b.py", False),
        ("policy/a.py", False),
    ]:
        assert _named_in_map(ROOT / path, blocks) is named, path


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "pipeline" and len(parts) > 2 else None


def test_no_two_pipeline_subpackages_import_each_other() -> None:
    edges = {
        (a, b)
        for m, targets in _graph().items()
        for t in targets
        if (a := _subpackage(m)) and (b := _subpackage(t)) and a != b
    }
    mutual = {tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges}
    assert not mutual, f"pipeline subpackages that import each other: {sorted(mutual)}"


def test_the_ground_floor_imports_nothing_above_it() -> None:
    """`pipeline.process` and `pipeline.store` import no other pipeline subpackage (config included), and
    importing the storage layer loads at most 25 project modules (35 when it imported the config package)."""
    import subprocess
    import sys

    above = [
        f"{m} -> {t}"
        for m, targets in _graph().items()
        if _subpackage(m) in ("pipeline.process", "pipeline.store")
        for t in targets
        if _subpackage(t) not in (None, "pipeline.process", "pipeline.store")
        and not (_subpackage(m) == "pipeline.store" and _subpackage(t) == "pipeline.process")
    ]
    assert not above, "\n".join(above)
    code = (
        "import sys; import pipeline.store.storage; "
        "print(sum(m.split('.')[0] in ('schemas', 'pipeline', 'policy', 'steps') for m in sys.modules))"
    )
    loaded = int(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout)  # fmt: skip
    assert loaded <= 25, f"importing pipeline.store.storage loads {loaded} project modules"


MAX_CLASS_LINES = 400
MAX_MODULE_LINES = 600
SIZE_REASON = re.compile(r"(?:^|\n[ \t]*\n)[ \t]*Size:[ \t]*\S")


def _oversized(source: str, name: str) -> list[str]:
    """Each class of `source` over MAX_CLASS_LINES lines (`end_lineno - lineno + 1`, decorators not counted) and the
    module itself when over MAX_MODULE_LINES lines, unless its docstring has a paragraph beginning `Size:` (the
    reason this is one unit)."""
    tree = ast.parse(source)
    if SIZE_REASON.search(ast.get_docstring(tree) or ""):
        return []
    found = []
    n_lines = len(source.splitlines())
    if n_lines > MAX_MODULE_LINES:
        found.append(f"{name}: module of {n_lines} lines")
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
            length = node.end_lineno - node.lineno + 1
            if length > MAX_CLASS_LINES:
                found.append(f"{name}: class {node.name} of {length} lines")
    return found


def test_no_class_over_400_and_no_module_over_600_lines_without_a_reason() -> None:
    offenders = [
        o
        for pkg in LAYERS
        for path in sorted((ROOT / pkg).rglob("*.py"))
        for o in _oversized(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not offenders, (
        f"no class over {MAX_CLASS_LINES} lines and no module over {MAX_MODULE_LINES} without a reason: cut it along "
        "a seam, or give its module docstring a paragraph beginning 'Size:' that says why it is one unit:\n"
        + "\n".join(offenders)
    )


def test_the_size_rule_reads_classes_modules_and_reasons() -> None:
    def module(doc: str, class_lines: int = 0, filler: int = 0) -> str:
        """A source: docstring `doc`, a class of `class_lines` lines, then `filler` more lines."""
        cls = "class C:\n" + "".join(f"    x{i} = {i}\n" for i in range(class_lines - 1)) if class_lines else ""
        return f'"""{doc}"""\n' + cls + "y = 0\n" * filler

    assert _oversized(module("A module.", class_lines=401), "m.py") == ["m.py: class C of 401 lines"]
    assert _oversized(module("A module.", class_lines=400), "m.py") == []
    assert _oversized(module("A module.", filler=600), "m.py") == ["m.py: module of 601 lines"]
    assert _oversized(module("A module.", filler=599), "m.py") == []
    for reason in ("A module.\n\nSize: one unit because of X.\n", "Size: one unit because of X."):
        assert _oversized(module(reason, class_lines=500, filler=200), "m.py") == []
    # "Size:" mid-paragraph, or with nothing after it, is no reason
    assert _oversized(module("A module. Size: small.", filler=600), "m.py") == ["m.py: module of 601 lines"]
    assert _oversized(module("A module.\n\nSize:\n\nMore.\n", filler=600), "m.py") == ["m.py: module of 606 lines"]
