"""Rollout pacing: whether a rollout worker should produce now, computed from what the run root says.

Pure functions, no I/O. A rollout from policy P is usable in batch slot T iff `0 <= (T-1) - P <= max_lag`
(`pipeline.store.staleness.lag`). A worker pauses while its policy would be stale for the next slot T = B + 1 (B = the
newest committed batch slot), and while the unconsumed rows usable by slot T or later already cover
`max_steps_ahead` batches (`count_unconsumed_rows`; with zero-variance filtering a file counts its rows with
signal, recorded as `signal_rows` in its ready marker, see `usable_rows`, and files without signal count once they
would let the BatchMaker fill a slot, see `fill_credit`; all of them once the run is saturated, see
`count_unconsumed_rows`).

In-flight claims (`pacing.count_claims`): a worker about to generate counts, on top of the committed rows, the rows
of other workers' standing claims (`claimed_rows`); if there is room it announces its own `Claim` (one empty object
under `pacing/claims/`, its fields in its name), reads the claims again and pauses, withdrawing it, if they now fill
the backlog. Workers that pass the committed-rows check at the same moment therefore do not all generate rows for
one slot, the extra rows going stale. A claim is withdrawn once its file is committed (its rows then count from
the file) and expires after `claim_ttl` (a SIGKILLed worker's), so no committed data depends on it.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.batch_maker.slot_metrics import fill_starts
from pipeline.config import TrainParams
from pipeline.store import layout, staleness
from pipeline.store.committed import StorageError
from pipeline.store.storage import RunStore
from schemas import RolloutRow

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PacingDecision:
    """Whether to produce now, and why not."""

    produce: bool
    reason: str
    next_slot: int
    slot_lag: int
    room: int = 0
    """When producing: rows still missing from the backlog (the next min(max_steps_ahead, slots left) slots' rows
    minus the unconsumed and claimed rows); a worker with `pacing.fit_room` generates no more prompts than cover
    it."""


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


def fill_credit(no_signal_rows: list[int], no_signal_fill_after: int, batch_size: int = 0) -> int:
    """Rows a BatchMaker can still admit by filling from files without signal (rows of each, in reading order):
    the first ones only start the fill (0 rows: `no_signal_fill_after` files, or as few as hold `batch_size` rows,
    `pipeline.batch_maker.slot_metrics.fill_starts`; `batch_size` 0: by files only), every later one is admitted
    whole. Assumes the files without signal come last (pessimistic: a fill started earlier admits more); 0 never
    fills."""
    credit = files = rows = 0
    for n in no_signal_rows:
        if fill_starts(files, rows, batch_size, no_signal_fill_after):
            credit += n
        else:
            files, rows = files + 1, rows + n
    return credit


def count_unconsumed_rows(
    files: dict[str, tuple[int, int, float]],
    entry: dict[str, Any] | None,
    last_slot: int,
    max_lag: int,
    batch_size: int,
    *,
    no_signal: dict[str, int] | None = None,
    no_signal_fill_after: int = 0,
    saturated: bool = False,
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
    add `fill_credit` with `no_signal_fill_after`, or all their rows when the run is `saturated` (slot B's entry says
    the BatchMaker fills slot B+1 from its first file: `pipeline.batch_maker.slot_metrics.fills_at_once`).
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
    credit = sum(zero) if saturated else fill_credit(zero, no_signal_fill_after, batch_size)
    return live + sum(usable[path][1] for path in fresh) + credit


def pacing_decision(
    *,
    policy_step: int,
    last_slot: int,
    unconsumed_rows: int,
    max_lag: int,
    batch_size: int,
    max_steps_ahead: int,
    claimed_rows: int = 0,
    num_train_steps: int | None = None,
) -> PacingDecision:
    """Produce iff rollouts from `policy_step` are usable by the next slot and we are not too far ahead.

    next slot T = last_slot + 1. Pause "finished" when T > `num_train_steps` (every slot of the run is committed:
    no row generated now can be trained); pause "stale" when (T-1) - P > max_lag; pause "ahead" when
    unconsumed_rows + claimed_rows >= the rows of the next min(max_steps_ahead, slots left) slots (batch_size
    each; `claimed_rows`: rows other workers are generating now, from their standing claims). Producing, `room`
    is the rows still missing.
    """
    nxt = last_slot + 1
    lag = staleness.lag(nxt, policy_step)
    if num_train_steps is not None and nxt > num_train_steps:
        return PacingDecision(
            False,
            f"finished: every batch slot of the run (train.num_train_steps={num_train_steps}) is committed; "
            "waiting for the learner's last policy",
            nxt,
            lag,
        )
    if lag > max_lag:
        return PacingDecision(
            False,
            f"stale: policy {policy_step} would have lag {lag} > max_lag={max_lag} in "
            f"slot {nxt}; waiting for a newer policy",
            nxt,
            lag,
        )
    slots_left = max_steps_ahead if num_train_steps is None else min(max_steps_ahead, num_train_steps - last_slot)
    limit = slots_left * batch_size
    if unconsumed_rows + claimed_rows >= limit:
        claimed = f" + {claimed_rows} being generated" if claimed_rows else ""
        return PacingDecision(
            False,
            f"ahead: ~{unconsumed_rows} unconsumed rows{claimed} >= the next {slots_left} slot(s)' rows ({limit})",
            nxt,
            lag,
        )
    return PacingDecision(True, "ok", nxt, lag, room=limit - unconsumed_rows - claimed_rows)


class PacingView:
    """What pacing reads from the run root, cached: ready markers (immutable, each read once) and the newest
    batch log entry."""

    def __init__(self, store: RunStore, train: TrainParams) -> None:
        self.store = store
        self.train = train
        self.markers: dict[str, tuple[int, int, float]] = {}
        self.no_signal: dict[str, int] = {}
        """Committed files without signal rows -> their rows (with zero-variance filtering)."""
        self.signal: dict[str, tuple[int, int]] = {}
        """Committed files -> (rows, rows with signal), for markers that record `signal_rows` (zero-variance
        filtering)."""
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
        if self.train.filter_zero_variance and rec.signal_rows is not None:
            self.signal[layout.data_of_marker(marker)] = (rec.rows, rec.signal_rows)
        return (p, n, rec.time)

    def signal_fraction(self, paths: Iterable[str]) -> float:
        """`signal_fraction` of the committed files `paths` (those whose markers record signal rows); 1.0 without
        zero-variance filtering."""
        return signal_fraction(self.signal[p] for p in paths if p in self.signal)

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


# -- in-flight claims ------------------------------------------------------------------------------------------

CLAIMS_DIR = layout.PACING_CLAIMS
"""Run-root folder of the in-flight claims: one empty object per worker generating now, its fields in its name."""
CLAIM_MIN_TTL_S = 30.0
"""A claim lives at least this long (a first claim, before the worker has timed a generation, lives
`CLAIM_FIRST_TTL_S`)."""
CLAIM_FIRST_TTL_S = 120.0
CLAIM_TTL_FACTOR = 3.0
"""A claim expires after this many times the worker's last generate-and-commit cycle (at least `CLAIM_MIN_TTL_S`,
at most the generation and write timeouts): a SIGKILLed worker's claim stops holding others back that soon."""
_SEP = "+"


@dataclass(frozen=True, order=True)
class Claim:
    """A worker's announcement that it is generating `rows` rows from policy `policy_step` now, to be committed as
    its rollout file number `seq`; ordered by (time, worker) so that every reader agrees who claimed first.

    Stored as the empty object `pacing/claims/<worker>+<seq>+<policy_step>+<rows>+<time ms>+<expires ms>`: one
    listing of the folder reads every claim (no object reads), O(workers) names."""

    time: float
    worker: str
    seq: int
    policy_step: int
    rows: int
    expires_at: float

    @property
    def name(self) -> str:
        """The object name that stores this claim."""
        parts = (
            self.worker,
            self.seq,
            self.policy_step,
            self.rows,
            round(self.time * 1000),
            round(self.expires_at * 1000),
        )
        return _SEP.join(str(p) for p in parts)

    @staticmethod
    def parse(name: str) -> Claim | None:
        """The claim an object name stores (None: not a claim name)."""
        parts = name.rsplit("/", 1)[-1].rsplit(_SEP, 5)
        if len(parts) != 6:
            return None
        try:
            seq, policy, rows, t_ms, exp_ms = (int(x) for x in parts[1:])
        except ValueError:
            return None
        return Claim(t_ms / 1000.0, parts[0], seq, policy, rows, exp_ms / 1000.0)


def standing_claims(
    claims: Sequence[Claim], *, now: float, oldest_usable: int, committed: Container[str], exclude: str = ""
) -> list[Claim]:
    """The claims that still count: not expired (`expires_at > now`), from a policy usable by the next slot
    (`>= oldest_usable`), whose rollout file is not committed yet (then its rows are counted from the file), and
    not `exclude`'s (the asking worker's own)."""
    out = []
    for c in claims:
        if c.worker == exclude or c.expires_at <= now or c.policy_step < oldest_usable:
            continue
        if layout.rollout_file(c.policy_step, c.worker, c.seq) in committed:
            continue
        out.append(c)
    return out


def claimed_rows(claims: Sequence[Claim]) -> int:
    """Rows of the standing `claims` of other workers: counted on top of the committed rows, before announcing and
    again after. Every claim seen counts, whatever its time: a claim's time is taken before its object is written,
    so of two workers announcing together, the one with the earlier time may be the only one to see the other's
    claim; yielding to every claim seen makes at least one of them pause (both, if both see each other: they
    retry after a random part of a poll interval, `ClaimBoard.collision_pause_s`)."""
    return sum(c.rows for c in claims)


MIN_SIGNAL_FRACTION = 0.1
"""The smallest share of rows with signal `rows_for_room` assumes (a run whose files have less is near saturation,
where the BatchMaker's fill counts the rest, `fill_credit`); bounds the overshoot of one file."""


def signal_fraction(counts: Iterable[tuple[int, int]]) -> float:
    """The share of rows with signal over committed files' (rows, signal rows), e.g. the recent files' ready markers
    with zero-variance filtering; 1.0 when they hold no rows (nothing known yet: every row is assumed to count)."""
    rows = signal = 0
    for n, s in counts:
        rows += n
        signal += s
    return signal / rows if rows > 0 else 1.0


def rows_for_room(room: int, fraction: float) -> int:
    """Rows to generate so that about `room` of them carry signal, given the recent `signal_fraction`
    (at least `MIN_SIGNAL_FRACTION`): with zero-variance filtering the backlog counts rows with signal only, so a file
    of `room` rows would cover a `fraction` of it, the next one a `fraction` of the rest, and so on: ever smaller
    files (down to one group), each a full generate-and-commit cycle, and tiny files without any signal that push
    the BatchMaker into its no-signal fill. As the dynamic sampling of DAPO (Yu et al. 2025, arXiv:2503.14476),
    which oversamples by the expected share of groups with signal, and sized to the backlog."""
    return math.ceil(room / max(fraction, MIN_SIGNAL_FRACTION))


def prompts_for_room(room: int, n_prompts: int, n_generations: int) -> int:
    """Prompts to generate for `room` missing rows: enough groups to cover it (ceil(room / n_generations)), at least
    1, at most the lesson's `n_prompts`. A full file for a backlog short of a few rows would leave most of its rows
    unconsumed until they go stale (files of one batch each, with a zero-advantage row or two missing, made
    half of the demo's remaining waste)."""
    return max(1, min(n_prompts, -(-room // max(1, n_generations))))


def claim_ttl(last_cycle_s: float | None, timeout_s: float) -> float:
    """Seconds a new claim lives: `CLAIM_TTL_FACTOR` × the last generate-and-commit cycle, at least
    `CLAIM_MIN_TTL_S` (`CLAIM_FIRST_TTL_S` before any cycle), at most `timeout_s` (generation + write timeouts)."""
    ttl = CLAIM_FIRST_TTL_S if last_cycle_s is None else max(CLAIM_MIN_TTL_S, CLAIM_TTL_FACTOR * last_cycle_s)
    return min(ttl, timeout_s)


class ClaimBoard:
    """One worker's view of `pacing/claims/`: read every claim (one listing), announce its own, withdraw it.

    Crash-safe: a claim is only a hint to other workers' pacing; a SIGKILLed worker's claim expires (and is then
    deleted by whichever worker lists it), and no committed data depends on it."""

    def __init__(self, store: RunStore, worker: str) -> None:
        self.store = store
        self.worker = worker
        self.mine: Claim | None = None
        self._jitter = random.Random(worker)

    def read(self, now: float) -> list[Claim]:
        """Every claim in the folder; expired ones of other workers are deleted on the way (best effort)."""
        out = []
        for path in self.store.list(CLAIMS_DIR):
            c = Claim.parse(path)
            if c is None:
                continue
            if c.expires_at <= now and c != self.mine:
                try:
                    self.store.delete(path)
                except (OSError, StorageError) as e:  # another worker deleted it first, or a storage hiccup
                    logger.debug("pacing: could not delete expired claim %s (%s)", path, e)
                continue
            out.append(c)
        return out

    def announce(self, seq: int, policy_step: int, rows: int, ttl_s: float, now: float) -> Claim:
        """Write this worker's claim (replacing its previous one)."""
        self.withdraw()
        claim = Claim(now, self.worker, seq, policy_step, rows, now + ttl_s)
        self.store.put_unique(f"{CLAIMS_DIR}/{claim.name}", b"")
        self.mine = claim
        return claim

    def collision_pause_s(self, interval_s: float) -> float:
        """A random part of `interval_s` to wait after withdrawing a claim because of another one announced at the
        same moment: workers woken by the same commit would otherwise collide again and again."""
        return self._jitter.uniform(0.0, interval_s)

    def withdraw(self) -> None:
        """Delete this worker's claim, if any (after its file is committed, or when it will not generate)."""
        if self.mine is not None:
            self.store.delete(f"{CLAIMS_DIR}/{self.mine.name}")
            self.mine = None
