"""JAX's persistent compilation cache kept writable when a folder holds entries written without a size limit.

With a size limit (`JAX_COMPILATION_CACHE_MAX_SIZE`, 4 GiB in step processes and the Makefile) JAX's LRU cache reads
the access-time file (`<key>-atime`) of every entry in the folder at each write, to choose what to evict; a process
with no limit (-1: the test suite's setting) writes entries without one. A single such entry in the folder made every
later write of a size-limited process fail (JAX warns "Error writing persistent compilation cache entry ...
FileNotFoundError ... -atime" and goes on), so nothing new was cached there again and every step start compiled its
train step and sampler programs from scratch (measured on the TRL comparison's ~50M job, 10 learner steps on a
2-core machine: 71.3 CPU s compiling its programs, as with the cache unwritable; 51.7 CPU s with them cached).

`install()` wraps the scan: an entry without an access time is given the oldest one (0) first, so the write goes on
and that entry is the first evicted. The wrap is made when JAX's cache module loads (an import hook,
`_hf_structure.ExecWrappingFinder`), so importing `policy` imports no JAX; left as JAX has it where its internals
differ (no `LRUCache._evict_if_needed`).
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable
from typing import Any

from policy._hf_structure import ExecWrappingFinder

logger = logging.getLogger(__name__)

TARGET = "jax._src.lru_cache"


def stamp_missing_access_times(cache: Any) -> int:
    """Give every entry of the LRU `cache`'s folder that has no access-time file the oldest access time (0);
    returns how many it stamped. Called with JAX's cache lock held (inside its write), so no writer races it."""
    module = sys.modules[TARGET]
    cache_suffix = getattr(module, "_CACHE_SUFFIX", "-cache")
    atime_suffix = getattr(module, "_ATIME_SUFFIX", "-atime")
    stamped = 0
    for entry in cache.path.glob(f"*{cache_suffix}"):
        atime = cache.path / f"{entry.name.removesuffix(cache_suffix)}{atime_suffix}"
        if not atime.exists():
            atime.write_bytes((0).to_bytes(8, "little"))
            stamped += 1
    if stamped:
        logger.info("compilation cache %s: %d entries without an access time, now the oldest", cache.path, stamped)
    return stamped


def _patch(module: types.ModuleType) -> None:
    """Wrap `module.LRUCache._evict_if_needed` (once) so that it stamps entries without an access time first."""
    cls = getattr(module, "LRUCache", None)
    evict = getattr(cls, "_evict_if_needed", None)
    if cls is None or evict is None or getattr(evict, "rlpipe_stamps_access_times", False):
        return

    def evict_if_needed(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "eviction_enabled", False):
            stamp_missing_access_times(self)
        return evict(self, *args, **kwargs)

    evict_if_needed.rlpipe_stamps_access_times = True  # type: ignore[attr-defined]
    cls._evict_if_needed = evict_if_needed


def _run_and_patch(run: Callable[[types.ModuleType], None], module: types.ModuleType) -> None:
    run(module)
    _patch(module)


def install() -> None:
    """Make JAX's LRU compilation cache stamp entries without an access time before each eviction scan, in this
    process: at once if JAX's cache module is loaded, else when it loads. Idempotent; a no-op where JAX's cache has
    no such scan."""
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    elif not any(isinstance(f, ExecWrappingFinder) and f.target == TARGET for f in sys.meta_path):
        sys.meta_path.insert(0, ExecWrappingFinder(TARGET, _run_and_patch))
