"""Sharded checkpoints: every learner process writes the blocks it holds; one marker commits them all.

Format (`schemas.records.SHARDED_CHECKPOINT_FORMAT`; no pickle):

    <dir>/shard-<attempt>-p<i>.safetensors   process i's blocks of every pytree (put_unique; unique name)
    <dir>/COMMITTED                          put_if_absent by process 0, written LAST: a `CommitMarker` with
        files   {p<i>: {path, size, sha256}} for every process's file (policies: crc32c, not sha256), and
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
file's size and checksum against the marker before using a byte, and assembles global arrays with
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

import dataclasses
import functools
import json
import logging
import math
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import haliax as hax
import jax
import numpy as np
from haliax.partitioning import pspec_for
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from pipeline.store import layout
from policy import mesh as mesh_lib
from policy.policy_format.committed import (
    CheckpointError,
    DamagedCommitError,
    _Store,
    policy_file_checksum,
    sha256_hex,
    st_load,
    verify_file,
)
from policy.policy_format.st_bytes import save as st_save  # one copy: safetensors.numpy.save makes two
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


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One block this process writes: tensor `full`'s box [start, stop), named `block` inside its file."""

    full: str
    block: str
    start: list[int]
    stop: list[int]
    data: Any
    """A device shard's data or a host array (copied to host only when its file is serialised)."""

    @property
    def nbytes(self) -> int:
        return math.prod(b - a for a, b in zip(self.start, self.stop, strict=True)) * np.dtype(self.data.dtype).itemsize

    def host(self) -> np.ndarray:
        dims = [b - a for a, b in zip(self.start, self.stop, strict=True)]
        return np.ascontiguousarray(np.asarray(self.data)).reshape(dims)


def _local_pieces(trees: dict[str, Any]) -> tuple[list[_Piece], dict[str, Any]]:
    """The blocks this process writes and the tensor index skeleton (shape, dtype, no blocks) of every tensor.

    For an array spread over several processes: its addressable shards with `replica_id == 0` (each block is
    written by exactly one process over all of them); host arrays and process-local device arrays (the same on
    every process): process 0 alone."""
    pieces: list[_Piece] = []
    index: dict[str, Any] = {}
    writer = mesh_lib.is_writer()
    for blob, tree in trees.items():
        for name, x, _ in _leaves(tree):
            full = f"{blob}/{name}"
            shape = tuple(int(n) for n in x.shape)
            index[full] = {"shape": list(shape), "dtype": np.dtype(x.dtype).name, "blocks": []}
            for idx, data in _owned_blocks(x, shape, writer):
                start, stop = _box(idx, shape)
                pieces.append(_Piece(full, f"{full}@{','.join(map(str, start))}", start, stop, data))
    return pieces, index


def _owned_blocks(x: Any, shape: tuple[int, ...], writer: bool) -> list[tuple[Any, Any]]:
    """(index, data) of the blocks of `x` this process writes: its replica-0 shards of a global array; of a host
    array or a process-local device array (the same on every process) all of it, on the writer process only."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return [(s.index, s.data) for s in x.addressable_shards if s.replica_id == 0]
    if not writer:
        return []
    if isinstance(x, jax.Array):
        return [(s.index, s.data) for s in x.addressable_shards if s.replica_id == 0]
    return [(tuple(slice(None) for _ in shape), x)]


def _local_blocks(trees: dict[str, Any], file_key: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """This process's blocks (tensor name in its file -> data) and its part of the tensor index, all in one file."""
    pieces, index = _local_pieces(trees)
    tensors: dict[str, np.ndarray] = {}
    for p in pieces:
        tensors[p.block] = p.host()
        index[p.full]["blocks"].append({"file": file_key, "name": p.block, "start": p.start, "stop": p.stop})
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


# ---------------------------------------------------------------------------------------------
# policies: every process writes its own blocks on parallel threads; no collective after the attempt id
# ---------------------------------------------------------------------------------------------

WRITE_THREADS = 8
"""Threads (and at most as many files) per process writing its blocks of one policy."""
READ_THREADS = 16
"""Threads a reader fetches the files of one folder on (each file one stream)."""
PART_BYTES = 64 << 20
"""A process's blocks are split into files of about this size (up to `WRITE_THREADS` files)."""
MANIFEST_WAIT_S = 600.0
"""How long process 0 waits for every other process's shard manifest before it gives up on a policy."""
PUBLISH_PAUSE_ENV = "RLPIPE_PUBLISH_PAUSE"
"""Test hook: `<process>:<seconds>` makes that learner process sleep after its shard files are durable and before
its manifest is written (a window for a SIGKILL mid-publish). Never set it outside tests."""


class PublishTimeoutError(RuntimeError):
    """Process 0 gave up waiting for another learner process's shards of a policy (it died or stalled)."""


@dataclasses.dataclass(frozen=True)
class ShardedPublish:
    """One policy to publish by every learner process: drawn on every process, in step order (`prepare_publish`),
    then written from any thread (`commit_publish`)."""

    folder: str
    trees: dict[str, Any]
    meta: dict[str, Any]
    attempt: str
    prefix: str
    """File name prefix of the shard files (`weights`)."""


def manifest_name(attempt: str, process: int) -> str:
    """The name of process `process`'s shard manifest of attempt `attempt` inside the folder."""
    return f"manifest-{attempt}-p{process:05d}.json"


def prepare_publish(folder: str, trees: dict[str, Any], meta: dict[str, Any], prefix: str) -> ShardedPublish:
    """Every learner process calls this for each policy, in the same order (it broadcasts process 0's attempt id).

    `trees` are kept as they are (device arrays stay on device; `commit_publish` copies each block to host when its
    file is serialised)."""
    return ShardedPublish(folder, trees, meta, _shared_attempt(), prefix)


def _parts(pieces: list[_Piece], threads: int, part_bytes: int) -> list[list[_Piece]]:
    """`pieces` in at most `threads` groups of balanced size (about `part_bytes` each): largest first, each to the
    lightest group."""
    total = sum(p.nbytes for p in pieces)
    n = max(1, min(threads, -(-total // max(part_bytes, 1)), len(pieces)))
    groups: list[list[_Piece]] = [[] for _ in range(n)]
    sizes = [0] * n
    for p in sorted(pieces, key=lambda p: -p.nbytes):
        i = sizes.index(min(sizes))
        groups[i].append(p)
        sizes[i] += p.nbytes
    return [g for g in groups if g]


def _pause_hook(pid: int, folder: str) -> None:
    spec = os.environ.get(PUBLISH_PAUSE_ENV, "")
    if not spec:
        return
    who, _, secs = spec.partition(":")
    if who.strip() == str(pid):
        logger.warning("%s: process %d wrote its shards of %s; pausing %s s", PUBLISH_PAUSE_ENV, pid, folder, secs)
        time.sleep(float(secs or 0))


def write_own_shards(
    store: _Store, job: ShardedPublish, threads: int = WRITE_THREADS, part_bytes: int = PART_BYTES
) -> dict[str, Any]:
    """Write this process's blocks of `job` as files on `threads` parallel threads, then its manifest (last).

    The manifest (`manifest_name`) names the writer (process index, host, OS pid), each file with size and checksum
    (crc32c: `committed.policy_file_checksum`), and the blocks of each tensor in them; it is written only once every
    file is durable. Returns it."""
    pid = jax.process_index()
    pieces, index = _local_pieces(job.trees)
    groups = _parts(pieces, threads, part_bytes)

    def write(k: int, group: list[_Piece]) -> tuple[str, dict[str, Any]]:
        key = f"p{pid}.{k}"
        data = st_save({p.block: p.host() for p in group}, metadata={"format": FORMAT})
        fname = f"{job.prefix}-{job.attempt}-p{pid:05d}-{k:03d}.safetensors"
        store.put_unique(layout.join(job.folder, fname), data)
        for p in group:
            index[p.full]["blocks"].append({"file": key, "name": p.block, "start": p.start, "stop": p.stop})
        return key, {"path": fname, "size": len(data), **policy_file_checksum(data)}

    if len(groups) > 1:
        with ThreadPoolExecutor(len(groups), thread_name_prefix="shard-write") as pool:
            files = dict(pool.map(lambda kg: write(*kg), enumerate(groups)))
    else:
        files = dict(write(k, g) for k, g in enumerate(groups))
    _pause_hook(pid, job.folder)
    manifest = {
        "format": FORMAT,
        "attempt_id": job.attempt,
        "process": pid,
        "process_count": jax.process_count(),
        "writer": {"process": pid, "host": socket.gethostname(), "pid": os.getpid()},
        "files": files,
        "tensors": {k: v for k, v in index.items() if v["blocks"]},
        "shapes": {k: {"shape": v["shape"], "dtype": v["dtype"]} for k, v in index.items()},
    }
    store.put_unique(layout.join(job.folder, manifest_name(job.attempt, pid)), json.dumps(manifest).encode())
    return manifest


def _wait_for_manifests(store: _Store, job: ShardedPublish, count: int, wait_s: float) -> list[dict[str, Any]]:
    """Every process's manifest of `job`'s attempt, in process order; PublishTimeoutError after `wait_s`."""
    got: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + wait_s
    delay = 0.02
    while True:
        for i in range(count):
            if i in got:
                continue
            rel = layout.join(job.folder, manifest_name(job.attempt, i))
            try:
                m = json.loads(store.get(rel))
            except FileNotFoundError:
                continue
            if m.get("attempt_id") != job.attempt or m.get("process") != i:
                raise CheckpointError(f"{rel}: manifest of attempt {m.get('attempt_id')!r} process {m.get('process')}")
            got[i] = m
        if len(got) == count:
            return [got[i] for i in range(count)]
        if time.monotonic() > deadline:
            missing = [manifest_name(job.attempt, i) for i in range(count) if i not in got]
            raise PublishTimeoutError(
                f"{job.folder}: learner process(es) {[i for i in range(count) if i not in got]} did not commit their "
                f"shards within {wait_s:.0f} s (missing {', '.join(missing)}): a process died or stalled mid-publish; "
                "the policy stays invisible (no COMMITTED) and is published again when the learner restarts"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def commit_publish(
    store: _Store,
    job: ShardedPublish,
    wait_s: float | None = None,
    threads: int = WRITE_THREADS,
    part_bytes: int = PART_BYTES,
) -> bool:
    """Every learner process calls this (from any thread: it holds no collective): write this process's shards,
    then, on process 0, wait for every process's manifest and write COMMITTED (create-if-absent) naming every file.

    True on process 0 when it committed the folder; False elsewhere and when the folder was already committed.
    A process killed before process 0 writes the marker leaves files no marker names: the folder stays unread.
    Raises PublishTimeoutError (process 0) when a manifest is still missing after `wait_s` (default
    `MANIFEST_WAIT_S`)."""
    marker = layout.join(job.folder, layout.COMMIT_MARKER)
    if store.exists(marker):
        logger.info("%s already committed; not rewriting", job.folder)
        return False
    t0 = time.monotonic()
    mine = write_own_shards(store, job, threads, part_bytes)
    if not mesh_lib.is_writer():
        return False
    everyone = _wait_for_manifests(store, job, jax.process_count(), MANIFEST_WAIT_S if wait_s is None else wait_s)
    files: dict[str, Any] = {}
    merged: dict[str, Any] = {k: {**v, "blocks": []} for k, v in mine["shapes"].items()}
    for m in everyone:
        files.update(m["files"])
        for name, entry in m["tensors"].items():
            if name not in merged:
                raise CheckpointError(f"{job.folder}: process {m['process']} wrote tensor {name!r} process 0 has not")
            merged[name]["blocks"].extend(entry["blocks"])
    for name, entry in merged.items():
        _check_tiling(name, entry)
    fields = {**job.meta, "format": FORMAT, "attempt_id": job.attempt, "files": files, "tensors": merged}
    record = CommitMarker.from_json(fields, path=marker)
    created = store.put_if_absent(marker, record.to_json())
    if not created:  # a lost acknowledgement: ours if the marker names our attempt
        try:
            created = CommitMarker.from_json(store.get(marker), path=marker).attempt_id == job.attempt
        except (OSError, RecordError):
            created = False
    total = sum(f["size"] for f in files.values())
    if created:
        logger.info(
            "committed %s (%d files from %d processes, %d B, %.2f s)",
            job.folder, len(files), len(everyone), total, time.monotonic() - t0,
        )  # fmt: skip
    else:
        logger.warning("%s was committed concurrently by another writer; ours is garbage", job.folder)
    return created


class _Reader:
    """Verified, lazily read shard files of one committed folder (each file read and checked once)."""

    def __init__(self, store: _Store, folder: str, record: CommitMarker) -> None:
        self.store, self.folder, self.record = store, folder, record
        self._files: dict[str, dict[str, np.ndarray]] = {}

    def prefetch(self, keys: list[str], threads: int = READ_THREADS) -> None:
        """Read and verify the files `keys` on up to `threads` parallel threads (one stream per file)."""
        todo = [k for k in dict.fromkeys(keys) if k not in self._files]
        if len(todo) > 1 and threads > 1:
            with ThreadPoolExecutor(min(threads, len(todo)), thread_name_prefix="shard-read") as pool:
                list(pool.map(self.file, todo))

    def file(self, key: str) -> dict[str, np.ndarray]:
        if key not in self._files:
            entry = self.record.files[key]
            rel = layout.join(self.folder, entry.path)
            try:
                data = self.store.get(rel)
            except FileNotFoundError:
                raise DamagedCommitError(rel, "named by the commit marker but missing") from None
            verify_file(rel, data, entry)
            self._files[key] = st_load(data)
        return self._files[key]

    def assemble(self, name: str, index: tuple[slice, ...] | None) -> np.ndarray:
        """The box `index` (None: all) of tensor `name`, pasted from every block that overlaps it."""
        t = self.record.tensors[name]  # type: ignore[index]
        shape = tuple(t.shape)
        if (
            index is None
            and len(t.blocks) == 1
            and list(t.blocks[0].stop) == list(shape)
            and not any(t.blocks[0].start)
        ):
            blk = t.blocks[0]  # one block is the whole tensor: the verified bytes' view, no copy
            data = self.file(blk.file).get(blk.name)
            if data is None:
                raise CheckpointError(f"{self.folder}: block {blk.name!r} missing from file {blk.file!r}")
            return data.reshape(shape)
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


def load_host(store: _Store, folder: str, record: CommitMarker, threads: int = READ_THREADS) -> dict[str, np.ndarray]:
    """Every tensor of a committed sharded folder whole in host memory (name -> array): its files fetched on up to
    `threads` parallel threads, each verified against the marker (size, checksum) before a byte is used."""
    reader = _Reader(store, folder, record)
    reader.prefetch(list(record.files), threads)
    return {name: reader.assemble(name, None) for name in record.tensors or {}}


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
    if lm is None:  # every tensor whole on this process: every file, fetched in parallel
        reader.prefetch(list(record.files))
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
