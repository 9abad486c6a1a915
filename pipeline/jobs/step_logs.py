"""Step output kept under the run root: `logs/<step>/<attempt>.log`, one file per process start.

On a local run root the step's output is written straight into that file. On any other run root (gs://, …)
it is written to a local file and the whole file is uploaded under the same fixed name every
`UPLOAD_EVERY_S` seconds while it grows, and once more when the step ends. Each upload replaces the object
atomically (`RunStore.put_unique`): a reader sees an earlier complete upload or the newer one, never a torn
file, and at most the last few seconds of output are missing until the step ends. A crash of the process
that uploads loses at most those seconds; the local copy stays in the temporary folder until then.

An attempt id is `<UTC time>-<8 hex>`, so the attempts of a step sort by start time.

A step the job runner started also writes the one line that ends an expected failure (`steps.cli.report`) to
`reason_path(step, attempt)`, a small file under the system temp folder, off the run root: when the run root is
full its log may be empty, and the runner still prints the step's reason from there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from pipeline.store import layout
from pipeline.store.faults import logs_full

if TYPE_CHECKING:
    from pipeline.store.storage import RunStore

logger = logging.getLogger(__name__)

UPLOAD_EVERY_S = 3.0
"""How often a growing log of a remote run root is uploaded."""


def new_attempt() -> str:
    """A fresh attempt id: sortable by start time, unique across processes and hosts."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class LogTarget:
    """Where one process start of a step logs: picklable, so a Ray task can open it on its own node."""

    run_root: str
    storage_options: dict[str, Any] | None
    step: str
    attempt: str

    @property
    def rel(self) -> str:
        """The path under the run root."""
        return layout.step_log(self.step, self.attempt)

    @property
    def location(self) -> str:
        """Where the user finds the log (an OS path or a URL)."""
        from pipeline.store.storage import RunStore

        return location(RunStore(self.run_root, self.storage_options), self.rel)


def location(store: RunStore, rel: str) -> str:
    """What a user types to find `rel` of `store`'s run root: an OS path (local) or a URL (`gs://bucket/…`)."""
    full = str(store.full_path(rel))
    return full if store.is_local else f"{store.protocol}://{full}"


def log_target(run_root: str, storage_options: Mapping[str, Any] | None, step: str) -> LogTarget:
    """The log of a new process start of `step` (a fresh attempt id)."""
    return LogTarget(run_root, dict(storage_options) if storage_options else None, step, new_attempt())


STEP_ENV = "RLPIPE_STEP"
"""Set by the job runner's launchers for a step's process: the step's name (`learner`, `rollout-worker0`, …)."""
ATTEMPT_ENV = "RLPIPE_ATTEMPT"
"""Set by the job runner's launchers for a step's process: the attempt id of its log."""


def child_log_target(
    run_root: str, storage_options: Mapping[str, Any] | None, default_step: str, suffix: str
) -> LogTarget:
    """The log of something this process starts (a child server): `logs/<step>/<attempt>.<suffix>.log`, beside
    this process's own step log when the job runner started it (`RLPIPE_STEP`, `RLPIPE_ATTEMPT`), else under
    `default_step` with a fresh attempt id."""
    step = os.environ.get(STEP_ENV) or default_step
    attempt = os.environ.get(ATTEMPT_ENV) or new_attempt()
    return LogTarget(run_root, dict(storage_options) if storage_options else None, step, f"{attempt}.{suffix}")


FULL_DEVICE = "/dev/full"
"""A device every write to fails with ENOSPC: the step log of a run root whose logs the fault hook fills."""
REASON_DIR = "rlpipe-step-reasons"
"""Folder under the system temp folder that holds the steps' one-line failure reasons (`reason_path`)."""


def reason_path(step: str, attempt: str) -> str:
    """Where the process start `attempt` of `step` writes the one line that ended it (see the module docstring)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{step}.{attempt}")
    return os.path.join(tempfile.gettempdir(), REASON_DIR, f"{safe}.txt")


def read_reason(target: LogTarget) -> str | None:
    """The one-line reason the process start of `target` wrote at its end (`reason_path`), removed once read, or
    None."""
    path = reason_path(target.step, target.attempt)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read().strip()
    except OSError:
        return None
    with contextlib.suppress(OSError):
        os.unlink(path)
    return text.removeprefix("error: ") or None


class StepLog:
    """The open log file of one process start of a step (see the module docstring).

    `open()` gives the file the step's output goes to; `close()` uploads the final state (remote roots).
    On a remote root the (empty) object exists as soon as the StepLog is made, so a message may point at it.
    """

    def __init__(self, target: LogTarget, *, upload_every_s: float = UPLOAD_EVERY_S) -> None:
        from pipeline.store.storage import RunStore

        self.target = target
        self.store = RunStore(target.run_root, target.storage_options)
        self.rel = target.rel
        self.location = location(self.store, self.rel)
        self._upload_every_s = upload_every_s
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if self.store.is_local:
            self.local_path = Path(self.location)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="rlpipe-log-")
            self.local_path = Path(self._tmp.name) / f"{target.step}.log"
        self._full = self.store.is_local and logs_full()
        """The fault-injection hook fills the logs' folder (`pipeline.store.faults`): the log is /dev/full."""
        if not self._full:
            try:
                self.local_path.parent.mkdir(parents=True, exist_ok=True)
                self.local_path.touch()
            except OSError as e:  # a full or read-only run root: the log goes to a local temp file instead (kept)
                fallback = Path(tempfile.mkdtemp(prefix="rlpipe-log-")) / f"{target.step}.{target.attempt}.log"
                logger.warning("cannot write the log %s (%s); logging to %s instead", self.location, e, fallback)
                self.local_path = fallback
                self.location = str(fallback)
                fallback.touch()
        self._stop = threading.Event()
        self._uploaded_size = -1
        self._thread: threading.Thread | None = None
        if not self.store.is_local:
            self._upload()
            self._thread = threading.Thread(target=self._upload_loop, name=f"log-upload-{target.step}", daemon=True)
            self._thread.start()

    def open(self) -> IO[bytes]:
        """The file (append mode) that the step's output goes to; the caller closes it."""
        return open(FULL_DEVICE if self._full else self.local_path, "ab")

    def close(self) -> None:
        """Stop the uploader and upload the final state (idempotent; a no-op for a local run root)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._upload()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _upload_loop(self) -> None:
        while not self._stop.wait(self._upload_every_s):
            self._upload()

    def _upload(self) -> None:
        try:
            size = os.path.getsize(self.local_path)
            if size == self._uploaded_size:
                return
            data = self.local_path.read_bytes()
            self.store.put_unique(self.rel, data)
            self._uploaded_size = len(data)
        except Exception as e:  # the step goes on; the next upload retries
            logger.warning("could not upload the log %s: %s", self.location, e)


def pump(source: IO[bytes], sink: IO[bytes], *, echo_prefix: str | None = None) -> None:
    """Copy `source` line by line into `sink` (flushed per line) until EOF; with `echo_prefix`, also print each
    line on this process's stdout behind that prefix (how a Ray task's step output reaches the driver)."""
    for line in iter(source.readline, b""):
        sink.write(line)
        sink.flush()
        if echo_prefix is not None:
            sys.stdout.write(echo_prefix + line.decode(errors="replace"))
            sys.stdout.flush()


def run_root_of(store: RunStore) -> str:
    """The run root as a server on this machine names it (absolute local path, or the gs:// URL)."""
    return str(store.root if store.is_local else store.url).rstrip("/")


def server_log(store: RunStore, worker_id: str) -> StepLog:
    """The open log of this worker's child server, `logs/<step>/<attempt>.server.log`: the step and attempt of the
    worker's own log when the job runner started it, else `rollout-<worker_id>` and a fresh attempt. The caller
    closes it (the final upload on a remote run root)."""
    return StepLog(child_log_target(store.url, store.storage_options, f"rollout-{worker_id}", "server"))
