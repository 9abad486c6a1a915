"""The committed-data layer of a run root: ready markers, verified reads, quarantine, and the storage errors.

`CommittedData` is mixed into `pipeline.store.storage.RunStore` (import everything from there); it relies only on the
store's primitives (`get`, `exists`, `list`, `put_if_absent`, `put_json_if_absent`, `write_parquet`,
`parse_parquet`). Its promises:

- `commit_data` writes data then a ready marker (`layout.ready_marker`, a `schemas.records.ReadyMarker`) naming
  its file, size, sha256, rows, schema, attempt_id and time, plus the producer's `extra` fields.
- `list_committed` trusts markers, never data listings.
- `read_committed` verifies the data against its marker; a permanently bad file (bad marker included, and a marker
  whose data file is gone) is quarantined (reason record via create-if-absent, a warning naming path and reason)
  and None is returned so the caller goes on: one damaged object never blocks the rest.
- `read_log_entry` refuses a damaged batch log entry (cut mid-JSON, of a newer version, a field missing) with
  `DamagedRecordError`: a `RecordError` that is also a `pipeline.process.exits.DamagedInputError` (one line naming
  the file and the field, exit code 7, never restarted): a slot's commit object cannot be rebuilt.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import dataclasses
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pipeline.process.config_error import ConfigError
from pipeline.process.exits import DamagedInputError, PathError
from pipeline.store import layout
from schemas.base import SchemaMismatchError, TableSpec
from schemas.records import BatchLogEntry, ReadyMarker, RecordError

logger = logging.getLogger("pipeline.store.storage")

TMP_PREFIX = ".tmp-"
"""Names starting with this are in-flight temp files: never listed, never read."""


class StorageError(Exception):
    """Base of the named storage errors."""


class StorageEndpointError(StorageError, ConfigError):
    """The storage endpoint of a run root cannot be reached at all (its host does not resolve, or it refuses
    connections): reported at once, naming the endpoint and where it came from, instead of retried as transient."""

    def __init__(self, source: str, endpoint: str, why: str) -> None:
        ConfigError.__init__(self, source, endpoint, why)


class StorageUnavailableError(Exception):
    """The run root's storage cannot be reached now: its endpoint refused the connection or its host name could
    not be resolved for the moment, or transient errors went on for the whole retry window. Unlike
    `StorageEndpointError` (a host name that does not exist: a configuration error), a later attempt may succeed.
    Deliberately not a `StorageError`: nothing is wrong with any file, so no reader may quarantine or skip one
    because of it."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"storage unavailable: {what}: {why}")
        self.what = what
        self.why = why


class CorruptFileError(PathError, StorageError):
    """A stored file is unreadable or does not match its commit marker (permanent; quarantine it); `str()` is
    `<path>: <reason>`."""


class MissingDataError(StorageError):
    """A committed ready marker names a data file that does not exist (`read_committed` quarantines such a file
    with this message as its reason)."""

    def __init__(self, path: str, marker: str) -> None:
        super().__init__(f"{path}: data file missing although its ready marker {marker} exists")
        self.path = path
        self.marker = marker


class DamagedRecordError(RecordError, DamagedInputError):
    """A commit record read from the run root is damaged: cut mid-JSON, of a version this reader cannot read, a field
    missing or of the wrong type. Still a `RecordError` (naming the file and the field) for the callers that catch
    one; as a `DamagedInputError` every entry point ends it in one line with `Exit.DAMAGED_INPUT`."""

    def __init__(self, error: RecordError) -> None:
        RecordError.__init__(self, error.path, error.field, error.why)
        self.reason = f"field {error.field!r}: {error.why}"


class NotCommittedError(StorageError):
    """`read_committed` was asked for a data file that has no ready marker."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path}: not committed (no ready marker {layout.ready_marker(path)})")
        self.path = path


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """What was written: run-root-relative path, size in bytes, hex sha256 and row count."""

    path: str
    size: int
    sha256: str
    rows: int


def new_attempt_id() -> str:
    """A fresh unique id (32 hex chars) for one attempt at a commit."""
    return uuid.uuid4().hex


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_HASH_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_HASH_POOL_LOCK = threading.Lock()


def _hash_pool() -> concurrent.futures.ThreadPoolExecutor:
    """A small shared pool for hashing next to parquet decoding (created on first use)."""
    global _HASH_POOL
    with _HASH_POOL_LOCK:
        if _HASH_POOL is None:
            _HASH_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="rlpipe-sha256")
        return _HASH_POOL


def check_rel(rel: str) -> str:
    """Normalise and refuse paths that would escape the run root or name temp files."""
    rel = rel.strip("/")
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"not a safe run-root-relative path: {rel!r}")
    if parts[-1].startswith(TMP_PREFIX):
        raise ValueError(f"{rel!r}: names starting with {TMP_PREFIX!r} are reserved for temp files")
    return rel


class CommittedData:
    """Ready-marker commits, verified reads and quarantine on top of a store's primitives (see the module doc)."""

    if TYPE_CHECKING:  # provided by RunStore
        _quarantine_cache: dict[str, str]
        _cache_lock: threading.Lock

        def get(self, rel: str) -> bytes: ...
        def exists(self, rel: str) -> bool: ...
        def list(self, rel_dir: str) -> builtins.list[str]: ...
        def put_if_absent(self, rel: str, data: bytes) -> bool: ...
        def put_json_if_absent(self, rel: str, obj: Any) -> bool: ...
        def get_json(self, rel: str) -> Any: ...
        def write_parquet(self, rel: str, table: pa.Table, spec: TableSpec[Any]) -> FileInfo: ...
        @staticmethod
        def parse_parquet(data: bytes, spec: TableSpec[Any], path: str, verify_pages: bool = True) -> pa.Table: ...

    # commit ----------------------------------------------------------------------------
    def commit_data(
        self, rel: str, table: pa.Table, spec: TableSpec[Any], extra: Mapping[str, Any] | None = None
    ) -> bool:
        """Write `table` at `rel` (put_unique), then commit it with a ready marker (put_if_absent).

        The marker holds file, size, sha256, rows, schema, attempt_id, time and the `extra` fields.
        Returns True if this call committed the file; False if it was already committed (then the data
        file is not touched). `rel` must be unique to one producing task: a concurrent writer of the same
        name is detected afterwards and logged as an error (its reader will quarantine on mismatch).
        """
        marker = layout.ready_marker(check_rel(rel))
        if self.exists(marker):
            logger.info("%s is already committed; not rewriting it", rel)
            return False
        info = self.write_parquet(rel, table, spec)
        fields: dict[str, Any] = {
            **dict(extra or {}),
            "file": rel,
            "size": info.size,
            "sha256": info.sha256,
            "rows": info.rows,
            "schema": spec.tag,
            "attempt_id": new_attempt_id(),
            "time": time.time(),
        }
        record = ReadyMarker.from_json(fields, path=marker)  # a producer field of the wrong type fails here
        if self.put_if_absent(marker, record.to_json()):
            return True
        try:
            other: ReadyMarker | None = ReadyMarker.from_json(self.get(marker), path=marker)
        except RecordError:
            other = None
        if other is None or other.sha256 != info.sha256:
            logger.error(
                "name collision: %s was committed concurrently by another writer (attempt %s)",
                rel,
                None if other is None else other.attempt_id,
            )
        return False

    def read_log_entry(self, slot: int) -> BatchLogEntry:
        """The committed log entry of batch `slot`.

        Raises FileNotFoundError (not committed) or DamagedRecordError (a RecordError naming the file and the field:
        not JSON, a newer version, a field missing or of the wrong type).
        """
        path = layout.batch_log_entry(slot)
        try:
            return BatchLogEntry.from_json(self.get(path), path=path)
        except RecordError as e:
            raise DamagedRecordError(e) from None

    def list_committed(self, rel_dir: str) -> builtins.list[str]:
        """Sorted data paths in `rel_dir` whose ready marker exists and that are not quarantined."""
        markers = [p for p in self.list(rel_dir) if p.endswith(layout.READY_SUFFIX)]
        if not markers:
            return []
        bad = self.quarantined()
        return [d for d in (layout.data_of_marker(m) for m in markers) if d not in bad]

    def read_marker(self, rel: str) -> ReadyMarker:
        """The ready marker of data file `rel`. Raises NotCommittedError or CorruptFileError (bad marker)."""
        marker = layout.ready_marker(rel)
        try:
            record = self.get_json(marker)
        except FileNotFoundError:
            raise NotCommittedError(rel) from None
        try:
            return ReadyMarker.from_json(record, path=marker)
        except RecordError as e:
            raise CorruptFileError(rel, f"bad ready marker ({e})") from None

    def read_committed(self, rel: str, spec: TableSpec[Any]) -> pa.Table | None:
        """Read a committed data file, verified against its marker; None if it is (now) quarantined.

        A permanent defect (bad marker, data file gone, size/sha256/row mismatch, unreadable parquet, checksum
        failure, foreign schema or unknown version) quarantines the file with a reason and returns None.
        Raises NotCommittedError without a marker.
        """
        rel = check_rel(rel)
        if self.is_quarantined(rel):
            logger.debug("%s is quarantined; skipped", rel)
            return None
        try:
            record = self.read_marker(rel)
            try:
                data = self.get(rel)
            except FileNotFoundError:
                missing = MissingDataError(rel, layout.ready_marker(rel))
                raise CorruptFileError(rel, str(missing).split(": ", 1)[1]) from None
            if len(data) != record.size:
                raise CorruptFileError(rel, f"size {len(data)} != marker size {record.size}")
            # Hash in a worker thread (hashlib releases the GIL) while parsing: the digest is checked before
            # anything is returned, and a digest mismatch is reported in preference to a parse error.
            digest_future = _hash_pool().submit(_sha256, data)
            parse_error: CorruptFileError | SchemaMismatchError | None = None
            table: pa.Table | None = None
            try:
                # page checksums would only repeat the sha256 check of the same bytes
                table = self.parse_parquet(data, spec, rel, verify_pages=False)
            except (CorruptFileError, SchemaMismatchError) as e:
                parse_error = e
            digest = digest_future.result()
            if digest != record.sha256:
                raise CorruptFileError(rel, f"sha256 {digest[:16]}… != marker sha256 {record.sha256[:16]}…")
            if parse_error is not None:
                raise parse_error
            assert table is not None
            if table.num_rows != record.rows:
                raise CorruptFileError(rel, f"{table.num_rows} rows != marker rows {record.rows}")
            return table
        except CorruptFileError as e:
            self.quarantine(rel, e.reason)
            return None
        except SchemaMismatchError as e:
            self.quarantine(rel, f"schema mismatch: expected {e.expected}, found {e.found}")
            return None

    # quarantine --------------------------------------------------------------------------
    def quarantine(self, rel: str, reason: str) -> None:
        """Set `rel` aside for good: a reason record (create-if-absent); the bytes stay for forensics."""
        rel = check_rel(rel)
        record = {"path": rel, "reason": reason, "time": time.time()}
        created = self.put_json_if_absent(layout.quarantine_record(rel), record)
        with self._cache_lock:
            self._quarantine_cache[layout.quarantine_record(rel)] = rel
        if created:
            logger.warning("quarantined %s: %s", rel, reason)
        else:
            logger.info("%s was already quarantined (new reason: %s)", rel, reason)

    def is_quarantined(self, rel: str) -> bool:
        """Whether `rel` has a quarantine record."""
        return self.exists(layout.quarantine_record(check_rel(rel)))

    def quarantined(self) -> set[str]:
        """Every quarantined path (fresh listing; records are immutable, so each is read once)."""
        out: set[str] = set()
        for rec in self.list(layout.QUARANTINE):
            if not rec.endswith(".json"):
                continue
            with self._cache_lock:
                known = self._quarantine_cache.get(rec)
            if known is None:
                try:
                    obj = self.get_json(rec)
                    known = str(obj["path"])
                except (CorruptFileError, KeyError, TypeError):
                    logger.warning("unreadable quarantine record %s", rec)
                    continue
                with self._cache_lock:
                    self._quarantine_cache[rec] = known
            out.add(known)
        return out
