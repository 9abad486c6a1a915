"""Waking a waiting step as soon as something changes under the run root.

A `Waker` is what a step sleeps on between two checks of a condition (`pipeline.store.poll.poll_until`):
  - on a local run root it subscribes to filesystem notifications (the `watchdog` package: inotify on Linux,
    FSEvents/kqueue elsewhere) for the whole root, and a sleep ends at the first create / move / modify under it
    (files under `logs/` and `metrics/`, and temporary files not yet renamed into place, do not wake anyone);
  - on an object store (gs://, or when notifications cannot be had) sleeps are adaptive: the first sleep after
    activity is short (`pipeline.process.backoff.MIN_INTERVAL_S`) and each further one doubles, up to the
    configured poll interval (`pipeline.process.backoff.Backoff`).
Either way a sleep never exceeds the poll interval, so a missed notification (a folder created and written to
before its watch was added) costs at most one poll interval, never correctness: the caller always re-checks
the run root itself.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pipeline.store.storage import TMP_PREFIX, RunStore

logger = logging.getLogger(__name__)

QUIET_DIRS = ("logs", "metrics")
"""Top-level folders whose changes wake nobody: no step waits on them, and they change all the time."""


class Waker:
    """Sleeps that end early when the run root changes (see the module docstring)."""

    def __init__(self, local_root: str | None) -> None:
        """`local_root`: the run root's OS path when it is on local disk (notifications), else None."""
        self._cond = threading.Condition()
        self._events = 0
        self._observer: Any = None
        if local_root is not None:
            self._observer = _start_observer(local_root, self.poke)

    @property
    def event_driven(self) -> bool:
        """Whether sleeps end on filesystem notifications (else only on `poke` or their timeout)."""
        return self._observer is not None

    def mark(self) -> int:
        """A token to take BEFORE checking a condition: `sleep(.., mark)` then ends at once if anything changed
        in between (no change is lost between the check and the sleep)."""
        with self._cond:
            return self._events

    def poke(self) -> None:
        """End current sleeps now (a relevant change, a stop request)."""
        with self._cond:
            self._events += 1
            self._cond.notify_all()

    def sleep(self, timeout_s: float, mark: int) -> bool:
        """Sleep until something changed since `mark` or `timeout_s` passed; True if woken by a change."""
        with self._cond:
            if self._events == mark and timeout_s > 0:
                self._cond.wait(timeout_s)
            return self._events != mark

    def close(self) -> None:
        """Stop watching (idempotent)."""
        obs, self._observer = self._observer, None
        if obs is not None:
            obs.stop()
            self.poke()


def _start_observer(root: str, notify: Any) -> Any:
    """A started recursive watchdog observer on `root` calling `notify()` on relevant changes; None if it fails."""
    import os

    try:
        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer
    except ImportError:  # declared dependency; without it, adaptive polling still works
        logger.warning("the watchdog package is missing: waiting by adaptive polling on %s", root)
        return None

    root_abs = os.path.abspath(root)

    def relevant(path: str) -> bool:
        rel = os.path.relpath(path, root_abs)
        top = rel.split(os.sep, 1)[0]
        return top not in QUIET_DIRS and not os.path.basename(path).startswith(TMP_PREFIX)

    class Handler(FileSystemEventHandler):
        def on_any_event(self, event: FileSystemEvent) -> None:
            if event.event_type in ("opened", "closed_no_write"):
                return
            dest = getattr(event, "dest_path", "") or ""
            if relevant(str(event.src_path)) or (dest and relevant(str(dest))):
                notify()

    try:
        os.makedirs(root_abs, exist_ok=True)
        observer = Observer()
        observer.daemon = True
        observer.schedule(Handler(), root_abs, recursive=True)
        observer.start()
    except OSError as e:  # e.g. the inotify watch limit: fall back to polling
        logger.warning("no filesystem notifications for %s (%s): waiting by adaptive polling", root_abs, e)
        return None
    return observer


_wakers: dict[str, Waker] = {}
_lock = threading.Lock()


def waker_for(store: RunStore) -> Waker:
    """The process's shared Waker for a RunStore (one observer per local root, started on first use)."""
    key = f"{store.protocol}://{store.root}"
    with _lock:
        w = _wakers.get(key)
        if w is None:
            w = Waker(store.root if store.is_local else None)
            _wakers[key] = w
        return w
