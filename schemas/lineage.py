"""Lineage index rows: the fate of every rollout row of the batch slots a garbage-collection run covers.

Written by the retention step (`pipeline.retention`) before it deletes rollout and batch data files, as
`lineage/slots-<first>-<last>-<attempt>.parquet` committed by its ready marker (whose `first_slot` /
`last_slot` fields name the covered slots). One row per fate: a rollout used in two batches has two `used`
rows; a dropped rollout has one row whose fate is the drop reason (`schemas.dropped.DROP_REASONS`).
With the kept `batches/dropped/` records and the batch log, it answers "what happened to rollout X" and
feeds the report after the data files are gone.
"""

from __future__ import annotations

import dataclasses

from schemas.base import TableSpec, ValidationError, check_choice, check_nonempty
from schemas.dropped import DROP_REASONS

USED = "used"
"""The fate of a rollout row that went into a batch (one row per batch)."""

FATES = (USED, *DROP_REASONS)


@dataclasses.dataclass
class LineageRow:
    """One fate of one rollout row.

    source_file: the rollout data file holding the row. policy_step: the policy that sampled it (-1: a
    malformed row that did not say). fate: `used` or a drop reason. slot: the batch slot that recorded the fate.
    """

    rollout_id: str
    source_file: str
    policy_step: int
    fate: str
    slot: int


def validate_lineage(row: LineageRow) -> None:
    """Raise ValidationError unless the fate is known, the file is named and the slot is a batch slot."""
    check_nonempty("source_file", row.source_file)
    check_choice("fate", row.fate, FATES)
    if row.slot < 1:
        raise ValidationError(f"slot must be >= 1, got {row.slot}")


LINEAGE: TableSpec[LineageRow] = TableSpec.of(LineageRow, "lineage", validate_lineage, version=1)
