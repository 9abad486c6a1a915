"""The rollout worker: polls for policies, asks a `RolloutManager` for rollouts, commits them, paces itself.

What it reads and writes under the run root, its phases and its file-name rules are those of the rollout program
(`python -m steps.rollout`, whose module docstring states them); every metric it logs is defined in `METRICS`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from pipeline.batch_maker.slot_metrics import fills_at_once
from pipeline.config import RolloutStepConfig
from pipeline.curriculum import load_latest_curriculum, sample_lesson, sampling_weights
from pipeline.environments.base import PromptSkip
from pipeline.environments.tokenizer import check_chat_lessons, load_tokenizer
from pipeline.jobs.step_logs import run_root_of, server_log
from pipeline.process.backoff import Backoff
from pipeline.process.exits import DamagedInputError, Exit, NoProgressError
from pipeline.process.step_kind import StepKind
from pipeline.process.watchdog import watchdog
from pipeline.rollout.pacing import (
    ClaimBoard,
    PacingDecision,
    PacingView,
    claim_ttl,
    claimed_rows,
    count_unconsumed_rows,
    pacing_decision,
    prompts_for_room,
    signal_rows,
    standing_claims,
)
from pipeline.rollout.rollout_batch import RolloutBatch, batch_stats
from pipeline.rollout.samples import samples_record, to_samples
from pipeline.rollout.worker_records import METRICS, WorkerSummary, incarnation_nonce, write_record  # noqa: F401
from pipeline.store import layout, run_state, staleness
from pipeline.store.notify import waker_for
from pipeline.store.poll import WaitTimeout, poll_until
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import MetricsWriter
from schemas import ROLLOUT

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicyRuntime:
    """What the worker asks of the JAX library, handed in by the rollout program
    (`policy.rollout_manager.policy_runtime(config, tokenizer)`), so this loop imports no JAX."""

    manages_weights: bool
    """The configured backend loads committed policies itself (a server): the worker never loads weights."""
    build_manager: Callable[[Any], Any]
    """model (None when the backend manages weights) -> the `RolloutManager` the worker samples with."""
    load_model: Callable[[RunStore, int], Any]
    """(store, committed policy step) -> its policy model."""
    publish_hf: Callable[[RunStore, int], Any]
    """(store, step) -> write `policies/step-S/hf/` when the backend's server needs it (a no-op otherwise)."""


NO_PROGRESS_AFTER = 20
PAUSE_RECORD_S = 2.0
"""A paused worker logs a `pause` metrics record (`paused_s`, `reason`: ahead or stale) per this many seconds of
pausing, and one when a run of pauses ends: the job runner's elastic pool reads them (`pipeline.jobs.pool`)."""
"""Consecutive sampling calls that generate nothing, every example failing with the same error type, after which a
worker stops with NoProgressError (exit 9, never restarted) instead of spinning: each call already re-draws a
failed example `max_example_retries` times."""


_ERROR_TYPE = re.compile(r"\b([A-Z]\w*(?:Error|Exception))\b")


def failure_kind(reason: str) -> str:
    """The error type a failure reason names (`generation error: PromptTooLongError('prompt 0 …')` ->
    `PromptTooLongError`), else its text up to the first `(` or `:`."""
    match = _ERROR_TYPE.search(str(reason))
    if match:
        return match.group(1)
    head = str(reason).split("(", 1)[0].split(":", 1)[0].strip()
    return re.sub(r"\d+", "#", head) or "<no reason>"  # "prompt has 9 tokens > …" and "… 12 tokens …": one kind


class RolloutWorker:
    """Polls for policies, asks the manager for rollouts, commits them, logs metrics, paces itself.

    `runtime` gives what the JAX library builds (the manager, policy models, HF folders); `store`, `tokenizer`,
    `manager` and `load_model` can be injected instead (tests). `load_model(step)` returns the policy model of a
    committed step.
    """

    def __init__(
        self,
        config: RolloutStepConfig,
        *,
        runtime: PolicyRuntime | None = None,
        store: RunStore | None = None,
        tokenizer: Any = None,
        manager: Any = None,
        load_model: Callable[[int], Any] | None = None,
        stall_grace_s: float | None = None,
    ) -> None:
        self.config = config
        self.store = store or RunStore(config.store.run_root, config.store.storage_options)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model.tokenizer)
        check_chat_lessons(config.curriculum.lessons, self.tokenizer, config.model.tokenizer)  # before waiting
        self._samples_step: int | None = None  # policy step of the last samples record
        self.worker_id = config.worker_id
        self.name = layout.check_component(f"{config.worker_id}.{incarnation_nonce()}", "worker name")
        self.metrics = MetricsWriter(self.store, StepKind.ROLLOUT, self.worker_id)
        self._manager = manager
        self._runtime = runtime
        self._server_log: Any = None  # a pipeline.jobs.step_logs.StepLog once a child server is attached
        self._load_model_fn = load_model
        self._stop = threading.Event()
        self._stop_reason = ""
        self._seq = 0
        self._rng = np.random.default_rng([config.seed, int(time.time_ns() % (1 << 62))])
        self._current_step: int | None = None
        self._view = PacingView(self.store, self.config.train)
        self._claims = ClaimBoard(self.store, self.name)
        """This worker's in-flight claim (`pipeline.rollout.pacing`): others count its rows while it generates."""
        self._last_cycle_s: float | None = None
        self._room: int | None = None
        """Rows the backlog still missed at the last pacing check that let this worker produce (`pacing.fit_room`)."""
        self._stall_grace_s = stall_grace_s if stall_grace_s is not None else max(2.0, 25 * config.polling.interval_s)
        self._weight_load_s = 0.0
        self._pause_s = 0.0
        self._unreported_pause: tuple[float, str] = (0.0, "")
        """Pause seconds not yet in a `pause` record, and the kind of the pause (see `PAUSE_RECORD_S`)."""
        self._paused_since: float | None = None
        """When the current run of pacing pauses began (None: producing)."""
        self._progress: tuple[int, int | None, float] = (0, None, time.monotonic())
        self._noticed_at: dict[int, float] = {}
        self._damaged: dict[int, str] = {}
        """policy step -> why this worker set it aside (damaged on read; quarantined): never loaded again."""
        """policy step -> unix time this worker first saw it committed (recorded in its ready markers)."""
        self._waker = waker_for(self.store)
        self._mark = 0
        self._backoff = Backoff(config.polling.interval_s)
        self.summary = WorkerSummary()
        self._fruitless: tuple[str, str, int] | None = None
        """(failure kind, last reason, consecutive sampling calls) while every call fails the same way."""
        self._partial = bool(getattr(config.inference, "partial_rollouts", False))
        """Partial rollouts: a prefetch thread loads new policies and stages them into the running sampler."""
        self._staged: int | None = None
        """The newest policy step handed to the sampler (partial rollouts)."""
        self._prefetch: threading.Thread | None = None
        self._prefetch_error: BaseException | None = None

    # -- control ------------------------------------------------------------------------------------

    def stop(self, reason: str = "stop requested") -> None:
        """Ask the loop to end after the current phase (thread/signal safe)."""
        if not self._stop.is_set():
            self._stop_reason = reason
            self._stop.set()
            self._waker.poke()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: finish the current phase, then exit cleanly. A second signal exits at once
        (Exit.INTERRUPTED, 130)."""

        def handler(signum: int, _frame: Any) -> None:
            if self._stop.is_set():
                logger.error("second signal %d: exiting now", signum)
                os._exit(Exit.INTERRUPTED)
            logger.info("signal %d: stopping after the current phase", signum)
            self.stop(f"signal {signum}")

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)
            signal.signal(signal.SIGINT, handler)

    # -- reading the run root ----------------------------------------------------------------------

    def _latest_policy(self) -> int | None:
        """The newest committed policy this worker has not set aside as damaged (None: none yet)."""
        if not self._damaged:
            return run_state.latest_policy_step(self.store)
        for s in reversed(run_state.step_folders(self.store, layout.POLICIES)):
            if s not in self._damaged and self.store.exists(layout.policy_marker(s)):
                return s
        return None

    def _set_aside(self, step: int, error: DamagedInputError) -> None:
        """Quarantine damaged policy `step`'s file with the reason; this worker never loads it again."""
        self._damaged[step] = str(error)
        if not self.store.is_quarantined(error.path):
            self.store.quarantine(error.path, error.reason)

    def _newest_intact(self, step: int, load: Callable[[int], Any], floor: int | None = None) -> tuple[int, Any]:
        """`(s, load(s))` for the newest policy `s <= step` that loads, setting aside (quarantining) each damaged
        one on the way, one warning line each (the documented recovery, as the learner's checkpoint fallback).

        `(-1, None)` when every intact policy is `<= floor` (the worker keeps the one it holds); the last
        `DamagedInputError` (exit 7) when no intact policy is left at all.
        """
        while True:
            try:
                return step, load(step)
            except DamagedInputError as e:
                self._set_aside(step, e)
                older = self._latest_policy()
                if older is None or older >= step:
                    raise
                keep = floor is not None and older <= floor
                logger.warning(
                    "policy %d is damaged and set aside (%s); %s",
                    step,
                    e,
                    f"keeping policy {floor}" if keep else f"falling back to policy {older}",
                )
                if keep:
                    return -1, None
                step = older

    def _last_batch_slot(self) -> int:
        # batch slots are never uncommitted: list only the log entries after the newest one seen (O(new slots))
        self._slot_floor = run_state.newest_slot_after(self.store, getattr(self, "_slot_floor", 0))
        return self._slot_floor

    def _should_stop(self, started: float) -> bool:
        c = self.config
        if self._stop.is_set():
            return True
        if self.store.exists(layout.STOP_FILE):
            self.stop(f"{layout.STOP_FILE} exists")
        elif c.max_rollouts is not None and self.summary.rows >= c.max_rollouts:
            self.stop(f"max_rollouts={c.max_rollouts} reached")
        elif c.max_seconds is not None and time.monotonic() - started >= c.max_seconds:
            self.stop(f"max_seconds={c.max_seconds} reached")
        elif not c.follow and c.max_rollouts is None and c.max_seconds is None and self.summary.files:
            self.stop("one write done (not follow mode and no bounds)")
        elif (run_state.latest_policy_step(self.store) or -1) >= c.train.num_train_steps:
            self.stop(f"learner finished (policy {c.train.num_train_steps} published)")
        return self._stop.is_set()

    # -- phases -------------------------------------------------------------------------------------

    def _load_model(self, step: int) -> Any:
        if self._load_model_fn is not None:
            return self._load_model_fn(step)
        return self._require_runtime().load_model(self.store, step)

    def _require_runtime(self) -> PolicyRuntime:
        if self._runtime is None:
            raise RuntimeError("RolloutWorker needs a PolicyRuntime (or an injected manager and load_model)")
        return self._runtime

    def wait_for_policy(self) -> int:
        """Block until a committed policy exists; return the newest step.

        Raises `WaitTimeout` naming `policies/step-00000000/COMMITTED` after `wait_for_policy_timeout_s`, or
        when the worker is stopped while waiting (`run` then stops cleanly).
        """

        def check_stop() -> None:
            if self._stop.is_set():
                raise WaitTimeout("stopped while waiting for the first policy")

        c = self.config  # not follow mode (a scheduled job): a short wait (see `run`)
        wait_s, setting = (
            (c.wait_for_policy_timeout_s, "wait_for_policy_timeout_s")
            if c.follow or c.wait_for_policy_timeout_s <= c.polling.bounded_wait_s
            else (c.polling.bounded_wait_s, "polling.bounded_wait_s")
        )

        step, _ = poll_until(
            self._latest_policy,
            timeout_s=wait_s,
            what=f"{self.store.full_path(layout.policy_marker(0))} (or any policies/step-*/COMMITTED)",
            interval_s=self.config.polling.interval_s,
            setting=setting,
            on_wait=check_stop,
            waker=self._waker,
        )
        self._noticed_at.setdefault(step, time.time())
        return step

    def _load_step(self, step: int) -> Any:
        t0 = time.monotonic()
        with watchdog(f"weight load (policy {step})", self.config.weight_load_timeout_s):
            model = self._load_model(step)
        self._weight_load_s += time.monotonic() - t0
        logger.info("loaded policy %d in %.2fs", step, time.monotonic() - t0)
        return model

    def _serve_step(self, step: int) -> None:
        """Tell a weight-managing server to load committed policy `step` (HF folder first when it needs one)."""
        with watchdog(f"server load (policy {step})", self.config.weight_load_timeout_s):
            if self._runtime is not None:
                self._runtime.publish_hf(self.store, step)
            self._weight_load_s += self.manager.load_policy(step)

    def sync_weights(self) -> bool:
        """Load the newest committed policy if it is newer than the one held (never older). True if changed.

        Partial rollouts: the prefetch thread loads it (`_prefetch_loop`); this adopts the newest one it staged."""
        if self._partial:
            return self._adopt_staged()
        managed = self._manager is not None and self._manager.manages_weights
        if self._manager is not None and self._manager.external_weights and not managed:
            return False
        latest = self._latest_policy()
        if latest is None or (self._current_step is not None and latest <= self._current_step):
            if latest is not None and self._current_step is not None and latest < self._current_step:
                logger.warning(
                    "newest committed policy %d is older than held policy %d; keeping %d",
                    latest,
                    self._current_step,
                    self._current_step,
                )
            return False
        self._noticed_at.setdefault(latest, time.time())
        if managed:
            latest, _ = self._newest_intact(latest, self._serve_step, floor=self._current_step)
        else:
            latest, model = self._newest_intact(latest, self._load_step, floor=self._current_step)
        if latest < 0:  # the newer policies are damaged: keep the one held
            return False
        if not managed:
            t0 = time.monotonic()
            with watchdog(f"model update (policy {latest})", self.config.weight_load_timeout_s):
                self.manager.update_model(model)
            self._weight_load_s += time.monotonic() - t0
        old, self._current_step = self._current_step, latest
        self.metrics.log({"event": "weights", "from_step": old, "policy_step": latest})
        self.metrics.flush()  # once per policy: the previous policy's writes reach trackers by the next learner step
        return True

    # -- partial rollouts: the prefetch thread ---------------------------------------------------------

    def _prefetch_loop(self) -> None:
        """Until stopped: load each newer committed policy (setting damaged ones aside, as `sync_weights`) and
        stage it into the sampler, which swaps it in between decode steps of the running call; an error stops
        the loop and is raised by the main loop (`_adopt_staged`)."""
        try:
            while not self._stop.is_set():
                latest = self._latest_policy()
                if latest is not None and (self._staged is None or latest > self._staged):
                    self._noticed_at.setdefault(latest, time.time())
                    step, model = self._newest_intact(latest, self._load_step, floor=self._staged)
                    if step >= 0:
                        self.manager.stage_model(model, step)
                        self._staged = step
                        self._waker.poke()  # a paused main loop adopts it now
                self._stop.wait(self.config.polling.interval_s)
        except BaseException as e:  # raised on the main thread
            self._prefetch_error = e
            self._waker.poke()

    def _adopt_staged(self) -> bool:
        """The main loop's view of the prefetch thread: raise its error, else take the newest staged policy as the
        held one (pacing, metrics). True if it changed."""
        if self._prefetch_error is not None:
            raise self._prefetch_error
        staged = self._staged
        if staged is None or (self._current_step is not None and staged <= self._current_step):
            return False
        old, self._current_step = self._current_step, staged
        self.metrics.log({"event": "weights", "from_step": old, "policy_step": staged})
        self.metrics.flush()
        return True

    def _start_prefetch(self) -> None:
        if self._partial and self._prefetch is None and self._manager is not None:
            self._prefetch = threading.Thread(target=self._prefetch_loop, name="policy-prefetch", daemon=True)
            self._prefetch.start()

    @property
    def manager(self) -> Any:
        """The RolloutManager (built on first use from the config and the newest policy)."""
        if self._manager is None:
            raise RuntimeError("manager not started: call start() first")
        return self._manager

    def start(self) -> None:
        """Phase 1: wait for a policy, load it and build the manager (unless one was injected)."""
        if self._manager is not None and self._manager.external_weights and not self._manager.manages_weights:
            return
        step = self.wait_for_policy()
        model: Any = None
        managed = self._require_runtime().manages_weights if self._manager is None else None
        if self._manager is None:
            model = None
            if not managed:
                step, model = self._newest_intact(step, self._load_step)
            self._manager = self._require_runtime().build_manager(model)
        if self._manager.manages_weights:
            if self._server_log is None:
                self._server_log = server_log(self.store, self.config.worker_id)
            log = self._server_log  # written locally, kept (uploaded) at its location: errors name the latter
            self._manager.attach_run(run_root_of(self.store), str(log.local_path), log.location)
            step, _ = self._newest_intact(step, self._serve_step)
        elif managed is None:
            step, model = self._newest_intact(step, self._load_step)
            self._manager.update_model(model)
        self._current_step = step
        if self._partial and model is not None:  # the sampler learns which policy its weights are
            self._manager.stage_model(model, step)
            self._staged = step
        self.metrics.log({"event": "weights", "from_step": None, "policy_step": step})

    def _policy_for_pacing(self) -> int:
        if self.manager.external_weights and not self.manager.manages_weights:
            step = self.manager.served_policy_step()
            if step is None:
                raise RuntimeError(
                    "the openai backend's server does not report its policy step (header X-Policy-Step or a "
                    "model name ending in step-<N>); rollouts cannot be tagged"
                )
            return step
        assert self._current_step is not None
        return self._current_step

    def pace(self) -> PacingDecision:
        """Decide whether to produce now (see `pacing_decision`)."""
        c = self.config
        policy = self._policy_for_pacing()
        last_slot = self._last_batch_slot()
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
        decision = self._decision(policy, last_slot, unconsumed)
        if decision.produce and c.pacing.count_claims:
            decision = self._claim(policy, last_slot, unconsumed, files)
        self._room = decision.room if decision.produce and c.pacing.fit_room else None
        return decision

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
        )

    def _claim(self, policy: int, last_slot: int, unconsumed: int, files: dict[str, Any]) -> PacingDecision:
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
        ttl = claim_ttl(self._last_cycle_s, c.generation_timeout_s + c.write_timeout_s)
        prompts = prompts_for_room(decision.room, sp.n_prompts, sp.n_generations_per_prompt)
        if not c.pacing.fit_room:
            prompts = sp.n_prompts
        self._claims.announce(self._seq, policy, prompts * sp.n_generations_per_prompt, ttl, time.time())
        decision = self._decision(policy, last_slot, unconsumed, claimed_rows(standing()))
        if not decision.produce:
            self._claims.withdraw()
            self._stop.wait(self._claims.collision_pause_s(c.polling.interval_s))
        return decision

    def _choose_lesson(self) -> tuple[str, PromptSkip | None]:
        """A lesson drawn by the newest curriculum state's weights, and the prompts its training draw passes over
        (difficulty-aware sampling, `curriculum.skip_after`; None when off or none is skipped)."""
        cur = self.config.curriculum
        state = load_latest_curriculum(self.store, cur)
        lesson_id = sample_lesson(sampling_weights(state, cur), self._rng)
        skipped = state.skipped_prompts(lesson_id)
        return lesson_id, PromptSkip(skipped, cur.retest_rate) if skipped else None

    def write(self, batch: RolloutBatch, timing: dict[str, float] | None = None) -> str:
        """Commit the batch as `rollouts/step-P/<name>-<seq>.parquet` (+ ready marker); return the path.

        `timing` (unix times, `METRICS`) goes into the ready marker for the learner's per-hop breakdown."""
        P = batch.metadata.weight_step
        rel = layout.rollout_file(P, self.name, self._seq)
        table = ROLLOUT.to_table(batch.rows)
        extra = {
            "worker_id": self.worker_id,
            "worker_name": self.name,
            "policy_step": P,
            "lesson_id": batch.lesson_id,
            "mode": batch.mode,
            "sampling": batch.sampling,
            "signal_rows": signal_rows(batch.rows),
            "n_failures": len(batch.failures),
            "failures": [f.to_json() for f in batch.failures[:200]],
            **(timing or {}),
        }
        with watchdog(f"write {rel}", self.config.write_timeout_s):
            committed = self.store.commit_data(rel, table, ROLLOUT, extra=extra)
        if not committed:
            raise RuntimeError(f"{rel} was already committed: file names of this incarnation collided")
        self._seq += 1
        return rel

    def _batch_id(self) -> str:
        return f"{self.name}-{self._seq:08d}"

    def run(self) -> WorkerSummary:
        """Run the phases of the program (`steps/rollout.py`) until stopped; returns what was done."""
        started = time.monotonic()
        try:
            self.start()
        except WaitTimeout as e:
            if self._stop.is_set():  # stopped (a signal, control/STOP) before the first policy: a clean stop, exit 0
                pass
            elif self.config.follow:
                raise
            else:
                self.stop(f"nothing to do: no committed policy yet ({e})")  # not follow mode: exit 0 saying why
        self._progress = (self._last_batch_slot(), self._latest_policy(), time.monotonic())
        writes = 0
        self._start_prefetch()
        try:
            while not self._should_stop(started):
                self._mark = self._waker.mark()  # before reading the root: a change from now on ends a pause
                self.sync_weights()
                if self._paused(self.pace()):
                    continue
                t_cycle = time.monotonic()
                try:
                    if self._produce_one(writes):
                        writes += 1
                finally:
                    self._claims.withdraw()  # committed (its rows now count from the file) or nothing to count
                self._last_cycle_s = time.monotonic() - t_cycle
        finally:
            if self._prefetch is not None:
                self._stop.set()  # the prefetch thread ends after its current load
                self._prefetch.join(timeout=self.config.weight_load_timeout_s)
            self.summary.stop_reason = self._stop_reason or "error"
            self.metrics.log(
                {
                    "event": "stop",
                    "reason": self.summary.stop_reason,
                    "rows": self.summary.rows,
                    "files": len(self.summary.files),
                }
            )
            self.metrics.flush()
        logger.info(
            "rollout worker %s stopped (%s): %d files, %d rows, %d failures",
            self.name,
            self.summary.stop_reason,
            len(self.summary.files),
            self.summary.rows,
            self.summary.failures,
        )
        return self.summary

    def _paused(self, decision: PacingDecision) -> bool:
        """Wait one poll interval when pacing says pause; True if it did.

        A pause "ahead" that saw no batch/policy progress for `stall_grace_s`, while the BatchMaker could be
        filling the next slot, lets one write through (a safety net should the BatchMaker need more rows than
        counted), so pacing can never deadlock the run; while the BatchMaker waits for the learner
        (`train.max_batches_ahead`) no write is let through, since its rows could only go stale.
        """
        state = (self._last_batch_slot(), self._latest_policy())
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
        if not self.config.follow and paused >= self.config.polling.bounded_wait_s:  # scheduled: nothing to do now
            self.stop(f"nothing more to do: paused by pacing for {paused:.0f}s ({decision.reason})")
            return True
        if not (decision.reason.startswith("ahead") and stalled >= self._stall_grace_s):
            logger.debug("pausing: %s", decision.reason)
            t0 = time.monotonic()
            # idle time compiles a sampler shape a later file may need (then pacing is checked again at once)
            if self._warm_up() or self._waker.sleep(self._backoff.next(self._waker.event_driven), self._mark):
                self._backoff.reset()
            self._pause_s += time.monotonic() - t0
            self._report_pause(time.monotonic() - t0, decision.reason)
            return True
        logger.info(
            "pacing: no batch/policy progress for %.1fs while paused (%s); producing one write anyway",
            stalled,
            decision.reason,
        )
        self._progress = (*state, time.monotonic())
        return False

    def _warm_up(self) -> bool:
        """While paused: have the sampler compile one shape a later file is likely to need (`RolloutManager.warm_up`:
        a prompt bucket next to the first one used), so that the compile does not land inside a later generation,
        which the learner may be waiting for; True if it did (seconds of work), False when nothing is left (cheap)."""
        warm = getattr(self._manager, "warm_up", None) if self._manager is not None else None
        return bool(warm()) if warm is not None else False

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

    def _produce_one(self, writes: int) -> bool:
        """Sample a lesson, generate one batch under the watchdog and commit it; True if a file was written."""
        c = self.config
        t0 = time.monotonic()
        lesson_id, skip = self._choose_lesson()
        t_lesson = time.monotonic() - t0
        sp = c.curriculum.sampling_for(lesson_id)
        n_examples = sp.n_prompts
        if c.max_rollouts is not None:
            left = c.max_rollouts - self.summary.rows
            n_examples = max(1, min(n_examples, math.ceil(left / sp.n_generations_per_prompt)))
        if self._room is not None:  # pacing.fit_room: no more prompts than the backlog is missing
            n_examples = min(n_examples, prompts_for_room(self._room, sp.n_prompts, sp.n_generations_per_prompt))
        if c.curriculum.micro_eval_frequency and writes and writes % c.curriculum.micro_eval_frequency == 0:
            self._micro_eval(lesson_id)
        policy = self._policy_for_pacing()
        timing = {"generate_started_at": time.time()}
        if policy in self._noticed_at:
            timing["worker_noticed_at"] = self._noticed_at[policy]
        with watchdog(f"generation (lesson {lesson_id})", c.generation_timeout_s):
            batch, m = self.manager.sample_batch(
                lesson_id,
                n_examples,
                sp.n_generations_per_prompt,
                "train",
                self._rng,
                policy,
                self.worker_id,
                batch_id=self._batch_id(),
                skip=skip,
            )
        self.summary.failures += int(m["failures"])
        if batch is None:
            failed = getattr(self.manager, "last_failures", None) or []
            # the reasons go into the record the report reads (its Scorers section), not only into this log
            reasons = list(dict.fromkeys(str(f.reason) for f in failed))[:5]
            self.metrics.log(
                {"event": "empty", "lesson_id": lesson_id, "policy_step": policy, "failure_reasons": reasons, **m}
            )
            self._no_progress(lesson_id, getattr(self.manager, "last_failures", None) or [])
            return False
        self._fruitless = None
        timing["generated_at"] = time.time()
        t0 = time.monotonic()
        rel = self.write(batch, timing)
        timing["rollout_committed_at"] = time.time()
        self._log_write(batch, {**m, **timing}, rel, time.monotonic() - t0, t_lesson)
        self._log_samples(batch, rel)
        return True

    def _no_progress(self, lesson_id: str, failures: list[Any]) -> None:
        """Count a sampling call that produced no rollout; NoProgressError naming the cause once
        `NO_PROGRESS_AFTER` consecutive calls failed every example the same way (the same error type: a lesson
        none of whose prompts fits `max_seq_len` fails every generation with PromptTooLongError, forever)."""
        kinds = {failure_kind(f.reason) for f in failures}
        if len(kinds) != 1:
            self._fruitless = None
            return
        (kind,) = kinds
        count = self._fruitless[2] + 1 if self._fruitless is not None and self._fruitless[0] == kind else 1
        self._fruitless = (kind, failures[-1].reason, count)
        if count >= NO_PROGRESS_AFTER:
            raise NoProgressError(
                f"lesson {lesson_id!r}: {count} sampling calls in a row generated nothing, every example failing "
                f"with {kind} (last: {' '.join(str(failures[-1].reason).split())}); check the lesson's prompts against "
                "max_seq_len, max_prompt_tokens and the inference settings"
            )

    def _log_samples(self, batch: RolloutBatch, rel: str) -> None:
        """A few completions as text, once per policy step this worker writes (`pipeline.rollout.samples`)."""
        step = batch.metadata.weight_step
        if self._samples_step == step:
            return
        self._samples_step = step
        decode = partial(self.tokenizer.decode, skip_special_tokens=True)
        self.metrics.log(samples_record(to_samples(batch.rows, decode), rel))

    def _micro_eval(self, lesson_id: str) -> None:
        c = self.config
        policy = self._policy_for_pacing()
        with watchdog(f"micro-eval (lesson {lesson_id})", c.generation_timeout_s):
            stats, _ = self.manager.evaluate_lesson(
                lesson_id,
                c.curriculum.micro_eval_n_examples,
                "micro_eval",
                self._rng,
                len(self.summary.files),
                policy,
                self.worker_id,
            )
        self.metrics.log({"event": "micro_eval", **dataclasses.asdict(stats)})

    def _log_write(self, batch: RolloutBatch, m: dict[str, float], rel: str, write_s: float, t_lesson: float) -> None:
        c = self.config
        P = batch.metadata.weight_step
        latest = self._latest_policy()
        last_slot = self._last_batch_slot()
        stats = batch_stats(batch)
        gen_s = max(batch.generate_s, 1e-9)
        self.summary.files.append(rel)
        self.summary.rows += len(batch.rows)
        self.summary.policy_steps.append(P)
        self.metrics.log(
            write_record(
                batch,
                m,
                rel,
                stats,
                latest=latest,
                last_slot=last_slot,
                max_lag=c.train.max_lag,
                times={
                    "time/write_s": write_s,
                    "time/weight_load_s": self._weight_load_s,
                    "time/pause_s": self._pause_s,
                    "time/sample_lesson_s": t_lesson,
                },
            )
        )
        self._weight_load_s = 0.0
        self._pause_s = 0.0
        logger.info(
            "wrote %s: %d rows, lesson %s, policy %d, reward %.3f, %.1f tok/s",
            rel,
            len(batch.rows),
            batch.lesson_id,
            P,
            stats.mean_reward,
            batch.n_response_tokens / gen_s,
        )

    def shutdown(self) -> None:
        """Release the manager's backend."""
        if self._manager is not None:
            self._manager.shutdown()
        if self._server_log is not None:  # after the server stopped: its last lines are in the final upload
            self._server_log.close()
