"""Published policy files are checked with crc32c (commit marker version 2); version-1 markers (sha256) still load.

- a policy published by the learner's path (`prepare_policy` + `commit_policy`) records a crc32c, no sha256, for
  every file, in its marker (version 2) and in its manifest; the worker-side load is bitwise the model;
- one flipped byte (same size) in one of its files is refused naming the file and "size/crc32c differ" (a
  `DamagedCommitError`: exit 7 / quarantine in the steps), and so is a cut file;
- a policy whose marker is in the version-1 form (every file with its sha256, written here from the files' own
  bytes with hashlib, as the old writer did) loads bitwise, and a flipped byte there is refused as "size/sha256
  differ";
- checkpoints keep sha256 (read by the learner only, once per restart).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import google_crc32c
import jax
import numpy as np
import pytest

from pipeline.config import ModelSpec
from pipeline.store import layout
from pipeline.store.storage import RunStore
from policy import model as M
from policy import policy_format as pf
from policy.policy_format import sharded
from schemas.records import CommitMarker

VOCAB = 64
SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32)


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _publish(store: RunStore, step: int, model: object) -> CommitMarker:
    pub = pf.prepare_policy(step, model, {"batch_slot": step}, None)  # type: ignore[arg-type]
    assert pf.commit_policy(store, pub, wait_s=5)
    return pf.policy_metadata(store, step)


def _same(a: object, b: object) -> bool:
    x, y = M.numpy_params(a), M.numpy_params(b)
    return len(x) == len(y) and all(p.dtype == q.dtype and np.array_equal(p, q) for p, q in zip(x, y, strict=True))


def test_new_policy_records_crc32c_and_a_flipped_byte_is_refused(tmp_path: Path) -> None:
    if google_crc32c.implementation != "c":
        pytest.skip("google_crc32c without its C implementation: policies record sha256")
    root = tmp_path / "run"
    store = RunStore(str(root))
    model = M.build_model(SPEC, VOCAB, jax.random.PRNGKey(3))
    marker = _publish(store, 1, model)
    raw = json.loads(store.get(layout.policy_marker(1)))
    assert raw["version"] == 2 and marker.files
    for f in marker.files.values():
        data = (root / layout.policy_dir(1) / f.path).read_bytes()
        assert f.sha256 is None and f.crc32c == f"{google_crc32c.value(data):08x}" and f.size == len(data)
    manifest = json.loads(store.get(layout.join(layout.policy_dir(1), sharded.manifest_name(marker.attempt_id, 0))))
    assert all("crc32c" in f and "sha256" not in f for f in manifest["files"].values())
    assert _same(pf.read_policy(store, 1, SPEC, VOCAB), model)

    victim = sorted(f.path for f in marker.files.values())[0]
    _flip_byte(root / layout.policy_dir(1) / victim, -5)  # a weight byte, not the header: still parses
    with pytest.raises(pf.DamagedCommitError, match=r"size/crc32c differ") as e:
        pf.read_policy(store, 1, SPEC, VOCAB)
    assert victim in str(e.value)

    marker2 = _publish(store, 2, model)
    victim2 = sorted(f.path for f in marker2.files.values())[0]
    path = root / layout.policy_dir(2) / victim2
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(pf.DamagedCommitError, match=r"size/crc32c differ"):
        pf.read_policy(store, 2, SPEC, VOCAB)


def test_version_1_marker_with_sha256_still_loads_and_is_verified(tmp_path: Path) -> None:
    root = tmp_path / "run"
    store = RunStore(str(root))
    model = M.build_model(SPEC, VOCAB, jax.random.PRNGKey(4))
    new = json.loads(store.get(layout.policy_marker(_publish(store, 3, model).step)))
    old = dict(new, version=1)  # the old writer's marker: version 1, every file with its sha256 and nothing else
    old["files"] = {
        k: {"path": f["path"], "size": f["size"],
            "sha256": hashlib.sha256((root / layout.policy_dir(3) / f["path"]).read_bytes()).hexdigest()}
        for k, f in new["files"].items()
    }  # fmt: skip
    old["step"] = 4
    folder4 = root / layout.policy_dir(4)
    folder4.mkdir(parents=True)
    for f in new["files"].values():
        (folder4 / f["path"]).write_bytes((root / layout.policy_dir(3) / f["path"]).read_bytes())
    (folder4 / layout.COMMIT_MARKER).write_text(json.dumps(old))

    marker = pf.policy_metadata(store, 4)
    assert all(f.sha256 and f.crc32c is None for f in marker.files.values())
    assert _same(pf.read_policy(store, 4, SPEC, VOCAB), model)
    victim = sorted(f["path"] for f in old["files"].values())[0]
    _flip_byte(folder4 / victim, -5)
    with pytest.raises(pf.DamagedCommitError, match=r"size/sha256 differ") as e:
        pf.read_policy(store, 4, SPEC, VOCAB)
    assert victim in str(e.value)


def test_checkpoints_keep_sha256(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path / "run"))
    model = M.build_model(SPEC, VOCAB, jax.random.PRNGKey(5))
    folder = layout.checkpoint_dir(7)
    assert sharded.save_sharded(store, folder, {pf.MODEL_BLOB: model}, {"step": 7, "vocab_size": VOCAB,
                                                                       "kind": "checkpoint"})  # fmt: skip
    rec = pf.read_marker(store, folder)
    for f in rec.files.values():
        assert f.crc32c is None and f.sha256 == pf.sha256_hex(store.get(layout.join(folder, f.path)))
