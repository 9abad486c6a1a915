"""Rollout rows: one sampled completion of one prompt, scored, as written by a rollout worker.

One row per response, with the sampling settings it was drawn with (temperature, top_p, top_k, min_p).
`response_logprobs`, `token_rewards` and `response_loss_mask` each
hold exactly one entry per response token. `response_loss_mask` is 1 on tokens the policy
produced and 0 on tokens it did not (tool outputs, environment turns in multi-turn
episodes), so multi-turn episodes travel in the same format.
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.compute as pc

from schemas.base import (
    Float32,
    Int8,
    Int32,
    TableSpec,
    ValidationError,
    check_finite,
    check_int_list,
    check_nonempty,
    check_same_length,
)


@dataclasses.dataclass
class RolloutRow:
    """One scored completion.

    rollout_id: stable, unique id (worker, file sequence number, row index).
    group_key: rows with the same key were sampled from the same prompt for RLOO/GRPO.
    policy_step: the policy checkpoint step that generated the response.
    temperature, top_p, top_k, min_p: the sampling controls of the request (top_p 1, top_k 0, min_p 0: off).
    response_text: the response as the environment saw it (decoded once by the worker; never re-tokenised).
    extracted_answer: the answer the environment's scorer extracted from the response (None: none was found or
        the environment does not extract one).
    ground_truth: the reference answer the response was scored against ("" when the task has none).
    reward_components: each reward function's own value (name -> value) for environments that combine several
        (a rubric's functions, a judge); `episode_reward` is their combination. Empty for a single-reward lesson.
    episode_id: the episode this row belongs to: an episode whose later prompt does not extend its transcript
        (a multi-turn agent that rewrote its history) is written as several rows, one per segment, sharing it.
        "" means the row is a whole episode (its rollout_id names it).
    segment_index: this row's position among its episode's segments (0 for a whole episode).
    token_policy_steps: the policy step that sampled each response token (version 4; partial rollouts switch
        policies between decode steps, so one response can span several). Every entry is >= `policy_step`, which
        is the oldest policy step of the row's sampling call; empty means every token is of `policy_step` (files of
        versions 1-3 are read with it filled so). Entries on tokens the policy did not sample (loss mask 0) are
        the step of the call that inserted them.
    """

    rollout_id: str
    env_name: str
    example_id: str
    lesson_id: str
    group_key: str
    prompt_tokens: list[Int32]
    response_tokens: list[Int32]
    response_logprobs: list[Float32]
    token_rewards: list[Float32]
    response_loss_mask: list[Int8]
    episode_reward: float
    truncated: bool
    finish_reason: str
    temperature: Float32
    policy_step: int
    worker_id: str
    timestamp: float
    top_p: Float32 = 1.0
    top_k: Int32 = 0
    min_p: Float32 = 0.0
    response_text: str = ""
    extracted_answer: str | None = None
    ground_truth: str = ""
    reward_components: dict[str, float] = dataclasses.field(default_factory=dict)
    episode_id: str = ""
    segment_index: Int32 = 0
    token_policy_steps: list[Int32] = dataclasses.field(default_factory=list)


SAMPLING_COLUMNS_V2 = (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0))
"""Columns version 2 added, with the value a version-1 file (which did not record them) is read with."""


TEXT_COLUMNS_V3: tuple[tuple[str, object], ...] = (
    ("response_text", ""),
    ("extracted_answer", None),
    ("ground_truth", ""),
    ("reward_components", []),
    ("episode_id", ""),
    ("segment_index", 0),
)
"""Columns version 3 added, with the value an older file (which did not record them) is read with."""


def _add_columns(table: pa.Table, columns: tuple[tuple[str, object], ...]) -> pa.Table:
    for name, value in columns:
        if name not in table.column_names:
            table = table.append_column(name, pa.array([value] * table.num_rows, ROLLOUT.schema.field(name).type))
    return table


def add_sampling_columns(table: pa.Table) -> pa.Table:
    """A version-1 rollout (or eval) table with the version-2 sampling columns at their "off" values."""
    return _add_columns(table, SAMPLING_COLUMNS_V2)


def add_text_columns(table: pa.Table) -> pa.Table:
    """A version-2 rollout (or eval) table with the version-3 columns at their "not recorded" values."""
    return _add_columns(table, TEXT_COLUMNS_V3)


def upgrade_from_v1(table: pa.Table) -> pa.Table:
    """A version-1 rollout (or eval) table with every column added since."""
    return add_text_columns(add_sampling_columns(table))


def add_token_policy_steps(table: pa.Table) -> pa.Table:
    """A version-3 rollout (or eval) table with the version-4 `token_policy_steps` column: every response token
    of a row at the row's `policy_step` (before version 4 a row was sampled by one policy)."""
    if "token_policy_steps" in table.column_names:
        return table
    lengths = pc.list_value_length(table.column("response_tokens")).to_pylist()
    steps = table.column("policy_step").to_pylist()
    values = [[int(s)] * int(n or 0) for s, n in zip(steps, lengths, strict=True)]
    return table.append_column("token_policy_steps", pa.array(values, ROLLOUT.schema.field("token_policy_steps").type))


def upgrade_to_v4(table: pa.Table) -> pa.Table:
    """A version-1, -2 or -3 rollout (or eval) table with every column added since (each upgrade adds only what
    is missing)."""
    return add_token_policy_steps(upgrade_from_v1(table))


def oldest_token_step(row: RolloutRow) -> int:
    """The policy step of the row's oldest token (the lag rule's step): `min(token_policy_steps)`, or
    `policy_step` when the row records none."""
    return min(row.token_policy_steps) if row.token_policy_steps else row.policy_step


def validate_rollout(row: RolloutRow) -> None:
    """Raise ValidationError naming the field when the row breaks the rollout contract."""
    for name in ("rollout_id", "env_name", "example_id", "lesson_id", "group_key", "worker_id"):
        check_nonempty(name, getattr(row, name))
    check_int_list("prompt_tokens", row.prompt_tokens)
    check_int_list("response_tokens", row.response_tokens)
    if not row.prompt_tokens:
        raise ValidationError("prompt_tokens must not be empty")
    check_same_length(
        ("response_tokens", "response_logprobs", "token_rewards", "response_loss_mask"),
        (row.response_tokens, row.response_logprobs, row.token_rewards, row.response_loss_mask),
    )
    check_finite("episode_reward", row.episode_reward)
    for i, r in enumerate(row.token_rewards):
        check_finite(f"token_rewards[{i}]", r)
    check_finite("temperature", row.temperature)
    if row.temperature < 0:
        raise ValidationError(f"temperature must be >= 0, got {row.temperature}")
    if not 0.0 < row.top_p <= 1.0:
        raise ValidationError(f"top_p must be in (0, 1], got {row.top_p}")
    if row.top_k < 0:
        raise ValidationError(f"top_k must be >= 0, got {row.top_k}")
    if not 0.0 <= row.min_p <= 1.0:
        raise ValidationError(f"min_p must be in [0, 1], got {row.min_p}")
    if row.policy_step < 0:
        raise ValidationError(f"policy_step must be >= 0, got {row.policy_step}")
    for name, value in row.reward_components.items():
        check_nonempty("reward_components key", name)
        check_finite(f"reward_components[{name!r}]", value)
    if row.segment_index < 0:
        raise ValidationError(f"segment_index must be >= 0, got {row.segment_index}")
    if row.token_policy_steps:
        check_int_list("token_policy_steps", row.token_policy_steps)
        check_same_length(("response_tokens", "token_policy_steps"), (row.response_tokens, row.token_policy_steps))
        if min(row.token_policy_steps) < row.policy_step:
            raise ValidationError(
                f"token_policy_steps holds step {min(row.token_policy_steps)}, older than policy_step {row.policy_step}"
            )


ROLLOUT: TableSpec[RolloutRow] = TableSpec.of(
    RolloutRow, "rollout", validate_rollout, version=4, upgrades={1: upgrade_to_v4, 2: upgrade_to_v4, 3: upgrade_to_v4}
)
"""Version 2 added top_p, top_k and min_p (version-1 files are read with those controls off); version 3 added
response_text, extracted_answer, ground_truth, reward_components, episode_id and segment_index (older files are
read with them empty); version 4 added token_policy_steps (older files are read with every token at the row's
policy_step)."""


def validate_group(rows: list[RolloutRow]) -> None:
    """Raise ValidationError unless all members of a group share group key and prompt."""
    if not rows:
        return
    first = rows[0]
    for r in rows[1:]:
        if r.group_key != first.group_key:
            raise ValidationError(f"group mixes keys {first.group_key!r} and {r.group_key!r}")
        if r.prompt_tokens != first.prompt_tokens:
            raise ValidationError(f"group {first.group_key!r}: members do not share a prompt")
