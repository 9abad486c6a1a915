"""The run's tracker receives every step's metrics records from the run root, step-prefixed, at steps that
never decrease, and not the records of before its start."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import MetricsWriter
from policy.trackers import RunTracker


class RecordingTracker:
    """A levanter-tracker-shaped recorder: what was logged, at which step, and whether the run finished."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, Any]]] = []
        self.finished = False

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        self.logged.append((step, dict(metrics)))

    def finish(self) -> None:
        self.finished = True


def test_records_of_every_step_reach_the_tracker(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path / "run"))
    before = MetricsWriter(store, "batchmaker", "bm-old", flush_every=1)
    before.log({"slot": 1, "mean_reward": 9.0, "staleness_mean": 9.0})  # a previous tracker run's record
    time.sleep(0.01)
    recorder = RecordingTracker()
    tracker = RunTracker(recorder, store, forward_every_s=0.05)
    bm = MetricsWriter(store, "batchmaker", "bm", flush_every=1)
    ro = MetricsWriter(store, "rollout", "w0", flush_every=1)
    ev = MetricsWriter(store, "evaluate", "evaluator", flush_every=1)
    bm.log({"slot": 2, "mean_reward": 0.25, "staleness_mean": 0.5, "n_rollouts": 16})
    ro.log({"event": "write", "rows": 16, "tokens": 100, "mean_reward": 0.5, "policy_lag": 1})
    ro.log({"rows": 16, "tokens": 50, "mean_reward": 0.0, "policy_lag": 0})  # a write of a worker before events
    ro.log({"event": "pause", "reason": "ahead", "paused_s": 2.0})
    ro.log({"event": "stop", "reason": "signal 15", "rows": 32, "files": 2})  # the worker's totals: not new rows
    time.sleep(0.3)
    tracker.log({"learner/loss": 1.5}, step=2)
    bm.log({"slot": 1, "mean_reward": 0.75, "staleness_mean": 0.0})  # arrives late: logged at the newest step
    ev.log({"policy_step": 2, "lesson_id": "cats", "mean_reward": 0.5, "success_rate": 1.0, "external": ""})
    tracker.finish()
    assert recorder.finished
    steps = [s for s, _ in recorder.logged]
    assert steps == sorted(steps)
    merged: dict[str, list[tuple[int, Any]]] = {}
    for step, metrics in recorder.logged:
        for k, v in metrics.items():
            merged.setdefault(k, []).append((step, v))
    assert merged["learner/loss"] == [(2, 1.5)]
    assert merged["batches/mean_reward"] == [(2, 0.25), (2, 0.75)]
    assert merged["batches/staleness_mean"] == [(2, 0.5), (2, 0.0)]
    assert merged["rollout/rows"] == [(2, 32.0)]
    assert merged["rollout/mean_reward"] == [(2, 0.25)]
    assert merged["rollout/rows_per_s"][0][1] > 0
    assert merged["eval/cats/mean_reward"] == [(2, 0.5)] and merged["eval/cats/success_rate"] == [(2, 1.0)]
    assert not [k for k in merged if k.endswith(("/time", "/kind", "/worker", "/slot", "/lesson_id"))]
    assert 9.0 not in [v for vs in merged.values() for _, v in vs]  # older than the tracker run: not replayed


def test_a_fresh_run_forwards_what_its_steps_committed_before_the_tracker_opened(tmp_path: Path) -> None:
    """A short run's workers can write every file before the learner opens its tracker (under load, in a 2-step gs://
    run, the tracker never got `rollout/rows_per_s`): a learner that starts the run forwards those records too, a
    restarted one (not fresh) only what is committed after it opens."""
    store = RunStore(str(tmp_path / "run"))
    ro = MetricsWriter(store, "rollout", "w0", flush_every=1)
    ro.log({"event": "write", "rows": 16, "tokens": 100, "mean_reward": 0.5, "policy_lag": 0})
    ro.log({"event": "write", "rows": 16, "tokens": 100, "mean_reward": 0.25, "policy_lag": 1})
    ro.log({"event": "stop", "reason": "done", "rows": 32, "files": 2})
    time.sleep(0.01)
    fresh, restarted = RecordingTracker(), RecordingTracker()
    for recorder, is_fresh in ((fresh, True), (restarted, False)):
        tracker = RunTracker(recorder, store, forward_every_s=60, fresh=is_fresh)
        tracker.log({"learner/loss": 1.0}, step=1)
        tracker.finish()
    seen = {k: v for _, metrics in fresh.logged for k, v in metrics.items()}
    assert seen["rollout/rows"] == 32.0 and seen["rollout/rows_per_s"] > 0
    assert not [k for _, metrics in restarted.logged for k in metrics if k.startswith("rollout/")]


def test_evaluations_that_finish_after_the_learner_are_awaited(tmp_path: Path) -> None:
    """The final policy's evaluations, committed after the learner's last step, are forwarded before the tracker
    run closes; a lesson that never arrives makes the wait give up at its bound."""
    import threading

    store = RunStore(str(tmp_path / "run"))
    recorder = RecordingTracker()
    tracker = RunTracker(recorder, store, forward_every_s=60)  # only the wait itself forwards
    tracker.log({"learner/loss": 1.0}, step=4)
    ev = MetricsWriter(store, "evaluate", "evaluator", flush_every=1)

    def evaluate_later() -> None:
        time.sleep(0.4)
        ev.log({"policy_step": 3, "lesson_id": "a", "mean_reward": 0.1})  # an older policy: not what is awaited
        ev.log({"policy_step": 4, "lesson_id": "a", "mean_reward": 0.5})
        time.sleep(0.3)
        ev.log({"policy_step": 4, "lesson_id": "b", "mean_reward": 0.7})

    t0 = time.monotonic()
    writer = threading.Thread(target=evaluate_later)
    writer.start()
    assert tracker.await_evaluations(4, ["a", "b"], timeout_s=30, poll_s=0.05)
    writer.join()
    assert 0.6 < time.monotonic() - t0 < 20
    t1 = time.monotonic()
    assert not tracker.await_evaluations(4, ["a", "c"], timeout_s=0.3, poll_s=0.05)
    assert 0.3 <= time.monotonic() - t1 < 5
    tracker.finish()
    logged = {k: (step, v) for step, metrics in recorder.logged for k, v in metrics.items()}
    assert logged["eval/a/mean_reward"] == (4, 0.5) and logged["eval/b/mean_reward"] == (4, 0.7)
