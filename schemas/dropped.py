"""Dropped-rollout records: which rollout rows the BatchMaker set aside, and why.

One file per committed batch slot (`batches/dropped/step-T-<attempt>.parquet`, named by the slot's
log entry under `dropped_file`): every rollout row whose fate was decided while slot T was being
built and that went into no batch. Together with the batch files' `rollout_ids`/`source_files`
lineage columns this answers "what happened to rollout X" from the run root alone. Only files
named by a committed log entry count; others are leftovers of attempts that lost the slot race.

Reasons (`DROP_REASONS`): stale (policy too old for the staleness window), zero_variance (all rewards
of its group equal), zero_advantage (its own advantage is exactly 0), superseded (a newer policy's
group for the same problem arrived: latest-version retention), evicted (reservoir over capacity),
too_long (does not fit seq_len under the overlong rule), malformed (breaks the rollout contract:
`detail` says how), future_policy (claims a policy the learner has not published).
"""

from __future__ import annotations

import dataclasses

from schemas.base import TableSpec, check_choice, check_nonempty

DROP_REASONS = (
    "stale",
    "zero_variance",
    "zero_advantage",
    "superseded",
    "evicted",
    "too_long",
    "malformed",
    "future_policy",
)


@dataclasses.dataclass
class DroppedRow:
    """One rollout row the BatchMaker dropped.

    row_index: the row's position in `source_file`. policy_step: -1 if the row was too malformed to say.
    slot: the batch slot whose commit recorded the drop.
    """

    rollout_id: str
    source_file: str
    row_index: int
    policy_step: int
    reason: str
    detail: str
    slot: int


def validate_dropped(row: DroppedRow) -> None:
    """Raise ValidationError unless the reason is a known one and the file is named."""
    check_nonempty("source_file", row.source_file)
    check_choice("reason", row.reason, DROP_REASONS)


DROPPED: TableSpec[DroppedRow] = TableSpec.of(DroppedRow, "dropped", validate_dropped, version=1)
