"""The rollout worker's `Pacer` on a real local run root with hand-committed rollout files, batch log entries and
policy markers (no model, no step process): it pauses a worker ahead of the BatchMaker and logs the pause, counts
another worker's claim, lets one write through a stalled BatchMaker but none while the BatchMaker waits for the
learner, and stops a scheduled worker that has nothing to do.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from log_entries import put_log_entry
from test_make_batches import commit_rollouts, publish_policy, rows_for

from pipeline.config import (
    CurriculumConfig,
    LessonConfig,
    PollingConfig,
    RolloutPacing,
    RolloutStepConfig,
    SamplingParams,
    StoreConfig,
    TrainParams,
)
from pipeline.process.step_kind import StepKind
from pipeline.rollout.pacer import Pacer
from pipeline.store import layout
from pipeline.store.notify import waker_for
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import MetricsWriter, read_metrics
from schemas.records import Cursor, Reservoir

SAMPLING = SamplingParams(n_prompts=2, n_generations_per_prompt=2, max_tokens=8)
CURRICULUM = CurriculumConfig(lessons={"cats": LessonConfig(lesson_id="cats")}, default_sampling=SAMPLING)


def _config(root: Path, **kw: Any) -> RolloutStepConfig:
    """batch_size 4 (one file of 4 rows), max_steps_ahead 1, max_lag 1, every row counts."""
    base: dict[str, Any] = dict(
        store=StoreConfig(run_root=str(root)),
        curriculum=CURRICULUM,
        train=TrainParams(batch_size=4, replay_buffer_capacity=64, max_lag=1, filter_zero_variance=False),
        pacing=RolloutPacing(max_steps_ahead=1),
        polling=PollingConfig(interval_s=0.02),
        worker_id="w0",
    )
    base.update(kw)
    return RolloutStepConfig(**base)


class _Worker:
    """What a worker hands its pacer: its stop, its newest policy and a count of warm-ups (no sampler here)."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.stop_event = threading.Event()
        self.stop_reasons: list[str] = []
        self.warm_ups = 0

    def stop(self, reason: str) -> None:
        self.stop_reasons.append(reason)
        self.stop_event.set()

    def warm_up(self) -> bool:
        self.warm_ups += 1
        return True  # as a sampler that compiled a shape: the pause ends without a sleep

    def pacer(self, config: RolloutStepConfig, name: str, **kw: Any) -> Pacer:
        return Pacer(
            config,
            self.store,
            name,
            stop_event=self.stop_event,
            stop=self.stop,
            waker=waker_for(self.store),
            metrics=MetricsWriter(self.store, StepKind.ROLLOUT, name),
            latest_policy=lambda: 0,
            warm_up=kw.pop("warm_up", self.warm_up),
            **kw,
        )


def _consume_all(store: RunStore, slot: int) -> None:
    """Commit batch slot `slot` as a BatchMaker that consumed every committed rollout file would."""
    seen = store.list_committed(layout.rollout_step_dir(0))
    put_log_entry(store, slot, cursor=Cursor(version=1, seen=seen, reservoir=Reservoir(next_seq=0, files=[])))


def test_pacer_pauses_ahead_logs_the_pause_and_counts_another_workers_claim(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path / "run"))
    publish_policy(store, 0)
    commit_rollouts(store, 0, 0, rows_for(0, "a", [[0.0, 1.0], [1.0, 0.0]]))  # 4 unconsumed rows: a batch ahead
    worker = _Worker(store)
    cfg = _config(tmp_path / "run")
    pacer = worker.pacer(cfg, "wa.1", stall_grace_s=1000.0)

    ahead = pacer.pace(0, 0)
    assert not ahead.produce and ahead.reason.startswith("ahead"), ahead
    assert pacer.paused(ahead) and worker.warm_ups == 1  # the pause's idle time went to a warm-up
    _consume_all(store, 1)
    go = pacer.pace(0, 0)
    assert go.produce and go.room == 4 and pacer.room == 4, go
    assert not pacer.paused(go)  # the run of pauses ends: its `pause` record is logged
    pacer.metrics.flush()
    pauses = [r for r in read_metrics(store, "rollout") if r.get("event") == "pause"]
    assert [p["reason"] for p in pauses] == ["ahead"] and pauses[0]["paused_s"] > 0

    # wa's claim (2 prompts x 2 = 4 rows) fills the backlog for wb until wa withdraws it
    other = worker.pacer(cfg, "wb.1", stall_grace_s=1000.0)
    held = other.pace(0, 0)
    assert not held.produce and "4 being generated" in held.reason, held
    pacer.withdraw()
    assert other.pace(0, 0).produce
    other.withdraw()


def test_a_stalled_batchmaker_gets_one_write_but_none_while_it_waits_for_the_learner(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path / "run"))
    publish_policy(store, 0)
    commit_rollouts(store, 0, 0, rows_for(0, "a", [[0.0, 1.0], [1.0, 0.0]]))
    worker = _Worker(store)
    pacer = worker.pacer(_config(tmp_path / "run"), "wa.1", stall_grace_s=0.2, warm_up=lambda: False)
    pacer.reset_progress()
    ahead = pacer.pace(0, 0)
    assert not ahead.produce
    started = time.monotonic()
    deadline = started + 10.0
    while pacer.paused(ahead):  # slot 0, policy 0: the BatchMaker could fill slot 1 but does not
        assert time.monotonic() < deadline, "no write let through a stalled BatchMaker"
    # the grace is wall time paused (the pacer's sleeps plus its reads of the run root between them), not the sum
    # of its sleeps (`pause_s`), which under load was 0.199 s when the write was rightly let through
    assert time.monotonic() - started >= 0.2 and pacer.pause_s > 0

    # slot 1 committed, newest policy 0, max_batches_ahead 1: slot 2 waits for policy 1, not for rows
    commit_rollouts(store, 0, 1, rows_for(0, "b", [[0.0, 1.0], [1.0, 0.0]]))
    put_log_entry(store, 1, cursor=Cursor(version=1, seen=[], reservoir=Reservoir(next_seq=0, files=[])))
    ahead = pacer.pace(0, 1)
    assert not ahead.produce and ahead.reason.startswith("ahead"), ahead
    until = time.monotonic() + 0.6  # 3 grace periods
    while time.monotonic() < until:
        assert pacer.paused(ahead), "a write was let through while the BatchMaker waits for the learner"


def test_a_scheduled_worker_paused_for_its_bounded_wait_stops_saying_why(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path / "run"))
    publish_policy(store, 0)
    commit_rollouts(store, 0, 0, rows_for(0, "a", [[0.0, 1.0], [1.0, 0.0]]))
    worker = _Worker(store)
    cfg = _config(tmp_path / "run", follow=False, polling=PollingConfig(interval_s=0.02, bounded_wait_s=0.1))
    pacer = worker.pacer(cfg, "wa.1", stall_grace_s=1000.0, warm_up=lambda: False)
    ahead = pacer.pace(0, 0)
    deadline = time.monotonic() + 10.0
    while not worker.stop_reasons:
        assert pacer.paused(ahead) and time.monotonic() < deadline
    assert worker.stop_reasons[0].startswith("nothing more to do: paused by pacing"), worker.stop_reasons


def test_once_every_slot_of_the_run_is_committed_a_scheduled_worker_stops_at_once(tmp_path: Path) -> None:
    """Rows sampled after the run's last batch slot can never be trained: a scheduled worker stops without waiting
    out its bounded wait, naming why; a following worker pauses until the learner's last policy ends it."""
    store = RunStore(str(tmp_path / "run"))
    publish_policy(store, 1)
    train = TrainParams(batch_size=4, replay_buffer_capacity=64, max_lag=1, filter_zero_variance=False,
                        num_train_steps=2)  # fmt: skip
    for slot in (1, 2):
        put_log_entry(store, slot)
    scheduled = _Worker(store)
    pacer = scheduled.pacer(_config(tmp_path / "run", train=train, follow=False), "wa.1", stall_grace_s=0.0)
    done = pacer.pace(1, 0)
    assert not done.produce and done.reason.startswith("finished"), done
    assert pacer.paused(done) and scheduled.stop_reasons == [f"nothing more to do: {done.reason}"]

    following = _Worker(store)
    pacer = following.pacer(_config(tmp_path / "run", train=train), "wb.1", stall_grace_s=0.0)
    for _ in range(3):  # no stall grace: an "ahead" pause would let a write through at once
        assert pacer.paused(pacer.pace(1, 0)) and not following.stop_reasons


def test_a_saturated_run_samples_the_missing_rows_not_a_multiple_of_them(tmp_path: Path) -> None:
    """With zero-variance filtering a worker oversamples by the recent share of rows with signal (the BatchMaker
    drops the rest); once the newest slot says the next one fills at once (`fills_at_once`), every row is taken,
    so it samples just the rows missing."""
    from pipeline.rollout.pacing import signal_rows
    from schemas.rollout import ROLLOUT

    store = RunStore(str(tmp_path / "run"))
    publish_policy(store, 0)
    train = TrainParams(batch_size=16, replay_buffer_capacity=64, max_lag=1, filter_zero_variance=True)
    rows = rows_for(0, "a", [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 1.0]])  # 2 of 8 rows with signal
    store.commit_data(layout.rollout_file(0, "w", 0), ROLLOUT.to_table(rows), ROLLOUT,
                      extra={"signal_rows": signal_rows(rows)})  # fmt: skip
    seen = store.list_committed(layout.rollout_step_dir(0))
    consumed = Cursor(version=1, seen=seen, reservoir=Reservoir(next_seq=0, files=[]))
    cfg = _config(tmp_path / "run", train=train)

    put_log_entry(store, 1, cursor=consumed)  # slot 1 filtered as usual and needed no fill
    filtering = _Worker(store).pacer(cfg, "wa.1", stall_grace_s=1000.0)
    go = filtering.pace(0, 0)
    assert go.produce and go.room == 16 and filtering.room == 64, (go, filtering.room)  # 16 / (2/8)

    publish_policy(store, 1)
    store.commit_data(layout.rollout_file(1, "w", 1), ROLLOUT.to_table(rows), ROLLOUT,
                      extra={"signal_rows": signal_rows(rows)})  # fmt: skip
    seen += store.list_committed(layout.rollout_step_dir(1))
    consumed = Cursor(version=1, seen=seen, reservoir=Reservoir(next_seq=0, files=[]))
    put_log_entry(store, 2, cursor=consumed, filled_no_signal=16)  # slot 2 was all fill: slot 3 fills at once
    saturated = _Worker(store).pacer(cfg, "wb.1", stall_grace_s=1000.0)
    go = saturated.pace(1, 1)
    assert go.produce and go.room == 16 and saturated.room == 16, (go, saturated.room)
