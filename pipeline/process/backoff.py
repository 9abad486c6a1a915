"""The one exponential backoff of rlpipe: delays doubling from a first one up to a cap.

Used by every retry or re-check loop: the job runner's restart delays (`restart_backoff_s` doubling up to
`restart_backoff_max_s`), the storage retries of one operation (`pipeline.store.storage.retry_delays`), and the
adaptive sleeps between two checks of the run root (`pipeline.store.poll.poll_until`, the rollout worker's
pacing): short right after activity, doubling up to the poll interval.
"""

from __future__ import annotations

MIN_INTERVAL_S = 0.01
"""Default first sleep after activity of an adaptive wait (doubles up to the poll interval)."""


def backoff_delay(first_s: float, max_s: float, attempt: int) -> float:
    """The delay before retry number `attempt` (0-based): `first_s * 2**attempt`, at most `max_s`."""
    return min(max_s, first_s * 2**attempt)


class Backoff:
    """Sleep lengths doubling from `min_s` up to `max_s`; `reset()` after activity makes the next one short."""

    def __init__(self, max_s: float, min_s: float = MIN_INTERVAL_S) -> None:
        self.max_s = max_s
        self.min_s = min(min_s, max_s)
        self._next = self.min_s

    def reset(self) -> None:
        """Activity: the next sleep is short again."""
        self._next = self.min_s

    def next(self, event_driven: bool = False) -> float:
        """The next sleep: `max_s` itself when notifications end sleeps (`event_driven`), else the doubling one."""
        if event_driven:
            return self.max_s
        s, self._next = self._next, min(self._next * 2, self.max_s)
        return s
