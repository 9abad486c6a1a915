"""A committed batch slot, verified against its log entry on read, and rebuilt from its recorded inputs when its data
file does not match.

`verified_batch(store, entry, train)` is how every reader of a batch's content gets it (the learner, `make replay`,
retention's lineage index): the data file named by the log entry `batches/log/step-T.json` must have the entry's
`data_size`, `data_sha256` and `rows`, and read as `schemas.BATCH`. A file that does not (replaced, truncated, gone,
or named by an entry whose digest was damaged) is never trained on: it is quarantined with its reason
(`RunStore.quarantine`; the bytes stay for forensics) and the recovery rule applies:

  the slot is rebuilt from its recorded inputs: the BatchMaker's reservoir as the cursor of slot T-1 records it
  (nothing before slot 1), then the rollout files of slot T's `ingested_files`, in that order, fed as the BatchMaker
  fed them (`no_signal_fill_after` included), then `BatchMaker.make_batch(T)`. The BatchMaker is deterministic, so
  this is the slot's batch exactly when it reproduces what the entry records: its digest (`data_size`,
  `data_sha256`), or, for an entry whose digest itself is damaged, every other record of the slot (`rows`, the
  lineage's source files and rollout count, and the reservoir the entry's cursor holds after the slot).

A rebuild that reproduces neither, or that cannot be made (the train config the slot was built with is not known,
slot T-1's entry is damaged, a rollout file it needs is quarantined or deleted by retention), stops the reader with
`pipeline.process.exits.DamagedInputError` naming the data file and what differs (exit code 7). The rebuild is made
in memory each time it is needed (nothing is written but the quarantine record), so every reader gets the same
batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import Any

import pyarrow as pa

from pipeline.batch_maker.maker import BatchMaker
from pipeline.batch_maker.packing import BatchResult
from pipeline.batch_maker.slot_metrics import fill_starts
from pipeline.config import TrainParams
from pipeline.process.exits import DamagedInputError
from pipeline.store import layout
from pipeline.store.committed import CorruptFileError
from pipeline.store.storage import RunStore
from schemas import BATCH, ROLLOUT
from schemas.base import SchemaMismatchError
from schemas.records import BatchLogEntry, RecordError

logger = logging.getLogger("pipeline.batch_maker.rebuild")


class RebuildError(Exception):
    """A batch slot cannot be rebuilt from its recorded inputs; the message says which input is missing."""


def train_hash(train: TrainParams) -> str:
    """The `config_hash` a BatchMaker with `train` stamps into its log entries (`loop_state.config_hash`)."""
    blob = json.dumps(dataclasses.asdict(train), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def verify_batch_file(store: RunStore, entry: BatchLogEntry) -> tuple[pa.Table | None, str]:
    """(the batch table, "") when the entry's data file matches it; (None, what differs) otherwise. Reads only."""
    path = entry.data_file
    if store.is_quarantined(path):
        return None, f"quarantined earlier ({_quarantine_reason(store, path)})"
    try:
        data = store.get(path)
    except FileNotFoundError:
        return None, f"data file missing although {layout.batch_log_entry(entry.slot)} commits it"
    if len(data) != entry.data_size:
        return None, f"size {len(data)} != data_size {entry.data_size} of {layout.batch_log_entry(entry.slot)}"
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.data_sha256:
        return None, (
            f"sha256 {digest[:16]}… != data_sha256 {entry.data_sha256[:16]}… of {layout.batch_log_entry(entry.slot)}"
        )
    try:
        table = store.parse_parquet(data, BATCH, path, verify_pages=False)
    except CorruptFileError as e:
        return None, e.reason
    except SchemaMismatchError as e:
        return None, f"schema mismatch: expected {e.expected}, found {e.found}"
    if table.num_rows != entry.rows:
        return None, f"{table.num_rows} rows != rows {entry.rows} of {layout.batch_log_entry(entry.slot)}"
    return table, ""


def verified_batch(store: RunStore, entry: BatchLogEntry, train: TrainParams | None) -> pa.Table:
    """Batch slot `entry.slot`'s table, verified against its log entry, or rebuilt (see the module docstring).

    `train`: the train config to rebuild with when it is the one the slot was built with (`config_hash`); None
    (or another one): the rebuild needs no more than the BatchMaker's config recorded in run.json, which the caller
    may pass instead. Raises DamagedInputError naming the data file and what differs when neither the file nor a
    rebuild can be trusted.
    """
    table, why = verify_batch_file(store, entry)
    if table is not None:
        return table
    path = entry.data_file
    if not store.is_quarantined(path):
        store.quarantine(path, why)
    if train is None or train_hash(train) != entry.config_hash:
        recorded = "unknown" if train is None else train_hash(train)
        raise DamagedInputError(
            path, f"{why}; not rebuilt: slot {entry.slot} was built with train config {entry.config_hash}, the "
            f"reader has {recorded}"
        )  # fmt: skip
    try:
        batch, snapshot = rebuild_slot(store, entry.slot, train)
    except (RebuildError, RecordError) as e:
        raise DamagedInputError(path, f"{why}; not rebuilt from its recorded inputs: {e}") from None
    data = store.parquet_bytes(batch.table, BATCH, path)
    rebuilt = store.parse_parquet(data, BATCH, path, verify_pages=False)  # read back as every batch file is read
    digest = hashlib.sha256(data).hexdigest()
    if len(data) == entry.data_size and digest == entry.data_sha256:
        logger.warning("batch slot %d: %s %s; rebuilt from its recorded inputs (identical to the committed digest)",
                       entry.slot, path, why)  # fmt: skip
        return rebuilt
    differs = _record_differences(entry, batch, snapshot)
    if differs:
        raise DamagedInputError(
            path, f"{why}; the rebuild from its recorded inputs differs from {layout.batch_log_entry(entry.slot)} "
            f"too ({'; '.join(differs)})"
        )  # fmt: skip
    logger.warning("batch slot %d: %s %s; rebuilt from its recorded inputs, which reproduce the entry's rows, lineage "
                   "and cursor but not its data_sha256 (the entry's digest is damaged)", entry.slot, path,
                   why)  # fmt: skip
    return rebuilt


def rebuild_slot(store: RunStore, slot: int, train: TrainParams) -> tuple[BatchResult, dict[str, Any]]:
    """Batch `slot` built again from its recorded inputs: (the batch, the reservoir snapshot after it).

    Raises RebuildError naming the input that is missing, RecordError for a damaged log entry."""
    entry = store.read_log_entry(slot)
    bm = BatchMaker(train)
    if slot > 1:
        try:
            previous = store.read_log_entry(slot - 1)
        except FileNotFoundError:
            raise RebuildError(f"{layout.batch_log_entry(slot - 1)} is not committed") from None
        reservoir = previous.cursor.reservoir
        for f in reservoir.files:
            bm.restore_file(_rollouts(store, f.path, slot), f.path, seq=f.seq, policy_step=f.policy_step, rows=f.rows,
                            uses=f.uses)  # fmt: skip
        bm.set_next_seq(reservoir.next_seq)
    # fed as `BatchMakerLoop.ingest` feeds them; every file was produced by a policy published before it was listed,
    # so the newest policy when the slot was committed refuses no row the live maker admitted
    no_signal_files = no_signal_rows = 0
    fill = entry.no_signal_fill_from_start  # saturated: the live maker filled from the first file (`fills_at_once`)
    for path in entry.ingested_files:
        table = _rollouts(store, path, slot)
        if train.filter_zero_variance and fill_starts(
            no_signal_files, no_signal_rows, train.batch_size, train.no_signal_fill_after
        ):
            fill = True
        rep = bm.add_rollouts(table, path, slot=slot, latest_policy=entry.learner_step,
                              dir_policy_step=layout.parse_step(path), admit_no_signal=fill)  # fmt: skip
        if rep.without_signal:
            no_signal_files += 1
            no_signal_rows += table.num_rows
    batch = bm.make_batch(slot)
    if batch is None:
        raise RebuildError(f"the recorded inputs of slot {slot} give too few eligible rollouts for a batch")
    return batch, bm.snapshot()


def _rollouts(store: RunStore, path: str, slot: int) -> pa.Table:
    table = store.read_committed(path, ROLLOUT) if store.exists(layout.ready_marker(path)) else None
    if table is None:
        why = "quarantined" if store.is_quarantined(path) else "not committed (deleted by retention?)"
        raise RebuildError(f"rollout file {path}, an input of slot {slot}, is {why}")
    return table


def _record_differences(entry: BatchLogEntry, batch: BatchResult, snapshot: dict[str, Any]) -> list[str]:
    """What the entry records about its slot that the rebuilt batch does not reproduce."""
    out = []
    if batch.table.num_rows != entry.rows:
        out.append(f"rows {batch.table.num_rows} != {entry.rows}")
    if sorted(set(batch.source_files)) != sorted(entry.lineage.source_files):
        out.append("lineage.source_files differ")
    if batch.stats["n_rollouts"] != entry.lineage.n_rollouts:
        out.append(f"lineage.n_rollouts {batch.stats['n_rollouts']} != {entry.lineage.n_rollouts}")
    if snapshot != entry.cursor.reservoir.to_dict():
        out.append("cursor.reservoir differs")
    return out


def _quarantine_reason(store: RunStore, path: str) -> str:
    try:
        return str(store.get_json(layout.quarantine_record(path)).get("reason", "no reason recorded"))
    except (FileNotFoundError, CorruptFileError, AttributeError):
        return "no readable reason"
