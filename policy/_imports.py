"""Import levanter's submodules without running its eager package `__init__` files.

`levanter/__init__.py` imports every subpackage (trainer, data, eval_harness, ...), and `levanter/data/__init__.py`
imports its Hugging Face data sources; together they pull in `datasets`, `pandas`, `ray` and `torch` and cost ~10 s
per process, although rlpipe uses only levanter's model, layer, HF-converter, inference-engine and tracker modules.
Python runs a package's `__init__` before any of its submodules, so `import levanter.models.llama` alone pays all
of it (llama imports the HF converter, which imports `levanter.callbacks`, which imports `levanter.data`).

`install()` registers a bare package module for each of those packages in `sys.modules` (the real `__path__`,
`__spec__`, `__file__`), so a submodule import loads only what that submodule needs. Every name the real
`__init__` binds stays reachable: the bare module reads the real `__init__`'s own import statements (without
running them) and imports the one submodule that defines a name on its first access (`levanter.current_tracker`,
`from levanter.data import DataLoader`); plain constants (`__version__`, `__all__`) are copied. A package whose
`__init__` does anything else is left alone and imported normally.

`policy/__init__.py` calls `install()` before any module of `policy` imports levanter. A process that imported
levanter before `policy` keeps the real package (slower to start, same behaviour).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

# Packages whose `__init__` is replaced by a lazy one, parents before children.
LAZY_PACKAGES: tuple[str, ...] = ("levanter", "levanter.data")


def _exports(package: str, init_file: Path) -> tuple[dict[str, tuple[str, str | None]], dict[str, Any]] | None:
    """(name -> (module, attribute or None for the module itself), constants) bound by `init_file`.

    None if the file does anything but import names and assign literal constants.
    """
    tree = ast.parse(init_file.read_text(encoding="utf-8"))
    names: dict[str, tuple[str, str | None]] = {}
    constants: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname is None:
                    continue  # `import a.b` binds `a`, which is not an export of this package
                names[alias.asname] = (alias.name, None)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                if alias.name == "*":
                    return None
                names[alias.asname or alias.name] = (base, alias.name)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                constants[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                return None
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        else:
            return None
    return names, constants


def _install_one(package: str) -> bool:
    """Register a lazy bare module for `package`; False if it is imported already or its `__init__` is not plain."""
    if package in sys.modules:
        return False
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None or spec.submodule_search_locations is None:
        return False
    found = _exports(package, Path(spec.origin))
    if found is None:
        return False
    names, constants = found
    module = types.ModuleType(package, f"{package} (lazy: package __init__ not run; see policy/_imports.py)")
    module.__spec__ = spec
    module.__path__ = list(spec.submodule_search_locations)
    module.__file__ = spec.origin
    module.__package__ = package
    module.__loader__ = spec.loader
    module.__dict__.update(constants)

    def lazy_attr(name: str) -> Any:
        target = names.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        source, attr = target
        value: Any = importlib.import_module(source)
        if attr is not None:
            # `from pkg.x import y` where y is a submodule rather than an attribute of pkg.x
            value = getattr(value, attr) if hasattr(value, attr) else importlib.import_module(f"{source}.{attr}")
        setattr(module, name, value)
        return value

    module.__getattr__ = lazy_attr  # type: ignore[method-assign]
    sys.modules[package] = module
    parent, _, child = package.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return True


def install() -> list[str]:
    """Make every package of `LAZY_PACKAGES` lazy that is not imported yet; returns the ones this call made lazy.

    Idempotent. A package already in `sys.modules` (real or lazy) is left as it is.
    """
    return [package for package in LAZY_PACKAGES if _install_one(package)]
