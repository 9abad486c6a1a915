"""Batch rows: the learner's complete input for one step (tokens, loss mask, advantages and the
sampler's logprobs per token, plus lineage).

A batch file `batches/…/step-T` holds exactly `batch_size` rows of fixed length
`seq_len`. With packing, one row holds several segments: `segment_ids` numbers them
0, 1, … along the row and marks padding with -1; per-segment lists (`rollout_ids`,
`source_files`, `policy_steps`, `temperatures`) are indexed by segment id. Attention never
crosses segments; `position_ids` restart at 0 in each segment.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pyarrow as pa

from schemas.base import Float32, Int8, Int32, TableSpec, ValidationError, check_int_list, check_same_length


@dataclasses.dataclass
class BatchRow:
    """One fixed-length training row (one or more packed segments)."""

    tokens: list[Int32]
    loss_mask: list[Int8]
    segment_ids: list[Int32]
    position_ids: list[Int32]
    advantages: list[Float32]
    generator_logprobs: list[Float32]
    reference_logprobs: list[Float32] | None
    truncated: list[bool]
    temperatures: list[Float32]
    policy_steps: list[int]
    rollout_ids: list[str]
    source_files: list[str]
    token_rewards: list[Float32] | None = None
    """Per-token rewards of the segments' response tokens (the rollouts' `token_rewards`: the episode reward on
    the last policy token plus any process rewards), 0 on prompt tokens and padding; read by critic PPO's GAE
    (`loss.type: ppo_critic`). None in batch files of version 1, written before the column existed."""


def _add_token_rewards(table: pa.Table) -> pa.Table:
    """A version-1 batch table with the version-2 `token_rewards` column, null (not recorded)."""
    return table.append_column("token_rewards", pa.nulls(table.num_rows, type=pa.list_(pa.float32())))


def validate_batch_row(row: BatchRow) -> None:
    """Raise ValidationError when per-token lists disagree in length or segments are inconsistent."""
    check_int_list("tokens", row.tokens)
    names = ["tokens", "loss_mask", "segment_ids", "position_ids", "advantages", "generator_logprobs"]
    values: list[list[Any]] = [
        row.tokens,
        row.loss_mask,
        row.segment_ids,
        row.position_ids,
        row.advantages,
        row.generator_logprobs,
    ]
    if row.reference_logprobs is not None:
        names.append("reference_logprobs")
        values.append(row.reference_logprobs)
    if row.token_rewards is not None:
        names.append("token_rewards")
        values.append(row.token_rewards)
    check_same_length(names, values)
    n_seg = max(row.segment_ids, default=-1) + 1
    check_same_length(
        ("segments", "truncated", "temperatures", "policy_steps", "rollout_ids", "source_files"),
        ([0] * n_seg, row.truncated, row.temperatures, row.policy_steps, row.rollout_ids, row.source_files),
    )
    for m, s in zip(row.loss_mask, row.segment_ids, strict=True):
        if m and s < 0:
            raise ValidationError("loss_mask is set on a padding position (segment_id -1)")


BATCH: TableSpec[BatchRow] = TableSpec.of(
    BatchRow, "batch", validate_batch_row, version=2, upgrades={1: _add_token_rewards}
)
