"""The disk cache of transformers' model import structure (policy/_hf_structure.py): a step process that reads it
sees exactly the structure transformers' own scan gives, and a damaged cache file is scanned again and replaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys
import policy
from policy import _hf_structure
import transformers.models as tm
from transformers.models.llama import LlamaConfig  # a name resolved through the lazy module
path = _hf_structure._cache_file(tm.__file__, None)
print(json.dumps({"cache": str(path), "type": type(tm).__name__, "llama": LlamaConfig.__name__}))
"""


def _child(cache: Path, enabled: bool = True) -> dict:
    env = {**os.environ, "RLPIPE_CACHE_DIR": str(cache), "USE_TORCH": "0"}
    env["RLPIPE_HF_STRUCTURE_CACHE"] = "1" if enabled else "0"
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _scanned() -> dict[frozenset[str], dict[str, set[str]]]:
    """transformers' own answer, computed in a process without the cache."""
    code = (
        "import json, transformers.models as tm\n"
        "from transformers.utils.import_utils import define_import_structure as d\n"
        "print(json.dumps([[sorted(b), {m: sorted(n) for m, n in v.items()}] for b, v in d(tm.__file__).items()]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "USE_TORCH": "0"}, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {frozenset(b): {m: set(n) for m, n in v.items()} for b, v in json.loads(proc.stdout)}


def _cached(path: Path) -> dict[frozenset[str], dict[str, set[str]]]:
    return {frozenset(b): {m: set(n) for m, n in v.items()} for b, v in json.loads(path.read_text())}


def test_cached_structure_equals_the_scan_and_is_reused(tmp_path: Path) -> None:
    first = _child(tmp_path)
    path = Path(first["cache"])
    assert path.parent == tmp_path and path.exists()
    assert first["type"] == "_LazyModule" and first["llama"] == "LlamaConfig"
    written = path.stat().st_mtime_ns
    second = _child(tmp_path)  # reads the file (and leaves it as it is)
    assert second == first and path.stat().st_mtime_ns == written
    assert _cached(path) == _scanned()


def test_damaged_cache_file_is_scanned_again_and_replaced(tmp_path: Path) -> None:
    path = Path(_child(tmp_path)["cache"])
    path.write_text('{"not": "a structure"')
    out = _child(tmp_path)
    assert out["llama"] == "LlamaConfig"
    assert _cached(path) == _scanned()


def test_turned_off_writes_nothing(tmp_path: Path) -> None:
    out = _child(tmp_path, enabled=False)
    assert out["llama"] == "LlamaConfig"
    assert list(tmp_path.iterdir()) == []
