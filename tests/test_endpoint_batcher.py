"""The batcher that feeds the generate endpoint's sampler (pipeline/environments/endpoint/batcher.py), alone: request
threads submit jobs, one sampler thread calls `generate`. No server, no model: the context is a recording sampler
that can hold a call, so jobs pile up behind it deterministically.

Checked: jobs queued while a call runs go into the next call, grouped by sampling settings (one call per group, in
queue order); the `max_pending` bound refuses one more job with 503 at once; a group whose call fails is retried job
by job, so only the bad job fails (400 for a ValueError); closing refuses queued and later jobs with 503; the capture
log is what `generate` returned, with the policy step read after the call; with callers expected, a call waits for a
job from each caller still running rather than a timer.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pipeline.environments.base import Completion
from pipeline.environments.endpoint import EndpointError
from pipeline.environments.endpoint.batcher import Batcher, Job, Sampled, group_jobs
from pipeline.environments.generation import NO_CONTROLS, GenerationRequest, SamplingControls
from pipeline.store.poll import poll_until

DEADLINE_S = 60.0
POISON = 666


class HeldSampler:
    """Answers each prompt with `n` completions `[len(prompt), i]`; holds its first call until `release` is set;
    refuses (ValueError) a batch holding a prompt that contains POISON."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.requests: list[GenerationRequest] = []

    def generate(self, request: GenerationRequest) -> list[list[Completion]]:
        self.requests.append(request)
        self.entered.set()
        assert self.release.wait(DEADLINE_S), "never released"
        if any(POISON in p for p in request.prompts):
            raise ValueError("poisoned prompt")
        return [[Completion([len(p), i], [-0.5, -1.0], "length") for i in range(request.n)] for p in request.prompts]


def job(prompt: list[int], *, n: int = 1, temperature: float = 1.0, seed: int | None = None) -> Job:
    return Job(prompt, n, temperature, 2, None, NO_CONTROLS, seed)


class Harness:
    """Batchers over one held sampler, and threads to submit from; `close` releases the sampler and closes them."""

    def __init__(self, sampler: HeldSampler) -> None:
        self.sampler = sampler
        self.pool = ThreadPoolExecutor(16)
        self.batchers: list[Batcher] = []

    def batcher(self, *, max_pending: int = 1024, capture_log: str | None = None) -> Batcher:
        b = Batcher(self.sampler, policy_step=lambda: 11, batch_window_s=0.0, max_pending=max_pending,
                    capture_log=capture_log)  # fmt: skip
        b.start()
        self.batchers.append(b)
        return b

    def queue(self, b: Batcher, j: Job) -> Future[Sampled]:
        """Submit `j` from a thread, once it waits (so the queue order is the order of these calls)."""
        before = b.pending
        answer = self.pool.submit(b.submit, j)
        wait("the job queued", lambda: b.pending == before + 1)
        return answer

    def held(self, **kw: Any) -> tuple[Batcher, Future[Sampled]]:
        """A batcher whose sampler holds its first call, on the job [1]."""
        b = self.batcher(**kw)
        first = self.queue(b, job([1]))
        wait("the first call", self.sampler.entered.is_set)
        return b, first

    def close(self) -> None:
        self.sampler.release.set()
        for b in self.batchers:
            b.close()
        self.pool.shutdown()


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness(HeldSampler())
    yield h
    h.close()


def wait(what: str, cond: Callable[[], bool]) -> None:
    poll_until(lambda: cond() or None, timeout_s=DEADLINE_S, what=what, interval_s=0.01, log_every_s=None)


def test_jobs_queued_behind_a_call_are_grouped_by_settings(harness: Harness) -> None:
    b, first = harness.held()
    jobs = [job([1, 2]), job([1, 2, 3], n=2), job([4, 5, 6, 7]), job([9], temperature=0.0), job([8], n=2)]
    answers = [harness.queue(b, j) for j in jobs]
    harness.sampler.release.set()
    assert first.result(DEADLINE_S) == ([Completion([1, 0], [-0.5, -1.0], "length")], 11)
    got = [a.result(DEADLINE_S) for a in answers]
    assert [[c.tokens for c in comps] for comps, _ in got] == [
        [[2, 0]],
        [[3, 0], [3, 1]],
        [[4, 0]],
        [[1, 0]],
        [[1, 0], [1, 1]],
    ]
    assert {step for _, step in got} == {11}
    # one call for the held job, then one per settings group, groups in order of their first job
    assert [(r.prompts, r.n, r.temperature) for r in harness.sampler.requests] == [
        ([[1]], 1, 1.0),
        ([[1, 2], [4, 5, 6, 7]], 1, 1.0),
        ([[1, 2, 3], [8]], 2, 1.0),
        ([[9]], 1, 0.0),
    ]
    assert b.generate_calls == 4 and b.pending == 0


def test_group_jobs_keeps_queue_order() -> None:
    top = SamplingControls(top_k=5)
    jobs = [job([1]), job([2], seed=3), job([3]), Job([4], 1, 1.0, 2, None, top, None), job([5], seed=3)]
    assert [[j.prompt[0] for j in g] for g in group_jobs(jobs)] == [[1, 3], [2, 5], [4]]


def test_max_pending_refuses_one_more_at_once(harness: Harness) -> None:
    b, first = harness.held(max_pending=2)
    second = harness.queue(b, job([2]))
    with pytest.raises(EndpointError, match="2 requests already wait for the sampler") as e:
        b.submit(job([3]))
    assert e.value.status == 503
    harness.sampler.release.set()
    assert [len(f.result(DEADLINE_S)[0]) for f in (first, second)] == [1, 1]
    assert b.pending == 0 and b.submit(job([3]))[0][0].tokens == [1, 0]  # room again


def test_a_failing_batch_is_retried_job_by_job(harness: Harness) -> None:
    b, first = harness.held()
    good, bad = harness.queue(b, job([1, 2])), harness.queue(b, job([POISON]))
    harness.sampler.release.set()
    first.result(DEADLINE_S)
    assert good.result(DEADLINE_S)[0][0].tokens == [2, 0]
    with pytest.raises(EndpointError, match="generation failed: ValueError: poisoned prompt") as e:
        bad.result(DEADLINE_S)
    assert e.value.status == 400
    assert [r.prompts for r in harness.sampler.requests] == [[[1]], [[1, 2], [POISON]], [[1, 2]], [[POISON]]]
    assert b.generate_calls == 2  # the failed calls are not counted


def test_close_refuses_queued_and_later_jobs(harness: Harness) -> None:
    b, first = harness.held()
    queued = harness.queue(b, job([2]))
    closing = harness.pool.submit(b.close)  # waits for the call in progress
    harness.sampler.release.set()
    closing.result(DEADLINE_S)
    assert first.result(DEADLINE_S)[0][0].tokens == [1, 0]
    with pytest.raises(EndpointError, match="closed") as e:
        queued.result(DEADLINE_S)
    assert e.value.status == 503
    with pytest.raises(EndpointError, match="the endpoint is closed"):
        b.submit(job([3]))
    assert not b.died()  # ended by close, not by an error


def test_capture_log_is_what_generate_returned(harness: Harness, tmp_path: Path) -> None:
    harness.sampler.release.set()
    log = tmp_path / "capture.jsonl"
    b = harness.batcher(capture_log=str(log))
    b.submit(job([5, 6], n=2))
    b.close()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines == [
        {"prompt_ids": [5, 6], "completion_ids": [2, i], "logprobs": [-0.5, -1.0], "finish_reason": "length",
         "policy_step": 11}
        for i in range(2)
    ]  # fmt: skip


def test_a_batch_waits_for_every_expected_caller_not_a_timer() -> None:
    """With callers expected, a call holds a job from each caller still running (no timer cut); a caller that
    finishes without calling is not waited for."""
    sampler = HeldSampler()
    sampler.release.set()
    b = Batcher(sampler, policy_step=lambda: 11, batch_window_s=0.0, batch_wait_max_s=DEADLINE_S)
    b.start()
    pool = ThreadPoolExecutor(4)
    try:
        b.expect_callers(3)
        answers = [pool.submit(b.submit, job([1] * k)) for k in (1, 2, 3)]
        assert [a.result(DEADLINE_S)[0][0].tokens for a in answers] == [[1, 0], [2, 0], [3, 0]]
        assert [len(r.prompts) for r in sampler.requests] == [3]  # one call, though the window is 0 s
        b.expect_callers(2)
        answer = pool.submit(b.submit, job([4]))
        wait("the job queued", lambda: b.pending == 1)
        b.caller_finished()  # the other caller ends without calling: the batch of one is complete
        assert answer.result(DEADLINE_S)[0][0].tokens == [1, 0]
        assert [len(r.prompts) for r in sampler.requests] == [3, 1]
    finally:
        b.close()
        pool.shutdown()
