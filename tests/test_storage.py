"""RunStore conformance over local disk, file://, memory:// and a real fake-gcs-server, plus the gcsfs
facts the commit protocol rests on (TestGcsfsFacts)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.process.exits import Exit
from pipeline.store import layout, storage
from pipeline.store.storage import (
    TMP_PREFIX,
    CorruptFileError,
    FileInfo,
    NotCommittedError,
    RunStore,
    SchemaMismatchError,
    new_attempt_id,
)
from schemas import EVAL_SUMMARY, ROLLOUT, RolloutRow
from schemas.records import ReadyMarker

REPO = Path(__file__).resolve().parents[1]
STEP_DIR = layout.rollout_step_dir(3)


def rollout_rows(n: int, *, worker: str = "w0", step: int = 3, resp_len: int = 8, seed: int = 0) -> list[RolloutRow]:
    """`n` valid rollout rows with distinct ids and deterministic content."""
    return [
        RolloutRow(
            rollout_id=f"{worker}-{seed}-{i}",
            env_name="cats",
            example_id=f"ex{i // 4}",
            lesson_id="lesson-a",
            group_key=f"g{i // 4}",
            prompt_tokens=[1, 2, 3 + i // 4],
            response_tokens=[(seed + i + j) % 1000 for j in range(resp_len)],
            response_logprobs=[-0.5] * resp_len,
            token_rewards=[0.0] * (resp_len - 1) + [1.0],
            response_loss_mask=[1] * resp_len,
            episode_reward=1.0,
            truncated=False,
            finish_reason="stop",
            temperature=1.0,
            policy_step=step,
            worker_id=worker,
            timestamp=1_700_000_000.25 + i,
        )
        for i in range(n)
    ]


def rollout_table(n: int = 8, **kw: Any) -> pa.Table:
    return ROLLOUT.to_table(rollout_rows(n, **kw))


def commit_raw(store: RunStore, rel: str, data: bytes, rows: int) -> None:
    """Commit arbitrary bytes with a marker that matches them (a writer that committed garbage)."""
    import hashlib

    store.put_unique(rel, data)
    marker = ReadyMarker(
        file=rel,
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        rows=rows,
        schema=ROLLOUT.tag,
        attempt_id=new_attempt_id(),
        time=time.time(),
    )
    assert store.put_if_absent(layout.ready_marker(rel), marker.to_json())


def raw_put(store: RunStore, rel: str, data: bytes) -> None:
    """Write bytes under the run root bypassing RunStore's protocol (e.g. a temp file left by a crash)."""
    full = f"{store.root}/{rel}"
    if store.is_local:
        os.makedirs(os.path.dirname(full), exist_ok=True)
        Path(full).write_bytes(data)
    else:
        store.fs.pipe_file(full, data)


def run_py(code: str, *args: str, **popen: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, **popen
    )


# primitives ---------------------------------------------------------------------------------


def test_put_unique_get_exists_list_delete(store: RunStore) -> None:
    assert store.list("a") == []
    assert not store.exists("a/x.bin")
    store.put_unique("a/x.bin", b"one")
    store.put_unique("a/b/y.bin", b"two")
    assert store.get("a/x.bin") == b"one"
    assert store.exists("a/x.bin")
    assert store.list("a") == ["a/b", "a/x.bin"]
    store.put_unique("a/x.bin", b"three")  # put_unique replaces atomically
    assert store.get("a/x.bin") == b"three"
    store.delete("a/x.bin")
    store.delete("a/x.bin")  # missing is fine
    assert not store.exists("a/x.bin")
    assert store.list("a") == ["a/b"]
    with pytest.raises(FileNotFoundError):
        store.get("a/x.bin")


def test_list_ignores_temp_files_and_leaves_none_behind(store: RunStore) -> None:
    store.put_unique("d/real.bin", b"x")
    assert store.put_if_absent("d/commit.json", b"{}")
    if store.is_local:  # our own writes leave no temp files
        assert sorted(os.listdir(os.path.join(store.root, "d"))) == ["commit.json", "real.bin"]
    raw_put(store, f"d/{TMP_PREFIX}half-written.parquet", b"PAR1 partial")
    assert store.list("d") == ["d/commit.json", "d/real.bin"]
    with pytest.raises(ValueError, match="reserved"):
        store.put_unique(f"d/{TMP_PREFIX}x", b"")


@pytest.mark.parametrize("bad", ["", "../escape", "a/../../b", "a//b", "./a"])
def test_unsafe_relative_paths_refused(local_store: RunStore, bad: str) -> None:
    with pytest.raises(ValueError, match="not a safe"):
        local_store.put_unique(bad, b"x")


def test_put_if_absent_semantics(store: RunStore) -> None:
    assert store.put_if_absent("c/k.json", b"mine") is True
    assert store.put_if_absent("c/k.json", b"theirs") is False
    assert store.get("c/k.json") == b"mine"
    # identical bytes: a retry of our own write whose acknowledgement was lost counts as ours
    assert store.put_if_absent("c/k.json", b"mine") is True


def test_json_helpers(store: RunStore) -> None:
    assert store.put_json_if_absent("j/a.json", {"x": 1})
    rec = store.get_json("j/a.json")
    assert rec["x"] == 1 and len(rec["attempt_id"]) == 32
    assert not store.put_json_if_absent("j/a.json", {"x": 1})  # a fresh attempt_id: someone else's
    store.put_unique("j/bad.json", b"{not json")
    with pytest.raises(CorruptFileError, match=re.escape("j/bad.json")):
        store.get_json("j/bad.json")


def test_transient_errors_are_retried_then_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage, "RETRY_BASE_DELAY_S", 0.02)
    monkeypatch.setattr(storage, "RETRY_MAX_DELAY_S", 0.02)
    monkeypatch.setattr(storage, "RETRY_WINDOW_S", 1.0)
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise TimeoutError("slow")
        return "ok"

    assert storage._retry("op", flaky) == "ok" and len(calls) == 3

    def always() -> None:
        calls.append(1)
        raise ConnectionResetError("reset")

    calls.clear()
    with pytest.raises(storage.StorageUnavailableError, match=r"^storage unavailable: op: ConnectionResetError") as e:
        storage._retry("op", always)
    assert isinstance(e.value.__cause__, ConnectionResetError)
    assert 3 <= len(calls) <= len(storage.retry_delays()) + 1 == 51  # the schedule, cut short by the window

    def permanent() -> None:
        calls.append(1)
        raise FileNotFoundError("gone")

    calls.clear()
    with pytest.raises(FileNotFoundError):
        storage._retry("op", permanent)
    assert len(calls) == 1


def test_transient_errors_are_retried_for_about_30_seconds() -> None:
    """The default schedule: doubling delays from 0.2 s, none over 5 s, 30 s in all."""
    delays = storage.retry_delays()
    assert delays[:3] == [0.2, 0.4, 0.8] and max(delays) == 5.0
    assert sum(delays) == pytest.approx(30.0)


@pytest.mark.slow
def test_an_outage_of_a_real_endpoint_mid_run_ends_in_storage_unavailable(caplog: pytest.LogCaptureFixture) -> None:
    """A store whose emulator stops answering: gcsfs's own retries and ours last about RETRY_WINDOW_S, then one
    StorageUnavailableError naming the operation (a step exits 75 on it and the job runner restarts it)."""
    import logging

    from gcs_emulator import GcsEmulator

    emu = GcsEmulator(bucket="outage").start()
    try:
        store = RunStore("gs://outage/run", emu.storage_options)
        store.put_unique("a.txt", b"1")
    finally:
        emu.stop()
    t0 = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="pipeline.store.storage"),
        pytest.raises(storage.StorageUnavailableError, match=r"^storage unavailable: get outage/run/a\.txt: "),
    ):
        store.get("a.txt")
    assert storage.RETRY_WINDOW_S * 0.5 < time.monotonic() - t0 < storage.RETRY_WINDOW_S * 4


def test_a_name_resolution_failure_mid_run_is_retried_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A store exists only once its endpoint answered: a DNS failure afterwards is an outage, retried (each retry
    logged) until it passes."""
    import logging
    import socket

    monkeypatch.setattr(storage, "RETRY_BASE_DELAY_S", 0.01)
    failures = [socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")] * 2
    calls: list[int] = []

    def resolves_later() -> str:
        calls.append(1)
        if failures:
            raise failures.pop()
        return "ok"

    with caplog.at_level(logging.WARNING, logger="pipeline.store.storage"):
        assert storage._retry("get gs://b/r/x", resolves_later) == "ok"
    assert len(calls) == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline.store.storage"]
    assert len(lines) == 2 and all("get gs://b/r/x" in ln and "name resolution" in ln for ln in lines), lines


# parquet ------------------------------------------------------------------------------------


def test_parquet_round_trip_is_lossless_and_tagged(store: RunStore) -> None:
    rows = rollout_rows(6)
    rel = f"{STEP_DIR}/w0-00000001.parquet"
    info = store.write_parquet(rel, ROLLOUT.to_table(rows), ROLLOUT)
    data = store.get(rel)
    import hashlib

    assert info == FileInfo(rel, len(data), hashlib.sha256(data).hexdigest(), 6)
    md = pq.ParquetFile(pa.BufferReader(data)).schema_arrow.metadata
    assert md[b"rlpipe.schema"] == b"rollout" and md[b"rlpipe.schema_version"] == str(ROLLOUT.version).encode()
    assert pq.ParquetFile(pa.BufferReader(data)).metadata.row_group(0).column(0).compression == "ZSTD"
    back = ROLLOUT.from_table(store.read_parquet(rel, ROLLOUT))
    assert back == rows
    assert all(type(t) is int for t in back[0].response_tokens)


def test_page_checksums_catch_a_flipped_byte() -> None:
    """A bit flip in any page is either caught (CorruptFileError) or harmless (it hit page-header statistics,
    which the CRC does not cover): never decoded silently wrong. Needs checksums on write and on read."""
    table = ROLLOUT.conform(rollout_table(64, resp_len=32), "t")
    data = RunStore.parquet_bytes(table, ROLLOUT)
    md = pq.ParquetFile(pa.BufferReader(data)).metadata.row_group(0)
    caught = harmless = 0
    for i in range(md.num_columns):
        col = md.column(i)
        start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
        for pos in range(start, start + col.total_compressed_size, 5):
            bad = bytearray(data)
            bad[pos] ^= 0x01
            try:
                got = RunStore.parse_parquet(bytes(bad), ROLLOUT, "p")
            except CorruptFileError:
                caught += 1
                continue
            assert got.equals(table), f"flip at byte {pos} ({col.path_in_schema}) decoded silently wrong"
            harmless += 1
    assert caught > 3 * harmless, (caught, harmless)


def test_read_parquet_raises_named_errors(local_store: RunStore) -> None:
    local_store.put_unique("x/empty.parquet", b"")
    with pytest.raises(CorruptFileError, match=re.escape("x/empty.parquet")):
        local_store.read_parquet("x/empty.parquet", ROLLOUT)
    newer = dataclasses.replace(ROLLOUT, version=ROLLOUT.version + 1)
    local_store.write_parquet("x/v2.parquet", rollout_table(2), newer)
    with pytest.raises(SchemaMismatchError) as ei:
        local_store.read_parquet("x/v2.parquet", ROLLOUT)
    assert ei.value.path == "x/v2.parquet" and ei.value.expected == ROLLOUT.tag and ei.value.found == newer.tag
    with pytest.raises(FileNotFoundError):
        local_store.read_parquet("x/none.parquet", ROLLOUT)


# commit protocol ----------------------------------------------------------------------------


def test_commit_then_read_committed(store: RunStore) -> None:
    rel = layout.rollout_file(3, "w0", 1)
    table = rollout_table(5)
    assert store.commit_data(rel, table, ROLLOUT, {"policy_step": 3, "worker_id": "w0"})
    assert store.list_committed(STEP_DIR) == [rel]
    marker = store.get_json(layout.ready_marker(rel))
    assert marker["file"] == rel and marker["rows"] == 5 and marker["policy_step"] == 3
    assert marker["size"] == len(store.get(rel)) and len(marker["attempt_id"]) == 32
    got = store.read_committed(rel, ROLLOUT)
    assert got is not None and got.equals(ROLLOUT.conform(table, rel))
    # a rerun of the same task collides on the marker and leaves the committed data untouched
    before = store.get(rel)
    assert not store.commit_data(rel, rollout_table(7, seed=9), ROLLOUT, {})
    assert store.get(rel) == before
    assert store.read_committed(rel, ROLLOUT) is not None


def test_uncommitted_and_half_written_files_are_invisible(store: RunStore) -> None:
    store.write_parquet(f"{STEP_DIR}/w0-00000001.parquet", rollout_table(3), ROLLOUT)  # data, no marker
    full = RunStore.parquet_bytes(rollout_table(3), ROLLOUT)
    raw_put(store, f"{STEP_DIR}/{TMP_PREFIX}w0-00000002.parquet-abc", full[: len(full) // 2])
    raw_put(store, f"{STEP_DIR}/{TMP_PREFIX}w0-00000002.ready.json-abc", b'{"size": 1')
    assert store.list_committed(STEP_DIR) == []
    with pytest.raises(NotCommittedError, match="w0-00000001"):
        store.read_committed(f"{STEP_DIR}/w0-00000001.parquet", ROLLOUT)
    ok = layout.rollout_file(3, "w0", 3)
    assert store.commit_data(ok, rollout_table(3), ROLLOUT, {})
    assert store.list_committed(STEP_DIR) == [ok]


_CRASH_CHILD = r"""
import json, sys, time
from pipeline.store.storage import RunStore
from schemas import ROLLOUT
sys.path.insert(0, "tests")
from test_storage import rollout_table
root, opts, rel = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
real = RunStore.put_if_absent
def stall(self, r, data):
    if r.endswith(".ready.json"):
        print("DATA_WRITTEN", flush=True)
        time.sleep(120)
    return real(self, r, data)
RunStore.put_if_absent = stall
RunStore(root, opts).commit_data(rel, rollout_table(4), ROLLOUT, {})
"""


@pytest.mark.parametrize("backend", ["local", "gs"])
def test_kill_between_data_and_marker_leaves_nothing_visible(store_factory: Any, backend: str) -> None:
    store = store_factory(backend)
    rel = layout.rollout_file(3, "w0", 1)
    child = run_py(_CRASH_CHILD, store.url, json.dumps(store.storage_options), rel)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip() == "DATA_WRITTEN", f"child did not reach the marker: {line!r}"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=10)
    assert store.exists(rel)  # the data landed...
    assert store.list_committed(STEP_DIR) == []  # ...but nothing is visible
    assert store.read_parquet(rel, ROLLOUT).num_rows == 4  # and nothing is corrupt
    assert store.quarantined() == set()
    # the rerun of the task commits it
    assert store.commit_data(rel, rollout_table(4), ROLLOUT, {})
    assert store.list_committed(STEP_DIR) == [rel]


def _commit_garbage(store: RunStore, name: str) -> tuple[str, str]:
    """Commit one defective file per kind; return (path, expected reason fragment)."""
    rel = f"{STEP_DIR}/{name}.parquet"
    good = RunStore.parquet_bytes(rollout_table(4), ROLLOUT)
    if name == "truncated":
        commit_raw(store, rel, good[: len(good) * 2 // 3], 4)
        return rel, "unreadable parquet"
    if name == "zero-byte":
        commit_raw(store, rel, b"", 4)
        return rel, "unreadable parquet"
    if name == "no-footer":
        commit_raw(store, rel, good[:-8], 4)
        return rel, "unreadable parquet"
    if name == "foreign-schema":
        summary = pa.table(
            {f.name: pa.array([], f.type) for f in EVAL_SUMMARY.schema}, schema=EVAL_SUMMARY.arrow_schema()
        )
        commit_raw(store, rel, RunStore.parquet_bytes(summary, EVAL_SUMMARY), 0)
        return rel, f"expected {ROLLOUT.tag}, found {EVAL_SUMMARY.tag}"
    if name == "newer-version":
        newer = dataclasses.replace(ROLLOUT, version=ROLLOUT.version + 1)
        commit_raw(store, rel, RunStore.parquet_bytes(rollout_table(4), newer), 4)
        return rel, f"expected {ROLLOUT.tag}, found {newer.tag}"
    if name == "no-metadata":
        sink = pa.BufferOutputStream()
        pq.write_table(rollout_table(4).replace_schema_metadata(None), sink)
        commit_raw(store, rel, sink.getvalue().to_pybytes(), 4)
        return rel, "found <none>@v<none>"
    if name == "size-mismatch":
        assert store.commit_data(rel, rollout_table(4), ROLLOUT, {})
        store.put_unique(rel, good + b"extra")
        return rel, "marker size"
    if name == "sha-mismatch":
        assert store.commit_data(rel, rollout_table(4), ROLLOUT, {})
        flipped = bytearray(store.get(rel))
        flipped[len(flipped) // 2] ^= 0xFF
        store.put_unique(rel, bytes(flipped))
        return rel, "sha256"
    if name == "row-mismatch":
        commit_raw(store, rel, good, 5)
        return rel, "4 rows != marker rows 5"
    if name == "bad-marker":
        store.put_unique(rel, good)
        store.put_unique(layout.ready_marker(rel), b"{oops")
        return rel, "invalid JSON"
    raise AssertionError(name)


CORRUPTIONS = [
    "truncated",
    "zero-byte",
    "no-footer",
    "foreign-schema",
    "newer-version",
    "no-metadata",
    "size-mismatch",
    "sha-mismatch",
    "row-mismatch",
    "bad-marker",
]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_defective_files_are_quarantined_and_the_reader_goes_on(
    store_factory: Any, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_factory("local")
    good = layout.rollout_file(3, "w0", 1)
    assert store.commit_data(good, rollout_table(4), ROLLOUT, {})
    bad, reason = _commit_garbage(store, kind)
    assert bad in store.list_committed(STEP_DIR)
    bad_bytes = store.get(bad)
    with caplog.at_level(logging.WARNING, logger="pipeline.store.storage"):
        results = {p: store.read_committed(p, ROLLOUT) for p in store.list_committed(STEP_DIR)}
    assert results[bad] is None
    assert results[good] is not None and results[good].num_rows == 4
    assert store.is_quarantined(bad) and store.quarantined() == {bad}
    record = store.get_json(layout.quarantine_record(bad))
    assert record["path"] == bad and reason in record["reason"], record
    assert any(bad in r.getMessage() and reason in r.getMessage() for r in caplog.records), caplog.text
    assert store.list_committed(STEP_DIR) == [good]
    assert store.get(bad) == bad_bytes  # the bad bytes stay for forensics
    assert store.read_committed(bad, ROLLOUT) is None  # and stay skipped


@pytest.mark.parametrize("backend", ["memory", "gs"])
def test_quarantine_on_remote_backends(store_factory: Any, backend: str) -> None:
    store = store_factory(backend)
    bad, reason = _commit_garbage(store, "truncated")
    assert store.read_committed(bad, ROLLOUT) is None
    assert store.quarantined() == {bad}
    assert reason in store.get_json(layout.quarantine_record(bad))["reason"]
    assert store.list_committed(STEP_DIR) == []


def test_missing_data_behind_a_marker_is_quarantined_and_the_reader_goes_on(store: RunStore) -> None:
    """A ready marker whose data file is gone is set aside like any unreadable file (one damaged object never blocks
    the rest): quarantined with its reason, None returned, no longer listed as committed."""
    rel = layout.rollout_file(3, "w0", 1)
    good = layout.rollout_file(3, "w0", 2)
    assert store.commit_data(rel, rollout_table(2), ROLLOUT, {})
    assert store.commit_data(good, rollout_table(3), ROLLOUT, {})
    store.delete(rel)
    assert store.read_committed(rel, ROLLOUT) is None
    assert store.is_quarantined(rel)
    reason = store.get_json(layout.quarantine_record(rel))["reason"]
    assert "data file missing" in reason and layout.ready_marker(rel) in reason, reason
    assert store.list_committed(STEP_DIR) == [good]
    assert store.read_committed(good, ROLLOUT).num_rows == 3  # type: ignore[union-attr]


# races ----------------------------------------------------------------------------------------


def test_put_if_absent_race_threads(store: RunStore) -> None:
    n_threads, n_keys = 8, 10
    barrier = threading.Barrier(n_threads)
    wins: dict[int, list[int]] = {k: [] for k in range(n_keys)}
    lock = threading.Lock()

    def worker(me: int) -> None:
        barrier.wait()
        for k in range(n_keys):
            if store.put_if_absent(f"race/k{k}.json", f"writer-{me}".encode()):
                with lock:
                    wins[k].append(me)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, winners in wins.items():
        assert len(winners) == 1, f"key {k}: winners {winners}"
        assert store.get(f"race/k{k}.json") == f"writer-{winners[0]}".encode()


_RACE_CHILD = r"""
import json, sys, uuid
from pipeline.store.storage import RunStore
root, opts, n_keys = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
store = RunStore(root, opts)
me = uuid.uuid4().hex
print("READY", flush=True)
sys.stdin.readline()
won = [k for k in range(n_keys) if store.put_if_absent(f"race/k{k}.json", me.encode())]
print(json.dumps({"me": me, "won": won}), flush=True)
"""


@pytest.mark.parametrize("backend", ["local", "gs"])
def test_put_if_absent_race_processes(store_factory: Any, backend: str) -> None:
    store = store_factory(backend)
    n_procs, n_keys = 3, 15
    procs = [
        run_py(_RACE_CHILD, store.url, json.dumps(store.storage_options), str(n_keys), stdin=subprocess.PIPE)
        for _ in range(n_procs)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("GO\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    for k in range(n_keys):
        winners = [r["me"] for r in results if k in r["won"]]
        assert len(winners) == 1, f"key {k}: {len(winners)} winners"
        assert store.get(f"race/k{k}.json") == winners[0].encode()


# GCS specifics (emulator) -------------------------------------------------------------------------


def test_gcs_listing_is_fresh_across_instances(store_factory: Any) -> None:
    a = store_factory("gs")
    b = RunStore(a.url, a.storage_options)
    assert a.list("fresh") == [] and a.list_committed("fresh") == []
    b.put_unique("fresh/x.bin", b"1")
    assert b.commit_data("fresh/y.parquet", rollout_table(1), ROLLOUT, {})
    assert a.list("fresh") == ["fresh/x.bin", "fresh/y.parquet", "fresh/y.ready.json"]
    assert a.list_committed("fresh") == ["fresh/y.parquet"]
    b.delete("fresh/x.bin")
    assert not a.exists("fresh/x.bin")


def test_gcs_lost_ack_resolved_by_reading_back(store_factory: Any) -> None:
    """The object our first (unacknowledged) create wrote is recognised as ours; anyone else's is not."""
    store = store_factory("gs")
    ours = json.dumps({"attempt_id": uuid.uuid4().hex}).encode()
    store.fs.pipe_file(store.full_path("log/step-00000001.json"), ours)  # the write that 'lost its ack'
    assert store.put_if_absent("log/step-00000001.json", ours) is True
    assert store.put_if_absent("log/step-00000001.json", b'{"attempt_id": "other"}') is False


class TestGcsfsFacts:
    """Measured gcsfs/emulator behaviour the protocol depends on; if one changes, revisit RunStore's promises."""

    def test_pipe_create_raises_on_existing_small_object(self, store_factory: Any) -> None:
        fs, p = store_factory("gs").fs, store_factory("gs").full_path("f/a")
        fs.pipe_file(p, b"1", mode="create")
        with pytest.raises(FileExistsError):
            fs.pipe_file(p, b"2", mode="create")
        assert fs.cat_file(p) == b"1"

    def test_open_xb_silently_overwrites(self, store_factory: Any) -> None:
        store = store_factory("gs")
        p = store.full_path("f/b")
        store.fs.pipe_file(p, b"1")
        with store.fs.open(p, "xb") as f:  # resumable upload: the emulator ignores ifGenerationMatch=0
            f.write(b"2")
        assert store.fs.cat_file(p) == b"2"

    def test_exception_inside_open_wb_commits_partial_object(self, store_factory: Any) -> None:
        store = store_factory("gs")
        p = store.full_path("f/c")
        with pytest.raises(RuntimeError), store.fs.open(p, "wb") as f:
            f.write(b"partial")
            raise RuntimeError("crash mid-write")
        assert store.fs.cat_file(p) == b"partial"

    def test_gcs_client_generation_match_zero_is_enforced(self, gcs_endpoint: Any) -> None:
        from google.api_core.exceptions import PreconditionFailed
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage as gcs

        client = gcs.Client(
            project="test", credentials=AnonymousCredentials(), client_options={"api_endpoint": gcs_endpoint.endpoint}
        )
        blob = client.bucket(gcs_endpoint.bucket).blob(f"facts/{uuid.uuid4().hex}")
        blob.upload_from_string(b"1", if_generation_match=0)
        with pytest.raises(PreconditionFailed):
            blob.upload_from_string(b"2", if_generation_match=0)
        assert blob.download_as_bytes() == b"1"


def test_memory_root_is_isolated_per_store(store_factory: Any) -> None:
    a, b = store_factory("memory"), store_factory("memory")
    a.put_unique("x", b"1")
    assert not b.exists("x") and b.list("") == []


def test_quarantined_is_cached_but_fresh(local_store: RunStore) -> None:
    other = RunStore(local_store.url)
    local_store.quarantine("a/b.parquet", "bad")
    assert other.quarantined() == {"a/b.parquet"}
    other.quarantine("a/c.parquet", "worse")
    assert local_store.quarantined() == {"a/b.parquet", "a/c.parquet"}
    # records are immutable: a second quarantine keeps the first reason
    local_store.quarantine("a/b.parquet", "again")
    assert local_store.get_json(layout.quarantine_record("a/b.parquet"))["reason"] == "bad"


@pytest.mark.parametrize(
    ("error", "expected", "code"),
    [
        (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), storage.StorageEndpointError, Exit.CONFIG),
        (
            socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
            storage.StorageUnavailableError,
            Exit.STORAGE_UNAVAILABLE,
        ),
        (ConnectionRefusedError(111, "Connection refused"), storage.StorageUnavailableError, Exit.STORAGE_UNAVAILABLE),
    ],
    ids=["no-such-host", "dns-down", "refused"],
)
def test_endpoint_errors_at_start_are_config_errors_or_unavailability(
    monkeypatch: pytest.MonkeyPatch, error: OSError, expected: type, code: int
) -> None:
    """What the resolver or the socket says at the first connection decides: a name that does not exist is a
    configuration error (exit 2, never restarted), a resolver that cannot answer now or a refused connection is
    an outage (exit 75, restarted by the job runner). Both name the endpoint and the setting it came from."""
    from steps.cli import run_command

    def connect(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(storage.socket, "create_connection", connect)
    endpoint = f"http://storage-{code}-{error.errno}.example:4443"
    with pytest.raises(expected, match=re.escape(endpoint)) as e:
        storage.check_endpoint(endpoint, "store.storage_options.endpoint_url")
    assert "store.storage_options.endpoint_url" in str(e.value)

    def main(_: object) -> int:
        storage.check_endpoint(endpoint, "STORAGE_EMULATOR_HOST")
        return 0

    assert run_command(lambda args: args, main, []) == code
    assert code in (Exit.CONFIG, Exit.STORAGE_UNAVAILABLE)


@pytest.mark.parametrize(
    ("location", "local"),
    [
        ("runs/demo", True),
        ("/abs/run", True),
        ("~/run", True),
        ("file:///abs/run", True),
        ("local:///abs/run", True),
        ("C://data/run", True),  # a Windows drive letter is no scheme
        ("gs://bucket/run", False),
        ("gcs://bucket/run", False),
        ("memory://run", False),
    ],
)
def test_one_local_rule_for_every_location(location: str, local: bool, tmp_path: Path) -> None:
    """`pipeline.store.urls.is_local` is the one rule: plain paths, file:// and local:// are local, and a RunStore
    agrees with it (local:// and file:// name the same folder as the plain path)."""
    from pipeline.store.urls import is_local, local_path, split_location

    assert is_local(location) is local
    assert (split_location(location)[0] == "file") is local
    if local:
        assert os.path.isabs(local_path(location))
    else:
        with pytest.raises(ValueError, match=re.escape(location)):
            local_path(location)
    for url in (str(tmp_path), f"file://{tmp_path}", f"local://{tmp_path}"):
        store = RunStore(url)
        assert store.is_local and store.protocol == "file" and store.root == str(tmp_path)
    assert not RunStore("memory://rule-check").is_local
