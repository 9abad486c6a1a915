"""Committed checkpoint folders on a RunStore: pytrees as safetensors, a marker written last.

Format (no pickle anywhere):

    <dir>/<name>-<attempt_id>.safetensors    one file per pytree (model, opt_state); unique name, put_unique
    <dir>/COMMITTED                          put_if_absent, written LAST: a `schemas.records.CommitMarker`
        (format, attempt_id, files {name: {path, size, sha256}}, kind, step, vocab_size, and the caller's
         metadata: batch slot, tokenizer, seq_len, lineage)

Why safetensors through the RunStore rather than levanter's tensorstore checkpoints: every write goes
through the same atomic `put_unique` / `put_if_absent` primitives as the rest of the run root, so the
same code works on local disk, `memory://`, gs:// and the GCS emulator (storage_options included);
the marker can list sizes and sha256 checksums of every byte it commits (a reader verifies them);
and the files are plain safetensors readable by any tool. The price: one file per pytree, written
from host memory, which is fine up to a few billion parameters on one host. Policies use this format;
learner checkpoints are sharded over the learner's processes (`policy.policy_format.sharded`, the same marker
with a tensor index); checkpoints of this older format still load.

A pytree is stored by flattening its array leaves with `jax.tree_util.keystr` paths as tensor names;
it is restored into a template of the same structure (built from the same config), so the bytes
round-trip exactly (bitwise) and a structure mismatch fails loudly naming the tensor.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from typing import Any, Protocol, TypeVar

import google_crc32c
import jax
import numpy as np

from pipeline.process.exits import DamagedInputError
from pipeline.store import layout
from policy.policy_format.st_bytes import save as st_save  # one copy: safetensors.numpy.save makes two
from schemas.records import CHECKPOINT_FORMAT, CommitFile, CommitMarker, RecordError

logger = logging.getLogger(__name__)

FORMAT = CHECKPOINT_FORMAT
T = TypeVar("T")

POLICY_WEIGHTS = "weights"
"""The blob of a policy that holds the full weights."""
ADAPTERS_BLOB = "adapters"
"""The blob of a policy that holds the LoRA adapter tensors."""
MODEL_BLOB = "model"
"""The pytree of a learner checkpoint that holds the model."""
OPT_BLOB = "opt_state"
"""The pytree of a learner checkpoint that holds the optimizer state."""


class CheckpointError(RuntimeError):
    """A committed checkpoint cannot be read: missing file, size/sha mismatch, or structure mismatch."""


class DamagedCommitError(CheckpointError, DamagedInputError):
    """A committed policy or checkpoint folder failed verification on read: its COMMITTED marker is cut, of an
    unknown version or missing a field, or a file it names is gone or differs from it (size, sha256). Still a
    `CheckpointError` (the learner falls back to an older intact checkpoint); as a `DamagedInputError` a reader
    with no older object to fall back to ends in one line naming the file and what differs, exit code 7."""

    def __init__(self, path: str, reason: str) -> None:
        DamagedInputError.__init__(self, path, reason)


class _Store(Protocol):
    def put_unique(self, rel: str, data: bytes) -> None: ...

    def put_if_absent(self, rel: str, data: bytes) -> bool: ...

    def get(self, rel: str) -> bytes: ...

    def exists(self, rel: str) -> bool: ...

    def list(self, rel: str) -> list[str]: ...

    def delete(self, rel: str) -> None: ...


_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
    "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip


def st_load(data: bytes) -> dict[str, Any]:
    """safetensors bytes -> numpy arrays by name, bfloat16 tensors included (published policies may be bf16).

    The arrays are read-only views into `data` (no copy: a policy is loaded once per step by every rollout
    worker); raises CheckpointError when the header or a tensor's extent is malformed."""
    import json

    import ml_dtypes

    try:
        if len(data) < 8:
            raise ValueError(f"{len(data)} bytes")
        n = int.from_bytes(data[:8], "little")
        header = json.loads(bytes(data[8 : 8 + n]))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except ValueError as e:
        raise CheckpointError(f"not a safetensors file ({e})") from None
    base = 8 + n
    out: dict[str, Any] = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = np.dtype(ml_dtypes.bfloat16 if t["dtype"] == "BF16" else _ST_DTYPES[t["dtype"]])
            shape = tuple(int(d) for d in t["shape"])
            start, end = (int(o) for o in t["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"tensor {name!r}: malformed header entry ({e!r})") from None
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= start <= end <= len(data) - base or end - start != count * dtype.itemsize:
            raise CheckpointError(f"tensor {name!r}: extent [{start}, {end}) does not hold {shape} {dtype}")
        out[name] = np.frombuffer(data, dtype=dtype, count=count, offset=base + start).reshape(shape)
    return out


def _is_array_leaf(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct | np.generic)


def tree_to_safetensors(tree: Any) -> bytes:
    """Serialise every array leaf of `tree` into safetensors bytes, named by its key path."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    tensors: dict[str, np.ndarray] = {}
    for path, leaf in leaves:
        if not _is_array_leaf(leaf):
            continue
        name = jax.tree_util.keystr(path)
        if name in tensors:
            raise CheckpointError(f"duplicate tensor name {name!r} while serialising")
        tensors[name] = np.ascontiguousarray(np.asarray(jax.device_get(leaf)))
    return st_save(tensors, metadata={"format": FORMAT})


def tree_from_safetensors(template: T, data: bytes, *, source: str) -> T:
    """Fill the array leaves of `template` (arrays or ShapeDtypeStructs) from safetensors bytes.

    Raises CheckpointError naming `source` and the tensor when a name is missing, extra,
    or its shape/dtype differs from the template.
    """
    tensors = st_load(data)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    out = []
    seen = set()
    for path, leaf in leaves:
        if not _is_array_leaf(leaf):
            out.append(leaf)
            continue
        name = jax.tree_util.keystr(path)
        if name not in tensors:
            raise CheckpointError(f"{source}: tensor {name!r} missing")
        arr = tensors[name]
        if tuple(leaf.shape) == () and tuple(arr.shape) == (1,):  # safetensors stores scalars as [1]
            arr = arr.reshape(())
        if tuple(arr.shape) != tuple(leaf.shape) or np.dtype(arr.dtype) != np.dtype(leaf.dtype):
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {arr.shape} {arr.dtype}, expected {leaf.shape} {leaf.dtype}"
            )
        seen.add(name)
        # device_put, not jnp.asarray: asarray compiles an identity program per tensor shape (~10 ms each at
        # start-up); a copy (may_alias=False) so the array never shares the verified bytes it was read from
        out.append(jax.device_put(arr, may_alias=False))
    extra = sorted(set(tensors) - seen)
    if extra:
        raise CheckpointError(f"{source}: unexpected tensors {extra[:5]} (structure mismatch)")
    return jax.tree_util.tree_unflatten(treedef, out)


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def crc32c_hex(data: bytes) -> str:
    """Hex CRC-32C (Castagnoli) of `data`, 8 digits (google_crc32c; its C implementation where installed)."""
    return f"{google_crc32c.value(data):08x}"


FAST_CHECKSUM = google_crc32c.implementation == "c"
"""Published policy files record a crc32c (~0.014 CPU s per 185 MB, measured, against sha256's ~0.10: a policy is
hashed once by the learner and once by every reader, every step). Only with google_crc32c's C implementation: its
pure-Python fallback is far slower than hashlib's sha256, which is then recorded instead."""


def policy_file_checksum(data: bytes) -> dict[str, str]:
    """The checksum a newly published policy file records in its marker: `{"crc32c": ...}` (`FAST_CHECKSUM`), else
    `{"sha256": ...}`."""
    return {"crc32c": crc32c_hex(data)} if FAST_CHECKSUM else {"sha256": sha256_hex(data)}


def verify_file(rel: str, data: bytes, entry: CommitFile) -> None:
    """Raise DamagedCommitError naming `rel` unless `data` has the size and checksum its marker entry records: the
    crc32c when the entry has one (policies published since marker version 2), else the sha256 (checkpoints, HF
    folders and every file of a version-1 marker)."""
    if entry.crc32c is not None:
        algo, same = "crc32c", len(data) == entry.size and crc32c_hex(data) == entry.crc32c
    else:
        algo, same = "sha256", len(data) == entry.size and sha256_hex(data) == entry.sha256
    if not same:
        raise DamagedCommitError(rel, f"size/{algo} differ from the commit marker ({len(data)} vs {entry.size} B)")


def write_committed(store: _Store, folder: str, blobs: dict[str, bytes], meta: dict[str, Any]) -> bool:
    """Write `blobs` as unique files under `folder`, then the COMMITTED marker (last, create-if-absent).

    Returns True when this call committed the folder, False when a marker already existed
    (someone — e.g. an earlier incarnation of this learner — committed it first; our files are
    then unreferenced garbage). A lost acknowledgement is resolved by reading the marker back.
    """
    marker = layout.join(folder, layout.COMMIT_MARKER)
    if store.exists(marker):
        logger.info("%s already committed; not rewriting", folder)
        return False
    attempt = uuid.uuid4().hex[:12]
    files: dict[str, CommitFile] = {}
    for name, data in blobs.items():
        fname = f"{name}-{attempt}.safetensors"
        store.put_unique(layout.join(folder, fname), data)
        files[name] = CommitFile(path=fname, size=len(data), sha256=sha256_hex(data))
    fields = {**meta, "format": FORMAT, "attempt_id": attempt, "files": {k: f.to_dict() for k, f in files.items()}}
    record = CommitMarker.from_json(fields, path=marker)  # metadata of the wrong type fails before any commit
    created = store.put_if_absent(marker, record.to_json())
    if not created:
        try:
            created = CommitMarker.from_json(store.get(marker), path=marker).attempt_id == attempt
        except (OSError, RecordError):
            created = False
    if created:
        logger.info("committed %s (%s)", folder, ", ".join(f"{k}: {v.size} B" for k, v in files.items()))
    else:
        logger.warning("%s was committed concurrently by another writer; ours is garbage", folder)
    return created


def read_marker(store: _Store, folder: str) -> CommitMarker:
    """The COMMITTED marker of `folder`; CheckpointError if missing, DamagedCommitError if invalid (the message
    names the file and the field)."""
    marker = layout.join(folder, layout.COMMIT_MARKER)
    try:
        data = store.get(marker)
    except FileNotFoundError:
        raise CheckpointError(f"{marker}: no commit marker") from None
    try:
        return CommitMarker.from_json(data, path=marker)
    except RecordError as e:
        raise DamagedCommitError(marker, f"unreadable commit marker: field {e.field!r}: {e.why}") from None


def read_blob(store: _Store, folder: str, record: CommitMarker, name: str) -> bytes:
    """Bytes of the committed file `name`, verified against the marker's size and checksum (`verify_file`;
    DamagedCommitError, naming the file and what differs, if they do not match or the file is gone)."""
    entry = record.files.get(name)
    if entry is None:
        raise DamagedCommitError(layout.join(folder, layout.COMMIT_MARKER), f"field 'files': lists no file {name!r}")
    rel = layout.join(folder, entry.path)
    try:
        data = store.get(rel)
    except FileNotFoundError:
        raise DamagedCommitError(rel, "named by the commit marker but missing") from None
    verify_file(rel, data, entry)
    return data
