"""The rollout worker: polls for policies, asks a `RolloutManager` for rollouts, commits them, paces itself. This is
its loop; following the newest policy is `pipeline.rollout.follower`'s part, deciding when to produce
`pipeline.rollout.pacer`'s.

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
from functools import partial
from typing import Any

import numpy as np

from pipeline.config import RolloutStepConfig
from pipeline.curriculum import load_latest_curriculum, sample_lesson, sampling_weights
from pipeline.environments.base import PromptSkip
from pipeline.environments.tokenizer import check_chat_lessons, load_tokenizer
from pipeline.process.exits import Exit, NoProgressError
from pipeline.process.step_kind import StepKind
from pipeline.process.watchdog import watchdog
from pipeline.rollout.follower import PolicyFollower, PolicyRuntime
from pipeline.rollout.pacer import PAUSE_RECORD_S, Pacer
from pipeline.rollout.pacing import PacingDecision, prompts_for_room, signal_rows
from pipeline.rollout.rollout_batch import RolloutBatch, batch_stats
from pipeline.rollout.samples import samples_record, to_samples
from pipeline.rollout.worker_records import METRICS, WorkerSummary, incarnation_nonce, write_record
from pipeline.store import layout, run_state
from pipeline.store.notify import waker_for
from pipeline.store.poll import WaitTimeout
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import MetricsWriter
from schemas import ROLLOUT

logger = logging.getLogger(__name__)

__all__ = ["METRICS", "NO_PROGRESS_AFTER", "PAUSE_RECORD_S", "PolicyRuntime", "RolloutWorker", "failure_kind"]
"""`PolicyRuntime` (`pipeline.rollout.follower`), `PAUSE_RECORD_S` (`pipeline.rollout.pacer`) and `METRICS`
(`pipeline.rollout.worker_records`) are named here too: the rollout program and its callers import them from here."""


NO_PROGRESS_AFTER = 20
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
    """Polls for policies, asks the manager for rollouts, commits them, logs metrics, paces itself: the loop around
    a `PolicyFollower` (`follower`: the policy the sampler holds) and a `Pacer` (`pacer`: when to produce).

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
        self._stop = threading.Event()
        self._stop_reason = ""
        self._seq = 0
        self._rng = np.random.default_rng([config.seed, int(time.time_ns() % (1 << 62))])
        self._waker = waker_for(self.store)
        self.follower = PolicyFollower(
            config,
            self.store,
            stop_event=self._stop,
            waker=self._waker,
            metrics=self.metrics,
            runtime=runtime,
            manager=manager,
            load_model=load_model,
        )
        self.pacer = Pacer(
            config,
            self.store,
            self.name,
            stop_event=self._stop,
            stop=self.stop,
            waker=self._waker,
            metrics=self.metrics,
            latest_policy=self.follower.latest_policy,
            warm_up=self.follower.warm_up,
            stall_grace_s=stall_grace_s,
        )
        self.summary = WorkerSummary()
        self._fruitless: tuple[str, str, int] | None = None
        """(failure kind, last reason, consecutive sampling calls) while every call fails the same way."""

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

    # -- phases (the follower and the pacer do the work) ---------------------------------------------

    def wait_for_policy(self) -> int:
        """Block until a committed policy exists; return the newest step (`PolicyFollower.wait_for_policy`)."""
        return self.follower.wait_for_policy()

    def start(self) -> None:
        """Phase 1: wait for a policy, load it and build the manager (unless one was injected)."""
        self.follower.start()

    def sync_weights(self) -> bool:
        """Hold the newest committed policy if it is newer than the one held (`PolicyFollower.sync`). True if
        changed."""
        return self.follower.sync()

    @property
    def manager(self) -> Any:
        """The RolloutManager (built on first use from the config and the newest policy)."""
        return self.follower.manager

    def pace(self) -> PacingDecision:
        """Decide whether to produce now (`Pacer.pace`, with the policy the next file would be sampled with)."""
        return self.pacer.pace(self.follower.policy_step(), self._seq)

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
        self.pacer.reset_progress()
        writes = 0
        self.follower.start_prefetch()
        try:
            while not self._should_stop(started):
                self.pacer.mark()  # before reading the root: a change from now on ends a pause
                self.sync_weights()
                if self.pacer.paused(self.pace()):
                    continue
                t_cycle = time.monotonic()
                try:
                    if self._produce_one(writes):
                        writes += 1
                finally:
                    self.pacer.withdraw()  # committed (its rows now count from the file) or nothing to count
                self.pacer.last_cycle_s = time.monotonic() - t_cycle
        finally:
            self.follower.stop_prefetch()  # the prefetch thread ends after its current load
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
        if self.pacer.room is not None:  # pacing.fit_room: no more prompts than the backlog is missing
            n_examples = min(n_examples, prompts_for_room(self.pacer.room, sp.n_prompts, sp.n_generations_per_prompt))
        if c.curriculum.micro_eval_frequency and writes and writes % c.curriculum.micro_eval_frequency == 0:
            self._micro_eval(lesson_id)
        policy = self.follower.policy_step()
        timing = {"generate_started_at": time.time()}
        noticed = self.follower.noticed_at(policy)
        if noticed is not None:
            timing["worker_noticed_at"] = noticed
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
        policy = self.follower.policy_step()
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
        latest = self.follower.latest_policy()
        last_slot = self.pacer.last_batch_slot()
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
                    "time/weight_load_s": self.follower.weight_load_s,
                    "time/pause_s": self.pacer.pause_s,
                    "time/sample_lesson_s": t_lesson,
                },
            )
        )
        self.follower.weight_load_s = 0.0
        self.pacer.pause_s = 0.0
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
        self.follower.shutdown()
