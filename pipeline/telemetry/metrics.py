"""Metrics records under the run root, readable without a tracker.

Each step process appends dict records; they are flushed as immutable JSON-lines files
`metrics/<step_kind>/<worker>-<seq>.jsonl` (a `pipeline.process.step_kind.StepKind`; unique names, atomic writes),
so a crash loses at most the unflushed tail and readers never see partial files.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Protocol

from pipeline.process.step_kind import StepKind
from pipeline.store import layout

logger = logging.getLogger(__name__)


class _PutStore(Protocol):
    def put_unique(self, rel: str, data: bytes) -> None: ...

    def list(self, rel_dir: str) -> list[str]: ...

    def get(self, rel: str) -> bytes: ...


FLUSH_INTERVAL_S = 5.0
"""A buffered record reaches the run root (and from there the tracker and the job's progress line) within about
this long of the next record after it (or at `flush()`)."""


class MetricsWriter:
    """Buffers metrics records of one process and flushes them as unique JSON-lines files.

    Every record gets `time` (unix seconds) and `kind`/`worker` fields. Flushes happen when
    `flush_every` records are buffered, when `flush_interval_s` passed, or on `flush()`.
    """

    def __init__(
        self,
        store: _PutStore,
        step_kind: StepKind | str,
        worker_id: str,
        *,
        flush_every: int = 50,
        flush_interval_s: float = FLUSH_INTERVAL_S,
    ) -> None:
        self._store = store
        self._kind = StepKind(step_kind)
        self._worker = worker_id
        self._buffer: list[dict[str, Any]] = []
        self._flush_every = flush_every
        self._flush_interval_s = flush_interval_s
        self._last_flush = time.monotonic()
        # A fresh sequence per process start: time-based so a restarted process never reuses a name.
        self._seq = int(time.time() * 1000) % 10**8
        self._nonce = f"{int(time.time() * 1e6) % 10**6:06d}"

    def log(self, record: dict[str, Any]) -> None:
        """Buffer one record (must be JSON-serialisable)."""
        rec = {"time": time.time(), "kind": self._kind, "worker": self._worker}
        rec.update(record)
        self._buffer.append(rec)
        if len(self._buffer) >= self._flush_every or time.monotonic() - self._last_flush > self._flush_interval_s:
            self.flush()

    def flush(self) -> None:
        """Write buffered records as one new file (no-op when empty)."""
        if not self._buffer:
            return
        data = "".join(json.dumps(r, sort_keys=True, default=float) + "\n" for r in self._buffer).encode()
        path = layout.metrics_file(self._kind, f"{self._worker}.{self._nonce}", self._seq)
        self._store.put_unique(path, data)
        self._seq += 1
        self._buffer.clear()
        self._last_flush = time.monotonic()


def read_metrics(store: _PutStore, step_kind: StepKind | str) -> list[dict[str, Any]]:
    """All committed records of one step kind, sorted by time."""
    out: list[dict[str, Any]] = []
    for rel in store.list(layout.metrics_dir(StepKind(step_kind))):
        if rel.endswith(".jsonl"):
            out.extend(_records(store, rel))
    out.sort(key=lambda r: r.get("time", 0.0))
    return out


def _records(store: _PutStore, rel: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for line in store.get(rel).decode().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                logger.warning("skipping unreadable metrics line in %s", rel)
    return out


class MetricsTail:
    """Follows the metrics records of some step kinds: each `new_records()` returns the records of the files
    committed since the previous call (every file is read once; files are immutable, so nothing is missed or
    read twice), sorted by time. With `since` (unix seconds), older records are skipped."""

    def __init__(self, store: _PutStore, kinds: tuple[StepKind, ...], *, since: float | None = None) -> None:
        self._store = store
        self._kinds = kinds
        self._since = since
        self._seen: set[str] = set()

    def new_records(self) -> list[dict[str, Any]]:
        """Records of the newly committed files, oldest first (each has `kind`, `worker` and `time`)."""
        out: list[dict[str, Any]] = []
        for kind in self._kinds:
            for rel in self._store.list(layout.metrics_dir(kind)):
                if rel.endswith(".jsonl") and rel not in self._seen:
                    self._seen.add(rel)
                    out.extend(_records(self._store, rel))
        if self._since is not None:
            out = [r for r in out if float(r.get("time", 0.0)) >= self._since]
        out.sort(key=lambda r: r.get("time", 0.0))
        return out
