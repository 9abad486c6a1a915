"""A wall-clock limit on a call that may never end (a generator that builds an astronomically large number)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import TypeVar

_T = TypeVar("_T")


class TimeLimitExceeded(Exception):
    """The call ran past its time limit and was interrupted."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"still running after {seconds:g} s")
        self.seconds = seconds


def can_limit() -> bool:
    """Whether `run_with_time_limit` can interrupt a call made here and now: only on the process's main thread
    (SIGALRM is delivered there) and while no other interval timer is set (it is one per process)."""
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0.0
    )


def run_with_time_limit(fn: Callable[[], _T], seconds: float) -> _T:
    """`fn()`, interrupted by `TimeLimitExceeded` once it has run `seconds` of wall time; the timer and the previous
    SIGALRM handler are restored however it ends. Where `can_limit()` is false (another thread, a timer already
    set) or `seconds` <= 0, `fn()` runs without a limit. The interruption lands between Python bytecodes: a single
    long call into C (one product of huge integers) finishes first."""
    if seconds <= 0 or not can_limit():
        return fn()

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise TimeLimitExceeded(seconds)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)
