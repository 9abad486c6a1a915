"""Retention end to end: a real job (GC off) on a local run root, fates computed from its files, then real
`python -m steps.gc` processes on copies of the root: lineage equals the fates, old data is gone, markers never
outlive their data, what the next slot reads stays, the report renders; SIGKILLed collections rerun to the end.

The local job is the session's `default_job` (configs/test_cats.yaml as it is: 6 learner steps, checkpoints every
2 steps), shared read-only with the other tests that check a finished job (copied before every collection). With
`keep_every` 3 and `keep_policies` 2 the kept policies {0, 3, 5, 6} tell the two rules apart: 3 is kept only as a
multiple, 5 only as one of the newest two, and 1, 2, 4 are collected."""

from __future__ import annotations

import collections
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import ROOT, FinishedJob, job_config, run_job

from pipeline.retention import read_index
from pipeline.store import layout, run_state, staleness
from pipeline.store.storage import RunStore
from schemas import BATCH
from schemas.dropped import DROPPED

pytestmark = pytest.mark.slow

N_STEPS = 6
"""Learner steps of the session's `default_job` (configs/test_cats.yaml), and of the job on the GCS emulator."""
WINDOW = 2
KEEP_EVERY = 3
KEPT_POLICIES = {0, KEEP_EVERY, N_STEPS - 1, N_STEPS}
"""Policy 0, every `KEEP_EVERY`th and the newest two."""
GC_FLAGS = [
    "--retention.keep_policies",
    "2",
    "--retention.keep_every",
    str(KEEP_EVERY),
    "--retention.data_window_slots",
    str(WINDOW),
]


def fates(store: RunStore) -> dict[str, collections.Counter[tuple[str, int]]]:
    """rollout_id -> Counter of (fate, slot), from the batch and dropped files named by the batch log."""
    out: dict[str, collections.Counter[tuple[str, int]]] = collections.defaultdict(collections.Counter)
    for slot in range(1, run_state.last_committed_slot(store) + 1):
        entry = store.read_log_entry(slot)
        for ids in store.read_parquet(entry.data_file, BATCH).column("rollout_ids").to_pylist():
            for rid in ids:
                out[rid][("used", slot)] += 1
        if entry.dropped_file:
            d = store.read_parquet(entry.dropped_file, DROPPED)
            for rid, reason in zip(d.column("rollout_id").to_pylist(), d.column("reason").to_pylist(), strict=True):
                out[rid][(reason, slot)] += 1
    return out


@pytest.fixture(scope="module")
def finished_root(default_job: FinishedJob) -> tuple[Path, dict]:
    """The session's finished test job (read only: every test collects on a copy) and its fates."""
    store = RunStore(str(default_job.root))
    assert run_state.last_committed_slot(store) == N_STEPS
    return default_job.root, fates(store)


def gc(root: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "steps.gc", "--store.run_root", str(root), *GC_FLAGS, *extra],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def check_safe(store: RunStore) -> None:
    """No marker without its data; everything a later slot (or a restarted step) reads is still there."""
    for step_dir in store.list(layout.ROLLOUTS):
        for marker in [p for p in store.list(step_dir) if p.endswith(layout.READY_SUFFIX)]:
            assert store.exists(layout.data_of_marker(marker)), marker
    for root in (layout.POLICIES, layout.CHECKPOINTS):
        for s in run_state.committed_steps(store, root):
            folder = layout.join(root, layout.step_name(s))
            marker = store.get_json(layout.join(folder, layout.COMMIT_MARKER))
            if not store.exists(layout.join(folder, "COLLECTED")):
                for f in marker["files"].values():
                    assert store.exists(layout.join(folder, f["path"])), (folder, f)
    last = run_state.last_committed_slot(store)
    for f in store.read_log_entry(last).cursor.reservoir.files:  # the BatchMaker's next slot reads these
        assert store.read_marker(f.path) and store.exists(f.path), f.path
    newest = run_state.committed_steps(store, layout.CHECKPOINTS)[-1]
    for slot in range(newest + 1, last + 1):  # a restarted learner reads these
        assert store.exists(store.read_log_entry(slot).data_file), slot
    low = staleness.oldest_allowed_policy(last + 1, 1)
    for s in range(max(low, 0), N_STEPS + 1):
        assert store.exists(layout.policy_marker(s)), s


def check_collected(store: RunStore, before: dict) -> None:
    index = read_index(store)
    got: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for rid, fate, slot in zip(*(index.column(c).to_pylist() for c in ("rollout_id", "fate", "slot")), strict=True):
        got[rid][(fate, slot)] += 1
    last = run_state.last_committed_slot(store)
    horizon = last - WINDOW
    expected = {rid: collections.Counter({k: n for k, n in c.items() if k[1] <= horizon}) for rid, c in before.items()}
    assert {r: c for r, c in got.items() if c} == {r: c for r, c in expected.items() if c}
    for rel in store.list(layout.BATCH_DATA):
        assert layout.parse_step(rel) > horizon, rel  # batch data of old slots is gone
    policies = run_state.committed_steps(store, layout.POLICIES)
    assert set(policies) == KEPT_POLICIES, policies
    deleted = [rid for rid, c in before.items() if c and max(s for _, s in c) <= horizon]
    assert deleted, "nothing old enough to delete"


def test_gc_keeps_lineage_and_report(finished_root: tuple[Path, dict], tmp_path: Path) -> None:
    src, before = finished_root
    root = tmp_path / "run"
    shutil.copytree(src, root)
    from pipeline.report import build_report, load_run

    report_before = load_run(str(root))
    bytes_before = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    proc = gc(root)
    assert proc.wait(timeout=300) == 0, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
    store = RunStore(str(root))
    check_collected(store, before)
    check_safe(store)
    assert sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) < bytes_before
    second = gc(root)  # a rerun finds nothing new and changes nothing
    assert second.wait(timeout=300) == 0
    check_collected(store, before)
    report_after = load_run(str(root))  # the report's counts come from the lineage index now
    assert report_after.rollout_uses == report_before.rollout_uses and report_before.rollout_uses
    assert report_after.rollouts_used == report_before.rollouts_used
    assert report_after.dropped_by_reason == report_before.dropped_by_reason
    assert not report_after.notes, report_after.notes
    assert Path(build_report(str(root), str(tmp_path / "report"))).stat().st_size > 0


def check_rollouts_collected(store: RunStore, index) -> None:
    """Every rollout file left below the scan window is in the reservoir or has a row of unrecorded fate (or one
    recorded after the covered slots); and some rollout files were deleted."""
    ids: dict[str, set[str]] = collections.defaultdict(set)
    for rid, src in zip(index.column("rollout_id").to_pylist(), index.column("source_file").to_pylist(), strict=True):
        ids[src].add(rid)
    last = run_state.last_committed_slot(store)
    live = {f.path for f in store.read_log_entry(last).cursor.reservoir.files}
    low = staleness.oldest_allowed_policy(last + 1, 1)
    left = [
        (rel, store.read_marker(rel).rows, len(ids.get(rel, ())))
        for p in run_state.rollout_folders(store)
        if p < low
        for rel in store.list_committed(layout.rollout_step_dir(p))
        if rel not in live
    ]
    assert not [x for x in left if x[1] == x[2]], left  # fully accounted files must be gone
    assert any(not store.exists(src) for src in ids), "no rollout file was deleted"


def _claims(root: Path) -> int:
    return len(list((root / layout.lease_dir("gc")).glob("epoch-*.json")))


def _progress(root: Path) -> int:
    """Lineage files and plans written so far (committed or not)."""
    return len(list((root / layout.LINEAGE).glob("*"))) + len(list((root / layout.GC).glob("*")))


def _plans(root: Path) -> int:
    return len([p for p in (root / layout.GC).glob("plan-*.json") if ".done" not in p.name])


def _open_plans(root: Path) -> int:
    plans = {p.name[: -len(".json")] for p in (root / layout.GC).glob("plan-*.json") if ".done" not in p.name}
    done = {p.name[: -len(".done.json")] for p in (root / layout.GC).glob("plan-*.done.json")}
    return len(plans - done)


def test_killed_gc_is_safe_and_a_rerun_completes(finished_root: tuple[Path, dict], tmp_path: Path) -> None:
    """SIGKILL at a random point of each collection's work (timed from its lease claim, when its imports are done);
    a small deletion budget spreads the work over many runs. The kill window adapts to the machine's speed: it
    widens after a kill that left no progress (no lineage file, no plan) and narrows after a run that finished.
    When a run finds nothing left to collect before enough kills landed inside a plan, the root is copied afresh
    (each copy is checked the same way; the last one is collected to the end)."""
    src, before = finished_root
    root = tmp_path / "run"
    shutil.copytree(src, root)
    rng = random.Random(17)
    kills = interrupted = 0
    window = 0.5
    for i in range(80):
        claims, progress, plans = _claims(root), _progress(root), _plans(root)
        proc = gc(root, "--retention.max_deletions", "3")
        deadline = time.monotonic() + 120
        while proc.poll() is None and _claims(root) == claims and time.monotonic() < deadline:
            time.sleep(0.01)
        if i % 2:  # aimed at the deletions: kill as soon as this run's plan exists
            while proc.poll() is None and _plans(root) == plans and time.monotonic() < deadline:
                time.sleep(0.002)
        else:
            time.sleep(rng.uniform(0.0, window))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
            interrupted += _open_plans(root) > 0
            if not i % 2:
                window *= 1.5 if _progress(root) == progress else 1.0
        elif not i % 2:
            window *= 0.7
        check_safe(RunStore(str(root)))
        if kills >= 12 and interrupted >= 4:
            break
        if proc.returncode == 0 and _plans(root) == plans:  # nothing left to collect: start over on a fresh copy
            shutil.rmtree(root)
            shutil.copytree(src, root)
    assert kills >= 12 and interrupted >= 4, (kills, interrupted)  # some kills fell inside a plan's deletions
    for _ in range(30):  # reruns with the same small budget until a run finds nothing left to delete
        plans = _plans(root)
        final = gc(root, "--retention.max_deletions", "3")
        assert final.wait(timeout=300) == 0
        if _plans(root) == plans:
            break
    store = RunStore(str(root))
    assert _open_plans(root) == 0
    check_safe(store)
    check_collected(store, before)


def test_job_with_retention_on_gcs_emulator(tmp_path: Path, gcs_endpoint) -> None:
    """The job runner collects while the job runs (every 3 slots) and at the end, on a gs:// run root. One rollout
    worker and no evaluator: collection reads neither (each would be a further process start on the emulator)."""
    run_root = f"gs://{gcs_endpoint.bucket}/retention-{os.getpid()}"
    overrides = {
        "train.num_train_steps": str(N_STEPS),
        "num_rollout_workers": "1",
        "evaluator": "false",
        "cadence.checkpoint_interval": "2",
        "retention.enabled": "true",
        "retention.gc_every_slots": "3",
        "retention.keep_policies": "2",
        "retention.keep_every": str(KEEP_EVERY),
        "retention.data_window_slots": str(WINDOW),
    }
    proc = run_job(job_config(tmp_path, run_root, gcs_endpoint.storage_options, **overrides))
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = RunStore(run_root, gcs_endpoint.storage_options)
    check_safe(store)
    last = run_state.last_committed_slot(store)
    horizon = last - WINDOW
    assert all(layout.parse_step(rel) > horizon for rel in store.list(layout.BATCH_DATA))
    from pipeline.retention import covered_through, index_files

    assert covered_through(index_files(store)) == horizon
    index = read_index(store)
    used = collections.Counter(
        s
        for s, f in zip(index.column("slot").to_pylist(), index.column("fate").to_pylist(), strict=True)
        if f == "used"
    )
    dropped = collections.Counter(
        (rid, s)
        for rid, s, f in zip(*(index.column(c).to_pylist() for c in ("rollout_id", "slot", "fate")), strict=True)
        if f != "used"
    )
    for slot in range(1, horizon + 1):
        entry = store.read_log_entry(slot)
        assert used[slot] == sum(1 for _ in range(entry.lineage.n_rollouts)), (
            slot
        )  # one used row per rollout the slot's batch holds
        if entry.dropped_file:
            d = store.read_parquet(entry.dropped_file, DROPPED)  # dropped records stay, and the index has them
            for rid in d.column("rollout_id").to_pylist():
                assert (rid, slot) in dropped, (rid, slot)
    assert set(run_state.committed_steps(store, layout.POLICIES)) == KEPT_POLICIES
    check_rollouts_collected(store, index)
    from pipeline.report import load_run

    data = load_run(run_root, gcs_endpoint.storage_options)
    assert not data.notes, data.notes
    assert data.rollout_uses and data.rollout_uses >= sum(used.values())
