"""RolloutWorker on a real local run root with a tiny real model: weight sync (newest policy only, never
backwards), rollouts tagged with the step that sampled them, pacing against the BatchMaker and learner,
bounded and follow modes, the stop file, watchdogs, and crashes (SIGKILL mid-run, a crash between data file
and ready marker) followed by a restart with fresh file names.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import draccus
import equinox as eqx
import jax
import pytest
from log_entries import put_log_entry

from pipeline.config import (
    CurriculumConfig,
    DenseInferenceConfig,
    LessonConfig,
    ModelSpec,
    PollingConfig,
    RolloutPacing,
    RolloutStepConfig,
    SamplingParams,
    StoreConfig,
    TrainParams,
)
from pipeline.environments.tokenizer import load_tokenizer
from pipeline.process.exits import Exit
from pipeline.process.watchdog import watchdog
from pipeline.rollout.pacing import (
    count_unconsumed_rows,
    estimate_unconsumed_rows,
    pacing_decision,
    signal_rows,
    usable_rows,
)
from pipeline.rollout.worker import RolloutWorker
from pipeline.store import layout
from pipeline.store.poll import WaitTimeout
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import read_metrics
from policy.model import build_model, model_vocab_size
from policy.policy_format import read_policy, write_policy
from policy.rollout_manager import RolloutManager, policy_runtime
from schemas import ROLLOUT, RolloutRow
from schemas.records import Cursor, Reservoir

ROOT = Path(__file__).resolve().parents[1]
SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=1, num_heads=2, num_kv_heads=2, max_seq_len=48)
SAMPLING = SamplingParams(temperature=1.0, n_prompts=2, n_generations_per_prompt=2, max_tokens=8)
CURRICULUM = CurriculumConfig(lessons={"cats": LessonConfig(lesson_id="cats")}, default_sampling=SAMPLING)
POLL = 0.05


def _config(root: Path, **kw: Any) -> RolloutStepConfig:
    train = kw.pop("train", TrainParams(batch_size=10_000, replay_buffer_capacity=10_000, max_lag=1))
    base: dict[str, Any] = dict(
        store=StoreConfig(run_root=str(root)),
        model=SPEC,
        inference=DenseInferenceConfig(max_seqs=8),
        curriculum=CURRICULUM,
        train=train,
        worker_id="w0",
        polling=PollingConfig(interval_s=POLL),
        wait_for_policy_timeout_s=30.0,
    )
    base.update(kw)
    return RolloutStepConfig(**base)


def _wait(cond: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _committed(store: RunStore, step: int) -> list[str]:
    return store.list_committed(layout.rollout_step_dir(step))


def _read_rows(store: RunStore, rel: str) -> list[Any]:
    table = store.read_committed(rel, ROLLOUT)
    assert table is not None, f"{rel} is not readable"
    return ROLLOUT.from_table(table)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("builtin:tiny")


@pytest.fixture(scope="module")
def model(tokenizer: Any) -> Any:
    return build_model(SPEC, model_vocab_size(tokenizer))


@pytest.fixture(scope="module")
def manager(tokenizer: Any, model: Any) -> Iterator[RolloutManager]:
    m = RolloutManager(DenseInferenceConfig(max_seqs=8), SPEC, CURRICULUM, tokenizer, model)
    yield m
    m.shutdown()


def _scaled(model: Any, f: float) -> Any:
    return jax.tree_util.tree_map(lambda x: x * f if eqx.is_inexact_array(x) else x, model)


class _Running:
    """A worker running in a thread; `stop()` joins it and returns (summary or exception)."""

    def __init__(self, worker: RolloutWorker) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as e:  # reported to the test by stop()
            self.error = e

    def stop(self, timeout: float = 60.0) -> None:
        self.worker.stop("test")
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "worker did not stop"
        if self.error is not None:
            raise self.error


# ---------------------------------------------------------------------------------------------
# pure parts
# ---------------------------------------------------------------------------------------------


def test_pacing_decision_staleness_window() -> None:
    kw = dict(unconsumed_rows=0, max_lag=1, batch_size=8, max_steps_ahead=1)
    assert pacing_decision(policy_step=4, last_slot=4, **kw).produce  # next slot 5: lag 0
    assert pacing_decision(policy_step=4, last_slot=5, **kw).produce  # next slot 6: lag 1 = max_lag
    stale = pacing_decision(policy_step=4, last_slot=6, **kw)  # next slot 7: lag 2
    assert not stale.produce and stale.reason.startswith("stale") and stale.slot_lag == 2
    assert pacing_decision(policy_step=4, last_slot=0, **kw).produce  # ahead of the BatchMaker: fine
    on_policy = dict(kw, max_lag=0)
    assert pacing_decision(policy_step=3, last_slot=3, **on_policy).produce
    assert not pacing_decision(policy_step=3, last_slot=4, **on_policy).produce


def test_pacing_decision_ahead_limit() -> None:
    kw = dict(policy_step=2, last_slot=2, max_lag=1, batch_size=8)
    assert pacing_decision(unconsumed_rows=7, max_steps_ahead=1, **kw).produce
    ahead = pacing_decision(unconsumed_rows=8, max_steps_ahead=1, **kw)
    assert not ahead.produce and ahead.reason.startswith("ahead")
    assert pacing_decision(unconsumed_rows=8, max_steps_ahead=2, **kw).produce


def test_pacing_decision_generates_nothing_past_the_runs_last_slot() -> None:
    """Rows sampled once every slot of the run is committed can never be trained: the worker pauses "finished"
    (never let through as a stalled "ahead" pause); before that, "ahead" counts only the slots the run has left."""
    kw = dict(policy_step=9, max_lag=1, batch_size=8, max_steps_ahead=2, unconsumed_rows=0, num_train_steps=10)
    done = pacing_decision(last_slot=10, **kw)  # slots 1..10 committed
    assert not done.produce and done.reason.startswith("finished") and "num_train_steps=10" in done.reason
    last = pacing_decision(last_slot=9, **kw)  # slot 10 left: one slot's rows, not max_steps_ahead=2 slots'
    assert last.produce and last.room == 8
    assert not pacing_decision(last_slot=9, **{**kw, "unconsumed_rows": 8}).produce
    assert pacing_decision(last_slot=8, **{**kw, "unconsumed_rows": 8}).room == 8  # slots 9, 10 left
    assert pacing_decision(last_slot=10, **{**kw, "num_train_steps": None}).produce  # unbounded: as before


def test_estimate_unconsumed_rows() -> None:
    # slot B=3 committed, max_lag=1: policies >= 2 are usable by slot 4; slot 3 may have eaten 8 rows of policy 2
    assert estimate_unconsumed_rows({1: 100, 2: 12, 3: 4}, last_slot=3, max_lag=1, batch_size=8) == 8
    # rows of policies >= B were in no committed slot: never estimated below them
    assert estimate_unconsumed_rows({2: 0, 3: 5}, last_slot=3, max_lag=1, batch_size=8) == 5
    assert estimate_unconsumed_rows({}, last_slot=0, max_lag=1, batch_size=8) == 0
    assert estimate_unconsumed_rows({0: 6}, last_slot=0, max_lag=2, batch_size=8) == 6


def test_usable_rows_count_signal_and_a_share_of_no_signal_rows() -> None:
    def row(group: str, reward: float) -> RolloutRow:
        return RolloutRow(
            rollout_id=f"{group}-{reward}",
            env_name="e",
            example_id=group,
            lesson_id="l",
            group_key=group,
            prompt_tokens=[1],
            response_tokens=[2],
            response_logprobs=[-1.0],
            token_rewards=[0.0],
            response_loss_mask=[1],
            episode_reward=reward,
            truncated=False,
            finish_reason="stop",
            temperature=1.0,
            policy_step=0,
            worker_id="w",
            timestamp=0.0,
        )

    rows = [row("a", 0.0), row("a", 1.0), row("a", 1.0), row("b", 1.0), row("b", 1.0), row("c", 0.5)]
    assert signal_rows(rows) == 3  # only group a has unequal rewards
    assert usable_rows(32, 8, filter_zero_variance=False, no_signal_fill_after=4) == 32
    assert usable_rows(32, None, filter_zero_variance=True, no_signal_fill_after=4) == 32  # an older marker
    assert usable_rows(32, 8, filter_zero_variance=True, no_signal_fill_after=4) == 8  # only a fill admits the rest
    assert usable_rows(32, 0, filter_zero_variance=True, no_signal_fill_after=4) == 0  # a fill: count_unconsumed_rows


def test_count_unconsumed_rows_from_cursor_time_or_estimate() -> None:
    files = {"a": (1, 4, 10.0), "b": (2, 4, 20.0), "c": (3, 4, 30.0), "old": (0, 4, 1.0)}
    # no slot yet: every usable row
    assert count_unconsumed_rows(files, None, last_slot=0, max_lag=1, batch_size=8) == 16
    # BatchMaker cursor: live rows of usable policies (>= B - max_lag = 2) + files it has not seen
    cursor = {
        "seen": ["a", "b"],
        "reservoir": {"files": [{"path": "b", "policy_step": 2, "rows": [1, 3], "uses": [0, 0]},
                                {"path": "a", "policy_step": 1, "rows": [0], "uses": [0]}]},
    }  # fmt: skip
    assert count_unconsumed_rows(files, {"cursor": cursor}, last_slot=3, max_lag=1, batch_size=8) == 2 + 4
    # commit time only: rows committed after the slot, plus policies >= B
    assert count_unconsumed_rows(files, {"time": 25.0}, last_slot=3, max_lag=1, batch_size=8) == 4
    assert count_unconsumed_rows(files, {"time": 15.0}, last_slot=3, max_lag=1, batch_size=8) == 8


def test_watchdog_calls_back_on_overrun_and_not_otherwise() -> None:
    fired: list[tuple[str, float]] = []
    with watchdog("fast", 5.0, on_timeout=lambda p, t: fired.append((p, t))):
        pass
    with watchdog("slow", 0.05, on_timeout=lambda p, t: fired.append((p, t))):
        time.sleep(0.3)
    assert fired == [("slow", 0.05)]


def test_watchdog_default_ends_the_process_loudly() -> None:
    code = (
        "import time; from pipeline.process.watchdog import watchdog\n"
        "with watchdog('generation', 0.2):\n    time.sleep(30)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == Exit.WATCHDOG
    assert "generation" in p.stderr and "exceeded" in p.stderr


# ---------------------------------------------------------------------------------------------
# workers on a real run root
# ---------------------------------------------------------------------------------------------


def _worker(config: Any, **kwargs: Any) -> RolloutWorker:
    """A worker as the rollout program builds it (the JAX library's runtime), with the test's injections."""
    return RolloutWorker(config, runtime=policy_runtime(config, kwargs.get("tokenizer")), **kwargs)


def test_wait_for_policy_times_out_naming_the_path(tmp_path: Path, tokenizer: Any) -> None:
    w = _worker(_config(tmp_path / "run", wait_for_policy_timeout_s=0.3), tokenizer=tokenizer)
    with pytest.raises(WaitTimeout, match=r"policies/step-00000000/COMMITTED"):
        w.run()


def test_worker_picks_up_newer_policy_and_never_moves_back(
    tmp_path: Path, tokenizer: Any, model: Any, manager: RolloutManager
) -> None:
    store = RunStore(str(tmp_path / "run"))
    write_policy(store, 0, model)
    load_calls: dict[int, int] = {}  # step -> files of policy 0 committed when its load started

    def load(step: int) -> Any:
        load_calls.setdefault(step, len(_committed(store, 0)))
        return read_policy(store, step, SPEC, model.Vocab.size)

    worker = _worker(_config(tmp_path / "run"), store=store, tokenizer=tokenizer, manager=manager, load_model=load)
    run = _Running(worker)
    try:
        _wait(lambda: _committed(store, 0), what="a rollout file from policy 0")
        write_policy(store, 2, _scaled(model, 1.5))
        n0_at_publish = len(_committed(store, 0))
        _wait(lambda: worker.follower.current_step == 2, what="pickup of policy 2")
        _wait(lambda: _committed(store, 2), what="a rollout file from policy 2")
        write_policy(store, 1, _scaled(model, 0.5))  # an older step published later (restarted learner)
        n2 = len(_committed(store, 2))
        _wait(lambda: len(_committed(store, 2)) >= n2 + 2, what="two more files from policy 2")
        assert worker.follower.current_step == 2
        assert not _committed(store, 1)
    finally:
        run.stop()
    # the load starts at the next poll: after at most the one write that was in flight at publication
    assert load_calls[2] <= n0_at_publish + 1
    assert sorted(load_calls) == [0, 2]
    for step in (0, 2):
        for rel in _committed(store, step):
            rows = _read_rows(store, rel)
            assert rows and {r.policy_step for r in rows} == {step}
            assert {r.worker_id for r in rows} == {"w0"}
            marker = store.read_marker(rel)
            assert marker.extra["policy_step"] == step and marker.extra["worker_id"] == "w0"
            groups: dict[str, set[float]] = {}
            for r in rows:
                groups.setdefault(r.group_key, set()).add(r.episode_reward)
            assert marker.signal_rows == sum(1 for r in rows if len(groups[r.group_key]) > 1)
    events = [r for r in read_metrics(store, "rollout") if r.get("event") == "weights"]
    assert [e["policy_step"] for e in events] == [0, 2]
    writes = [r for r in read_metrics(store, "rollout") if r.get("event") == "write"]
    assert writes and all(k in writes[0] for k in ("rollouts_per_s", "tokens_per_s", "policy_lag", "time/write_s"))


def test_bounded_mode_stops_after_max_rollouts(tmp_path: Path, tokenizer: Any, model: Any, manager: Any) -> None:
    store = RunStore(str(tmp_path / "run"))
    write_policy(store, 0, model)
    cfg = _config(tmp_path / "run", follow=False, max_rollouts=8)
    summary = _worker(cfg, store=store, tokenizer=tokenizer, manager=manager).run()
    assert summary.rows == 8 and len(summary.files) == 2
    assert "max_rollouts" in summary.stop_reason
    names = [Path(f).name for f in _committed(store, 0)]
    assert len(names) == 2 and names[0].endswith("-00000000.parquet") and names[1].endswith("-00000001.parquet")


def test_stop_file_stops_a_following_worker(tmp_path: Path, tokenizer: Any, model: Any, manager: Any) -> None:
    store = RunStore(str(tmp_path / "run"))
    write_policy(store, 0, model)
    worker = _worker(_config(tmp_path / "run"), store=store, tokenizer=tokenizer, manager=manager)
    run = _Running(worker)
    _wait(lambda: _committed(store, 0), what="first file")
    store.put_unique(layout.STOP_FILE, b"stop")
    run.thread.join(30)
    assert not run.thread.is_alive() and run.error is None
    assert layout.STOP_FILE in worker.summary.stop_reason


def _log_slot(store: RunStore, slot: int) -> None:
    """Commit batch slot `slot` as a BatchMaker that consumed every rollout file committed so far would: its
    cursor has seen them all and keeps no live rows."""
    seen = [f for p in range(10) for f in _committed(store, p)]
    put_log_entry(store, slot, cursor=Cursor(version=1, seen=seen, reservoir=Reservoir(next_seq=0, files=[])))


def test_pacing_pauses_ahead_and_when_stale(tmp_path: Path, tokenizer: Any, model: Any, manager: Any) -> None:
    """batch_size 4 = one write; max_steps_ahead 1; max_lag 1; no zero-variance filtering: every row counts."""
    store = RunStore(str(tmp_path / "run"))
    write_policy(store, 0, model)
    train = TrainParams(batch_size=4, replay_buffer_capacity=64, max_lag=1, filter_zero_variance=False)
    cfg = _config(tmp_path / "run", train=train, pacing=RolloutPacing(max_steps_ahead=1))
    worker = _worker(cfg, store=store, tokenizer=tokenizer, manager=manager, stall_grace_s=1000.0)
    run = _Running(worker)
    try:
        _wait(lambda: len(_committed(store, 0)) == 1, what="first write")
        time.sleep(1.0)
        assert len(_committed(store, 0)) == 1, "should pause: one batch of unconsumed rows is ahead"
        _log_slot(store, 1)  # the BatchMaker consumed slot 1 (policy 0 still usable in slot 2)
        _wait(lambda: len(_committed(store, 0)) == 2, what="second write after slot 1")
        time.sleep(1.0)
        assert len(_committed(store, 0)) == 2
        _log_slot(store, 2)  # slot 3 needs policy >= 1: policy 0 would be stale
        time.sleep(1.0)
        assert len(_committed(store, 0)) == 2, "should pause: policy 0 is stale for slot 3"
        write_policy(store, 1, _scaled(model, 1.5))
        _wait(lambda: len(_committed(store, 1)) == 1, what="a write from policy 1")
    finally:
        run.stop()
    writes = [r for r in read_metrics(store, "rollout") if r.get("event") == "write"]
    assert [w["policy_step"] for w in writes] == [0, 0, 1]
    assert [w["slot_lag"] for w in writes] == [0, 1, 1]


def test_stalled_batchmaker_gets_one_write_per_grace_period(
    tmp_path: Path, tokenizer: Any, model: Any, manager: Any
) -> None:
    store = RunStore(str(tmp_path / "run"))
    write_policy(store, 0, model)
    train = TrainParams(batch_size=4, replay_buffer_capacity=64, max_lag=1)
    cfg = _config(tmp_path / "run", train=train, pacing=RolloutPacing(max_steps_ahead=1))
    worker = _worker(cfg, store=store, tokenizer=tokenizer, manager=manager, stall_grace_s=0.5)
    run = _Running(worker)
    try:
        _wait(lambda: len(_committed(store, 0)) >= 3, timeout=30, what="writes let through by the stall grace")
    finally:
        run.stop()


def test_no_stall_write_while_the_batchmaker_waits_for_the_learner(
    tmp_path: Path, tokenizer: Any, model: Any, manager: Any
) -> None:
    """Slot 1 committed, newest policy 0, max_batches_ahead 1: slot 2 waits for policy 1, so a paused worker
    lets no write through however long the learner takes (such rows could only go stale)."""
    store = RunStore(str(tmp_path / "run"))
    write_policy(store, 0, model)
    train = TrainParams(batch_size=4, replay_buffer_capacity=64, max_lag=1, filter_zero_variance=False)
    cfg = _config(tmp_path / "run", train=train, pacing=RolloutPacing(max_steps_ahead=1))
    worker = _worker(cfg, store=store, tokenizer=tokenizer, manager=manager, stall_grace_s=0.3)
    run = _Running(worker)
    try:
        _wait(lambda: len(_committed(store, 0)) >= 1, what="first write")
        _log_slot(store, 1)
        _wait(lambda: len(_committed(store, 0)) >= 2, what="the write for slot 2")
        n = len(_committed(store, 0))
        time.sleep(2.0)  # > 6 grace periods
        assert len(_committed(store, 0)) == n, "no write may be let through while slot 2 waits for policy 1"
        write_policy(store, 1, _scaled(model, 1.5))
        _log_slot(store, 2)
        _wait(lambda: len(_committed(store, 1)) >= 1, what="a write from policy 1 once the learner moved on")
    finally:
        run.stop()


class _CrashBeforeMarker(RunStore):
    """A store whose process 'dies' right after writing a data file, before its ready marker."""

    def put_if_absent(self, rel: str, data: bytes) -> bool:
        if rel.endswith(layout.READY_SUFFIX):
            raise SystemExit("simulated crash between data file and ready marker")
        return super().put_if_absent(rel, data)


def test_crash_between_data_and_marker_leaves_nothing_visible_and_restart_uses_fresh_names(
    tmp_path: Path, tokenizer: Any, model: Any, manager: Any
) -> None:
    root = tmp_path / "run"
    store = RunStore(str(root))
    write_policy(store, 0, model)
    crashing = _worker(
        _config(root, follow=False, max_rollouts=4),
        store=_CrashBeforeMarker(str(root)),
        tokenizer=tokenizer,
        manager=manager,
    )
    with pytest.raises(SystemExit):
        crashing.run()
    orphans = [p for p in store.list(layout.rollout_step_dir(0)) if p.endswith(".parquet")]
    assert len(orphans) == 1 and not _committed(store, 0)
    restarted = _worker(_config(root, follow=False, max_rollouts=4), store=store, tokenizer=tokenizer, manager=manager)
    summary = restarted.run()
    assert summary.files == _committed(store, 0) and summary.files[0] not in orphans
    assert restarted.name != crashing.name and restarted.name.startswith("w0.")
    assert _read_rows(store, summary.files[0])[0].rollout_id.startswith(restarted.name)


# ---------------------------------------------------------------------------------------------
# real processes: SIGKILL and restart, SIGTERM
# ---------------------------------------------------------------------------------------------


def _cli(root: Path, *extra: str) -> list[str]:
    """`python -m steps.rollout --config_path <yaml>` for the test config (nested overrides go through YAML)."""
    cfg_path = root.parent / f"rollout-{len(list(root.parent.glob('rollout-*.yaml')))}.yaml"
    cfg_path.write_text(draccus.dump(_config(root, worker_id="wk")))
    return [sys.executable, "-m", "steps.rollout", f"--config_path={cfg_path}", *extra]


def _spawn(root: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(_cli(root, *extra), cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_sigkill_mid_run_leaves_no_visible_partial_file_and_restart_goes_on(tmp_path: Path, model: Any) -> None:
    root = tmp_path / "run"
    store = RunStore(str(root))
    write_policy(store, 0, model)
    p = _spawn(root, tmp_path / "w1.log")
    try:
        _wait(lambda: len(_committed(store, 0)) >= 2 or p.poll() is not None, timeout=300, what="first files")
        assert p.poll() is None, (tmp_path / "w1.log").read_text()[-3000:]
        time.sleep(0.013)  # somewhere in generate / write
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
    first = _committed(store, 0)
    shas = {rel: store.read_marker(rel).sha256 for rel in first}
    for rel in first:  # every visible file is complete and verifies
        assert _read_rows(store, rel)
    assert not store.quarantined()
    p2 = _spawn(root, tmp_path / "w2.log", "--max_rollouts=8", "--follow=false")
    assert p2.wait(300) == 0, (tmp_path / "w2.log").read_text()[-3000:]
    after = _committed(store, 0)
    new = sorted(set(after) - set(first))
    assert len(new) == 2
    incarnations = {Path(f).name.rsplit("-", 1)[0] for f in first}
    assert len(incarnations) == 1 and not {Path(f).name.rsplit("-", 1)[0] for f in new} & incarnations
    assert {rel: store.read_marker(rel).sha256 for rel in first} == shas  # old files untouched
    for rel in after:
        assert _read_rows(store, rel)


@pytest.mark.slow
def test_sigterm_stops_gracefully(tmp_path: Path, model: Any) -> None:
    root = tmp_path / "run"
    store = RunStore(str(root))
    write_policy(store, 0, model)
    p = _spawn(root, tmp_path / "w.log")
    try:
        _wait(lambda: _committed(store, 0) or p.poll() is not None, timeout=300, what="first file")
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, (tmp_path / "w.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    stops = [r for r in read_metrics(store, "rollout") if r.get("event") == "stop"]
    assert len(stops) == 1 and stops[0]["reason"] == f"signal {int(signal.SIGTERM)}"
    assert json.loads(json.dumps(stops[0]))["files"] == len(_committed(store, 0))
