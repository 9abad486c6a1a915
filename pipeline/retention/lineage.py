"""The lineage index: the fate of every rollout row of the batch slots whose data files retention deletes.

`build_index(store, first, last)` reads the committed log entries of slots `first..last`, their batch data files
(`rollout_ids`, `source_files`, `policy_steps` per segment: one `used` row per segment) and their dropped records
(one row per drop, fate = reason). `write_index` commits it as `lineage/slots-<first>-<last>-<attempt>.parquet`
with a ready marker whose `first_slot` / `last_slot` fields name the covered slots. `read_index` returns the
rows of every committed lineage file; when two files cover overlapping slots (two collections raced), the one
with the lower first slot, then the lexicographically first name, wins for the overlap, so no fate is counted
twice. `covered_through` is the newest slot covered contiguously from 1.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa

from pipeline.batch_maker.rebuild import verified_batch
from pipeline.config import TrainParams
from pipeline.store import layout, run_state
from pipeline.store.storage import RunStore, new_attempt_id
from schemas.dropped import DROPPED
from schemas.lineage import LINEAGE, USED

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexFile:
    """One committed lineage file and the slots it covers."""

    path: str
    first_slot: int
    last_slot: int


def index_files(store: RunStore) -> list[IndexFile]:
    """The committed lineage files whose slots do not overlap an earlier one's, in slot order."""
    found: list[IndexFile] = []
    for path in store.list_committed(layout.LINEAGE):
        marker = store.read_marker(path)
        try:
            first, last = int(marker.extra["first_slot"]), int(marker.extra["last_slot"])
        except (KeyError, TypeError, ValueError):
            store.quarantine(path, "lineage marker without first_slot/last_slot")
            continue
        found.append(IndexFile(path, first, last))
    found.sort(key=lambda f: (f.first_slot, f.path))
    chosen: list[IndexFile] = []
    through = 0
    for f in found:
        if f.first_slot > through:  # an overlapping (raced) file adds nothing the chosen ones lack
            chosen.append(f)
            through = f.last_slot
        elif f.last_slot > through:
            logger.warning("lineage file %s overlaps slots up to %d; its rows are not used", f.path, through)
    return chosen


def covered_through(files: Iterable[IndexFile]) -> int:
    """The newest slot T such that slots 1..T are all covered by `files` (0 if slot 1 is not)."""
    through = 0
    for f in sorted(files, key=lambda f: f.first_slot):
        if f.first_slot != through + 1:
            break
        through = f.last_slot
    return through


def _recorded_train(store: RunStore) -> TrainParams | None:
    """The run's train config as run.json records it (None: not readable), for rebuilding a damaged batch."""
    import draccus

    try:
        return draccus.decode(TrainParams, run_state.read_run_record(store)["config"]["train"])
    except (FileNotFoundError, KeyError, TypeError, ValueError, draccus.utils.ParsingError):
        return None


def _slot_rows(store: RunStore, slot: int, train: TrainParams | None = None) -> dict[str, list[object]]:
    """The lineage columns of one committed slot: its batch's segments (`used`) and its dropped rows.

    The batch is verified against its log entry (a damaged data file is quarantined and the slot rebuilt with
    `train`, or DamagedInputError: `pipeline.batch_maker.rebuild`), so the index never records a damaged file's
    rows."""
    entry = store.read_log_entry(slot)
    cols: dict[str, list[object]] = {name: [] for name in LINEAGE.schema.names}
    batch = verified_batch(store, entry, train)
    for ids, files, steps in zip(
        batch.column("rollout_ids").to_pylist(),
        batch.column("source_files").to_pylist(),
        batch.column("policy_steps").to_pylist(),
        strict=True,
    ):
        for rid, src, step in zip(ids, files, steps, strict=True):
            for name, value in zip(LINEAGE.schema.names, (rid, src, step, USED, slot), strict=True):
                cols[name].append(value)
    if entry.dropped_file is not None:
        dropped = store.read_parquet(entry.dropped_file, DROPPED)
        for name, column in (
            ("rollout_id", "rollout_id"),
            ("source_file", "source_file"),
            ("policy_step", "policy_step"),
            ("fate", "reason"),
        ):
            cols[name].extend(dropped.column(column).to_pylist())
        cols["slot"].extend([slot] * dropped.num_rows)
    return cols


def build_index(store: RunStore, first: int, last: int) -> pa.Table:
    """The lineage rows of batch slots `first..last` (every slot must be committed with its data present)."""
    cols: dict[str, list[object]] = {name: [] for name in LINEAGE.schema.names}
    train = _recorded_train(store)
    for slot in range(first, last + 1):
        for name, values in _slot_rows(store, slot, train).items():
            cols[name].extend(values)
    return pa.Table.from_pydict(cols, schema=LINEAGE.arrow_schema())


def write_index(store: RunStore, first: int, last: int, table: pa.Table) -> str:
    """Commit `table` as the lineage index of slots `first..last`; returns its path."""
    path = layout.lineage_file(first, last, new_attempt_id())
    store.commit_data(path, table, LINEAGE, extra={"first_slot": first, "last_slot": last})
    logger.info("lineage index of slots %d..%d: %s (%d rows)", first, last, path, table.num_rows)
    return path


def read_index(store: RunStore, files: Iterable[IndexFile] | None = None, since_slot: int = 0) -> pa.Table:
    """The rows of the (non-overlapping) committed lineage files covering slots >= `since_slot`."""
    tables = []
    for f in index_files(store) if files is None else files:
        if f.last_slot < since_slot:
            continue
        table = store.read_committed(f.path, LINEAGE)
        if table is not None:
            tables.append(table)
    if not tables:
        return LINEAGE.arrow_schema().empty_table()
    return pa.concat_tables(tables)


def used_through(store: RunStore) -> tuple[int, list[str]]:
    """(T, ids): slots 1..T are covered by the lineage index, and `ids` lists the rollout id of every `used`
    row of those slots (one per batch use); (0, []) without an index."""
    files = index_files(store)
    through = covered_through(files)
    if through == 0:
        return 0, []
    table = read_index(store, [f for f in files if f.last_slot <= through])
    ids = [
        rid
        for rid, fate in zip(table.column("rollout_id").to_pylist(), table.column("fate").to_pylist(), strict=True)
        if fate == USED
    ]
    return through, ids
