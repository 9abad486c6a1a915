"""Typed JSON commit records (`schemas.records`): round trips, refusals naming file and field, and every record
a short real job writes validates against its class."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from jobs import FinishedJob
from log_entries import log_entry

from pipeline.store import layout
from pipeline.store.storage import CorruptFileError, RunStore
from schemas.records import (
    CHECKPOINT_FORMAT,
    BatchLogEntry,
    CommitFile,
    CommitMarker,
    Cursor,
    HfFolderMarker,
    LatestPointer,
    ReadyMarker,
    RecordError,
    Reservoir,
    ReservoirFile,
)

MARKER_PATH = "policies/step-00000003/COMMITTED"


def batch_entry() -> BatchLogEntry:
    reservoir = Reservoir(
        next_seq=7,
        files=[
            ReservoirFile(
                path="rollouts/step-00000002/w-00000001.parquet", seq=6, policy_step=2, rows=[0, 3], uses=[1, 0]
            )
        ],
    )
    return log_entry(
        4,
        seq_len=64,
        ingested_files=["rollouts/step-00000002/w-00000001.parquet"],
        sealed={"0": ["rollouts/step-00000000/w-00000000.parquet"]},
        cursor=Cursor(
            version=1, seen=["rollouts/step-00000002/w-00000001.parquet"], reservoir=reservoir, late=[], sweep_next=2
        ),
        dropped_file="batches/dropped/step-00000004-a.parquet",
        dropped={"stale": 3},
        curriculum_evals=["evals/step-00000002/cats.summary.parquet"],
        curriculum_eval_values={"evals/step-00000002/cats.summary.parquet": [0.5], "evals/x.summary.parquet": None},
    )


def ready_marker() -> ReadyMarker:
    return ReadyMarker(
        file="rollouts/step-00000001/w-00000000.parquet",
        size=1234,
        sha256="ab" * 32,
        rows=8,
        schema="rollout@v1",
        attempt_id="f" * 32,
        time=1.5,
        signal_rows=4,
        extra={"worker_id": "w", "policy_step": 1, "failures": [{"error": "x"}]},
    )


def commit_marker() -> CommitMarker:
    return CommitMarker(
        format=CHECKPOINT_FORMAT,
        attempt_id="0123456789ab",
        files={"model": CommitFile(path="model-0123456789ab.safetensors", size=10, sha256="cd" * 32)},
        kind="checkpoint",
        step=3,
        vocab_size=64,
        batch_slot=3,
        tokenizer="builtin:tiny",
        seq_len=64,
        parent=2,
        slots=[3, 3],
        loss="RLOOLossConfig",
    )


def hf_marker() -> HfFolderMarker:
    return HfFolderMarker(step=3, files={"config.json": CommitFile(path="config.json", size=12, sha256="ab" * 32)})


RECORDS: list[Any] = [batch_entry(), ready_marker(), commit_marker(), LatestPointer(step=5), hf_marker()]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_round_trip(record: Any) -> None:
    data = record.to_json()
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    obj = json.loads(data)
    assert list(obj) == sorted(obj) and obj["version"] == type(record).VERSION
    assert type(record).from_json(data, path="x.json") == record
    assert type(record).from_json(data.decode(), path="x.json") == record
    assert type(record).from_json(obj, path="x.json") == record


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_no_version_field_reads_as_version_1(record: Any) -> None:
    obj = json.loads(record.to_json())
    del obj["version"]
    assert type(record).from_json(obj, path="x.json") == record


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_bumped_or_unknown_version_is_refused_naming_file_and_field(record: Any) -> None:
    cls = type(record)
    for version in (cls.VERSION + 1, 0, "1"):
        obj = {**json.loads(record.to_json()), "version": version}
        with pytest.raises(RecordError, match=r"^runs/r/thing\.json: field 'version': ") as e:
            cls.from_json(json.dumps(obj), path="runs/r/thing.json")
        assert e.value.path == "runs/r/thing.json" and e.value.field == "version"


@pytest.mark.parametrize(
    ("record", "field"),
    [
        (batch_entry(), "data_file"),
        (batch_entry(), "cursor"),
        (ready_marker(), "sha256"),
        (commit_marker(), "files"),
        (commit_marker(), "vocab_size"),
        (LatestPointer(step=1), "step"),
        (hf_marker(), "files"),
    ],
    ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_missing_field_is_refused_naming_file_and_field(record: Any, field: str) -> None:
    obj = json.loads(record.to_json())
    del obj[field]
    with pytest.raises(RecordError, match=rf"^some/file\.json: field '{field}': missing$"):
        type(record).from_json(obj, path="some/file.json")


def test_nested_and_typed_fields_are_checked_by_dotted_name() -> None:
    obj = json.loads(batch_entry().to_json())
    obj["cursor"]["reservoir"]["files"][0]["seq"] = "6"
    with pytest.raises(RecordError, match=r"field 'cursor\.reservoir\.files\[0\]\.seq': must be an integer"):
        BatchLogEntry.from_json(obj, path="e.json")
    obj = json.loads(batch_entry().to_json())
    obj["cursor"]["version"] = 2
    with pytest.raises(RecordError, match=r"field 'cursor\.version': unknown cursor version 2"):
        BatchLogEntry.from_json(obj, path="e.json")
    obj = json.loads(batch_entry().to_json())
    obj["tokenizer"] = "gpt2"  # a field no writer declares is refused, not silently carried
    with pytest.raises(RecordError, match=r"field 'tokenizer': unknown field"):
        BatchLogEntry.from_json(obj, path="e.json")
    with pytest.raises(RecordError, match=r"field 'slot': must be an integer, got True"):
        BatchLogEntry.from_json({**json.loads(batch_entry().to_json()), "slot": True}, path="e.json")
    with pytest.raises(RecordError, match=r"field 'format'"):
        CommitMarker.from_json({**json.loads(commit_marker().to_json()), "format": "pickle"}, path="c")
    untyped = {"step": 3, "files": ["config.json"]}  # what hf/COMMITTED held before it was a record
    with pytest.raises(RecordError, match=r"field 'files': "):
        HfFolderMarker.from_json(untyped, path="h")
    bad_key = json.loads(hf_marker().to_json())
    bad_key["files"]["model.safetensors"] = bad_key["files"].pop("config.json")
    with pytest.raises(RecordError, match=r"field 'files\.model\.safetensors\.path'"):
        HfFolderMarker.from_json(bad_key, path="h")
    with pytest.raises(RecordError, match=r"e\.json: field '<json>': not valid JSON"):
        BatchLogEntry.from_json(b"{oops", path="e.json")
    with pytest.raises(RecordError, match=r"field '<record>': must be a JSON object"):
        LatestPointer.from_json(b"[1]", path="e.json")


def test_older_cursor_and_entries_without_seals_still_read() -> None:
    """Cursors written before late sweeps (no `late` / `sweep_next`) and entries written before seals."""
    obj = json.loads(batch_entry().to_json())
    del obj["cursor"]["late"], obj["cursor"]["sweep_next"], obj["sealed"]
    entry = BatchLogEntry.from_json(obj, path="e.json")
    assert entry.cursor.late == [] and entry.cursor.sweep_next == 0 and entry.sealed is None


def test_an_older_version_is_upgraded_by_name() -> None:
    """The upgrade hook: a record class at version 2 reads version 1 through `_upgrade_from_v1`."""

    @dataclasses.dataclass(frozen=True)
    class PointerV2(LatestPointer):
        VERSION = 2
        note: str = ""

        @staticmethod
        def _upgrade_from_v1(obj: dict[str, Any]) -> dict[str, Any]:
            return {**obj, "note": "from v1"}

    assert PointerV2.from_json(b'{"step": 4}', path="p") == PointerV2(step=4, note="from v1")
    assert PointerV2.from_json(b'{"step": 4, "version": 2, "note": "n"}', path="p") == PointerV2(step=4, note="n")
    with pytest.raises(RecordError, match="version 3 is newer"):
        PointerV2.from_json(b'{"step": 4, "version": 3}', path="p")


def test_a_bad_ready_marker_quarantines_its_data_file(tmp_path: Path) -> None:
    from schemas import ROLLOUT

    store = RunStore(str(tmp_path))
    rel = layout.rollout_file(0, "w", 0)
    store.put_unique(rel, b"data")
    obj = {**json.loads(ready_marker().to_json()), "file": rel, "version": 9}
    store.put_unique(layout.ready_marker(rel), json.dumps(obj).encode())
    with pytest.raises(CorruptFileError, match="field 'version'"):
        store.read_marker(rel)
    assert store.read_committed(rel, ROLLOUT) is None and store.is_quarantined(rel)


# ------------------------------------------------------------------------------------ a short real job
JOB_STEPS = 6  # the session's test job (configs/test_cats.yaml)


@pytest.fixture
def job_root(default_job: FinishedJob) -> RunStore:
    """The run root of the session's test job (shared with other files: read only)."""
    return RunStore(str(default_job.root))


def _all_files(store: RunStore, folder: str = "") -> list[str]:
    out = []
    for rel in store.list(folder):
        children = store.list(rel)
        out.extend(_all_files(store, rel) if children else [rel])
    return out


@pytest.mark.slow
def test_every_record_a_job_writes_validates(job_root: RunStore) -> None:
    store = job_root
    files = _all_files(store)
    by_type: dict[type, list[Any]] = {BatchLogEntry: [], ReadyMarker: [], CommitMarker: [], LatestPointer: []}
    for rel in files:
        name = rel.rsplit("/", 1)[-1]
        if rel.startswith(layout.BATCH_LOG + "/") and name.endswith(".json"):
            cls: type = BatchLogEntry
        elif name.endswith(layout.READY_SUFFIX):
            cls = ReadyMarker
        elif name == layout.COMMIT_MARKER:
            cls = CommitMarker
        elif rel == layout.POLICY_LATEST:
            cls = LatestPointer
        else:
            continue
        data = store.get(rel)
        record = cls.from_json(data, path=rel)  # raises RecordError naming the file and field
        assert json.loads(data)["version"] == cls.VERSION, f"{rel} was written without its version"
        by_type[cls].append((rel, record))
    counts = {cls.__name__: len(v) for cls, v in by_type.items()}
    assert counts["BatchLogEntry"] == JOB_STEPS and counts["LatestPointer"] == 1, counts
    assert counts["ReadyMarker"] > 0 and counts["CommitMarker"] >= JOB_STEPS + 1, counts  # policies 0..6, checkpoints
    for rel, entry in by_type[BatchLogEntry]:
        assert layout.batch_log_entry(entry.slot) == rel and store.exists(entry.data_file)
        assert entry.cursor.version == Cursor.VERSION and entry.rows > 0
    for rel, marker in by_type[ReadyMarker]:
        assert marker.file == layout.data_of_marker(rel) and marker.size == len(store.get(marker.file))
    kinds = {m.kind for _, m in by_type[CommitMarker]}
    assert kinds == {"policy", "checkpoint"}
    for rel, m in by_type[CommitMarker]:
        folder = rel.rsplit("/", 1)[0]
        assert layout.parse_step(folder) == m.step and m.files
    (_, latest), = by_type[LatestPointer]  # fmt: skip
    assert latest.step == JOB_STEPS
