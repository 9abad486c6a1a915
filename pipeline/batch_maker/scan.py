"""Which rollout folders the BatchMaker step lists for a slot, and which of them are sealed.

Slot T scans the policy folders P >= `scan_low(T)`: the staleness window plus `LATE_SCAN_STEPS` folders below
it, so a file that arrives a little late is still read and its rows recorded as dropped `stale`. When a folder
leaves that range, the log entry of the slot that moved the range past it `seals` it with the files seen there;
any other file committed into it later is late and is found by a late sweep.
"""

from __future__ import annotations

import logging

from pipeline.store import layout, run_state, staleness
from pipeline.store.storage import RunStore

logger = logging.getLogger(__name__)

LATE_SCAN_STEPS = 4
"""Policy folders scanned below the staleness window, so late files are recorded as dropped `stale`."""


class ScanWindow:
    """The scanned policy folders of each slot, and the seals of the folders that left them."""

    def __init__(self, store: RunStore, max_lag: int) -> None:
        self.store = store
        self.max_lag = max_lag
        self._seals: dict[int, frozenset[str]] = {}  # policy folder -> files seen in it when it left the window
        self._unsealed_warned: set[int] = set()

    def scan_low(self, slot: int) -> int:
        """The oldest policy folder slot `slot` lists."""
        return max(0, staleness.oldest_allowed_policy(slot, self.max_lag) - LATE_SCAN_STEPS)

    def discover(self, slot: int, seen: set[str], folders: list[int] | None = None) -> list[tuple[int, str]]:
        """Committed, unseen, unquarantined rollout files of scanned policy folders, as (P, path), sorted.

        `folders`: the policy folders listed by the caller (None: list them now, `run_state.rollout_folders` from
        `scan_low(slot)`: only the folders from the window on are returned, however many lie below it).
        `quarantine/` is listed once per call, not once per folder. So a poll costs one listing of the folder
        names from the window on, one per such folder and one of `quarantine/`, returning the window's files:
        O(files in the window), not O(files or folders of the run).
        """
        low = self.scan_low(slot)
        out = []
        bad: set[str] | None = None
        for p in run_state.rollout_folders(self.store, low) if folders is None else [f for f in folders if f >= low]:
            markers = [m for m in self.store.list(layout.rollout_step_dir(p)) if m.endswith(layout.READY_SUFFIX)]
            if markers and bad is None:
                bad = self.store.quarantined()
            for path in (layout.data_of_marker(m) for m in markers):
                if path not in seen and path not in (bad or ()):
                    out.append((p, path))
        return sorted(out)

    def sealed_folders(self, slot: int, seen: set[str]) -> dict[str, list[str]]:
        """The folders that leave the scan window with slot `slot`, each with the files seen in it.

        Stamped into slot `slot`'s log entry (so it commits atomically with the slot); a late sweep later
        treats any other committed file of such a folder as late.
        """
        leaving = range(self.scan_low(slot), self.scan_low(slot + 1))
        out: dict[str, list[str]] = {str(p): [] for p in leaving}
        for path in seen:
            p = layout.parse_step(path)  # the policy step P of rollouts/step-P/…
            if p in leaving:
                out[str(p)].append(path)
        return {p: sorted(v) for p, v in out.items()}

    def remember(self, sealed: dict[str, list[str]]) -> None:
        """Cache the seals a slot being committed stamps (so a sweep need not read them back)."""
        self._seals.update((int(p), frozenset(v)) for p, v in sealed.items())

    def forget(self) -> None:
        """Drop cached seals: a lost slot may have cached seals that never committed."""
        self._seals.clear()

    def seal(self, p: int) -> frozenset[str] | None:
        """Files seen in policy folder `p` when it left the scan window; None if that is not (yet) known."""
        if p in self._seals:
            return self._seals[p]
        # the slot whose commit moved the window past p: the newest slot that still scanned it
        at = staleness.newest_slot_allowing(p + LATE_SCAN_STEPS, self.max_lag)
        try:
            sealed = self.store.read_log_entry(at).sealed
        except FileNotFoundError:
            return None  # not committed yet (or still being written behind)
        if sealed is None or str(p) not in sealed:
            if p not in self._unsealed_warned:  # older log format, or max_lag changed since: cannot tell
                self._unsealed_warned.add(p)
                logger.warning("no seal for rollout folder %d in %s: late files there are not swept", p,
                               layout.batch_log_entry(at))  # fmt: skip
            return None
        self._seals[p] = frozenset(sealed[str(p)])
        return self._seals[p]
