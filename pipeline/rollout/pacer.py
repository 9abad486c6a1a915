"""The rollout worker's pacer: the stateful part of pacing. It reads the backlog and the BatchMaker's progress,
decides whether the worker produces now (the pure rules are in `pipeline.rollout.pacing`), announces and withdraws
the worker's claim, waits out pauses (letting one write through a stalled BatchMaker) and logs `pause` records.
The worker's loop (`pipeline.rollout.worker`) composes it with its `PolicyFollower` (`pipeline.rollout.follower`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pipeline.batch_maker.slot_metrics import fills_at_once
from pipeline.config import RolloutStepConfig
from pipeline.process.backoff import Backoff
from pipeline.rollout.pacing import (
    ClaimBoard,
    PacingDecision,
    PacingView,
    claim_ttl,
    claimed_rows,
    count_unconsumed_rows,
    pacing_decision,
    prompts_for_room,
    rows_for_room,
    standing_claims,
)
from pipeline.store import run_state, staleness
from pipeline.store.notify import Waker
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import MetricsWriter

logger = logging.getLogger(__name__)

PAUSE_RECORD_S = 2.0
"""A paused worker logs a `pause` metrics record (`paused_s`, `reason`: ahead, stale or finished) per this many
seconds of pausing, and one when a run of pauses ends: the job runner's elastic pool reads them
(`pipeline.jobs.pool`)."""


class Pacer:
    """Decides, for the worker named `name`, whether to produce now, and pauses it when not.

    The worker hands in what pacing needs of it: `latest_policy()` (the newest committed policy it would use),
    `warm_up()` (idle work while paused; True if it did some), `stop(reason)` (a scheduled worker with nothing to
    do stops), its `stop_event` (ends a collision pause early) and its `waker` (a change under the run root ends
    a pause). `stall_grace_s`: see `paused`.
    """

    def __init__(
        self,
        config: RolloutStepConfig,
        store: RunStore,
        name: str,
        *,
        stop_event: threading.Event,
        stop: Callable[[str], None],
        waker: Waker,
        metrics: MetricsWriter,
        latest_policy: Callable[[], int | None],
        warm_up: Callable[[], bool],
        stall_grace_s: float | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.name = name
        self.metrics = metrics
        self._stop_event = stop_event
        self._stop = stop
        self._waker = waker
        self._latest_policy = latest_policy
        self._warm_up = warm_up
        self._view = PacingView(store, config.train)
        self._claims = ClaimBoard(store, name)
        """This worker's in-flight claim (`pipeline.rollout.pacing`): others count its rows while it generates."""
        self.stall_grace_s = stall_grace_s if stall_grace_s is not None else max(2.0, 25 * config.polling.interval_s)
        self.last_cycle_s: float | None = None
        """Seconds the worker's last production cycle took (the TTL of its next claim)."""
        self.room: int | None = None
        """Rows to generate for what the backlog still missed at the last pacing check that let this worker produce
        (`pacing.fit_room`; with zero-variance filtering, scaled up by the recent share of rows with signal,
        `rows_for_room`)."""
        self.pause_s = 0.0
        """Seconds paused since the worker's last write record (it resets this)."""
        self._unreported_pause: tuple[float, str] = (0.0, "")
        """Pause seconds not yet in a `pause` record, and the kind of the pause (see `PAUSE_RECORD_S`)."""
        self._paused_since: float | None = None
        """When the current run of pacing pauses began (None: producing)."""
        self._progress: tuple[int, int | None, float] = (0, None, time.monotonic())
        """(newest batch slot, newest policy, when either last changed): the stall clock of `paused`."""
        self._backoff = Backoff(config.polling.interval_s)
        self._slot_floor = 0
        self._mark = 0
        self._saturated = False
        """Whether the newest batch log entry says the next slot fills at once (`fills_at_once`), at the last
        `pace`."""

    def last_batch_slot(self) -> int:
        """The newest committed batch slot."""
        # batch slots are never uncommitted: list only the log entries after the newest one seen (O(new slots))
        self._slot_floor = run_state.newest_slot_after(self.store, self._slot_floor)
        return self._slot_floor

    def reset_progress(self) -> None:
        """Start the stall clock now, at the run root's current slot and policy."""
        self._progress = (self.last_batch_slot(), self._latest_policy(), time.monotonic())

    def mark(self) -> None:
        """Remember the run root's state before the worker reads it: a change from now on ends a pause."""
        self._mark = self._waker.mark()

    def withdraw(self) -> None:
        """Withdraw this worker's claim (its rows were committed, or there is nothing to count)."""
        self._claims.withdraw()

    def pace(self, policy: int, seq: int) -> PacingDecision:
        """Decide whether to produce the worker's file number `seq` with policy `policy` now (see
        `pacing_decision`); with `pacing.count_claims`, announce its claim when it produces."""
        c = self.config
        last_slot = self.last_batch_slot()
        files = self._view.committed_rollouts(last_slot - c.train.max_lag, max(policy, last_slot))
        entry = self._view.log_entry(last_slot)
        t = c.train
        saturated = entry is not None and fills_at_once(
            entry.get("filled_no_signal"),
            bool(entry.get("no_signal_fill_from_start")),
            t.batch_size,
            filter_zero_variance=t.filter_zero_variance,
            no_signal_fill_after=t.no_signal_fill_after,
        )
        unconsumed = count_unconsumed_rows(
            files,
            entry,
            last_slot,
            c.train.max_lag,
            c.train.batch_size,
            no_signal=self._view.no_signal,
            no_signal_fill_after=c.train.no_signal_fill_after,
            saturated=saturated,
        )
        self._saturated = saturated
        decision = self._decision(policy, last_slot, unconsumed)
        if decision.produce and c.pacing.count_claims:
            decision = self._claim(policy, last_slot, unconsumed, files, seq)
        self.room = self._rows_for(decision.room, files) if decision.produce and c.pacing.fit_room else None
        return decision

    def _rows_for(self, room: int, files: dict[str, Any]) -> int:
        """Rows to generate for `room` missing rows: `rows_for_room` at the signal fraction of the recent `files`;
        `room` itself while the run is saturated (the BatchMaker admits the next slot's rows without signal from its
        first file on, so rows sampled to find signal would only be dropped)."""
        if self._saturated:
            return room
        return rows_for_room(room, self._view.signal_fraction(files))

    def _decision(self, policy: int, last_slot: int, unconsumed: int, claimed: int = 0) -> PacingDecision:
        """`pacing_decision` with this worker's settings (`claimed`: rows other workers are generating now)."""
        c = self.config
        return pacing_decision(
            policy_step=policy,
            last_slot=last_slot,
            unconsumed_rows=unconsumed,
            max_lag=c.train.max_lag,
            batch_size=c.train.batch_size,
            max_steps_ahead=c.pacing.max_steps_ahead,
            claimed_rows=claimed,
            num_train_steps=c.train.num_train_steps,
        )

    def _claim(self, policy: int, last_slot: int, unconsumed: int, files: dict[str, Any], seq: int) -> PacingDecision:
        """Pacing with the rows other workers are generating now: pause if their standing claims fill the backlog;
        else announce this worker's claim, read the claims again and pause (withdrawing it, after a random part of
        a poll interval) if the claims now seen fill it (`claimed_rows`), so that workers passing the check together
        do not all generate."""
        c = self.config
        sp = c.curriculum.default_sampling
        lo = staleness.oldest_allowed_policy(last_slot + 1, c.train.max_lag)

        def standing() -> list[Any]:
            now = time.time()
            return standing_claims(
                self._claims.read(now), now=now, oldest_usable=lo, committed=files, exclude=self.name
            )

        decision = self._decision(policy, last_slot, unconsumed, claimed_rows(standing()))
        if not decision.produce:
            return decision
        ttl = claim_ttl(self.last_cycle_s, c.generation_timeout_s + c.write_timeout_s)
        prompts = prompts_for_room(self._rows_for(decision.room, files), sp.n_prompts, sp.n_generations_per_prompt)
        if not c.pacing.fit_room:
            prompts = sp.n_prompts
        self._claims.announce(seq, policy, prompts * sp.n_generations_per_prompt, ttl, time.time())
        decision = self._decision(policy, last_slot, unconsumed, claimed_rows(standing()))
        if not decision.produce:
            self._claims.withdraw()
            self._stop_event.wait(self._claims.collision_pause_s(c.polling.interval_s))
        return decision

    def paused(self, decision: PacingDecision) -> bool:
        """Wait one poll interval when pacing says pause; True if it did.

        A pause "ahead" that saw no batch/policy progress for `stall_grace_s`, while the BatchMaker could be
        filling the next slot, lets one write through (a safety net should the BatchMaker need more rows than
        counted), so pacing can never deadlock the run; while the BatchMaker waits for the learner
        (`train.max_batches_ahead`) no write is let through, since its rows could only go stale.
        """
        state = (self.last_batch_slot(), self._latest_policy())
        if state != self._progress[:2] or self._batchmaker_waits_for_learner(*state):
            # a BatchMaker held back by max_batches_ahead waits for the learner, not for rows: more rows
            # would only go stale, so the stall clock runs only while it could be filling the next slot
            self._progress = (*state, time.monotonic())
        if decision.produce:
            self._backoff.reset()
            self._paused_since = None
            self._report_pause(0.0, "", end=True)
            return False
        stalled = time.monotonic() - self._progress[2]
        if self._paused_since is None:
            self._paused_since = time.monotonic()
        paused = time.monotonic() - self._paused_since
        # the stall clock runs only while paused: the time this worker spent generating its last file (a first
        # generation compiles for seconds) is no stall, and letting a write through then only makes stale rows
        stalled = min(stalled, paused)
        if not self.config.follow and decision.reason.startswith("finished"):  # scheduled: nothing left, ever
            self._stop(f"nothing more to do: {decision.reason}")
            return True
        if not self.config.follow and paused >= self.config.polling.bounded_wait_s:  # scheduled: nothing to do now
            self._stop(f"nothing more to do: paused by pacing for {paused:.0f}s ({decision.reason})")
            return True
        if not (decision.reason.startswith("ahead") and stalled >= self.stall_grace_s):
            logger.debug("pausing: %s", decision.reason)
            t0 = time.monotonic()
            # idle time compiles a sampler shape a later file may need (then pacing is checked again at once)
            if self._warm_up() or self._waker.sleep(self._backoff.next(self._waker.event_driven), self._mark):
                self._backoff.reset()
            self.pause_s += time.monotonic() - t0
            self._report_pause(time.monotonic() - t0, decision.reason)
            return True
        logger.info(
            "pacing: no batch/policy progress for %.1fs while paused (%s); producing one write anyway",
            stalled,
            decision.reason,
        )
        self._progress = (*state, time.monotonic())
        return False

    def _report_pause(self, dt: float, reason: str, *, end: bool = False) -> None:
        """Count `dt` more seconds paused for `reason`; log a `pause` record of the seconds not yet logged once
        they reach `PAUSE_RECORD_S`, or at the `end` of a run of pauses."""
        unreported, kind = self._unreported_pause
        unreported += dt
        kind = reason.split(":", 1)[0] if reason else kind
        if unreported > 0 and (end or unreported >= PAUSE_RECORD_S):
            self.metrics.log({"event": "pause", "reason": kind, "paused_s": unreported})
            unreported = 0.0
        self._unreported_pause = (unreported, kind)

    def _batchmaker_waits_for_learner(self, last_slot: int, latest_policy: int | None) -> bool:
        """True while the BatchMaker may not write the next slot yet (slot B+1 > newest policy +
        `train.max_batches_ahead`): it is waiting for the learner, whatever rows are committed."""
        newest = -1 if latest_policy is None else latest_policy
        return last_slot + 1 > newest + self.config.train.max_batches_ahead
