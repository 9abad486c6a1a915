"""Per-step latency: the hop breakdown (pipeline.telemetry.hops), event-driven waits (pipeline.store.notify), and the
timing records a real job writes (learner, BatchMaker, rollout metrics; log entries; ready markers; the report)."""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path

import pytest
from jobs import FinishedJob

from pipeline.store import layout
from pipeline.store.notify import Waker, waker_for
from pipeline.store.poll import poll_until
from pipeline.store.storage import RunStore
from pipeline.telemetry.hops import EVENTS, HOPS, step_hops

# ------------------------------------------------------------------------------------------ step_hops


def test_hops_add_up_to_the_step_and_follow_the_chain() -> None:
    events = {e: 100.0 + i for i, e in enumerate(EVENTS)}  # one second per link, 100 .. 109
    hops = step_hops(100.0, 110.5, events)
    assert list(hops) == list(HOPS)
    assert sum(hops.values()) == pytest.approx(10.5)
    assert hops["publish"] == 0.0  # policy published exactly when the step started
    assert hops["worker_notice"] == pytest.approx(1.0)
    assert hops["handoff"] == pytest.approx(1.5)


def test_hops_clamp_events_outside_the_step_and_merge_missing_ones() -> None:
    events = {
        "policy_published_at": 90.0,  # before the step: the rollout was generated during the previous step
        "generated_at": 95.0,
        "rollout_committed_at": 99.0,
        "batch_noticed_at": 102.0,
        "batch_committed_at": 101.0,  # out of order (clock skew between hosts): made monotone
        "learner_noticed_at": 103.0,
        "train_started_at": 103.5,
        "trained_at": 104.0,
    }
    hops = step_hops(100.0, 104.25, events)
    assert sum(hops.values()) == pytest.approx(4.25)
    assert all(v >= 0 for v in hops.values())
    for h in ("publish", "worker_notice", "load_and_pace", "generate", "rollout_commit", "batch_commit"):
        assert hops[h] == 0.0, h
    assert hops["batch_notice"] == pytest.approx(2.0)
    assert hops["learner_notice"] == pytest.approx(1.0)
    assert hops["train"] == pytest.approx(0.5)
    assert step_hops(5.0, 7.0, {})["handoff"] == pytest.approx(2.0)  # nothing known: all in the last hop


# ------------------------------------------------------------------------------------------ waits


def test_waker_wakes_on_a_change_under_the_root_and_not_on_logs(tmp_path: Path) -> None:
    waker = Waker(str(tmp_path))
    try:
        assert waker.event_driven
        (tmp_path / "logs").mkdir()
        (tmp_path / "batches" / "log").mkdir(parents=True)
        for _ in range(50):  # let the notifications of the folder creations above arrive (late on a loaded machine)
            if not waker.sleep(1.0, waker.mark()):
                break
        mark = waker.mark()
        (tmp_path / "logs" / "x.log").write_text("noise")
        assert not waker.sleep(0.5, mark), "a write under logs/ woke the waiter"
        mark = waker.mark()
        timer = threading.Timer(0.1, lambda: (tmp_path / "batches" / "log" / "step-1.json").write_text("{}"))
        timer.start()
        assert waker.sleep(30.0, mark), "a new file under the root did not wake the waiter"
        timer.join()
    finally:
        waker.close()


def test_a_change_between_check_and_sleep_is_not_lost(tmp_path: Path) -> None:
    waker = Waker(None)  # no notifications: only pokes end a sleep early
    assert not waker.event_driven
    mark = waker.mark()
    waker.poke()  # happens after the check, before the sleep
    assert waker.sleep(30.0, mark)


def test_poll_until_with_the_stores_waker_sees_a_file_written_by_another_thread(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path))
    target = layout.batch_log_entry(1)
    timer = threading.Timer(0.2, lambda: store.put_if_absent(target, b"{}"))
    timer.start()
    value, waited = poll_until(
        lambda: store.exists(target), timeout_s=60, what=target, interval_s=30.0, waker=waker_for(store)
    )
    timer.join()
    assert value is True
    assert waited < 30.0  # woken by the notification, not by the (30 s) poll interval


# ------------------------------------------------------------------------------------------ a real job

NUM_STEPS = 6


@pytest.fixture
def finished_job(default_job: FinishedJob) -> Path:
    """The run root of the session's test job (configs/test_cats.yaml: 6 learner steps); read only."""
    return default_job.root


def _records(root: Path, kind: str) -> list[dict]:
    out = []
    for f in sorted((root / "metrics" / kind).glob("*.jsonl")):
        out.extend(json.loads(line) for line in f.read_text().splitlines() if line.strip())
    return out


@pytest.mark.slow
def test_learner_records_hold_hops_that_sum_to_the_step_time(finished_job: Path) -> None:
    recs = sorted((r for r in _records(finished_job, "learner") if "train_s" in r), key=lambda r: r["step"])
    assert [r["step"] for r in recs] == list(range(1, NUM_STEPS + 1))
    for r in recs:
        assert set(r["hops"]) == set(HOPS), r
        for key in ("step_started_at", "step_ended_at", "learner_noticed_at", "batch_committed_at", "trained_at"):
            assert isinstance(r.get(key), float), (key, r)
        assert sum(r["hops"].values()) == pytest.approx(r["step_s"], rel=1e-6)
        assert r["hops"]["train"] > 0
    # against an independent clock: the metrics records' own `time` (written once per step, after the step)
    for prev, r in itertools.pairwise(recs):
        between = r["time"] - prev["time"]
        assert sum(r["hops"].values()) == pytest.approx(between, rel=0.10, abs=0.02), (r["step"], between)
    # the chain reached back to the rollout workers for at least one step
    assert any("rollout_committed_at" in r and "generate_started_at" in r for r in recs)


@pytest.mark.slow
def test_batchmaker_rollout_and_commit_records_carry_their_times(finished_job: Path) -> None:
    bm = [r for r in _records(finished_job, "batchmaker") if "slot" in r and "n_rollouts" in r]
    assert len(bm) >= NUM_STEPS
    assert all(r["batch_committed_at"] >= r["batch_noticed_at"] for r in bm)
    writes = [r for r in _records(finished_job, "rollout") if r.get("event") == "write"]
    assert writes and all(r["rollout_committed_at"] >= r["generated_at"] >= r["generate_started_at"] for r in writes)
    store = RunStore(str(finished_job))
    entry = store.read_log_entry(NUM_STEPS)
    assert entry.timing is not None and entry.timing["batch_committed_at"] == entry.time
    last = entry.timing["last_file"]
    if last is not None:
        assert "generated_at" in store.read_marker(last).extra


@pytest.mark.slow
def test_report_shows_the_latency_section(finished_job: Path, tmp_path: Path) -> None:
    from pipeline.report import build_report

    out = build_report(str(finished_job), str(tmp_path / "report"))
    page = (Path(out) if Path(out).is_file() else Path(out) / "index.html").read_text()
    assert "Per-step latency" in page
    assert (tmp_path / "report" / "plots" / "latency_hops.png").exists()


def test_pacing_counts_no_row_whose_advantage_is_zero() -> None:
    """A row at its group's mean reward has advantage 0 and is dropped by the BatchMaker (`zero_advantage`):
    counting it made workers pause for rows that never came until the stall grace let one write through."""
    from pipeline.rollout.pacing import signal_rows
    from schemas import RolloutRow

    def row(group: str, i: int, reward: float) -> RolloutRow:
        return RolloutRow(rollout_id=f"{group}-{i}", env_name="e", example_id=group, lesson_id="l", group_key=group,
                          prompt_tokens=[1], response_tokens=[2], response_logprobs=[-1.0], token_rewards=[0.0],
                          response_loss_mask=[1], episode_reward=reward, truncated=False, finish_reason="stop",
                          temperature=1.0, policy_step=0, worker_id="w", timestamp=0.0)  # fmt: skip

    rows = [row("a", 0, 0.0), row("a", 1, 1.0), row("a", 2, 0.5), row("b", 0, 1.0), row("b", 1, 1.0)]
    assert signal_rows(rows) == 2  # a's 0.5 is the group mean; b has no variance


def test_files_without_signal_count_only_once_they_would_fill_a_slot() -> None:
    """The stall seen on the demo: 2 files with 8 signal rows and 4 without any (no_signal_fill_after=4; files of a
    quarter batch, so the fill starts by their count) give a BatchMaker 16 rows, not the 44 the old per-file share
    counted; a 5th file without signal is admitted whole."""
    from pipeline.rollout.pacing import count_unconsumed_rows, fill_credit

    assert fill_credit([32] * 4, 4) == 0 and fill_credit([32] * 5, 4) == 32 and fill_credit([32] * 9, 0) == 0
    files = {f"rollouts/step-00000017/f{i}.parquet": (17, 8 if i in (1, 3) else 0, 10.0 + i) for i in range(6)}
    no_signal = {path: 32 for path, (_, n, _) in files.items() if n == 0}
    kw = {"last_slot": 18, "max_lag": 1, "batch_size": 128, "no_signal": no_signal, "no_signal_fill_after": 4}
    cursor = {"cursor": {"seen": [], "reservoir": {"files": [{"policy_step": 16, "rows": [1, 2, 3]}]}}}
    assert count_unconsumed_rows(files, cursor, **kw) == 16  # < 128: produce
    files["rollouts/step-00000018/g.parquet"] = (18, 0, 20.0)
    no_signal["rollouts/step-00000018/g.parquet"] = 32
    assert count_unconsumed_rows(files, cursor, **kw) == 16 + 32  # the 5th file without signal fills the slot
