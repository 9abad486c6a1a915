"""JAX's persistent compilation cache with a size limit stays writable when its folder holds an entry written without
one (`policy/_compile_cache.py`): JAX's own `LRUCache` on a real folder, as a size-limited step process uses it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from jax._src.lru_cache import LRUCache

import policy  # noqa: F401  (installs the fix, as every step process does)


def test_a_size_limited_cache_writes_beside_an_entry_without_an_access_time(tmp_path: Path) -> None:
    unlimited = LRUCache(str(tmp_path), max_size=-1)  # the test suite's setting: no access-time files
    unlimited.put("stray", b"s" * 100)
    assert not (tmp_path / "stray-atime").exists()
    limited = LRUCache(str(tmp_path), max_size=250)  # a step process's setting (4 GiB there)
    limited.put("first", b"a" * 100)  # raised FileNotFoundError (stray-atime) before the fix
    assert limited.get("first") == b"a" * 100
    assert (tmp_path / "stray-atime").read_bytes() == bytes(8)  # the oldest access time
    limited.put("second", b"b" * 100)  # 300 bytes > 250: the stray goes first, the entries with access times stay
    assert not (tmp_path / "stray-cache").exists()
    assert limited.get("first") == b"a" * 100 and limited.get("second") == b"b" * 100


def test_the_fix_is_made_when_jax_loads_its_cache_not_when_policy_is_imported() -> None:
    """A fresh interpreter (as a step process starts): importing `policy` loads no JAX; JAX's cache module, once
    loaded, has the fix."""
    code = (
        "import sys, policy\n"
        "assert 'jax' not in sys.modules\n"
        "from jax._src.lru_cache import LRUCache\n"
        "assert LRUCache._evict_if_needed.rlpipe_stamps_access_times\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
