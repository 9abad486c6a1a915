"""Watchdogs for phases that cannot be interrupted from Python (a hung JAX or network call).

A phase run under `watchdog(phase, timeout_s)` that overruns logs a CRITICAL line naming the phase and the limit
and ends the process with `os._exit(Exit.WATCHDOG)` (3, `pipeline.process.exits`); the job runner restarts the
step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator

from pipeline.process.exits import Exit

logger = logging.getLogger(__name__)


def _exit_on_timeout(phase: str, timeout_s: float) -> None:
    logger.critical("watchdog: phase %r exceeded %.1fs; exiting with status %d", phase, timeout_s, Exit.WATCHDOG)
    logging.shutdown()
    os._exit(Exit.WATCHDOG)


@contextlib.contextmanager
def watchdog(
    phase: str, timeout_s: float | None, on_timeout: Callable[[str, float], None] = _exit_on_timeout
) -> Iterator[None]:
    """Run the block under a timer thread: if it is still running after `timeout_s`, call
    `on_timeout(phase, timeout_s)` (default: log CRITICAL and `os._exit(Exit.WATCHDOG)`). None/<=0 disables it."""
    if timeout_s is None or timeout_s <= 0:
        yield
        return
    timer = threading.Timer(timeout_s, on_timeout, args=(phase, timeout_s))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
