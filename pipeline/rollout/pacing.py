"""Rollout pacing: whether a rollout worker should produce now, computed from what the run root says.

Pure functions, no I/O. A rollout from policy P is usable in batch slot T iff `0 <= (T-1) - P <= max_lag`
(`pipeline.store.staleness.lag`). A worker pauses while its policy would be stale for the next slot T = B + 1 (B = the
newest committed batch slot), and while the unconsumed rows usable by slot T or later already cover
`max_steps_ahead` batches (`count_unconsumed_rows`; with zero-variance filtering a file counts its rows with
signal, recorded as `signal_rows` in its ready marker, see `usable_rows`, and files without signal count once they
would let the BatchMaker fill a slot, see `fill_credit`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.config import TrainParams
from pipeline.store import layout, staleness
from pipeline.store.committed import StorageError
from schemas import RolloutRow

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PacingDecision:
    """Whether to produce now, and why not."""

    produce: bool
    reason: str
    next_slot: int
    slot_lag: int


def estimate_unconsumed_rows(rows_by_policy: dict[int, int], last_slot: int, max_lag: int, batch_size: int) -> int:
    """Rows still usable by slot B+1 or later, estimated from committed row counts.

    usable = Σ rows of policies P >= B - max_lag (those with lag <= max_lag in slot B+1);
    consumed ≈ batch_size × #{committed slots T <= B that could hold them} = batch_size × min(max_lag, B);
    estimate = max(0, usable - consumed). Rows of policies P >= B cannot be in any committed slot (a slot
    T holds P <= T - 1), so the estimate never falls below their count.
    """
    lo = staleness.oldest_allowed_policy(last_slot + 1, max_lag)  # usable by the next slot B+1
    usable = sum(n for p, n in rows_by_policy.items() if p >= lo)
    fresh = sum(n for p, n in rows_by_policy.items() if p >= last_slot)
    consumed = batch_size * min(max_lag, last_slot)
    return max(fresh, usable - consumed, 0)


def signal_rows(rows: Sequence[RolloutRow]) -> int:
    """Rows with a learning signal: in a group (group_key, policy_step) whose episode rewards are not all equal,
    and with a reward other than the group's mean (its advantage, leave-one-out or mean-centred, is then not 0).
    What a BatchMaker that filters zero-variance groups and zero-advantage rows can admit; counting a row whose
    advantage is exactly 0 would let pacing wait for rows that never come."""
    rewards: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        rewards.setdefault((r.group_key, r.policy_step), []).append(r.episode_reward)
    n = 0
    for v in rewards.values():
        if max(v) > min(v):
            mean = sum(v) / len(v)
            tol = 1e-9 * max(1.0, max(abs(x) for x in v))
            n += sum(1 for x in v if abs(x - mean) > tol)
    return n


def usable_rows(rows: int, signal: int | None, *, filter_zero_variance: bool, no_signal_fill_after: int) -> int:
    """Rows of one committed file that count toward pacing on their own.

    Without zero-variance filtering (or for a marker without `signal_rows`): every row. With it: the signal rows
    only. The other rows are admitted only while the BatchMaker fills a slot, which starts after
    `no_signal_fill_after` files without any signal: `count_unconsumed_rows` credits those from the files without
    signal it is given (`no_signal`), since the fill depends on how many there are, not on one file.
    """
    if not filter_zero_variance or signal is None:
        return rows
    return signal


def fill_credit(no_signal_rows: list[int], no_signal_fill_after: int) -> int:
    """Rows a BatchMaker can still admit by filling from files without signal (rows of each, in reading order):
    the first `no_signal_fill_after` of them only start the fill (0 rows), every later one is admitted whole.
    Assumes the files without signal come last (pessimistic: a fill started earlier admits more); 0 never fills."""
    if no_signal_fill_after <= 0:
        return 0
    return sum(no_signal_rows[no_signal_fill_after:])


def count_unconsumed_rows(
    files: dict[str, tuple[int, int, float]],
    entry: dict[str, Any] | None,
    last_slot: int,
    max_lag: int,
    batch_size: int,
    *,
    no_signal: dict[str, int] | None = None,
    no_signal_fill_after: int = 0,
) -> int:
    """Rollout rows usable by slot B+1 or later (policies P >= B - max_lag) that no committed slot consumed.

    `files`: committed rollout files (all workers) of policies >= B - max_lag, as path -> (policy step, rows,
    marker time); `entry`: the batch log entry of slot B (None when B = 0). In order of precision:
    - the entry holds the BatchMaker's `cursor` (the BatchMaker's log entry): exact, the live reservoir rows of usable
      policies plus the rows of committed files it has not seen yet;
    - the entry holds its commit `time`: rows of files committed after it, plus rows of policies >= B
      (which no slot <= B can hold);
    - otherwise `estimate_unconsumed_rows`.
    `no_signal` (path -> rows) names the files without any signal (zero-variance filtering): the unconsumed ones
    add `fill_credit` with `no_signal_fill_after`.
    """
    lo = staleness.oldest_allowed_policy(last_slot + 1, max_lag)  # usable by the next slot B+1
    usable = {path: v for path, v in files.items() if v[0] >= lo}
    live = 0
    if entry is None:
        fresh = list(usable)
    elif isinstance(cursor := entry.get("cursor"), dict) and isinstance(cursor.get("reservoir"), dict):
        seen = set(cursor.get("seen") or [])
        live = sum(
            len(f.get("rows") or [])
            for f in cursor["reservoir"].get("files", [])
            if int(f.get("policy_step", -1)) >= lo
        )
        fresh = [path for path in usable if path not in seen]
    elif isinstance(entry.get("time"), int | float):
        t = float(entry["time"])
        fresh = [path for path, (p, _, mt) in usable.items() if mt > t or p >= last_slot]
    else:
        by_policy: dict[int, int] = {}
        for p, n, _ in usable.values():
            by_policy[p] = by_policy.get(p, 0) + n
        return estimate_unconsumed_rows(by_policy, last_slot, max_lag, batch_size)
    zero = [no_signal[path] for path in sorted(fresh) if no_signal and path in no_signal]
    return live + sum(usable[path][1] for path in fresh) + fill_credit(zero, no_signal_fill_after)


def pacing_decision(
    *,
    policy_step: int,
    last_slot: int,
    unconsumed_rows: int,
    max_lag: int,
    batch_size: int,
    max_steps_ahead: int,
) -> PacingDecision:
    """Produce iff rollouts from `policy_step` are usable by the next slot and we are not too far ahead.

    next slot T = last_slot + 1. Pause "stale" when (T-1) - P > max_lag; pause "ahead" when
    unconsumed_rows >= max_steps_ahead × batch_size.
    """
    nxt = last_slot + 1
    lag = staleness.lag(nxt, policy_step)
    if lag > max_lag:
        return PacingDecision(
            False,
            f"stale: policy {policy_step} would have lag {lag} > max_lag={max_lag} in "
            f"slot {nxt}; waiting for a newer policy",
            nxt,
            lag,
        )
    limit = max_steps_ahead * batch_size
    if unconsumed_rows >= limit:
        return PacingDecision(
            False, f"ahead: ~{unconsumed_rows} unconsumed rows >= max_steps_ahead×batch_size={limit}", nxt, lag
        )
    return PacingDecision(True, "ok", nxt, lag)


class PacingView:
    """What pacing reads from the run root, cached: ready markers (immutable, each read once) and the newest
    batch log entry."""

    def __init__(self, store: Any, train: TrainParams) -> None:
        self.store = store
        self.train = train
        self.markers: dict[str, tuple[int, int, float]] = {}
        self.no_signal: dict[str, int] = {}
        """Committed files without signal rows -> their rows (with zero-variance filtering)."""
        self._entry_cache: tuple[int, dict[str, Any] | None] = (-1, None)

    def committed_rollouts(self, lo: int, hi: int) -> dict[str, tuple[int, int, float]]:
        """Committed rollout files (all workers) of policies in [lo, hi]: path -> (policy, rows, marker time).

        rows: what the file can contribute to batches (`usable_rows`).
        """
        out: dict[str, tuple[int, int, float]] = {}
        for p in range(max(lo, 0), hi + 1):
            for marker in self.store.list(layout.rollout_step_dir(p)):
                if not marker.endswith(layout.READY_SUFFIX):
                    continue
                if marker not in self.markers:
                    self.markers[marker] = self._read(marker, p)
                out[layout.data_of_marker(marker)] = self.markers[marker]
        return out

    def _read(self, marker: str, p: int) -> tuple[int, int, float]:
        try:
            rec = self.store.read_marker(layout.data_of_marker(marker))
        except (FileNotFoundError, StorageError) as e:
            logger.warning("pacing: unreadable marker %s (%s); counted as 0 rows", marker, e)
            return (p, 0, 0.0)
        n = usable_rows(
            rec.rows,
            rec.signal_rows,
            filter_zero_variance=self.train.filter_zero_variance,
            no_signal_fill_after=self.train.no_signal_fill_after,
        )
        if self.train.filter_zero_variance and rec.signal_rows == 0:
            self.no_signal[layout.data_of_marker(marker)] = rec.rows
        return (p, n, rec.time)

    def log_entry(self, slot: int) -> dict[str, Any] | None:
        """The batch log entry of `slot` (None for slot 0 or an unreadable entry); cached for the newest slot."""
        if slot <= 0:
            return None
        if self._entry_cache[0] != slot:
            try:
                entry: dict[str, Any] | None = self.store.read_log_entry(slot).to_dict()
            except (FileNotFoundError, ValueError, StorageError) as e:
                logger.warning("pacing: cannot read %s (%s)", layout.batch_log_entry(slot), e)
                entry = None
            self._entry_cache = (slot, entry)
        return self._entry_cache[1]
