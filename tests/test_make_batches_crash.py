"""Crash test: SIGKILL the real `python -m steps.make_batches` at random points while rollout files keep
arriving and a simulated learner consumes slots; restart it each time; then check the invariants.

Invariants checked (I1-I3 of tests/invariants.py, for the BatchMaker):
- slots are contiguous from 1, each log entry's data file exists and matches its size and sha256, has
  batch_size rows, and its dropped file exists; lease epochs never go backwards along the slots;
- no rollout row is in more than max_samples_per_rollout committed batches, none is dropped twice, and a
  file is "first read" (ingested_files) by at most one committed slot;
- every committed rollout row is used up (in exactly max_samples_per_rollout batches), dropped with a reason,
  live in the newest cursor with exactly the use count the batch lineage shows, or in a file no committed
  slot has read yet (still pending); rows of quarantined files are in no batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.process.exits import Exit
from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas import BATCH, ROLLOUT, RolloutRow
from schemas.records import ReadyMarker

REPO = Path(__file__).resolve().parents[1]
KILLS = 20
TTL_S = 1.0
BATCH_SIZE = 4
MAX_USES = 2
MAX_LAG = 1
LATE_SCAN_STEPS = 4  # pipeline.batch_maker.scan.LATE_SCAN_STEPS


def _rows(policy: int, tag: str, rng: np.random.Generator) -> list[RolloutRow]:
    out = []
    for g in range(2):
        prompt = rng.integers(1, 50, 3).tolist()
        constant = rng.random() < 0.1
        for k in range(3):
            n = int(rng.integers(1, 8))
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
                    episode_reward=1.0 if constant else float(k % 2),
                    truncated=False,
                    finish_reason="stop",
                    temperature=1.0,
                    policy_step=policy,
                    worker_id="w",
                    timestamp=time.time(),
                )
            )
    return out


class World:
    """A rollout producer and a simulated learner running as threads against the run root."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.learner = 0
        self.stop = threading.Event()
        self.produce = threading.Event()
        self.produce.set()
        self.files = 0
        self.corrupt: list[str] = []
        store.put_json_if_absent(layout.policy_marker(0), {"step": 0})

    def producer(self) -> None:
        rng = np.random.default_rng(1)
        seq = 0
        per_policy: dict[int, int] = {}
        while not self.stop.is_set():
            if not self.produce.is_set():
                time.sleep(0.05)
                continue
            policy = self.learner
            if per_policy.get(policy, 0) >= 3:  # paced like real workers: a few writes per policy
                time.sleep(0.02)
                continue
            per_policy[policy] = per_policy.get(policy, 0) + 1
            if rng.random() < 0.15:  # a late file from an older policy (possibly already stale)
                policy = max(0, policy - int(rng.integers(1, 4)))
            path = layout.rollout_file(policy, "w", seq)
            if rng.random() < 0.03:  # a corrupt file behind a valid-looking marker
                junk = b"PAR1 not a parquet file" + bytes(rng.integers(0, 255, 64, dtype=np.uint8))
                self.store.put_unique(path, junk)
                marker = ReadyMarker(
                    file=path,
                    size=len(junk),
                    sha256=hashlib.sha256(junk).hexdigest(),
                    rows=6,
                    schema=ROLLOUT.tag,
                    attempt_id=f"junk{seq}",
                    time=time.time(),
                )
                self.store.put_if_absent(layout.ready_marker(path), marker.to_json())
                self.corrupt.append(path)
            else:
                self.store.commit_data(path, ROLLOUT.to_table(_rows(policy, f"r{seq}", rng)), ROLLOUT)
            seq += 1
            self.files = seq
            time.sleep(0.03)

    def learner_loop(self) -> None:
        while not self.stop.is_set():
            while self.store.exists(layout.batch_log_entry(self.learner + 1)):
                self.learner += 1
                self.store.put_json_if_absent(layout.policy_marker(self.learner), {"step": self.learner})
            time.sleep(0.03)


def _start(root: Path) -> subprocess.Popen[bytes]:
    args = [
        sys.executable, "-m", "steps.make_batches", "--store.run_root", str(root), "--follow", "true",
        "--holder_id", "crash-maker", "--lease_ttl_s", str(TTL_S), "--polling.interval_s", "0.02",
        "--train.batch_size", str(BATCH_SIZE), "--train.seq_len", "24", "--train.max_lag", str(MAX_LAG),
        "--train.max_samples_per_rollout", str(MAX_USES), "--train.max_batches_ahead", "2",
        "--train.num_train_steps", "100000", "--train.max_batch_latency_s", "30", "--train.pack", "true",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOGLEVEL": "WARNING"}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def check_invariants(store: RunStore, corrupt: list[str]) -> dict[str, int]:
    """Assert the invariants of the module docstring; return counts per fate."""
    names = store.list(layout.BATCH_LOG)
    entries = [store.get_json(p) for p in names]
    slots = [e["slot"] for e in entries]
    assert slots == list(range(1, len(slots) + 1)), slots
    assert [layout.parse_step(p) for p in names] == slots
    uses: Counter[tuple[str, str]] = Counter()
    dropped: Counter[tuple[str, str]] = Counter()
    first_read: Counter[str] = Counter()
    epochs = []
    for e in entries:
        data = store.get(e["data_file"])
        assert len(data) == e["data_size"] and hashlib.sha256(data).hexdigest() == e["data_sha256"]
        t = store.read_parquet(e["data_file"], BATCH)
        assert t.num_rows == BATCH_SIZE == e["rows"]
        in_batch = [
            (f, r)
            for fs, rs in zip(t.column("source_files").to_pylist(), t.column("rollout_ids").to_pylist(), strict=True)
            for f, r in zip(fs, rs, strict=True)
        ]
        assert len(set(in_batch)) == len(in_batch)
        uses.update(in_batch)
        if e["dropped_file"]:
            d = pq.read_table(store.full_path(e["dropped_file"]))
            assert all(r for r in d.column("reason").to_pylist())
            dropped.update(zip(d.column("source_file").to_pylist(), d.column("rollout_id").to_pylist(), strict=True))
        first_read.update(e["ingested_files"])
        epochs.append(e["lease_epoch"])
    assert epochs == sorted(epochs)
    assert not [f for f, n in first_read.items() if n > 1], "a file was first read by two committed slots"
    assert max(uses.values(), default=0) <= MAX_USES
    assert max(dropped.values(), default=0) <= 1
    last = entries[-1] if entries else {"cursor": {"reservoir": {"files": []}}}
    live: dict[tuple[str, int], int] = {}
    for f in last["cursor"]["reservoir"]["files"]:
        live.update({(f["path"], r): u for r, u in zip(f["rows"], f["uses"], strict=True)})
    scan_low = max(0, len(entries) - MAX_LAG - LATE_SCAN_STEPS)  # scan range of the next slot
    fates: Counter[str] = Counter()
    for p in layout_policy_dirs(store):
        for path in store.list_committed(layout.rollout_step_dir(p)):
            if path in corrupt:
                continue
            table = store.read_committed(path, ROLLOUT)
            assert table is not None, path
            for i, rid in enumerate(table.column("rollout_id").to_pylist()):
                key = (path, rid)
                u = uses.get(key, 0)
                if dropped[key]:
                    assert (path, i) not in live
                    fates["dropped"] += 1
                elif (path, i) in live:
                    assert u == live[(path, i)] < MAX_USES, (key, u, live[(path, i)])
                    fates["live"] += 1
                elif u == MAX_USES:
                    fates["used_up"] += 1
                else:
                    assert u == 0 and path not in first_read and p >= scan_low, (key, u, p, scan_low)
                    fates["pending"] += 1
    for path in corrupt:
        assert store.is_quarantined(path) or path not in first_read
        assert not [k for k in uses if k[0] == path]
    return dict(fates)


def _epochs(store: RunStore) -> int:
    return len([p for p in store.list("leases/batchmaker") if p.endswith(".json") and ".renew-" not in p])


def layout_policy_dirs(store: RunStore) -> list[int]:
    return sorted(layout.parse_step(p) for p in store.list(layout.ROLLOUTS))


@pytest.mark.slow
def test_sigkill_at_random_points_keeps_invariants(tmp_path: Path) -> None:
    root = tmp_path / "run"
    store = RunStore(str(root))
    world = World(store)
    threads = [
        threading.Thread(target=world.producer, daemon=True),
        threading.Thread(target=world.learner_loop, daemon=True),
    ]
    for t in threads:
        t.start()
    rng = random.Random(0)
    kills = 0
    t0 = time.time()
    proc: subprocess.Popen[bytes] | None = None
    try:
        while kills < KILLS:
            epochs = _epochs(store)
            proc = _start(root)
            up = time.time() + 60
            while _epochs(store) == epochs and proc.poll() is None and time.time() < up:
                time.sleep(0.01)  # kill only after start-up (imports), once it holds the lease
            try:
                rc = proc.wait(timeout=rng.uniform(0.0, 1.2))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills += 1
                continue  # the restart's start-up (imports) outlasts TTL_S; if not, it exits LEASE_HELD and is retried
            err = proc.stderr.read().decode() if proc.stderr else ""
            assert rc == Exit.LEASE_HELD and "crash-maker" in err, f"maker exited {rc}: {err[-2000:]}"
            time.sleep(0.2)
        # settle: no new files; a last maker runs uninterrupted until it has nothing left to do, then STOP
        world.produce.clear()
        time.sleep(TTL_S + 0.1)  # the last killed holder's lease lapses
        proc = _start(root)
        time.sleep(4.0)
        store.put_unique(layout.STOP_FILE, b"stop")
        rc = proc.wait(timeout=30)
        err = proc.stderr.read().decode() if proc.stderr else ""
        assert rc == 0, err[-2000:]
    finally:
        world.stop.set()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for t in threads:
            t.join(timeout=5)
    fates = check_invariants(store, world.corrupt)
    slots = len(store.list(layout.BATCH_LOG))
    summary = {"kills": kills, "slots": slots, "files": world.files, "seconds": round(time.time() - t0, 1), **fates}
    print(json.dumps(summary))
    assert slots >= KILLS, summary  # it made progress between kills
    assert fates.get("dropped", 0) > 0 and fates.get("used_up", 0) > 0
