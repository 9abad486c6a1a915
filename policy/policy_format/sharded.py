"""Sharded checkpoints: every learner process writes the blocks it holds; one marker commits them all.

Format (`schemas.records.SHARDED_CHECKPOINT_FORMAT`; no pickle):

    <dir>/shard-<attempt>-p<i>.safetensors   process i's blocks of every pytree (put_unique; unique name)
    <dir>/COMMITTED                          put_if_absent by process 0, written LAST: a `CommitMarker` with
        files   {p<i>: {path, size, sha256}} for every process's file, and
        tensors {"<pytree>/<key path>": {shape, dtype, blocks: [{file, name, start, stop}]}}: the global
                shape and dtype of each tensor and the disjoint boxes that tile it.

Write protocol (every process calls `save_sharded`): process 0 draws the attempt id and broadcasts it; each
process writes one file of the blocks it owns (for each array, its addressable shards with `replica_id == 0`,
so every block is written exactly once over all processes); the sizes, checksums and block lists are then
all-gathered, which is also the barrier: process 0 gets them only once every process's file is durable in the
store. Process 0 checks that the blocks tile every tensor and writes the marker. A process killed anywhere
before that leaves files no marker names: a folder without COMMITTED is never read.

Read protocol (`load_sharded`): each process reads only the files holding blocks that overlap the pieces
its devices need on the *target* mesh (any mesh shape: blocks are cut and pasted by their boxes), verifies each
file's size and sha256 against the marker before using a byte, and assembles global arrays with
`jax.make_array_from_callback`. Without a mesh, every tensor is assembled whole in host memory.

Why safetensors files through the RunStore rather than levanter's tensorstore serialization (which would work:
tensorstore's gcs driver reaches a GCS emulator through `TENSORSTORE_GCS_HTTP_URL`): every byte goes
through the same atomic `put_unique` / `put_if_absent` of the run root, so one code path serves local disk,
`memory://` and gs:// with the run's fsspec `storage_options` (tensorstore has its own kvstore drivers,
credentials and endpoint settings, and no `memory://` shared with the other steps); each process hashes the
bytes it writes while they are in memory, so the marker lists the size and sha256 of every file without a
second read (tensorstore writes chunk files in place, which would have to be listed and read back to hash);
a reader verifies exactly the bytes it uses (tensorstore reads behind our back); and a restarted process
never writes into a name an older incarnation may still be writing. The price: a process's blocks are
serialised in host memory before the write (one process's share at a time, not the whole model).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import uuid
from typing import Any

import haliax as hax
import jax
import numpy as np
from haliax.partitioning import pspec_for
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from pipeline.store import layout
from policy import mesh as mesh_lib
from policy.policy_format.committed import CheckpointError, DamagedCommitError, _Store, sha256_hex
from schemas.records import SHARDED_CHECKPOINT_FORMAT, CommitMarker, RecordError

logger = logging.getLogger(__name__)

FORMAT = SHARDED_CHECKPOINT_FORMAT


def _leaves(tree: Any) -> list[tuple[str, Any, Any]]:
    """(name, array-or-template, axes or None) of every array leaf; NamedArrays are one leaf named by its path."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=hax.is_named_array)[0]:
        named = hax.is_named_array(leaf)
        arr = leaf.array if named else leaf
        if isinstance(arr, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
            out.append((jax.tree_util.keystr(path), arr, leaf.axes if named else None))
    return out


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[list[int], list[int]]:
    bounds = [sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True)]
    return [b[0] for b in bounds], [b[1] for b in bounds]


def _local_blocks(trees: dict[str, Any], file_key: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """This process's blocks (tensor name in its file -> data) and its part of the tensor index."""
    tensors: dict[str, np.ndarray] = {}
    index: dict[str, Any] = {}
    writer = mesh_lib.is_writer()
    for blob, tree in trees.items():
        for name, x, _ in _leaves(tree):
            full = f"{blob}/{name}"
            shape = tuple(int(n) for n in x.shape)
            entry = index.setdefault(full, {"shape": list(shape), "dtype": np.dtype(x.dtype).name, "blocks": []})
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                pieces = [(s.index, s.data) for s in x.addressable_shards if s.replica_id == 0]
            elif writer:  # host arrays and process-local device arrays (same on every process): process 0 writes
                pieces = (
                    [(s.index, s.data) for s in x.addressable_shards if s.replica_id == 0]
                    if isinstance(x, jax.Array)
                    else [(tuple(slice(None) for _ in shape), x)]
                )
            else:
                pieces = []
            for idx, data in pieces:
                start, stop = _box(idx, shape)
                block = f"{full}@{','.join(map(str, start))}"
                dims = [b - a for a, b in zip(start, stop, strict=True)]
                tensors[block] = np.ascontiguousarray(np.asarray(data)).reshape(dims)
                entry["blocks"].append({"file": file_key, "name": block, "start": start, "stop": stop})
    return tensors, index


def _shared_attempt() -> str:
    """A fresh attempt id, process 0's on every process."""
    attempt = uuid.uuid4().hex[:12]
    if jax.process_count() == 1:
        return attempt
    raw = np.frombuffer(attempt.encode(), np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(raw), np.uint8)).decode()


def _all_gather_json(obj: Any) -> list[Any]:
    """`obj` of every process, in process order (a collective: returns once every process has called it)."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row[: int(n)]).decode()) for row, n in zip(gathered, sizes, strict=True)]


def _check_tiling(name: str, entry: dict[str, Any]) -> None:
    """The blocks of one tensor cover it exactly (disjoint boxes inside the shape whose volumes add up)."""
    shape = entry["shape"]
    total = 0
    for b in entry["blocks"]:
        bounds = zip(b["start"], b["stop"], shape, strict=True)
        if any(not (0 <= a < z <= n) and not (a == z == 0 == n) for a, z, n in bounds):
            raise CheckpointError(f"tensor {name!r}: block {b['name']!r} lies outside shape {shape}")
        total += math.prod(z - a for a, z in zip(b["start"], b["stop"], strict=True))
    starts = [tuple(b["start"]) for b in entry["blocks"]]
    if total != math.prod(shape) or len(set(starts)) != len(starts):
        raise CheckpointError(f"tensor {name!r}: blocks cover {total} of {math.prod(shape)} elements")


def save_sharded(store: _Store, folder: str, trees: dict[str, Any], meta: dict[str, Any]) -> bool:
    """Commit `trees` (name -> pytree of arrays, possibly sharded over several processes) under `folder`.

    Every learner process must call this (it contains collectives). Returns True on the process that
    committed the folder (process 0), False elsewhere or when the folder was already committed.
    """
    marker = layout.join(folder, layout.COMMIT_MARKER)
    if mesh_lib.agree_with_writer(store.exists(marker)):
        logger.info("%s already committed; not rewriting", folder)
        return False
    attempt = _shared_attempt()
    pid = jax.process_index()
    file_key = f"p{pid}"
    tensors, index = _local_blocks(trees, file_key)
    data = st_save(tensors, metadata={"format": FORMAT})
    fname = f"shard-{attempt}-p{pid:05d}.safetensors"
    store.put_unique(layout.join(folder, fname), data)
    mine = {"key": file_key, "path": fname, "size": len(data), "sha256": sha256_hex(data), "index": index}
    everyone = _all_gather_json(mine)  # the barrier: every process's file is in the store
    if not mesh_lib.is_writer():
        return False
    files = {p["key"]: {"path": p["path"], "size": p["size"], "sha256": p["sha256"]} for p in everyone}
    merged: dict[str, Any] = {}
    for p in everyone:
        for name, entry in p["index"].items():
            merged.setdefault(name, {**entry, "blocks": []})["blocks"].extend(entry["blocks"])
    for name, entry in merged.items():
        _check_tiling(name, entry)
    fields = {**meta, "format": FORMAT, "attempt_id": attempt, "files": files, "tensors": merged}
    record = CommitMarker.from_json(fields, path=marker)
    created = store.put_if_absent(marker, record.to_json())
    if not created:  # a lost acknowledgement: ours if the marker names our attempt
        try:
            created = CommitMarker.from_json(store.get(marker), path=marker).attempt_id == attempt
        except (OSError, RecordError):
            created = False
    total = sum(f["size"] for f in files.values())
    if created:
        logger.info("committed %s (%d shard files, %d B)", folder, len(files), total)
    else:
        logger.warning("%s was committed concurrently by another writer; ours is garbage", folder)
    return created


class _Reader:
    """Verified, lazily read shard files of one committed folder (each file read and checked once)."""

    def __init__(self, store: _Store, folder: str, record: CommitMarker) -> None:
        self.store, self.folder, self.record = store, folder, record
        self._files: dict[str, dict[str, np.ndarray]] = {}

    def file(self, key: str) -> dict[str, np.ndarray]:
        if key not in self._files:
            entry = self.record.files[key]
            rel = layout.join(self.folder, entry.path)
            try:
                data = self.store.get(rel)
            except FileNotFoundError:
                raise DamagedCommitError(rel, "named by the commit marker but missing") from None
            if len(data) != entry.size or sha256_hex(data) != entry.sha256:
                raise DamagedCommitError(rel, f"size/sha256 differ from the commit marker ({len(data)}/{entry.size} B)")
            self._files[key] = st_load(data)
        return self._files[key]

    def assemble(self, name: str, index: tuple[slice, ...] | None) -> np.ndarray:
        """The box `index` (None: all) of tensor `name`, pasted from every block that overlaps it."""
        t = self.record.tensors[name]  # type: ignore[index]
        shape = tuple(t.shape)
        start, stop = _box(index, shape) if index is not None else ([0] * len(shape), list(shape))
        out = np.empty([b - a for a, b in zip(start, stop, strict=True)], np.dtype(t.dtype))
        filled = 0
        for blk in t.blocks:
            lo = [max(a, b) for a, b in zip(start, blk.start, strict=True)]
            hi = [min(a, b) for a, b in zip(stop, blk.stop, strict=True)]
            if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)) and shape:
                continue
            data = self.file(blk.file).get(blk.name)
            if data is None:
                raise CheckpointError(f"{self.folder}: block {blk.name!r} missing from file {blk.file!r}")
            data = data.reshape([b - a for a, b in zip(blk.start, blk.stop, strict=True)])
            src = tuple(slice(lo_ - b0, h - b0) for lo_, h, b0 in zip(lo, hi, blk.start, strict=True))
            dst = tuple(slice(lo_ - s0, h - s0) for lo_, h, s0 in zip(lo, hi, start, strict=True))
            out[dst] = data[src]
            filled += math.prod(h - lo_ for lo_, h in zip(lo, hi, strict=True))
        if filled != out.size:
            raise CheckpointError(f"{self.folder}: tensor {name!r}: blocks cover {filled} of {out.size} elements")
        return out


def load_sharded(
    store: _Store, folder: str, record: CommitMarker, templates: dict[str, Any], lm: mesh_lib.LearnerMesh | None
) -> dict[str, Any]:
    """Restore each template (name -> pytree of ShapeDtypeStructs, NamedArrays allowed) from a sharded checkpoint.

    With a mesh, NamedArray leaves come back as global arrays laid out by the mesh's parameter mapping and each
    process reads only the blocks its devices need; other leaves (and every leaf without a mesh) come back
    whole on this process. Raises CheckpointError naming the tensor on a missing, extra or mis-shaped tensor
    and naming the file on a size or checksum mismatch."""
    tensors = record.tensors or {}
    reader = _Reader(store, folder, record)
    out: dict[str, Any] = {}
    seen: set[str] = set()
    for blob, template in templates.items():
        values = []
        for name, leaf, axes in _leaves(template):
            full = f"{blob}/{name}"
            t = tensors.get(full)
            if t is None:
                raise CheckpointError(f"{folder}: tensor {full!r} missing")
            if tuple(t.shape) != tuple(leaf.shape) or np.dtype(t.dtype) != np.dtype(leaf.dtype):
                raise CheckpointError(
                    f"{folder}: tensor {full!r} has shape {t.shape} {t.dtype}, expected {leaf.shape} {leaf.dtype}"
                )
            seen.add(full)
            if lm is not None and axes is not None:
                spec = pspec_for(hax.NamedArray(leaf, axes), lm.param_mapping, preserve_existing_shardings=False)
                sharding = NamedSharding(lm.mesh, spec)
                block = functools.partial(reader.assemble, full)
                arr: jax.Array = jax.make_array_from_callback(leaf.shape, sharding, block)
            else:
                arr = jax.device_put(reader.assemble(full, None), may_alias=False)  # no per-shape program
            values.append(hax.NamedArray(arr, axes) if axes is not None else arr)
        out[blob] = _fill(template, values)
    extra = sorted(set(tensors) - seen)
    if extra:
        raise CheckpointError(f"{folder}: unexpected tensors {extra[:5]} (structure mismatch)")
    return out


def _fill(template: Any, values: list[Any]) -> Any:
    """`template` with its array leaves (as `_leaves` lists them) replaced by `values`, in order."""
    it = iter(values)

    def swap(leaf: Any) -> Any:
        arr = leaf.array if hax.is_named_array(leaf) else leaf
        if isinstance(arr, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
            return next(it)
        return leaf

    return jax.tree_util.tree_map(swap, template, is_leaf=hax.is_named_array)
