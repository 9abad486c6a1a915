"""The one way a step waits for something to appear under the run root."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TypeVar

from pipeline.process.backoff import Backoff
from pipeline.store.notify import Waker

T = TypeVar("T")

logger = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
"""How often a wait that has not ended says (at INFO) what it still waits for."""


class WaitTimeout(TimeoutError):
    """Nothing appeared in time; the message says what was awaited, for how long, and which setting bounds it."""


def poll_until(
    condition: Callable[[], T | None],
    *,
    timeout_s: float,
    what: str | Callable[[], str],
    interval_s: float = 0.05,
    setting: str | None = None,
    on_wait: Callable[[], None] | None = None,
    progress: Callable[[], object] | None = None,
    log_every_s: float | None = LOG_EVERY_S,
    log: logging.Logger | None = None,
    waker: Waker | None = None,
) -> tuple[T, float]:
    """Call `condition` until it returns something other than None/False; return (that value, seconds waited).

    `on_wait` runs before each sleep (renew a lease, check a stop file: it may raise to abort the wait).
    With `progress`, the timeout restarts whenever `progress()` changes. Raises `WaitTimeout` naming `what`
    (and `setting`, the config field that bounds the wait) after `timeout_s` without success or progress
    (`math.inf`: a wait without a bound, such as a follow-mode step's wait for new work).
    While the wait lasts, one INFO line on `log` (default: this module's logger) every `log_every_s` seconds
    says what is awaited, for how long so far and the bound (None: silent).

    Between checks it sleeps on `waker` (`pipeline.store.notify.waker_for(store)`): on a local root a change under the
    root ends the sleep at once; otherwise sleeps are adaptive, from a few ms doubling up to `interval_s`. No
    sleep exceeds `interval_s`.
    """
    waker = waker if waker is not None else Waker(None)
    backoff = Backoff(interval_s)
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    next_log = t0 + log_every_s if log_every_s else float("inf")
    last = progress() if progress is not None else None
    while True:
        mark = waker.mark()
        value = condition()
        if value is not None and value is not False:
            return value, time.monotonic() - t0
        now = time.monotonic()
        if progress is not None:
            p = progress()
            if p != last:
                last, deadline = p, now + timeout_s
        bound = f"{setting}={timeout_s:g}" if setting else f"{timeout_s:g}s"
        if now > deadline:
            raise WaitTimeout(f"waited {now - t0:.1f}s (> {bound}) for {_describe(what)}")
        if now >= next_log:
            limit = "no time limit" if math.isinf(timeout_s) else f"gives up after {bound}"
            (log or logger).info("waiting %.0fs for %s (%s)", now - t0, _describe(what), limit)
            next_log = now + (log_every_s or float("inf"))
        if on_wait is not None:
            on_wait()
        if waker.sleep(backoff.next(waker.event_driven), mark):
            backoff.reset()


def _describe(what: str | Callable[[], str]) -> str:
    return what() if callable(what) else what
