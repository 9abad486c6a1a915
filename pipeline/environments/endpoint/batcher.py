"""The batcher that feeds the generate endpoint's sampler: request threads queue their prompts as `Job`s; one
sampler thread takes what is queued (waiting `batch_window_s` for more), groups the jobs that share sampling
settings, and calls `context.generate` once per group; jobs that arrive while a call runs go into the next one.

When the caller knows how many clients can call (`expect_callers(n)`, then `caller_finished()` as each one ends:
an environment's running episodes, each waiting on at most one call at a time), the batch waits for them instead
of a timer: it is sampled once it holds a job from every caller still running, or after `batch_wait_max_s` (a
caller busy elsewhere, e.g. in a slow tool call, delays the others at most that long). Episodes' first calls
arrive spread over the time their programs take to start; a fixed window of milliseconds cut them into many
sampler calls, each as costly as one holding them all.

Load: at most `max_pending` jobs wait at once (queued or being sampled); one more is refused with 503 at once. A
group whose call fails is retried one job at a time, so one bad request does not fail the others; a job that fails
alone gets 400 (the context refused it with ValueError) or 500. `capture_log` (a local file path) appends one JSON
line per sampled choice as `context.generate` returned it (a debug record, used by tests).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from pipeline.environments.base import Completion, check_completions
from pipeline.environments.endpoint.errors import EndpointError
from pipeline.environments.generation import GenerationRequest, SamplingControls

logger = logging.getLogger(__name__)

Sampled = tuple[list[Completion], int]
"""A job's answer: its `n` completions and the policy step that sampled them."""


@dataclasses.dataclass
class Job:
    """One prompt waiting for the sampler, with the settings it is sampled with."""

    prompt: list[int]
    n: int
    temperature: float
    max_tokens: int
    stop_tokens: tuple[int, ...] | None
    controls: SamplingControls
    seed: int | None
    future: Future[Sampled] = dataclasses.field(default_factory=Future)

    def key(self) -> tuple[Any, ...]:
        """Jobs with equal keys are sampled in one `context.generate` call."""
        return (self.n, self.temperature, self.max_tokens, self.stop_tokens, self.controls, self.seed)


def group_jobs(jobs: list[Job]) -> list[list[Job]]:
    """The jobs grouped by sampling settings, groups in the order of their first job, jobs in queue order."""
    groups: dict[tuple[Any, ...], list[Job]] = {}
    for j in jobs:
        groups.setdefault(j.key(), []).append(j)
    return list(groups.values())


class _Wake:
    """Queued by `expect_callers` / `caller_finished`: the sampler thread looks at its batch again."""


_WAKE = _Wake()


class Batcher:
    """Batches jobs into `context.generate` calls (see the module docstring); `start` / `close`.

    `policy_step()` is read after each call: the step recorded with its answers. `seed` seeds the draws of groups
    whose jobs give none."""

    def __init__(
        self,
        context: Any,
        *,
        policy_step: Callable[[], int],
        batch_window_s: float = 0.005,
        batch_wait_max_s: float = 0.25,
        max_pending: int = 1024,
        seed: int = 0,
        capture_log: str | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending}: must be >= 1")
        self.context = context
        self.policy_step = policy_step
        self.batch_window_s = batch_window_s
        self.batch_wait_max_s = batch_wait_max_s
        self._callers: int | None = None
        self._callers_lock = threading.Lock()
        self.max_pending = max_pending
        self.capture_log = capture_log
        self.generate_calls = 0
        """`context.generate` calls made (one per group of jobs sharing sampling settings)."""
        self._rng = np.random.default_rng(seed)
        self._queue: queue.Queue[Job | _Wake | None] = queue.Queue()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._log_lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the sampler thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="endpoint-sampler", daemon=True)
            self._thread.start()

    def died(self) -> bool:
        """Whether the sampler thread was started and ended before `close` (then no job will be answered)."""
        return self._thread is not None and not self._thread.is_alive() and not self._closed.is_set()

    def close(self) -> None:
        """Stop the sampler thread (after the call it is in) and refuse every job still queued with 503."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, Job) and not job.future.done():
                job.future.set_exception(EndpointError(503, "the endpoint closed"))

    def expect_callers(self, n: int | None) -> None:
        """From now on a batch waits for a job from each of `n` callers (None: the `batch_window_s` timer only)."""
        if n is not None and n < 0:
            raise ValueError(f"n={n}: must be >= 0 or None")
        with self._callers_lock:
            self._callers = n
        self._queue.put(_WAKE)

    def caller_finished(self) -> None:
        """One expected caller will call no more (no-op when none are expected)."""
        with self._callers_lock:
            if self._callers is None:
                return
            self._callers = max(0, self._callers - 1)
        self._queue.put(_WAKE)

    def _batch_full(self, jobs: int) -> bool | None:
        """Whether `jobs` jobs are one from every expected caller (None: no callers are expected)."""
        with self._callers_lock:
            return None if self._callers is None else jobs >= self._callers

    @property
    def pending(self) -> int:
        """Jobs waiting for the sampler now (queued or being sampled)."""
        with self._pending_lock:
            return self._pending

    def submit(self, job: Job, timeout: float | None = None) -> Sampled:
        """Queue `job` and wait for its answer. Raises EndpointError: 503 when `max_pending` jobs already wait or
        the batcher is closed, 400 / 500 when sampling it failed; TimeoutError after `timeout` seconds."""
        if self._closed.is_set():
            raise EndpointError(503, "the endpoint is closed")
        with self._pending_lock:
            if self._pending >= self.max_pending:
                raise EndpointError(503, f"{self.max_pending} requests already wait for the sampler; retry later")
            self._pending += 1
        try:
            self._queue.put(job)
            return job.future.result(timeout=timeout)
        finally:
            with self._pending_lock:
                self._pending -= 1

    def _loop(self) -> None:
        while not self._closed.is_set():
            job = self._queue.get()
            if job is None:
                break
            if isinstance(job, _Wake):
                continue
            jobs = [job]
            start = time.monotonic()
            while True:  # take whatever else is queued: until every expected caller has called, else a moment
                full = self._batch_full(len(jobs))
                if full:
                    break
                wait = self.batch_window_s if full is None else self.batch_wait_max_s
                try:
                    nxt = self._queue.get(timeout=max(0.0, start + wait - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                if isinstance(nxt, Job):
                    jobs.append(nxt)
            for group in group_jobs(jobs):
                self._run_group(group)

    def _run_group(self, group: list[Job]) -> None:
        first = group[0]
        seed = first.seed if first.seed is not None else int(self._rng.integers(0, 2**31 - 1))
        try:
            request = GenerationRequest(
                [j.prompt for j in group],
                n=first.n,
                temperature=first.temperature,
                max_tokens=first.max_tokens,
                stop_tokens=first.stop_tokens,
                seed=seed,
                controls=first.controls,
            )
            outs = check_completions(self.context.generate(request), len(group), first.n)
            step = self.policy_step()
            self.generate_calls += 1
        except Exception as e:
            if len(group) > 1:  # one bad request must not fail the others: answer each alone
                logger.warning("generate endpoint: a batch of %d failed (%r); retrying one by one", len(group), e)
                for j in group:
                    self._run_group([j])
                return
            status = 400 if isinstance(e, ValueError) else 500
            logger.warning("generate endpoint: request failed: %r", e)
            first.future.set_exception(EndpointError(status, f"generation failed: {type(e).__name__}: {e}"))
            return
        self._log(group, outs, step)
        for j, comps in zip(group, outs, strict=True):
            if not j.future.done():
                j.future.set_result((comps, step))

    def _log(self, group: list[Job], outs: list[list[Completion]], step: int) -> None:
        if not self.capture_log:
            return
        lines = [
            json.dumps(
                {
                    "prompt_ids": j.prompt,
                    "completion_ids": [int(t) for t in c.tokens],
                    "logprobs": [float(x) for x in c.logprobs],
                    "finish_reason": c.finish_reason,
                    "policy_step": step,
                }
            )
            for j, comps in zip(group, outs, strict=True)
            for c in comps
        ]
        with self._log_lock, open(self.capture_log, "a") as f:
            f.write("".join(line + "\n" for line in lines))
