"""A disk cache of the import structure that `transformers.models` computes at every import.

Importing `transformers.models` (which levanter's model modules do, through its HF checkpoint converter) reads
every Python file of every model folder of transformers (~1,400 files) to work out which names each one
exports: ~0.4 s of CPU at every step start that is not forked from the fork server (and in the fork server).
The answer depends only on those files, so `install()` keeps it in a JSON file keyed by the transformers version,
the folder and its modification time, and reads it back on later imports; any problem (no cache folder, an
unreadable or foreign file) falls back to transformers' own scan, so the import behaves exactly as without it.

Where: `$RLPIPE_CACHE_DIR`, else `~/.cache/rlpipe`. `RLPIPE_HF_STRUCTURE_CACHE=0`
turns it off.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys
import tempfile
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "transformers.models"
FORMAT = 1


def cache_dir() -> Path:
    """The folder of rlpipe's small process-start caches: `$RLPIPE_CACHE_DIR`, else `~/.cache/rlpipe` (where step
    processes also keep JAX's compilation cache by default)."""
    return Path(os.environ.get("RLPIPE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "rlpipe"))


def _cache_file(module_path: str, prefix: str | None) -> Path | None:
    """The cache file of `define_import_structure(module_path, prefix)` for the installed transformers."""
    try:
        import transformers

        folder = os.path.dirname(os.path.abspath(module_path))
        stamp = os.stat(folder).st_mtime_ns
    except (ImportError, OSError):
        return None
    key = json.dumps([FORMAT, transformers.__version__, folder, stamp, prefix])
    return cache_dir() / f"hf-import-structure-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _encode(structure: dict[frozenset[str], dict[str, set[str]]]) -> list[Any]:
    return [
        [sorted(backends), {m: sorted(names) for m, names in modules.items()}]
        for backends, modules in structure.items()
    ]


def _decode(raw: Any) -> dict[frozenset[str], dict[str, set[str]]]:
    if not isinstance(raw, list):
        raise ValueError("not a list")
    out: dict[frozenset[str], dict[str, set[str]]] = {}
    for backends, modules in raw:
        if not isinstance(backends, list) or not isinstance(modules, dict):
            raise ValueError("bad entry")
        out[frozenset(backends)] = {str(m): set(names) for m, names in modules.items()}
    return out


def cached(define: Callable[..., Any]) -> Callable[..., Any]:
    """`define` (transformers' `define_import_structure`) answered from the disk cache when it can be."""

    def define_cached(module_path: str, prefix: str | None = None) -> Any:
        path = _cache_file(module_path, prefix)
        if path is not None:
            try:
                return _decode(json.loads(path.read_text()))
            except FileNotFoundError:
                pass
            except (OSError, ValueError, TypeError) as e:  # foreign or damaged: scan again and replace it
                logger.debug("ignoring %s: %s", path, e)
        structure = define(module_path, prefix)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
                with os.fdopen(fd, "w") as f:
                    json.dump(_encode(structure), f)
                os.replace(tmp, path)  # readers see the old file or the whole new one
            except (OSError, TypeError, ValueError) as e:
                logger.debug("not caching the transformers import structure: %s", e)
        return structure

    return define_cached


class ExecWrappingFinder(importlib.abc.MetaPathFinder):
    """Finds module `target` as usual and executes it through `wrap(run, module)`, `run` being its loader's own
    `exec_module`: a module patched around its execution without being imported first (also used by
    `policy/_compile_cache.py`)."""

    def __init__(
        self, target: str, wrap: Callable[[Callable[[types.ModuleType], None], types.ModuleType], None]
    ) -> None:
        self.target, self.wrap = target, wrap

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.target:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run, wrap = spec.loader.exec_module, self.wrap
        spec.loader.exec_module = lambda module: wrap(run, module)  # type: ignore[method-assign]
        return spec


def _exec_with_cached_structure(run: Callable[[types.ModuleType], None], module: types.ModuleType) -> None:
    """Run `transformers.models`' `__init__` with the cached `define_import_structure`."""
    utils = sys.modules.get("transformers.utils.import_utils")
    original = getattr(utils, "define_import_structure", None)
    if utils is None or original is None:
        run(module)
        return
    utils.define_import_structure = cached(original)  # type: ignore[attr-defined]
    try:
        run(module)  # binds the cached function by `from ..utils.import_utils import ...`
    finally:
        utils.define_import_structure = original  # type: ignore[attr-defined]


def install() -> bool:
    """Answer `transformers.models`' import structure from the disk cache in this process (False: not installed,
    because transformers.models is imported already or the cache is turned off). Idempotent."""
    if os.environ.get("RLPIPE_HF_STRUCTURE_CACHE", "1") == "0" or TARGET in sys.modules:
        return False
    if any(isinstance(f, ExecWrappingFinder) and f.target == TARGET for f in sys.meta_path):
        return True
    sys.meta_path.insert(0, ExecWrappingFinder(TARGET, _exec_with_cached_structure))
    return True
