"""Reading a run root into `RunData`: everything the report shows, never raising for missing data.

Each reader fills part of one `RunData`; an unreadable or malformed file becomes a note in `RunData.notes`
(shown in the summary) instead of an error. The record helpers at the end (`num`, `last_per`, `series`,
`start_time`) are how the sections pick numbers out of metrics records.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.process.step_kind import StepKind
from pipeline.report.answers import AnswerSample, read_answers
from pipeline.retention.lineage import used_through
from pipeline.rollout.samples import SAMPLES_EVENT, Sample, newest_rollout_file, newest_samples, tokenizer_decoder
from pipeline.store import layout
from pipeline.store.storage import CorruptFileError, RunStore, SchemaMismatchError
from pipeline.telemetry.metrics import read_metrics
from schemas import BATCH, EVAL_SUMMARY
from schemas.base import TableSpec
from schemas.dropped import DROPPED
from schemas.records import BatchLogEntry, RecordError

logger = logging.getLogger(__name__)

METRIC_KINDS = (StepKind.LEARNER, StepKind.BATCHMAKER, StepKind.ROLLOUT)
"""The metrics step kinds the report reads (evaluations come from their summary files, the authority)."""

_READ_THREADS = 16
_BATCHMAKER_ALIASES = (
    ("staleness_min", "lag_min"),
    ("staleness_mean", "lag_mean"),
    ("staleness_max", "lag_max"),
    ("mean_reward", "reward_mean"),
)
EXTERNAL_PREFIX = "external-"
"""Folder prefix under `evals/` of the summaries of external baselines (`external-<name>`)."""


def _get_many(store: RunStore, rels: Sequence[str]) -> list[bytes | None]:
    """Fetch objects concurrently; a missing or unreadable object gives None (logged)."""

    def one(rel: str) -> bytes | None:
        try:
            return store.get(rel)
        except (OSError, ValueError) as e:
            logger.warning("report: cannot read %s: %s", rel, e)
            return None

    if len(rels) <= 1:
        return [one(r) for r in rels]
    with ThreadPoolExecutor(max_workers=min(_READ_THREADS, len(rels))) as pool:
        return list(pool.map(one, rels))


def _parse_json(rel: str, data: bytes | None, notes: list[str]) -> Any:
    """Parsed JSON, or None when the object is missing or not JSON (then noted in `notes`)."""
    if data is None:
        return None
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        logger.warning("report: %s is not valid JSON: %s", rel, e)
        notes.append(f"{rel} is not valid JSON ({e})")
        return None


@dataclasses.dataclass
class RunData:
    """Everything the report shows, as read from one run root."""

    run_root: str
    run_config: dict[str, Any] | None = None
    metrics: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    eval_summaries: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    batch_slots: list[int] = dataclasses.field(default_factory=list)
    rollout_uses: int | None = None
    """Rollout uses summed over committed batches (None: no lineage found)."""
    rollouts_used: int | None = None
    """Distinct rollouts in committed batches (None: no lineage found)."""
    rollouts_used_with_signal: int | None = None
    """Distinct rollouts in committed batches with a non-zero advantage in at least one batch (rows a slot filled
    without signal, advantage 0, are used but teach nothing); None when some batch files are gone (retention)."""
    dropped_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    """Distinct dropped rollouts per reason."""
    curriculum_events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    quarantined: int = 0
    """Files set aside by any step (quarantine records)."""
    quarantine: list[dict[str, str]] = dataclasses.field(default_factory=list)
    """Every quarantine record as {path, kind, reason}, by path: what was set aside (a rollout or batch file, a
    curriculum state) or skipped (a damaged policy `evaluate` skipped, a checkpoint the learner fell back from)."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """Problems met while reading (unreadable files), shown in the summary."""
    samples_file: str | None = None
    """The newest committed rollout file (the samples of the latest policy come from it)."""
    samples: list[Sample] = dataclasses.field(default_factory=list)
    """Decoded completions of `samples_file`."""
    samples_note: str | None = None
    """Why `samples` is empty although there are rollouts (e.g. no tokenizer to decode with)."""
    sample_records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The `samples` metrics records of rollout workers (one per policy step and worker), by time."""
    answers: list[AnswerSample] = dataclasses.field(default_factory=list)
    """Right and wrong samples per lesson from eval and rollout rows (`pipeline.report.answers`)."""
    pool: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The elastic rollout pool's records (`pipeline.jobs.pool.read_pool_records`; [] without one), by time."""
    empty_records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The rollout workers' `empty` records, by time: sampling calls that committed nothing because every example
    failed (their `env/` scorer metrics and `failure_reasons`; `pipeline.report.scorers`)."""


QUARANTINE_KINDS = (
    (f"{layout.POLICIES}/", "policy (skipped)"),
    (f"{layout.CHECKPOINTS}/", "checkpoint (skipped)"),
    (f"{layout.ROLLOUTS}/", "rollout file"),
    ("batches/data/", "batch file"),
    (f"{layout.CURRICULUM}/", "curriculum state"),
    (f"{layout.EVALS}/", "evaluation file"),
)
"""The kind of a quarantined object by the folder it lies in (anything else: "other")."""


def quarantine_kind(path: str) -> str:
    """What a quarantined path is (`QUARANTINE_KINDS`)."""
    return next((kind for prefix, kind in QUARANTINE_KINDS if path.startswith(prefix)), "other")


def _read_quarantine(store: RunStore, data: RunData) -> None:
    """Every quarantine record: path, kind and reason (an unreadable record becomes a note)."""
    records = [r for r in store.list(layout.QUARANTINE) if r.endswith(".json")]
    for rel, blob in zip(records, _get_many(store, records), strict=True):
        obj = _parse_json(rel, blob, data.notes)
        if not isinstance(obj, dict) or not isinstance(obj.get("path"), str):
            if obj is not None:
                data.notes.append(f"quarantine record {rel} names no path")
            continue
        path = obj["path"]
        data.quarantine.append({"path": path, "kind": quarantine_kind(path), "reason": str(obj.get("reason", ""))})
    data.quarantine.sort(key=lambda r: r["path"])


def _read_run_config(store: RunStore, data: RunData) -> None:
    obj = _parse_json(layout.RUN_CONFIG, _get_many(store, [layout.RUN_CONFIG])[0], data.notes)
    if isinstance(obj, dict):
        data.run_config = obj
    elif obj is not None:
        data.notes.append(f"{layout.RUN_CONFIG} is not a JSON object")


def _parse_or_note(data: RunData, blob: bytes, spec: TableSpec[Any], rel: str, what: str) -> pa.Table | None:
    """The parquet table of `blob` (read through `spec`), or None with a note "skipped <what> <rel>: why"
    when it is damaged or of another schema."""
    try:
        return RunStore.parse_parquet(blob, spec, rel)
    except (CorruptFileError, SchemaMismatchError) as e:
        data.notes.append(f"skipped {what} {rel}: {e}")
        return None


def _read_eval_summaries(store: RunStore, data: RunData, bad: set[str]) -> None:
    """Every evaluation summary `evals/step-S/<lesson>.summary.parquet` (its presence commits it)."""
    rels = [
        rel
        for eval_dir in store.list(layout.EVALS)
        for rel in store.list(eval_dir)
        if rel.endswith(".summary.parquet") and rel not in bad
    ]
    for rel, blob in zip(rels, _get_many(store, rels), strict=True):
        if blob is None:
            continue
        table = _parse_or_note(data, blob, EVAL_SUMMARY, rel, "evaluation summary")
        if table is None:
            continue
        folder = rel.split("/")[-2]
        external = folder[len(EXTERNAL_PREFIX) :] if folder.startswith(EXTERNAL_PREFIX) else None
        for row in table.to_pylist():
            row["external"] = external
            data.eval_summaries.append(row)


def _find_strings(obj: Any) -> Iterable[str]:
    """Every string value inside a JSON value."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _find_strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _find_strings(v)


def _read_batch_log(store: RunStore, data: RunData) -> tuple[list[str], list[str], dict[int, str]]:
    """Committed batch slots; returns the batch data files and dropped files their log entries name,
    and each slot's attempt id."""
    log_rels = [r for r in store.list(layout.BATCH_LOG) if r.endswith(".json")]
    data_files: set[str] = set()
    dropped_files: set[str] = set()
    attempts: dict[int, str] = {}
    for rel, blob in zip(log_rels, _get_many(store, log_rels), strict=True):
        try:
            slot = layout.parse_step(rel)
        except ValueError:
            continue
        data.batch_slots.append(slot)
        entry = _parse_json(rel, blob, data.notes)
        try:
            record = BatchLogEntry.from_json(entry, path=rel) if isinstance(entry, dict) else None
        except RecordError as e:  # not a valid record: still show what it names, and say so
            data.notes.append(str(e))
            record = None
        if record is not None:
            data_files.add(record.data_file)
            if record.dropped_file is not None:
                dropped_files.add(record.dropped_file)
            attempts[slot] = record.attempt_id
            continue
        for s in _find_strings(entry):
            for folder, found in ((layout.BATCH_DATA, data_files), (layout.BATCH_DROPPED, dropped_files)):
                if s.endswith(".parquet") and folder + "/" in s:
                    found.add(s[s.index(folder) :])
        if isinstance(entry, dict) and isinstance(entry.get("attempt_id"), str):
            attempts[slot] = entry["attempt_id"]
    data.batch_slots.sort()
    return sorted(data_files), sorted(dropped_files), attempts


def _read_lineage(store: RunStore, data: RunData, data_files: Sequence[str], prior: Sequence[str] = ()) -> None:
    """Count rollout uses from the `rollout_ids` lineage column of committed batch files, plus the `prior` uses
    the lineage index records for slots whose batch files retention deleted."""
    if not data_files and not prior:
        return
    ids: list[str] = list(prior)
    with_signal: set[str] = set()
    unreadable = 0
    for rel, blob in zip(data_files, _get_many(store, data_files), strict=True):
        if blob is None:
            unreadable += 1
            continue
        try:
            pf = pq.ParquetFile(pa.BufferReader(blob))
            BATCH.check_metadata(pf.schema_arrow.metadata, rel)
            table = pf.read(columns=["rollout_ids", "segment_ids", "advantages"])
        except (pa.ArrowException, OSError, ValueError) as e:  # SchemaMismatchError is a ValueError
            logger.warning("report: skipping batch file %s: %s", rel, e)
            unreadable += 1
            continue
        row_ids = table.column("rollout_ids").to_pylist()
        for seg_ids in row_ids:
            ids.extend(seg_ids or [])
        with_signal.update(_ids_with_signal(table, row_ids))
    if unreadable:
        data.notes.append(f"{unreadable} committed batch data file(s) unreadable: rollout counts are partial")
    data.rollout_uses = len(ids)
    data.rollouts_used = len(set(ids))
    data.rollouts_used_with_signal = None if prior else len(with_signal)


def _ids_with_signal(table: pa.Table, row_ids: list[list[str] | None]) -> set[str]:
    """The rollout ids of `table`'s batch rows (a row's k-th id is its segment k) whose segment carries a non-zero
    advantage on some token."""
    segments = table.column("segment_ids").combine_chunks()
    row = np.asarray(pc.list_parent_indices(segments).to_numpy(), dtype=np.int64)
    seg = np.asarray(pc.list_flatten(segments).to_numpy(), dtype=np.int64)
    adv = np.asarray(pc.list_flatten(table.column("advantages").combine_chunks()).to_numpy())
    hit = (adv != 0) & (seg >= 0)
    pairs = np.unique(np.stack([row[hit], seg[hit]], axis=1), axis=0) if hit.any() else np.empty((0, 2), np.int64)
    out: set[str] = set()
    for r, k in pairs.tolist():
        ids = row_ids[r] or []
        if k < len(ids):
            out.add(ids[k])
    return out


def _read_dropped(store: RunStore, data: RunData, named: Sequence[str], attempts: dict[int, str]) -> None:
    """Distinct dropped rollouts per reason, read through `schemas.dropped.DROPPED`.

    Only the files that committed batch log entries name count (others are leftovers of attempts that
    lost a slot race). Without such names (older logs), every file in `batches/dropped/` counts except
    those of another attempt than the one a slot's log entry records.
    """
    rels = list(named)
    if not rels:

        def committed(rel: str) -> bool:
            try:
                slot = layout.parse_step(rel)
            except ValueError:
                return True
            attempt = attempts.get(slot)
            return attempt is None or rel.endswith(f"{layout.step_name(slot)}-{attempt}.parquet")

        rels = [r for r in store.list(layout.BATCH_DROPPED) if r.endswith(".parquet") and committed(r)]
    reason_of: dict[str, str] = {}
    for rel, blob in zip(rels, _get_many(store, rels), strict=True):
        if blob is None:
            data.notes.append(f"dropped-rollout file {rel} is missing")
            continue
        table = _parse_or_note(data, blob, DROPPED, rel, "dropped-rollout file")
        if table is None:
            continue
        for rid, reason in zip(table.column("rollout_id").to_pylist(), table.column("reason").to_pylist(), strict=True):
            reason_of[str(rid)] = str(reason)
    counts: dict[str, int] = defaultdict(int)
    for reason in reason_of.values():
        counts[reason] += 1
    data.dropped_by_reason = dict(sorted(counts.items()))


def _read_curriculum(store: RunStore, data: RunData) -> None:
    """The events of the newest readable curriculum state (each state lists every event so far)."""
    rels = [r for r in store.list(layout.CURRICULUM) if r.endswith(".json")]
    for rel in reversed(rels):
        state = _parse_json(rel, _get_many(store, [rel])[0], data.notes)
        events = state.get("events") if isinstance(state, dict) else None
        if not isinstance(events, list):
            if state is not None:
                data.notes.append(f"{rel} has no 'events' list")
            continue
        data.curriculum_events = [ev for ev in events if isinstance(ev, dict)]
        data.curriculum_events.sort(key=lambda e: num(e, "step") or 0.0)  # stable: keeps the writer's order
        return


def _read_samples(store: RunStore, data: RunData) -> None:
    """Decoded completions of the newest rollout file, with the tokenizer the run's config names."""
    model = ((data.run_config or {}).get("config") or {}).get("model") or {}
    spec = model.get("tokenizer") if isinstance(model, dict) else None
    if not isinstance(spec, str):
        data.samples_note = f"{layout.RUN_CONFIG} names no tokenizer (config.model.tokenizer) to decode rollouts"
        data.samples_file = newest_rollout_file(store)
        return
    try:
        decode = tokenizer_decoder(spec)
    except (ValueError, OSError) as e:
        data.samples_note = str(e)
        data.samples_file = newest_rollout_file(store)
        return
    data.samples_file, data.samples = newest_samples(store, decode)


def _decoder(data: RunData) -> Any:
    """The decoder of the tokenizer run.json names, or None when there is none to load."""
    model = ((data.run_config or {}).get("config") or {}).get("model") or {}
    spec = model.get("tokenizer") if isinstance(model, dict) else None
    try:
        return tokenizer_decoder(spec) if isinstance(spec, str) else None
    except (ValueError, OSError):
        return None


_EMPTY_EVENT = "rollout_empty"
"""Where `_normalise_metrics` sets the rollout workers' `empty` records aside (then `RunData.empty_records`)."""


def _normalise_metrics(metrics: dict[str, list[dict[str, Any]]]) -> None:
    """Fill canonical field names from known aliases and keep only rollout-write records.

    BatchMaker stats may name staleness `lag_min/lag_mean/lag_max` and the batch reward `reward_mean`;
    rollout workers also log non-write events (weights, empty, micro_eval, stop) that are no training data.
    """
    for rec in metrics.get(StepKind.BATCHMAKER, []):
        for canonical, alias in _BATCHMAKER_ALIASES:
            if canonical not in rec and alias in rec:
                rec[canonical] = rec[alias]
    if StepKind.ROLLOUT in metrics:
        samples = [r for r in metrics[StepKind.ROLLOUT] if r.get("event") == SAMPLES_EVENT]
        metrics[SAMPLES_EVENT] = samples
        metrics[_EMPTY_EVENT] = [r for r in metrics[StepKind.ROLLOUT] if r.get("event") == "empty"]
        metrics[StepKind.ROLLOUT] = [r for r in metrics[StepKind.ROLLOUT] if r.get("event", "write") == "write"]


def load_run(run_root: str, storage_options: dict[str, Any] | None = None) -> RunData:
    """Read everything the report shows from `run_root` (missing parts stay empty, never raise)."""
    store = RunStore(run_root, storage_options)  # read only: the report never writes into the run root
    data = RunData(run_root=run_root)
    bad = store.quarantined()
    data.quarantined = len(bad)
    _read_quarantine(store, data)
    _read_run_config(store, data)
    for kind in METRIC_KINDS:
        data.metrics[kind] = read_metrics(store, kind)
    _normalise_metrics(data.metrics)
    data.sample_records = data.metrics.pop(SAMPLES_EVENT, [])
    data.empty_records = data.metrics.pop(_EMPTY_EVENT, [])
    _read_eval_summaries(store, data, bad)
    data_files, dropped_files, attempts = _read_batch_log(store, data)
    covered, indexed_uses = used_through(store)  # slots 1..covered: the lineage index, not the batch files
    _read_lineage(store, data, [f for f in data_files if f not in bad and layout.parse_step(f) > covered], indexed_uses)
    _read_dropped(store, data, [f for f in dropped_files if f not in bad], attempts)
    _read_curriculum(store, data)
    try:
        from pipeline.jobs.pool import read_pool_records

        data.pool = read_pool_records(store)
    except Exception as e:  # a view: an unreadable pool record must not cost the report
        data.notes.append(f"cannot read the rollout pool's records: {type(e).__name__}: {e}")
    try:
        _read_samples(store, data)
    except Exception as e:  # samples are a view: a failure to read them must not cost the report
        logger.exception("report: cannot read sample completions")
        data.samples_note = f"cannot read sample completions: {type(e).__name__}: {e}"
    try:
        data.answers = read_answers(store, data.eval_summaries, _decoder(data), data.notes, bad)
    except Exception as e:  # a view as well
        logger.exception("report: cannot read right and wrong answers")
        data.notes.append(f"cannot read right and wrong answers: {type(e).__name__}: {e}")
    return data


# ---------------------------------------------------------------------------------------
# record helpers
# ---------------------------------------------------------------------------------------


def num(rec: dict[str, Any], key: str) -> float | None:
    """`rec[key]` as a finite float, or None when missing, non-numeric or not finite."""
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def last_per(records: Iterable[dict[str, Any]], key: str) -> dict[int, dict[str, Any]]:
    """The last record (by time) for each integer value of `key` (a rerun step overrides)."""
    out: dict[int, dict[str, Any]] = {}
    for rec in records:
        k = num(rec, key)
        if k is not None:
            out[int(k)] = rec
    return dict(sorted(out.items()))


def series(by_x: dict[int, dict[str, Any]], field: str) -> tuple[list[int], list[float]]:
    """(x, y) of the records that carry a numeric `field`."""
    xs, ys = [], []
    for x, rec in by_x.items():
        y = num(rec, field)
        if y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def start_time(data: RunData) -> float | None:
    """The earliest metrics record time of the run (None: no timed record)."""
    times = [t for recs in data.metrics.values() for r in recs if (t := num(r, "time")) is not None]
    return min(times) if times else None
