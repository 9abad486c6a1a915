"""Declared, versioned data contracts of rlpipe (pyarrow only, no JAX).

Every parquet file the pipeline writes carries its schema name and version in the
file metadata (`rlpipe.schema`, `rlpipe.schema_version`); readers check both.
Every JSON commit record (batch log entry, ready marker, COMMITTED marker, LATEST)
is a typed, versioned class in `schemas.records`; readers and writers go through it.
"""

from schemas.base import (
    SCHEMA_NAME_KEY,
    SCHEMA_VERSION_KEY,
    SchemaMismatchError,
    TableSpec,
    ValidationError,
)
from schemas.batch import BATCH, BatchRow
from schemas.dropped import DROP_REASONS, DROPPED, DroppedRow
from schemas.evaluation import EVAL_ROW, EVAL_SUMMARY, EvalRow, EvalSummaryRow
from schemas.lineage import LINEAGE, LineageRow
from schemas.records import (
    BatchLogEntry,
    CommitMarker,
    LatestPointer,
    ReadyMarker,
    RecordError,
)
from schemas.rollout import ROLLOUT, RolloutRow

__all__ = [
    "BATCH",
    "DROPPED",
    "DROP_REASONS",
    "EVAL_ROW",
    "EVAL_SUMMARY",
    "LINEAGE",
    "ROLLOUT",
    "SCHEMA_NAME_KEY",
    "SCHEMA_VERSION_KEY",
    "BatchLogEntry",
    "BatchRow",
    "CommitMarker",
    "DroppedRow",
    "EvalRow",
    "EvalSummaryRow",
    "LatestPointer",
    "LineageRow",
    "ReadyMarker",
    "RecordError",
    "RolloutRow",
    "SchemaMismatchError",
    "TableSpec",
    "ValidationError",
]
