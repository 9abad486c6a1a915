"""The file transport at scale, simulated: N rollout workers, the real BatchMaker and a stub learner on one run root.

    python -m bench.bench_scale                               # N = 10, 100, 1000 on local disk and the GCS emulator
    python -m bench.bench_scale --workers 10,200 --backends local --slots 20
    python -m bench.bench_scale --latency_ms 30               # every storage request of every party made 30 ms slower

What runs (all in this process, against the real storage code):

- N simulated rollout workers (no model). A bounded pool of `--threads` driver threads plays them: each logical
  worker writes one rollout file of `--rows_per_file` rows (groups of 4, responses of ~`--resp_tokens` tokens)
  every `N / --files_per_s` seconds, so the *aggregate* supply is the same at every N (a larger pool of slower
  workers, as with a larger model), through `RunStore.commit_data` into `rollouts/step-P/` where P is the newest
  policy the worker saw when it checked (`run_state.latest_policy_step`, as the real worker does before a write);
- the real BatchMaker machinery (`pipeline.batch_maker.loop.BatchMakerLoop`, driven slot by slot exactly as
  `steps.make_batches.main` drives it: pace, gather, build, commit with write-behind), on its own store;
- a stub learner: waits for batch slot T's log entry, reads the batch through the real verified read
  (`pipeline.batch_maker.rebuild.verified_batch`), sleeps `--step_s`, and publishes policy T of `--policy_mib` MiB
  through the real commit path (`policy.policy_format.committed.write_committed`, then the LATEST hint).

Each party has its own `CountingStore` (a RunStore that counts every storage request by kind, the objects a
listing returned, and can add `--latency_ms` before each request). Counted per committed slot of the BatchMaker
(after `--warmup` slots): requests by kind (list / get / put / head / delete; a GCS listing returns at most 1,000
objects per request, so `list` counts ceil(entries / 1000) requests per listing), listed entries, slot latency
(the learner asked for the slot -> its log entry exists; median and 90th percentile) and the BatchMaker's
reservoir arrays at their peak. Workers' requests are reported per rollout file.

Results: a table on stdout; `--json PATH` writes the rows.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa

from bench.common import gcs_emulator_class, machine_name
from pipeline.batch_maker.loop import BatchMakerLoop
from pipeline.batch_maker.loop_state import new_slot_log
from pipeline.batch_maker.rebuild import verified_batch
from pipeline.batch_maker.scan import ScanWindow
from pipeline.config import BatchMakerStepConfig, PollingConfig, StoreConfig, TrainParams
from pipeline.config.validate import validate_batch_maker
from pipeline.process.step_kind import StepKind
from pipeline.store import layout, run_state
from pipeline.store.lease import Lease
from pipeline.store.storage import RunStore
from schemas import ROLLOUT
from schemas.records import LatestPointer

logger = logging.getLogger("bench.scale")

GCS_LIST_PAGE = 1000
"""Objects one GCS list request returns at most (the JSON API's maxResults ceiling)."""
KINDS = ("list", "get", "put", "head", "delete")


GCS_LATENCY_MS = {"list": 40.0, "get": 30.0, "put": 50.0, "head": 25.0, "delete": 30.0}
"""`--latency_ms gcs`: added per request by kind. Google publishes no latency figures for Cloud Storage (only
request-rate guidance: ~1,000 object writes/s and ~5,000 reads/s per bucket before it autoscales); these are
typical same-region first-byte times for small objects, an assumption stated as such in docs/scale.md."""


def parse_latency(text: str) -> dict[str, float]:
    """`--latency_ms`: a number (ms for every request), `gcs` (`GCS_LATENCY_MS`) or `list=40,get=30,...`."""
    text = text.strip()
    if text == "gcs":
        return {k: v / 1000.0 for k, v in GCS_LATENCY_MS.items()}
    if "=" not in text:
        return dict.fromkeys(KINDS, float(text) / 1000.0)
    out = dict.fromkeys(KINDS, 0.0)
    for part in text.split(","):
        k, _, v = part.partition("=")
        if k.strip() not in out:
            raise ValueError(f"--latency_ms: unknown request kind {k!r} (one of {', '.join(KINDS)})")
        out[k.strip()] = float(v) / 1000.0
    return out


class CountingStore(RunStore):
    """A RunStore that counts its storage requests by kind (thread-safe) and can delay each by `latency_s[kind]`.

    Counting sits on the RunStore primitives, so it is the same on every backend: one `get`/`put`/`head`/`delete`
    is one object request (a small object: one upload; `put_if_absent` that collides reads the object back, counted
    as a `get`); a listing counts ceil(entries / 1000) `list` requests, as GCS pages it, and `listed` the entries
    it returned (`list_after`: only the entries after its start offset, as GCS returns them; on local disk the
    directory read itself is O(entries), but free). `seconds` is the wall time spent inside requests, by kind."""

    def __init__(
        self, root: str, storage_options: dict[str, Any] | None = None, latency_s: dict[str, float] | None = None
    ) -> None:
        super().__init__(root, storage_options)
        self.latency_s = dict(latency_s or {})
        self._lock = threading.Lock()
        self._inner = threading.local()
        self.ops = dict.fromkeys(KINDS, 0)
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.listed = 0
        self.list_calls = 0

    @contextlib.contextmanager
    def _request(self, kind: str, n: int = 1) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            if self.latency_s.get(kind, 0.0) > 0:
                time.sleep(self.latency_s[kind] * n)
            yield
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.ops[kind] += n
                self.seconds[kind] += dt

    def snapshot(self) -> dict[str, float]:
        """The counts so far (`listed`: objects returned by listings; `list_calls`: listings made)."""
        with self._lock:
            return {**self.ops, "listed": self.listed, "list_calls": self.list_calls,
                    **{f"{k}_s": v for k, v in self.seconds.items()}}  # fmt: skip

    def get(self, rel: str) -> bytes:
        with self._request("get"):
            return super().get(rel)

    def _holds(self, full: str, data: bytes) -> bool:
        with self._request("get"):
            return super()._holds(full, data)

    def put_unique(self, rel: str, data: bytes) -> None:
        with self._request("put"):
            super().put_unique(rel, data)

    def put_if_absent(self, rel: str, data: bytes) -> bool:
        with self._request("put"):
            return super().put_if_absent(rel, data)

    def exists(self, rel: str) -> bool:
        with self._request("head"):
            return super().exists(rel)

    def delete(self, rel: str) -> None:
        with self._request("delete"):
            super().delete(rel)

    def _listing(self, fn: Any, *args: str) -> list[str]:
        if getattr(self._inner, "depth", 0):  # list() inside list_after() (local disk): counted as the list_after
            out: list[str] = fn(*args)
            return out
        t0 = time.perf_counter()
        self._inner.depth = 1
        try:
            out = fn(*args)
        finally:
            self._inner.depth = 0
        pages = max(1, math.ceil(len(out) / GCS_LIST_PAGE))
        if self.latency_s.get("list", 0.0) > 0:
            time.sleep(self.latency_s["list"] * pages)
        with self._lock:
            self.listed += len(out)
            self.list_calls += 1
            self.ops["list"] += pages
            self.seconds["list"] += time.perf_counter() - t0
        return out

    def list(self, rel_dir: str) -> list[str]:
        return self._listing(super().list, rel_dir)

    def list_after(self, rel_dir: str, start_after: str) -> builtins.list[str]:
        return self._listing(super().list_after, rel_dir, start_after)


def diff(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """b - a, key by key."""
    return {k: b[k] - a.get(k, 0) for k in b}


# --- the simulated parties ------------------------------------------------------------------------


@dataclasses.dataclass
class SimConfig:
    """One simulation run's shape."""

    workers: int
    files_per_s: float
    rows_per_file: int
    resp_tokens: int
    batch_size: int
    step_s: float
    policy_bytes: int
    slots: int
    warmup: int
    threads: int
    max_lag: int = 2
    seed: int = 0
    history: int = 0
    """Slots already made before the run (a long run's past): policies 0..history, `history_files` committed
    rollout files spread over the old policy folders, and log entries 1..history (empty slots)."""
    history_files: int = 0


def rollout_table(n: int, rng: np.random.Generator, resp_mean: int) -> pa.Table:
    """`n` rollout rows (schema `ROLLOUT`, groups of 4 with continuous rewards) with ~`resp_mean` response tokens."""
    p_len = np.repeat(rng.integers(32, 97, max(1, n // 4)), 4)[:n]
    r_len = rng.integers(max(1, resp_mean // 2), resp_mean * 3 // 2 + 1, n)

    def lists(lengths: np.ndarray, values: np.ndarray) -> pa.Array:
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    n_tok = int(r_len.sum())
    cols: dict[str, Any] = {
        "rollout_id": [f"r{i}" for i in range(n)],
        "env_name": ["math"] * n,
        "example_id": [f"ex{i // 4}" for i in range(n)],
        "lesson_id": ["lesson"] * n,
        "group_key": [f"g{i // 4}" for i in range(n)],
        "prompt_tokens": lists(p_len, rng.integers(0, 32000, int(p_len.sum()), dtype=np.int32)),
        "response_tokens": lists(r_len, rng.integers(0, 32000, n_tok, dtype=np.int32)),
        "response_logprobs": lists(r_len, -rng.random(n_tok, dtype=np.float32)),
        "token_rewards": lists(r_len, np.zeros(n_tok, dtype=np.float32)),
        "response_loss_mask": lists(r_len, np.ones(n_tok, dtype=np.int8)),
        "episode_reward": rng.random(n),
        "truncated": np.zeros(n, dtype=bool),
        "finish_reason": ["stop"] * n,
        "temperature": np.ones(n, dtype=np.float32),
        "policy_step": np.zeros(n, dtype=np.int64),
        "worker_id": ["w0"] * n,
        "timestamp": np.zeros(n),
        "top_p": np.ones(n, np.float32),
        "top_k": np.zeros(n, np.int32),
        "min_p": np.zeros(n, np.float32),
        "response_text": ["x"] * n,
        "extracted_answer": pa.array([None] * n, pa.string()),
        "ground_truth": [""] * n,
        "reward_components": pa.array([[] for _ in range(n)], pa.map_(pa.string(), pa.float64())),
        "episode_id": [f"e{i}" for i in range(n)],
        "segment_index": np.zeros(n, np.int32),
    }
    if "token_policy_steps" in ROLLOUT.arrow_schema().names:  # version 4: empty = every token of `policy_step`
        cols["token_policy_steps"] = pa.array([[] for _ in range(n)], pa.list_(pa.int32()))
    return ROLLOUT.conform(pa.table(cols), "<simulated>")


class Workers:
    """N logical rollout workers played by `threads` driver threads; each writes one file every N / files_per_s s."""

    def __init__(self, store: CountingStore, cfg: SimConfig, stop: threading.Event) -> None:
        self.store = store
        self.cfg = cfg
        self.stop = stop
        self.files = 0
        self._lock = threading.Lock()
        rng = np.random.default_rng(cfg.seed)
        # A few row templates (rows of the configured size), re-labelled per file: building parquet is the real
        # cost of a commit, generating the numbers is not what is measured.
        self.templates = [rollout_table(cfg.rows_per_file, rng, cfg.resp_tokens) for _ in range(4)]
        self.threads = [
            threading.Thread(target=self._drive, args=(t,), name=f"sim-worker-{t}", daemon=True)
            for t in range(min(cfg.threads, cfg.workers))
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=30)

    def _drive(self, t: int) -> None:
        cfg = self.cfg
        period = cfg.workers / cfg.files_per_s
        mine = list(range(t, cfg.workers, len(self.threads)))
        rnd = random.Random(cfg.seed * 1000 + t)
        due = {w: time.monotonic() + rnd.uniform(0, period) for w in mine}
        seq = dict.fromkeys(mine, 0)
        while not self.stop.is_set():
            w = min(due, key=due.__getitem__)
            delay = due[w] - time.monotonic()
            if delay > 0 and self.stop.wait(delay):
                return
            self._write(w, seq[w])
            seq[w] += 1
            due[w] += period

    def _write(self, w: int, seq: int) -> None:
        policy = run_state.latest_policy_step(self.store)
        if policy is None:
            return
        write_rollout_file(self.store, self.templates[seq % len(self.templates)], f"w{w:05d}", seq, policy)
        with self._lock:
            self.files += 1


def write_rollout_file(store: RunStore, template: pa.Table, worker_id: str, seq: int, policy: int) -> str:
    """Commit `template`'s rows, re-labelled as worker `worker_id`'s file `seq` of policy `policy`; its path."""
    n = template.num_rows
    table = template
    ids = pa.array([f"{worker_id}-{seq}-{i}" for i in range(n)])
    groups = pa.array([f"{worker_id}-{seq}-g{i // 4}" for i in range(n)])
    table = table.set_column(table.schema.get_field_index("rollout_id"), "rollout_id", ids)
    table = table.set_column(table.schema.get_field_index("group_key"), "group_key", groups)
    steps = pa.array(np.full(n, policy, dtype=np.int64))
    table = table.set_column(table.schema.get_field_index("policy_step"), "policy_step", steps)
    path = layout.rollout_file(policy, worker_id, seq)
    store.commit_data(path, table, ROLLOUT)
    return path


def publish_policy(store: RunStore, step: int, blob: bytes) -> None:
    """Publish policy `step` (one file `blob`) through the real commit path, then advance the LATEST hint."""
    from policy.policy_format.committed import write_committed

    meta = {"step": step, "vocab_size": 32000, "kind": "policy"}
    write_committed(store, layout.policy_dir(step), {"weights": blob}, meta)
    store.put_unique(layout.POLICY_LATEST, LatestPointer(step=step).to_json())


class StubLearner:
    """Trains nothing: reads each committed batch (verified) and publishes a policy of `policy_bytes` bytes."""

    def __init__(self, store: CountingStore, cfg: SimConfig, train: TrainParams, stop: threading.Event) -> None:
        self.store = store
        self.cfg = cfg
        self.train = train
        self.stop = stop
        self.asked_at: dict[int, float] = {}
        """slot -> when the learner started waiting for it (it had published policy slot - 1)."""
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="stub-learner", daemon=True)
        self.blob = np.random.default_rng(cfg.seed).bytes(cfg.policy_bytes)

        self.first = cfg.history + 1
        """The first slot this learner trains (slots 1..history are the pre-made history)."""

    def publish(self, step: int) -> None:
        publish_policy(self.store, step, self.blob)

    def _run(self) -> None:
        try:
            for slot in range(self.first, self.first + self.cfg.slots):
                self.asked_at[slot] = time.time()
                path = layout.batch_log_entry(slot)
                while not self.store.exists(path):
                    if self.stop.wait(0.01):
                        return
                entry = self.store.read_log_entry(slot)
                verified_batch(self.store, entry, self.train)
                time.sleep(self.cfg.step_s)
                self.publish(slot)
        except BaseException as e:  # reported by the driver
            self.error = e
            self.stop.set()


# --- one run --------------------------------------------------------------------------------------


def make_history(store: RunStore, history: int, history_files: int, max_lag: int, table: pa.Table) -> None:
    """A long run's past on a fresh root: policies 0..history (tiny; LATEST names `history`), `history_files`
    committed rollout files of `table` spread over the policy folders below slot history+1's scan window, and the
    log entries of slots 1..history (empty slots, each sealing the folders that left the scan window with it).

    The objects are the ones the real commit paths write (the same data, ready markers, COMMITTED markers and
    log entries, built by the same record classes), uploaded in bulk (`fs.pipe`: concurrent, no fsync) because a
    fixture of thousands of files through the one-by-one durable path takes minutes; nothing here is measured.
    """
    from schemas import BATCH
    from schemas.records import (
        CHECKPOINT_FORMAT,
        BatchLogEntry,
        CommitFile,
        CommitMarker,
        Cursor,
        Lineage,
        ReadyMarker,
        Reservoir,
    )

    def sha256_hex(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    objects: dict[str, bytes] = {}
    blob = b"old"
    for step in range(history + 1):
        folder = layout.policy_dir(step)
        objects[layout.join(folder, "weights-old.safetensors")] = blob
        fields = {"step": step, "vocab_size": 32000, "kind": "policy", "format": CHECKPOINT_FORMAT, "attempt_id": "old",
                  "files": {"weights": CommitFile(path="weights-old.safetensors", size=len(blob),
                                                  sha256=sha256_hex(blob)).to_dict()}}  # fmt: skip
        marker_path = layout.join(folder, layout.COMMIT_MARKER)
        objects[marker_path] = CommitMarker.from_json(fields, path=marker_path).to_json()
    data = RunStore.parquet_bytes(table, ROLLOUT)
    below = max(1, history - max_lag - 6)  # every old file in a folder below the first slot's scan window
    paths = [layout.rollout_file(i % below, f"old{i % 97:03d}", i) for i in range(history_files if history else 0)]
    digest = sha256_hex(data)
    for path in paths:
        objects[path] = data
        marker = {"file": path, "size": len(data), "sha256": digest, "rows": table.num_rows, "schema": ROLLOUT.tag,
                  "attempt_id": "old", "time": time.time()}  # fmt: skip
        ready = layout.ready_marker(path)
        objects[ready] = ReadyMarker.from_json(marker, path=ready).to_json()
    scan = ScanWindow(store, max_lag)
    by_folder: dict[int, list[str]] = {}
    for path in paths:
        by_folder.setdefault(layout.parse_step(path), []).append(path)
    for t in range(1, history + 1):
        leaving = range(scan.scan_low(t), scan.scan_low(t + 1))
        entry = BatchLogEntry(
            slot=t, attempt_id=f"history-{t}", seq_len=0, schema=BATCH.tag, holder="history", lease_epoch=1,
            config_hash="history", learner_step=t - 1, ingested_files=[], quarantined_files=[], late_files=[],
            filled_no_signal=0, sealed={str(p): sorted(by_folder.get(p, [])) for p in leaving},
            lineage=Lineage(n_rollouts=0, n_groups=0, policy_steps=[0, 0], staleness=[0.0, 0.0, 0.0],
                            source_files=[]),
            cursor=Cursor(version=1, seen=[], reservoir=Reservoir(next_seq=0, files=[]), late=[], sweep_next=0),
            data_file=layout.batch_data_file(t, "history"), data_size=0, data_sha256="", rows=0, time=time.time(),
            dropped_file=None, dropped={},
        )  # fmt: skip
        objects[layout.batch_log_entry(t)] = entry.to_json()
    if store.is_local:
        for folder in {os.path.dirname(store.full_path(rel)) for rel in objects}:
            os.makedirs(folder, exist_ok=True)
    store.fs.pipe({store.full_path(rel): data for rel, data in objects.items()})
    store.put_unique(layout.POLICY_LATEST, LatestPointer(step=history).to_json())


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` (None: this process) so far."""
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def run_once(
    root: str,
    options: dict[str, Any] | None,
    cfg: SimConfig,
    latency_s: dict[str, float] | None = None,
    server_pid: int | None = None,
) -> dict[str, Any]:
    """One simulation on a fresh run root; per-slot figures after the warm-up slots.

    `server_pid`: the storage server's process (the emulator), whose CPU use over the measured slots is reported.
    """
    first = cfg.history + 1
    last = cfg.history + cfg.slots
    train = TrainParams(
        num_train_steps=last,
        batch_size=cfg.batch_size,
        seq_len=max(256, 2 * cfg.resp_tokens + 128),
        max_lag=cfg.max_lag,
        max_batches_ahead=1,
        max_batch_latency_s=120.0,
    )
    config = BatchMakerStepConfig(
        store=StoreConfig(run_root=root, storage_options=dict(options or {})),
        train=train,
        polling=PollingConfig(interval_s=0.2),
        holder_id="bench-scale",
    )
    validate_batch_maker(config)
    bm_store = CountingStore(root, options, latency_s)
    worker_store = CountingStore(root, options, latency_s)
    learner_store = CountingStore(root, options, latency_s)
    stop = threading.Event()
    learner = StubLearner(learner_store, cfg, train, stop)
    workers = Workers(worker_store, cfg, stop)
    if cfg.history:
        make_history(RunStore(root, options), cfg.history, cfg.history_files, cfg.max_lag, workers.templates[0])
    else:
        learner.publish(0)
    learner_store.ops = dict.fromkeys(KINDS, 0)
    lease = Lease(bm_store, StepKind.BATCHMAKER, "bench-scale", config.lease_ttl_s)
    lease.acquire_waiting(interval_s=0.2)
    maker = BatchMakerLoop(config, bm_store, lease)
    committed: dict[int, float] = {}
    peak_arrays = 0
    proc = psutil.Process()
    peak_rss = 0

    def after_commit(slot: int, batch: Any, log: dict[str, Any]) -> None:
        committed[slot] = float(log["batch_committed_at"])

    maker.after_commit = after_commit
    per_slot: list[dict[str, Any]] = []
    t_start = time.monotonic()
    cpu0: dict[str, float] = {}
    workers.start()
    learner.thread.start()
    try:
        st = maker.recover()
        if st.next_slot != first:
            raise RuntimeError(f"recovered at slot {st.next_slot}, expected {first}")
        for slot in range(first, last + 1):
            if stop.is_set():
                break
            if slot == first + cfg.warmup:  # the measured slots begin
                cpu0 = {"t": time.monotonic(), "bench": _cpu_s(None),
                        "server": _cpu_s(server_pid) if server_pid else 0.0}  # fmt: skip
            before = bm_store.snapshot()
            files_before = len(st.seen)
            log = new_slot_log()
            maker.pace(slot)
            maker.gather(st, slot, log)
            peak_arrays = max(peak_arrays, st.bm.nbytes())  # the reservoir at its fullest: before the batch
            peak_rss = max(peak_rss, proc.memory_info().rss)
            batch = st.bm.make_batch(slot)
            if batch is None:
                raise RuntimeError(f"slot {slot}: ready but nothing built")
            maker.commit(st, batch, log, maker.learner_now())
            per_slot.append(
                {
                    "slot": slot,
                    "ops": diff(before, bm_store.snapshot()),
                    "files": len(log["ingested_files"]),
                    "seen_delta": len(st.seen) - files_before,
                    "seen": len(st.seen),
                }
            )
        maker.settle()
        cpu1 = {"t": time.monotonic(), "bench": _cpu_s(None), "server": _cpu_s(server_pid) if server_pid else 0.0}
    finally:
        stop.set()
        maker.close()
        workers.join()
        learner.thread.join(timeout=30)
        with contextlib.suppress(Exception):
            lease.release()
    if learner.error is not None:
        raise RuntimeError(f"stub learner failed: {learner.error}") from learner.error
    wall = time.monotonic() - t_start
    measured = [r for r in per_slot if r["slot"] >= first + cfg.warmup]
    # The ops counted between two slot boundaries include the write-behind of the previous slot: in steady state
    # that is one slot's writes per slot, so the per-slot figures are the mean over the measured slots.
    n = max(1, len(measured))
    keys = (*KINDS, "listed", "list_calls", *(f"{k}_s" for k in KINDS))
    ops = {k: sum(r["ops"][k] for r in measured) / n for k in keys}
    lat = [committed[s] - learner.asked_at[s] for s in range(first + cfg.warmup, last + 1)
           if s in committed and s in learner.asked_at]  # fmt: skip
    w = worker_store.snapshot()
    span = max(1e-9, cpu1["t"] - cpu0["t"]) if cpu0 else 1e-9
    return {
        "workers": cfg.workers,
        "history": cfg.history,
        "history_files": cfg.history_files if cfg.history else 0,
        "slots": len(measured),
        "wall_s": wall,
        "rollout_files": workers.files,
        "files_per_slot": sum(r["files"] for r in measured) / n,
        "bm_ops_per_slot": {k: ops[k] for k in KINDS},
        "bm_ops_total_per_slot": sum(ops[k] for k in KINDS),
        "bm_listed_per_slot": ops["listed"],
        "bm_objects_per_list_call": ops["listed"] / max(1e-9, ops["list_calls"]),
        "bm_request_ms": {k: 1000 * ops[f"{k}_s"] / ops[k] for k in KINDS if ops[k]},
        "slot_latency_p50_s": statistics.median(lat) if lat else None,
        "slot_latency_p95_s": statistics.quantiles(lat, n=20)[-1] if len(lat) >= 2 else None,
        "bm_reservoir_peak_mib": peak_arrays / 2**20,
        "bm_cursor_files": measured[-1]["seen"] if measured else 0,
        "process_rss_peak_mib": peak_rss / 2**20,
        "bench_cpu_util": (cpu1["bench"] - cpu0["bench"]) / span if cpu0 else None,
        "server_cpu_util": (cpu1["server"] - cpu0["server"]) / span if cpu0 and server_pid else None,
        "worker_ops_per_file": {k: w[k] / max(1, workers.files) for k in KINDS},
        "worker_request_ms": {k: 1000 * w[f"{k}_s"] / w[k] for k in KINDS if w[k]},
        "learner_ops_per_step": {k: v / max(1, cfg.slots) for k, v in learner_store.snapshot().items() if k in KINDS},
    }


@contextlib.contextmanager
def backend_root(backend: str, tmp: Path, name: str) -> Iterator[tuple[str, dict[str, Any] | None, int | None]]:
    """(run root, storage options, server pid) of a fresh run root on `backend` (`local`, or `gcs`: the emulator)."""
    if backend == "local":
        yield str(tmp / name), None, None
        return
    emu = gcs_emulator_class()()
    emu.start()
    try:
        yield f"gs://{emu.bucket}/{name}", emu.storage_options, emu._proc.pid
    finally:
        emu.stop()


def print_table(rows: list[dict[str, Any]]) -> None:
    """The measured table (what docs/scale.md holds)."""
    head = ("backend", "N", "history", "slots", "files/slot", "list", "get", "put", "head", "del", "ops/slot",
            "listed/slot", "objs/list", "slot p50 s", "slot p95 s", "RSS MiB", "cursor files", "worker ops/file",
            "bench CPU", "server CPU")  # fmt: skip
    out = [head]
    for r in rows:
        o = r["bm_ops_per_slot"]
        wo = sum(r["worker_ops_per_file"].values())
        out.append(
            (
                r["backend"] + (f"+{r['latency']}" if r["latency"] else ""),
                str(r["workers"]),
                f"{r['history']}/{r['history_files']}" if r["history"] else "-",
                str(r["slots"]),
                f"{r['files_per_slot']:.1f}",
                *(f"{o[k]:.1f}" for k in KINDS),
                f"{r['bm_ops_total_per_slot']:.1f}",
                f"{r['bm_listed_per_slot']:.0f}",
                f"{r['bm_objects_per_list_call']:.1f}",
                _f(r["slot_latency_p50_s"]),
                _f(r["slot_latency_p95_s"]),
                f"{r['process_rss_peak_mib']:.0f}",
                str(r["bm_cursor_files"]),
                f"{wo:.1f}",
                _pct(r["bench_cpu_util"]),
                _pct(r["server_cpu_util"]),
            )
        )
    widths = [max(len(row[i]) for row in out) for i in range(len(head))]
    for i, row in enumerate(out):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if i == 0:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)))
    print(
        "per BatchMaker slot: storage requests by kind (list = ceil(entries/1000) per listing, as GCS pages), objects "
        "listed, objects per listing, slot latency (learner asks -> log entry committed); history: slots/old files "
        "made before the run; RSS: the whole bench process (BatchMaker, workers, learner); cursor files: the seen "
        "set the log entry carries; workers: requests per rollout file; CPU: cores busy over the measured slots"
    )
    for r in rows:
        ms = ", ".join(f"{k} {v:.1f}" for k, v in r["bm_request_ms"].items())
        wms = ", ".join(f"{k} {v:.1f}" for k, v in r["worker_request_ms"].items())
        print(f"{r['backend']} N={r['workers']}: mean ms per request: BatchMaker {ms}; workers {wms}")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="10,100,1000", help="comma-separated N")
    ap.add_argument("--backends", default="local,gcs", help="local, gcs (the fake-gcs-server emulator)")
    ap.add_argument("--files_per_s", type=float, default=16.0, help="aggregate rollout files per second")
    ap.add_argument("--rows_per_file", type=int, default=8)
    ap.add_argument("--resp_tokens", type=int, default=96, help="mean response tokens per row")
    ap.add_argument("--batch_size", type=int, default=32, help="rows per batch slot")
    ap.add_argument("--step_s", type=float, default=0.3, help="the stub learner's seconds per step")
    ap.add_argument("--policy_mib", type=float, default=1.0, help="size of each published policy")
    ap.add_argument("--slots", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4, help="first slots not counted")
    ap.add_argument("--threads", type=int, default=16, help="driver threads playing the workers")
    ap.add_argument("--latency_ms", default="0",
                    help="added to every storage request of every party: ms, `gcs` (assumed GCS figures, see "
                    "GCS_LATENCY_MS) or per kind `list=40,get=30,put=50,head=25,delete=30`")  # fmt: skip
    ap.add_argument("--history", type=int, default=0, help="slots already made before the run (a long run's past)")
    ap.add_argument("--history_files", type=int, default=2000, help="old committed rollout files of that past")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    latency = parse_latency(args.latency_ms)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="rlpipe-scale-"))
    print(f"bench_scale on {machine_name()}")
    for backend in args.backends.split(","):
        for n in (int(x) for x in args.workers.split(",")):
            cfg = SimConfig(
                workers=n, files_per_s=args.files_per_s, rows_per_file=args.rows_per_file,
                resp_tokens=args.resp_tokens, batch_size=args.batch_size, step_s=args.step_s,
                policy_bytes=int(args.policy_mib * 2**20), slots=args.slots, warmup=args.warmup, threads=args.threads,
                history=args.history, history_files=args.history_files,
            )  # fmt: skip
            with backend_root(backend, tmp, f"{backend}-{n}") as (root, options, pid):
                row = run_once(root, options, cfg, latency, pid)
            row.update(backend=backend, latency="" if args.latency_ms.strip() in ("0", "") else args.latency_ms)
            rows.append(row)
            print(f"{backend} N={n}: {row['slots']} slots in {row['wall_s']:.1f}s, "
                  f"{row['bm_ops_total_per_slot']:.1f} BatchMaker requests/slot", flush=True)  # fmt: skip
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_name(), "args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
