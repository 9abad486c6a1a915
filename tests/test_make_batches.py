"""The BatchMaker step as real processes on a temporary run root (`python -m steps.make_batches`)."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from log_entries import put_log_entry

from pipeline.process.exits import Exit
from pipeline.store import layout
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import read_metrics
from schemas import BATCH, ROLLOUT, RolloutRow

REPO = Path(__file__).resolve().parents[1]


def rows_for(policy: int, tag: str, rewards: list[list[float]], seed: int = 0) -> list[RolloutRow]:
    """Rollout rows: one group per entry of `rewards`."""
    rng = np.random.default_rng(seed)
    out = []
    for g, group in enumerate(rewards):
        prompt = rng.integers(1, 50, 3).tolist()
        for k, r in enumerate(group):
            n = int(rng.integers(1, 6))
            out.append(
                RolloutRow(
                    rollout_id=f"{tag}-{g}-{k}",
                    env_name="env",
                    example_id=f"{tag}-ex{g}",
                    lesson_id="lesson",
                    group_key=f"{tag}-g{g}",
                    prompt_tokens=prompt,
                    response_tokens=rng.integers(50, 100, n).tolist(),
                    response_logprobs=[-0.5] * n,
                    token_rewards=[0.0] * n,
                    response_loss_mask=[1] * n,
                    episode_reward=float(r),
                    truncated=False,
                    finish_reason="stop",
                    temperature=1.0,
                    policy_step=policy,
                    worker_id="w",
                    timestamp=0.0,
                )
            )
    return out


def commit_rollouts(store: RunStore, policy: int, seq: int, rows: list[RolloutRow], validate: bool = True) -> str:
    path = layout.rollout_file(policy, "w", seq)
    store.commit_data(path, ROLLOUT.to_table(rows, validate=validate), ROLLOUT)
    return path


def publish_policy(store: RunStore, step: int) -> None:
    store.put_json_if_absent(layout.policy_marker(step), {"step": step})


def step_args(root: Path, **kw: Any) -> list[str]:
    base: dict[str, Any] = {
        "train.batch_size": 4,
        "train.seq_len": 16,
        "train.max_lag": 1,
        "train.max_batches_ahead": 1,
        "train.max_batch_latency_s": 3,
        "polling.interval_s": 0.05,
    }
    base.update(kw)
    args = [sys.executable, "-m", "steps.make_batches", "--store.run_root", str(root)]
    for k, v in base.items():
        args += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    return args


def run_step(root: Path, timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(step_args(root, **kw), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def log_entries(store: RunStore) -> list[dict[str, Any]]:
    return [store.get_json(p) for p in store.list(layout.BATCH_LOG)]


def batch_uses(store: RunStore) -> dict[str, int]:
    uses: dict[str, int] = {}
    for e in log_entries(store):
        t = store.read_parquet(e["data_file"], BATCH)
        for ids in t.column("rollout_ids").to_pylist():
            for rid in ids:
                uses[rid] = uses.get(rid, 0) + 1
    return uses


def dropped_rows(store: RunStore) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for e in log_entries(store):
        if e.get("dropped_file"):
            out += pq.read_table(store.full_path(e["dropped_file"])).to_pylist()
    return out


@pytest.fixture
def run_root(tmp_path: Path) -> tuple[Path, RunStore]:
    root = tmp_path / "run"
    store = RunStore(str(root))
    publish_policy(store, 0)
    return root, store


def test_bounded_run_writes_slots_lineage_metrics_and_resumes(run_root: tuple[Path, RunStore]) -> None:
    root, store = run_root
    for i in range(4):
        commit_rollouts(store, 0, i, rows_for(0, f"a{i}", [[0.0, 1.0], [1.0, 1.0], [0.0, 1.0, 1.0]], seed=i))
    r = run_step(root, max_batches=1, **{"train.max_batches_ahead": 3})
    assert r.returncode == 0, r.stderr
    r = run_step(root, max_batches=1, **{"train.max_batches_ahead": 3})  # a rerun continues at slot 2
    assert r.returncode == 0, r.stderr
    entries = log_entries(store)
    assert [e["slot"] for e in entries] == [1, 2]
    seen_files: list[str] = []
    for e in entries:
        data = store.get(e["data_file"])
        assert len(data) == e["data_size"] and e["rows"] == 4 and e["schema"] == BATCH.tag
        t = store.read_parquet(e["data_file"], BATCH)
        assert t.num_rows == 4 and all(len(x) == 16 for x in t.column("tokens").to_pylist())
        seen_files += e["ingested_files"]
        assert e["lease_epoch"] >= 1 and e["config_hash"] and "cursor" in e
    assert len(seen_files) == len(set(seen_files))  # a file is first read once
    assert seen_files == sorted(seen_files)  # oldest policy, then name: lazily, only as needed
    assert len(seen_files) < 4  # never consumes more than it needs
    uses = batch_uses(store)
    assert len(uses) == 8 and max(uses.values()) == 1
    zero_var = [d for d in dropped_rows(store) if d["reason"] == "zero_variance"]
    assert len(zero_var) == 2 * len(seen_files)
    recs = read_metrics(store, "batchmaker")
    assert [r["slot"] for r in recs] == [1, 2]
    for key in ("mean_reward", "staleness_mean", "advantage_std", "padding_fraction", "wait_s", "tokens"):
        assert key in recs[0]
    assert recs[0]["groups_filtered_zero_variance"] == 1


def test_no_signal_slot_fills_after_the_stated_number_of_files(run_root: tuple[Path, RunStore]) -> None:
    """A solved task (every group all-equal rewards) fills the slot after `no_signal_fill_after` files (here fewer
    than hold a batch of rows, which would start the fill as well)."""
    root, store = run_root
    paths = [commit_rollouts(store, 0, i, rows_for(0, f"s{i}", [[1.0, 1.0]], seed=i)) for i in range(5)]
    r = run_step(root, **{"train.no_signal_fill_after": 0, "train.max_batch_latency_s": 1})  # plain mode
    assert r.returncode == Exit.TIMEOUT and "have 0 eligible of 4" in r.stderr  # 0: never fill, fail loudly
    assert log_entries(store) == []
    r = run_step(root, max_batches=1, **{"train.no_signal_fill_after": 1})
    assert r.returncode == 0, r.stderr
    (e,) = log_entries(store)
    assert e["ingested_files"] == paths[:3]  # 1 file (2 rows of a batch of 4) filtered, then 2 admitted
    assert e["filled_no_signal"] == 4 and "admitting zero-variance groups" in r.stderr
    t = store.read_parquet(e["data_file"], BATCH)
    assert {f for fs in t.column("source_files").to_pylist() for f in fs} == set(paths[1:3])
    assert all(a == 0.0 for row in t.column("advantages").to_pylist() for a in row)
    assert len([d for d in dropped_rows(store) if d["reason"] == "zero_variance"]) == 2
    assert read_metrics(store, "batchmaker")[0]["rows_filled_no_signal"] == 4


def test_pacing_and_wait_timeout_names_what_it_waited_for(run_root: tuple[Path, RunStore]) -> None:
    root, store = run_root
    for i in range(4):
        commit_rollouts(store, 0, i, rows_for(0, f"a{i}", [[0.0, 1.0], [0.0, 1.0]], seed=i))
    r = run_step(root, **{"train.max_batch_latency_s": 1})  # plain mode (not bounded): a wait fails loudly
    assert r.returncode == Exit.TIMEOUT
    assert "policies/step-00000001/COMMITTED" in r.stderr and "batch slot 2" in r.stderr
    assert [e["slot"] for e in log_entries(store)] == [1]  # T <= learner_step + max_batches_ahead


def test_bounded_mode_commits_what_it_can_and_exits_0_saying_why(run_root: tuple[Path, RunStore]) -> None:
    """A scheduled job: `--max_batches 3` with rollouts for one slot commits it and exits 0 after
    polling.bounded_wait_s; with too few rollouts for any slot, it commits nothing and exits 0; no traceback either
    way."""
    root, store = run_root
    commit_rollouts(store, 0, 0, rows_for(0, "a0", [[0.0, 1.0]], seed=0))  # 2 of the 4 rows a slot needs
    t0 = time.monotonic()
    r = run_step(root, max_batches=3, **{"polling.bounded_wait_s": 1})
    assert r.returncode == 0, r.stderr
    assert "bounded mode: nothing more to do: committed 0 of max_batches=3" in r.stderr and "batch slot 1" in r.stderr
    assert "Traceback" not in r.stderr and time.monotonic() - t0 < 30
    assert log_entries(store) == []
    for i in range(1, 4):
        commit_rollouts(store, 0, i, rows_for(0, f"a{i}", [[0.0, 1.0], [0.0, 1.0]], seed=i))
    r = run_step(root, max_batches=3, **{"polling.bounded_wait_s": 1})
    assert r.returncode == 0, r.stderr
    assert "committed 1 of max_batches=3" in r.stderr and "policies/step-00000001/COMMITTED" in r.stderr
    assert "Traceback" not in r.stderr
    assert [e["slot"] for e in log_entries(store)] == [1]


def test_two_processes_one_exits_naming_the_holder(run_root: tuple[Path, RunStore]) -> None:
    root, store = run_root
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(
        step_args(root, follow=True, holder_id="maker-A", lease_ttl_s=3, **{"train.max_batch_latency_s": 60}),
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 30
        while not store.list("leases/batchmaker") and time.time() < deadline:
            time.sleep(0.05)
        second = run_step(root, follow=True, holder_id="maker-B")
        assert second.returncode == Exit.LEASE_HELD, second.stderr
        assert "maker-A" in second.stderr
        store.put_unique(layout.STOP_FILE, b"stop")
        assert first.wait(timeout=30) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def test_corrupt_file_quarantined_and_step_goes_on(run_root: tuple[Path, RunStore]) -> None:
    root, store = run_root
    bad = commit_rollouts(store, 0, 0, rows_for(0, "bad", [[0.0, 1.0], [0.0, 1.0]]))
    Path(store.full_path(bad)).write_bytes(b"PAR1 this is not parquet")
    commit_rollouts(store, 0, 1, rows_for(0, "good", [[0.0, 1.0], [0.0, 1.0]]))
    r = run_step(root, max_batches=1)
    assert r.returncode == 0, r.stderr
    assert store.is_quarantined(bad)
    (entry,) = log_entries(store)
    assert bad not in entry["ingested_files"] and set(batch_uses(store)) == {
        f"good-{g}-{k}" for g in (0, 1) for k in (0, 1)
    }


def test_malformed_rows_dropped_with_reason(run_root: tuple[Path, RunStore]) -> None:
    root, store = run_root
    rows = rows_for(0, "m", [[0.0, 1.0, 0.0, 1.0, 1.0, 0.0]])
    rows[0] = dataclasses.replace(rows[0], token_rewards=[*rows[0].token_rewards, 0.0])
    rows[1] = dataclasses.replace(rows[1], episode_reward=math.nan)
    commit_rollouts(store, 0, 0, rows, validate=False)
    r = run_step(root, max_batches=1)
    assert r.returncode == 0, r.stderr
    dropped = {d["rollout_id"]: d for d in dropped_rows(store)}
    assert dropped["m-0-0"]["reason"] == "malformed" and "lengths disagree" in dropped["m-0-0"]["detail"]
    assert dropped["m-0-1"]["reason"] == "malformed" and "episode_reward" in dropped["m-0-1"]["detail"]
    assert set(batch_uses(store)) == {f"m-0-{k}" for k in range(2, 6)}


def test_stale_and_future_files_dropped_with_reason(run_root: tuple[Path, RunStore]) -> None:
    root, store = run_root
    for s in range(1, 5):
        publish_policy(store, s)
    for s in range(1, 5):  # slots 1..4 exist already: the learner is at policy 4
        put_log_entry(store, s, config_hash="x")  # an empty slot: no files seen, an empty reservoir
    commit_rollouts(store, 2, 0, rows_for(2, "stale", [[0.0, 1.0]]))  # slot 5 allows policies 3..4
    store.commit_data(layout.rollout_file(9, "w", 0), ROLLOUT.to_table(rows_for(9, "future", [[0.0, 1.0]])), ROLLOUT)
    commit_rollouts(store, 4, 1, rows_for(4, "ok", [[0.0, 1.0], [1.0, 0.0]]))
    r = run_step(root, max_batches=1)
    assert r.returncode == 0, r.stderr
    reasons = {d["rollout_id"]: d["reason"] for d in dropped_rows(store)}
    assert reasons == {"stale-0-0": "stale", "stale-0-1": "stale", "future-0-0": "future_policy",
                       "future-0-1": "future_policy"}  # fmt: skip


@pytest.mark.parametrize(("flag", "value"), [("train.max_lag", -1), ("train.batch_size", 0)])
def test_bad_config_refused_naming_the_field(tmp_path: Path, flag: str, value: int) -> None:
    r = run_step(tmp_path / "run", max_batches=1, **{flag: value})
    assert r.returncode == Exit.CONFIG
    assert flag in r.stderr
    assert not (tmp_path / "run" / "batches").exists()


def test_follow_mode_ends_when_the_learner_finishes(run_root: tuple[Path, RunStore]) -> None:
    root, store = run_root
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        step_args(root, follow=True, **{"train.num_train_steps": 3, "train.max_batch_latency_s": 30}),
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        seq = 0
        learner = 0
        while proc.poll() is None and time.time() < deadline:
            commit_rollouts(store, learner, seq, rows_for(learner, f"s{seq}", [[0.0, 1.0], [1.0, 0.0]], seed=seq))
            seq += 1
            while store.exists(layout.batch_log_entry(learner + 1)):  # the simulated learner consumes a slot
                learner += 1
                publish_policy(store, learner)
            time.sleep(0.1)
        assert proc.wait(timeout=5) == 0
        assert [e["slot"] for e in log_entries(store)] == [1, 2, 3] and learner == 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("write_behind", [True, False])
def test_slot_taken_by_another_maker_is_discarded_and_recovered(
    run_root: tuple[Path, RunStore], write_behind: bool
) -> None:
    """A maker that built slot 1 while a real step process committed it first loses the slot, keeps no trace of
    its own attempt in the log, and recovers to slot 2 from the winner's entry."""
    from pipeline.batch_maker.loop import BatchMakerLoop
    from pipeline.batch_maker.loop_state import SlotLost, new_slot_log
    from pipeline.config import BatchMakerStepConfig, StoreConfig, TrainParams
    from pipeline.store.lease import Lease

    root, store = run_root
    for seq in range(2):
        commit_rollouts(store, 0, seq, rows_for(0, f"f{seq}", [[0.0, 1.0], [1.0, 0.0]]))
    train = TrainParams(batch_size=4, seq_len=16, max_lag=1, max_batches_ahead=1, max_batch_latency_s=3)
    cfg = BatchMakerStepConfig(store=StoreConfig(run_root=str(root)), train=train, write_behind=write_behind)
    # its own lease name, so the real step below can take the batchmaker lease: only the commit decides
    lease = Lease(store, "other-maker", "loser", 30.0)
    lease.acquire()
    maker = BatchMakerLoop(cfg, store, lease)
    committed: list[int] = []
    maker.after_commit = lambda slot, batch, log: committed.append(slot)
    st = maker.recover()
    log = new_slot_log()
    maker.gather(st, 1, log)
    batch = st.bm.make_batch(1)
    assert batch is not None

    winner = run_step(root, max_batches=1)
    assert winner.returncode == 0, winner.stderr[-2000:]
    winner_entry = store.get_json(layout.batch_log_entry(1))

    if write_behind:
        assert maker.commit(st, batch, log, 0) is True  # accepted for writing; the outcome comes with settle()
        with pytest.raises(SlotLost):
            maker.settle()
    else:
        assert maker.commit(st, batch, log, 0) is False
    maker.close()
    assert committed == []
    assert store.get_json(layout.batch_log_entry(1)) == winner_entry
    assert [layout.parse_step(p) for p in store.list(layout.BATCH_LOG)] == [1]
    assert maker.recover().next_slot == 2


def test_late_file_in_a_sealed_folder_is_recorded_as_dropped_once(run_root: tuple[Path, RunStore]) -> None:
    """A rollout file committed into a policy folder after it left the scan window (a very slow worker) is found
    by a later slot's sweep and its rows are dropped `stale` exactly once, also across a restart; its group without
    reward spread is dropped `zero_variance`, not `stale` (it could not have trained fresh either)."""
    root, store = run_root
    for p in range(10):
        publish_policy(store, p)
        commit_rollouts(store, p, 0, rows_for(p, f"p{p}", [[0.0, 1.0], [1.0, 0.0]], seed=p))
    kw: dict[str, Any] = {"train.num_train_steps": 10, "train.max_batches_ahead": 3, "late_sweep_folders": 2}
    r = run_step(root, max_batches=8, **kw)
    assert r.returncode == 0, r.stderr[-2000:]
    entries = {e["slot"]: e for e in log_entries(store)}
    # max_lag 1 + 4 late-scan steps: slot 6 moved the scan window past folder 0, slot 7 past folder 1
    assert entries[6]["sealed"] == {"0": [layout.rollout_file(0, "w", 0)]}
    assert entries[7]["sealed"] == {"1": [layout.rollout_file(1, "w", 0)]}
    late = commit_rollouts(store, 1, 1, rows_for(1, "late", [[0.0, 1.0, 1.0], [1.0, 1.0]], seed=99))

    r = run_step(root, max_batches=2, **kw)  # slot 9 sweeps folders 1-2 (round robin), slot 10 (final) all
    assert r.returncode == 0, r.stderr[-2000:]
    entries = {e["slot"]: e for e in log_entries(store)}
    assert sorted(entries) == list(range(1, 11))
    assert [s for s, e in entries.items() if e.get("late_files")] == [9]
    assert entries[9]["late_files"] == [late] and late in entries[9]["ingested_files"]
    drops = [d for d in dropped_rows(store) if d["source_file"] == late]
    assert sorted(d["rollout_id"] for d in drops) == ["late-0-0", "late-0-1", "late-0-2", "late-1-0", "late-1-1"]
    assert {d["rollout_id"]: d["reason"] for d in drops} == {
        **dict.fromkeys(["late-0-0", "late-0-1", "late-0-2"], "stale"),
        **dict.fromkeys(["late-1-0", "late-1-1"], "zero_variance"),
    }
    assert not any(rid.startswith("late-") for rid in batch_uses(store))
