"""Sharded learner checkpoints in one process: the marker lists every file and tensor block, bytes round-trip
bitwise (local disk and the GCS emulator), a folder without COMMITTED is never loaded, a damaged shard file is
refused naming the file, and a checkpoint of the older whole-pytree format still loads.

Several processes and other mesh shapes: tests/test_mesh.py (saved on 4 devices, resumed on 1 and 2; exact
replay on the same mesh) and tests/test_job_crash_learner_group.py (two processes of a job's learner killed and
restarted)."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest

from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas.records import CHECKPOINT_FORMAT, SHARDED_CHECKPOINT_FORMAT, CommitMarker

pytest.importorskip("jax")

from test_learner import VOCAB, tiny_config

from policy import learner as L
from policy import mesh as mesh_lib
from policy import model as M
from policy import policy_format as pf


def _state(cfg):  # a model and optimizer state whose every leaf differs from a fresh init
    optimizer = L.build_optimizer(cfg.optimizer, cfg.train.num_train_steps)
    model = M.build_model(cfg.model, VOCAB, jax.random.PRNGKey(7))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    opt_state = jax.tree_util.tree_map(lambda x: x + 0.5 if eqx.is_inexact_array(x) else x, opt_state)
    return optimizer, L.LearnerState(5, model, opt_state, None)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))]


def _same(a, b) -> bool:
    xs, ys = _leaves(a), _leaves(b)
    return len(xs) == len(ys) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(xs, ys, strict=True))


@pytest.mark.parametrize("backend", ["local", "gs"])
def test_sharded_checkpoint_round_trips_bitwise(store_factory, backend):
    store: RunStore = store_factory(backend)
    cfg = tiny_config(store.root)
    optimizer, state = _state(cfg)
    lm = mesh_lib.build_mesh(cfg.mesh)
    state = L.shard_state(state, lm)
    assert pf.write_checkpoint(store, state, cfg, 1)
    assert not pf.write_checkpoint(store, state, cfg, 1)  # already committed: not rewritten

    rec = CommitMarker.from_json(store.get(layout.checkpoint_marker(5)), path="m")
    assert rec.format == SHARDED_CHECKPOINT_FORMAT and rec.kind == "checkpoint" and list(rec.files) == ["p0"]
    assert rec.tensors is not None and any(k.startswith("model/") for k in rec.tensors)
    assert any(k.startswith("opt_state/") for k in rec.tensors)
    data = store.get(layout.join(layout.checkpoint_dir(5), rec.files["p0"].path))
    assert len(data) == rec.files["p0"].size and pf.sha256_hex(data) == rec.files["p0"].sha256

    for mesh in (None, lm):
        got = pf.read_checkpoint(store, 5, cfg.model, VOCAB, optimizer, mesh)
        assert got.step == 5 and _same(got.model, state.model) and _same(got.opt_state, state.opt_state)


def test_half_written_and_damaged_checkpoints_are_never_loaded(tmp_path):
    store = RunStore(str(tmp_path / "run"))
    cfg = tiny_config(store.root)
    optimizer, state = _state(cfg)
    assert pf.write_checkpoint(store, state, cfg, 1)
    # a half-written checkpoint 6: its shard file is there, its marker is not
    folder5, folder6 = layout.checkpoint_dir(5), layout.checkpoint_dir(6)
    rec = CommitMarker.from_json(store.get(layout.checkpoint_marker(5)), path="m")
    shard = store.get(layout.join(folder5, rec.files["p0"].path))
    store.put_unique(layout.join(folder6, rec.files["p0"].path), shard)
    assert pf.committed_checkpoints(store) == [5]
    assert L.resume_or_init(store, cfg, VOCAB, optimizer).step == 5

    # a damaged shard file of committed checkpoint 7 (one flipped byte, same size): refused naming the file;
    # resuming falls back to checkpoint 5
    state7 = L.LearnerState(7, state.model, state.opt_state, 5)
    assert pf.write_checkpoint(store, state7, cfg, 6)
    rec7 = CommitMarker.from_json(store.get(layout.checkpoint_marker(7)), path="m")
    rel = layout.join(layout.checkpoint_dir(7), rec7.files["p0"].path)
    raw = bytearray(store.get(rel))
    raw[-1] ^= 0xFF
    (tmp_path / "run" / rel).write_bytes(bytes(raw))
    with pytest.raises(pf.CheckpointError, match=r"shard-.*size/sha256 differ"):
        pf.read_checkpoint(store, 7, cfg.model, VOCAB, optimizer)
    assert L.resume_or_init(store, cfg, VOCAB, optimizer).step == 5


def test_whole_pytree_checkpoint_of_the_older_format_still_loads(tmp_path):
    store = RunStore(str(tmp_path / "run"))
    cfg = tiny_config(store.root)
    optimizer, state = _state(cfg)
    blobs = {pf.MODEL_BLOB: pf.tree_to_safetensors(state.model), pf.OPT_BLOB: pf.tree_to_safetensors(state.opt_state)}
    meta = {"kind": "checkpoint", "step": 5, "batch_slot": 5, "vocab_size": VOCAB}
    assert pf.write_committed(store, layout.checkpoint_dir(5), blobs, meta)
    assert pf.read_marker(store, layout.checkpoint_dir(5)).format == CHECKPOINT_FORMAT
    got = L.resume_or_init(store, cfg, VOCAB, optimizer, mesh_lib.build_mesh(cfg.mesh))
    assert got.step == 5 and _same(got.model, state.model) and _same(got.opt_state, state.opt_state)
