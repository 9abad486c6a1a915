"""Run-root storage: atomic puts, create-if-absent commits, committed parquet, quarantine.

One `RunStore` wraps one run root: a local path, `file://…`, `memory://…` or `gs://bucket/…`.
Every path the API takes or returns is relative to that root and uses '/'.

Promises (the gcsfs / GCS behaviour they rest on is checked by tests/test_storage.py::TestGcsfsFacts):

- `put_unique(rel, data)`: after it returns, `rel` holds exactly `data`; no reader ever sees a
  partial object. Local: temp file in the same folder, fsync, `os.replace`, fsync the folder.
  GCS: one single-request `pipe` (an object upload is atomic). Never `with fs.open(p, "wb")`.
- `put_if_absent(rel, data)`: create-only-if-absent. True: the object now holds our `data`
  (we created it, or a retry of our own create hit its own earlier success: the lost-ack case is
  resolved by reading the object back and comparing bytes, so commit objects must be unique per
  attempt -- `put_json_if_absent` and `commit_data` add an `attempt_id`). False: it already held
  something else. Local: temp + fsync + `os.link` (atomic `FileExistsError`). GCS: `pipe(mode="create")`,
  i.e. `ifGenerationMatch=0` on a simple upload. `memory://` is NOT atomic across processes (one
  process-wide lock makes it atomic between threads); it exists for quick unit tests only.
- `list(rel_dir)`: a fresh listing (no listing cache) of the folder's direct children, sorted,
  temp files (`.tmp-…`) excluded; a missing folder lists as empty.
- Parquet is written with page checksums, schema name and version in its metadata, compressed
  with zstd (see `parquet_write_options`), serialized once in memory and put with `put_unique`.
  Read back with page checksum verification and always through the declared `TableSpec`.
- `commit_data` / `list_committed` / `read_committed` / `quarantine` (the committed-data layer, in
  `pipeline.store.committed`): a data file is committed by its ready marker, read back verified against it,
  and quarantined when permanently bad.
- Transient errors (timeouts, connection resets and refusals, name-resolution failures, HTTP 408/429/5xx) are
  retried with exponential backoff capped at `RETRY_MAX_DELAY_S`, each retry logged, until `RETRY_WINDOW_S`
  (30 s) of wall time have passed since the first try, gcsfs's own retries inside a call included (a refused
  connection or a DNS failure spends ~30 s in gcsfs alone); then they raise `StorageUnavailableError` (a step
  exits with `Exit.STORAGE_UNAVAILABLE`, 75 (`pipeline.process.exits`), and the job runner restarts it). A write
  the storage refuses for good (no space, read-only, a file where a folder must be) raises
  `pipeline.process.exits.StorageFaultError` naming the path and the free space (`pipeline.store.faults`, which also
  holds the fault-injection hook `RLPIPE_INJECT_STORAGE_FAULT` the tests use to fill a disk). Other errors
  propagate unchanged.
- Storage options: `storage_options_from(given)` is the one way every command builds them: the JSON object in
  `$RLPIPE_STORAGE_OPTIONS`, overridden key by key by the command's own (`--store.storage_options '{…}'`).
  A gs:// RunStore also takes the environment's options itself. gcsfs reads `STORAGE_EMULATOR_HOST`
  (e.g. `http://127.0.0.1:4443`) as its endpoint when `endpoint_url` is not given.
- An unreachable endpoint fails fast: the first gs:// RunStore of a process connects to its endpoint once
  (`check_endpoint`), instead of minutes of gcsfs retries. A host name that does not exist raises
  `StorageEndpointError` (a ConfigError: one line and exit code 2 in every step, never restarted); a refused
  connection or a temporary name-resolution failure raises `StorageUnavailableError` (one line, exit code 75,
  restarted by the job runner); both name the endpoint and the setting it came from. Once a store exists its
  endpoint has answered, so a name-resolution failure mid-run is an outage and is retried like any transient
  error.

Size: over 600 lines as the one storage layer every step writes through: `RunStore`'s atomic puts and create-if-absent
commits, the retry policy and endpoint check they run under, and how storage options are built belong together (each
promise above rests on the others); the committed-data layer on top already lives in `pipeline.store.committed` and
the mapping of write faults in `pipeline.store.faults`.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.process.backoff import backoff_delay
from pipeline.process.config_error import ConfigError
from pipeline.process.exits import StorageFaultError
from pipeline.store import layout
from pipeline.store.committed import (
    TMP_PREFIX,
    CommittedData,
    CorruptFileError,
    FileInfo,
    MissingDataError,
    NotCommittedError,
    StorageEndpointError,
    StorageError,
    StorageUnavailableError,
    new_attempt_id,
)
from pipeline.store.committed import _sha256 as _sha256
from pipeline.store.committed import check_rel as _check_rel
from pipeline.store.faults import injected_fault, not_a_folder, storage_fault
from pipeline.store.urls import local_path, split_location
from schemas.base import SchemaMismatchError, TableSpec

__all__ = [
    "TMP_PREFIX",
    "CorruptFileError",
    "FileInfo",
    "MissingDataError",
    "MissingRunError",
    "NotCommittedError",
    "RunStore",
    "SchemaMismatchError",
    "StorageEndpointError",
    "StorageError",
    "StorageUnavailableError",
    "check_endpoint",
    "existing_run_root",
    "new_attempt_id",
    "parquet_write_options",
    "require_run",
    "storage_options_from",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


# Parquet write settings (measured by bench/bench_storage.py on rollout-shaped files, 2-core VM):
# - zstd level 1 over snappy: token ids (int32) and logprobs (float32) compress ~25% smaller than with
#   snappy at about the same encode speed and faster decode; fewer bytes to upload to and read from GCS,
#   which dominates on object storage. Every pyarrow build reads zstd.
# - dictionary encoding only for string columns (ids, names: few distinct values). On numeric list
#   columns pyarrow's default dictionary attempt is ~3x slower to encode and gives *larger* files (a
#   32k-token vocabulary overflows the dictionary page and falls back to plain anyway).
# - page checksums (CRC32) on every page, verified on read: a flipped bit must fail loudly, not decode.
PARQUET_COMPRESSION = "zstd"
PARQUET_COMPRESSION_LEVEL = 1


def parquet_write_options(schema: pa.Schema) -> dict[str, Any]:
    """The `pq.write_table` keyword arguments every committed parquet file is written with."""
    return {
        "compression": PARQUET_COMPRESSION,
        "compression_level": PARQUET_COMPRESSION_LEVEL,
        "use_dictionary": [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)],
        "write_page_checksum": True,
        "store_schema": True,
    }


RETRY_BASE_DELAY_S = 0.2
RETRY_MAX_DELAY_S = 5.0
RETRY_WINDOW_S = 30.0
"""How long (wall time from the first try) transient storage errors are retried before StorageUnavailableError."""
_TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})

_MEMORY_LOCK = threading.Lock()


STORAGE_OPTIONS_ENV = "RLPIPE_STORAGE_OPTIONS"
"""Environment variable: a JSON object of fsspec storage options for every command (flags override its keys)."""
ENDPOINT_CHECK_TIMEOUT_S = 5.0
_REACHABLE: set[str] = set()
_REACHABLE_LOCK = threading.Lock()


def storage_options_from(given: str | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The storage options of a command: `$RLPIPE_STORAGE_OPTIONS` (a JSON object), then `given` (a JSON object's
    text, e.g. the value of `--store.storage_options`, or a mapping) key by key on top.

    Raises ConfigError naming the flag or the variable and the value when either is not a JSON object."""
    out = _json_object(STORAGE_OPTIONS_ENV, os.environ.get(STORAGE_OPTIONS_ENV) or None)
    if isinstance(given, Mapping):
        out.update(given)
    else:
        out.update(_json_object("store.storage_options", given))
    return out


def _json_object(name: str, text: str | None) -> dict[str, Any]:
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(name, text, f"not JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise ConfigError(name, text, 'must be a JSON object, e.g. \'{"token": "anon"}\'')
    return value


def existing_run_root(url: str, given: str | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The storage options of a read-only command (`storage_options_from(given)`) after checking that `url` holds a
    run (its run.json exists); ConfigError naming `store.run_root` and the path otherwise. Creates nothing."""
    options = storage_options_from(given)
    require_run(RunStore(url, options))
    return options


class MissingRunError(ConfigError):
    """A read-only command was pointed at a run root that does not exist or has no run.json."""

    def __init__(self, url: str) -> None:
        why = f"no run there (the path does not exist or has no {layout.RUN_CONFIG})"
        super().__init__("store.run_root", url, why)


def require_run(store: RunStore) -> None:
    """Refuse (MissingRunError naming the path) a run root without run.json; creates nothing."""
    if not store.exists(layout.RUN_CONFIG):
        raise MissingRunError(store.url)


def check_endpoint(endpoint: str, source: str, timeout_s: float = ENDPOINT_CHECK_TIMEOUT_S) -> None:
    """Connect once to `endpoint` (an http(s) URL); StorageEndpointError naming it and `source` when its host
    does not resolve or refuses the connection. A timeout is only logged (it may pass). Each reachable endpoint
    is checked once per process."""
    with _REACHABLE_LOCK:
        if endpoint in _REACHABLE:
            return
    parts = urllib.parse.urlsplit(endpoint)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except socket.gaierror as e:
        if e.errno == socket.EAI_AGAIN:  # the resolver could not answer now: an outage, not a wrong name
            why = f"host {host!r} could not be resolved for now ({e.strerror or e})"
            raise StorageUnavailableError(f"{endpoint} ({source})", why) from None
        raise StorageEndpointError(source, endpoint, f"host {host!r} does not resolve ({e.strerror or e})") from None
    except ConnectionRefusedError:
        raise StorageUnavailableError(f"{endpoint} ({source})", f"connection refused by {host}:{port}") from None
    except OSError as e:
        logger.warning("storage endpoint %s (%s) did not answer within %.0fs: %s", endpoint, source, timeout_s, e)
        return
    with _REACHABLE_LOCK:
        _REACHABLE.add(endpoint)


def _gcs_endpoint(opts: Mapping[str, Any]) -> tuple[str, str]:
    """(the endpoint gcsfs will use for these options, the setting it comes from)."""
    if opts.get("endpoint_url"):
        return str(opts["endpoint_url"]), "store.storage_options.endpoint_url"
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if emulator not in ("", "default"):
        url = emulator if emulator.startswith(("http://", "https://")) else f"http://{emulator}"
        return url, "STORAGE_EMULATOR_HOST"
    return "https://storage.googleapis.com", "the default GCS endpoint"


def _is_transient(exc: BaseException) -> bool:
    """Whether an error of a store's operation is worth retrying: timeouts, connection failures, name-resolution
    failures (the store's endpoint answered when it was made: a name that stops resolving is a DNS outage),
    HTTP 408/429/5xx."""
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(exc, StorageUnavailableError):  # an inner retry already spent its window
        return False
    if isinstance(exc, socket.gaierror) or isinstance(getattr(exc, "os_error", None), socket.gaierror):
        return True
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    code = getattr(exc, "code", None) or getattr(exc, "status", None)
    if isinstance(code, int) and code in _TRANSIENT_HTTP:
        return True
    return type(exc).__module__.split(".")[0] == "aiohttp"


def retry_delays() -> list[float]:
    """The backoff delays between tries of one storage operation: doubling from RETRY_BASE_DELAY_S, each at most
    RETRY_MAX_DELAY_S, summing to RETRY_WINDOW_S."""
    delays: list[float] = []
    total = 0.0
    while total < RETRY_WINDOW_S:
        delay = min(backoff_delay(RETRY_BASE_DELAY_S, RETRY_MAX_DELAY_S, len(delays)), RETRY_WINDOW_S - total)
        if delay <= 0:
            break
        delays.append(delay)
        total += delay
    return delays


def _retry(what: str, fn: Callable[[], T]) -> T:
    """Call `fn`; a transient error is retried after each of `retry_delays()` (every retry logged) while the
    retries stay within RETRY_WINDOW_S of wall time since the first call (gcsfs's own retries inside one call
    count too), then raises StorageUnavailableError naming `what` and the last error. Other errors propagate
    unchanged."""
    delays = retry_delays()
    started = time.monotonic()
    for attempt in range(len(delays) + 1):
        try:
            return fn()
        except Exception as e:
            if not _is_transient(e):
                raise
            elapsed = time.monotonic() - started
            if attempt == len(delays) or elapsed + delays[attempt] > RETRY_WINDOW_S:
                why = f"{type(e).__name__}: {e} (still failing after {elapsed:.0f} s of retries)"
                raise StorageUnavailableError(what, " ".join(why.split())) from e
            logger.warning("transient error on %s (%s: %s); retry %d in %.1fs", what, type(e).__name__, e,
                           attempt + 1, delays[attempt])  # fmt: skip
            time.sleep(delays[attempt])
    raise AssertionError("unreachable")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RunStore(CommittedData):
    """Storage of one run root. Thread-safe; cheap to construct; holds no open handles.

    root: a local path, `file://…`, `memory://…` or `gs://bucket/prefix`.
    storage_options: passed to the fsspec filesystem (e.g. gcsfs `endpoint_url`, `token`, `project`).
    """

    def __init__(self, root: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        protocol, path = split_location(root)
        self.protocol: str = protocol
        self.is_local: bool = protocol == "file"
        """On local disk (`pipeline.store.urls.is_local`: a plain path, `file://…` or `local://…`)."""
        self._quarantine_cache: dict[str, str] = {}
        self._cache_lock = threading.Lock()
        self._policy_floor: int | None = None
        """The newest committed policy step this object found (`pipeline.store.run_state.latest_policy_step`
        lists only what came after it)."""
        if self.is_local:
            self.root = local_path(root)
            self.fs: fsspec.AbstractFileSystem = fsspec.filesystem("file")
        else:
            opts = dict(self.storage_options)
            if protocol in ("gs", "gcs"):
                opts = storage_options_from(opts)  # the environment's options under the given ones
                check_endpoint(*_gcs_endpoint(opts))
                # Discovery must be fresh: no listing cache, no shared instance with a stale cache.
                opts.setdefault("use_listings_cache", False)
                opts.setdefault("skip_instance_cache", True)
            self.fs = fsspec.filesystem(protocol, **opts)
            self.root = path.rstrip("/")
        self.url: str = root

    def __repr__(self) -> str:
        return f"RunStore({self.url!r})"

    # paths -----------------------------------------------------------------------------
    def full_path(self, rel: str) -> str:
        """The backend path of a run-root-relative path (local: absolute OS path)."""
        rel = _check_rel(rel)
        if self.is_local:
            return os.path.join(self.root, *rel.split("/"))
        return f"{self.root}/{rel}" if self.root else rel

    def _tmp_name(self, rel: str) -> str:
        head, _, tail = rel.rpartition("/")
        name = f"{TMP_PREFIX}{tail}-{uuid.uuid4().hex[:12]}"
        return f"{head}/{name}" if head else name

    # primitives --------------------------------------------------------------------------
    def put_unique(self, rel: str, data: bytes) -> None:
        """Write `data` at `rel` atomically: readers see the old state or all of `data`, never a part."""
        full = self.full_path(rel)
        if self.is_local:
            self._local_write_tmp_then(full, data, lambda tmp: os.replace(tmp, full), rel)
            return
        self._remote_write(rel, full, lambda: _retry(f"put {full}", lambda: self.fs.pipe_file(full, data)))

    def put_if_absent(self, rel: str, data: bytes) -> bool:
        """Create `rel` holding `data` only if it does not exist.

        Returns True if the object now holds exactly our `data` (we created it, or it already held identical
        bytes: this is how a lost acknowledgement followed by gcsfs's retry is recognised as our own write),
        False if it existed with other content. Same semantics on every backend. `data` must therefore be
        unique to this attempt (carry an attempt id) whenever two writers must be told apart.
        """
        full = self.full_path(rel)
        if self.is_local:
            created = True

            def link(tmp: str) -> None:
                nonlocal created
                try:
                    os.link(tmp, full)
                except FileExistsError:
                    created = False
                finally:
                    os.unlink(tmp)

            self._local_write_tmp_then(full, data, link, rel)
            return created or self._holds(full, data)
        if self.protocol == "memory":
            with _MEMORY_LOCK:
                if self.fs.exists(full):
                    return self._holds(full, data)
                self._remote_write(rel, full, lambda: self.fs.pipe_file(full, data))
                return True
        try:
            self._remote_write(
                rel, full, lambda: _retry(f"create {full}", lambda: self.fs.pipe_file(full, data, mode="create"))
            )
            return True
        except FileExistsError:
            return self._holds(full, data)

    def _remote_write(self, rel: str, full: str, write: Callable[[], object]) -> None:
        """Run one object upload; an injected fault (`pipeline.store.faults`) or a storage-refused write becomes
        a StorageFaultError naming the object's URL."""
        where = f"{self.protocol}://{full}"
        rule = injected_fault(rel)
        try:
            if rule is not None:
                raise rule.error(where)
            write()
        except FileExistsError:
            raise
        except OSError as e:
            fault = storage_fault(where, e, local=False)
            if fault is None:
                raise
            raise fault from e

    def _holds(self, full: str, data: bytes) -> bool:
        """After a create-if-absent collision: True iff the existing object is byte-identical to ours."""
        try:
            existing = self._get_full(full)
        except FileNotFoundError:  # deleted between the collision and the read: not ours
            return False
        if existing == data:
            # Expected, not a problem: a retried request whose first attempt landed, or a step redoing a write it
            # made before a restart. Identical bytes carry the same attempt id, so the object is this writer's.
            logger.debug("create-if-absent of %s: the object already holds these exact bytes; kept as written", full)
            return True
        return False

    def _local_write_tmp_then(self, full: str, data: bytes, finish: Callable[[str], None], rel: str) -> None:
        """Write `data` to a temp file beside `full`, fsync it, `finish(tmp)` (rename or link it into place).

        A write the storage refuses (no space, read-only, a file where a folder must be; or a fault injected for
        `rel`, `pipeline.store.faults`) raises StorageFaultError naming `full`; the temp file, whole or half
        written, is removed when it can be and is never read (temp names are never listed)."""
        folder = os.path.dirname(full)
        rule = injected_fault(rel)
        tmp = os.path.join(folder, os.path.basename(self._tmp_name(os.path.basename(full))))
        try:
            try:
                os.makedirs(folder, exist_ok=True)
            except (FileExistsError, NotADirectoryError) as e:
                raise (not_a_folder(full) or e) from e
            try:
                with open(tmp, "xb") as f:
                    if rule is not None:  # a disk that fills up (or is read-only) part-way through this object
                        f.write(data[: rule.after_bytes])
                        raise rule.error(full)
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                finish(tmp)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            _fsync_dir(folder)
        except StorageFaultError:
            raise
        except OSError as e:
            fault = storage_fault(full, e)
            if fault is None:
                raise
            raise fault from e

    def get(self, rel: str) -> bytes:
        """All bytes of `rel`. Raises FileNotFoundError if absent."""
        return self._get_full(self.full_path(rel))

    def _get_full(self, full: str) -> bytes:
        if self.is_local:
            with open(full, "rb") as f:
                return f.read()
        data = _retry(f"get {full}", lambda: self.fs.cat_file(full))
        return bytes(data)

    def exists(self, rel: str) -> bool:
        """Whether `rel` exists now (uncached)."""
        full = self.full_path(rel)
        if self.is_local:
            return os.path.exists(full)
        if self.protocol in ("gs", "gcs"):
            with contextlib.suppress(FileNotFoundError):
                _retry(f"info {full}", lambda: self.fs.info(full, refresh=True))
                return True
            return False
        return bool(self.fs.exists(full))

    def list(self, rel_dir: str) -> list[str]:
        """Fresh, sorted listing of the direct children (files and folders) of `rel_dir`, as relative paths.

        Temp files are excluded; a missing folder lists as empty.
        """
        rel_dir = rel_dir.strip("/")
        if self.is_local:
            folder = self.full_path(rel_dir) if rel_dir else self.root
            try:
                names = os.listdir(folder)
            except (FileNotFoundError, NotADirectoryError):
                return []
        else:
            folder = self.full_path(rel_dir) if rel_dir else self.root
            try:
                if self.protocol in ("gs", "gcs"):
                    entries = _retry(f"ls {folder}", lambda: self.fs.ls(folder, detail=False, refresh=True))
                else:
                    entries = self.fs.ls(folder, detail=False)
            except FileNotFoundError:
                return []
            names = [str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries]
        prefix = f"{rel_dir}/" if rel_dir else ""
        return sorted(prefix + n for n in names if n and not n.startswith(TMP_PREFIX))

    def list_after(self, rel_dir: str, start_after: str) -> builtins.list[str]:
        """`list(rel_dir)` restricted to the children whose name sorts after `start_after` (a name, not a path).

        On GCS one listing with `startOffset`, so the objects returned (and the pages paid for) are only the ones
        after `start_after`, however many come before; elsewhere (local disk: a directory read is free) the full
        listing, filtered.
        """
        rel_dir = rel_dir.strip("/")
        prefix = f"{rel_dir}/" if rel_dir else ""
        if self.protocol not in ("gs", "gcs"):
            return [p for p in self.list(rel_dir) if p[len(prefix) :] > start_after]
        from fsspec.asyn import sync  # gcsfs is async underneath; its `ls` has no start offset

        bucket, _, key = f"{self.root}/{prefix}".partition("/")
        names: set[str] = set()
        token: str | None = None
        while True:
            kw = {"pageToken": token} if token else {}
            page = _retry(f"ls {bucket}/{key} after {start_after}", lambda kw=kw: sync(  # type: ignore[misc]
                self.fs.loop, self.fs._call, "GET", "b/{}/o", bucket, delimiter="/", prefix=key,
                startOffset=key + start_after, maxResults=1000, json_out=True, **kw))  # fmt: skip
            for obj in page.get("items", []):
                names.add(str(obj["name"])[len(key) :])
            names.update(str(p)[len(key) :].rstrip("/") for p in page.get("prefixes", []))
            token = page.get("nextPageToken")
            if not token:
                break
        return sorted(prefix + n for n in names if n and n > start_after and not n.startswith(TMP_PREFIX))

    def delete(self, rel: str) -> None:
        """Remove `rel` (garbage collection only; commit objects are never deleted). Missing is fine."""
        full = self.full_path(rel)
        if self.is_local:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(full)
            return
        with contextlib.suppress(FileNotFoundError):
            _retry(f"rm {full}", lambda: self.fs.rm_file(full))

    # json ------------------------------------------------------------------------------
    def put_json_if_absent(self, rel: str, obj: Any) -> bool:
        """Create `rel` holding `obj` as JSON only if absent (see `put_if_absent`).

        A dict without an `attempt_id` key gets a fresh one, so that a lost acknowledgement can be told
        apart from someone else's identical record. Returns True if the record is ours.
        """
        if isinstance(obj, dict) and "attempt_id" not in obj:
            obj = {**obj, "attempt_id": new_attempt_id()}
        data = json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
        return self.put_if_absent(rel, data)

    def get_json(self, rel: str) -> Any:
        """Parse `rel` as JSON. Raises FileNotFoundError if absent, CorruptFileError if unparseable."""
        data = self.get(rel)
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptFileError(rel, f"invalid JSON: {e}") from None

    # parquet ---------------------------------------------------------------------------
    @staticmethod
    def parquet_bytes(table: pa.Table, spec: TableSpec[Any], path: str = "<table>") -> bytes:
        """Serialize `table` (conformed to `spec`) to parquet bytes with page checksums and schema metadata."""
        table = spec.conform(table, path)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, **parquet_write_options(table.schema))
        return sink.getvalue().to_pybytes()

    def write_parquet(self, rel: str, table: pa.Table, spec: TableSpec[Any]) -> FileInfo:
        """Write `table` as parquet at `rel` with `put_unique` (atomic); return what was written."""
        data = self.parquet_bytes(table, spec, rel)
        self.put_unique(rel, data)
        return FileInfo(path=rel, size=len(data), sha256=_sha256(data), rows=table.num_rows)

    @staticmethod
    def parse_parquet(data: bytes, spec: TableSpec[Any], path: str, verify_pages: bool = True) -> pa.Table:
        """Parse parquet bytes through `spec`, verifying page checksums unless `verify_pages` is False (for bytes
        already checked against a whole-file digest).

        Files of an older version the spec can upgrade are returned with the current columns.
        Raises CorruptFileError (unreadable, checksum failure) or SchemaMismatchError (foreign schema,
        other version, missing columns).
        """
        try:
            pf = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=verify_pages)
            file_schema = pf.schema_arrow
            version = spec.check_metadata(file_schema.metadata, path)
            present = set(file_schema.names)
            table = spec.upgrade(pf.read(columns=[n for n in spec.schema.names if n in present]), version)
        except SchemaMismatchError:
            raise
        except (pa.ArrowException, OSError, ValueError) as e:
            raise CorruptFileError(path, f"unreadable parquet ({type(e).__name__}: {e})") from None
        try:
            return spec.conform(table, path)
        except SchemaMismatchError:
            raise
        except pa.ArrowException as e:
            raise SchemaMismatchError(path, spec.tag, f"columns not castable ({e})") from None

    def read_parquet(self, rel: str, spec: TableSpec[Any]) -> pa.Table:
        """Read `rel` through `spec`. Raises FileNotFoundError, CorruptFileError or SchemaMismatchError."""
        return self.parse_parquet(self.get(rel), spec, rel)
