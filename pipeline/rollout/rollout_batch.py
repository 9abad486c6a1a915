"""What a RolloutManager call returns: `RolloutBatch` (rows + `RolloutMetadata` + every `RecordedFailure`), its
summary `RolloutBatchStats` (`batch_stats`), and the conversion of environment episodes to schema rows."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.config import SamplingParams
from pipeline.environments.generation import SamplingControls
from schemas import EvalRow, EvalSummaryRow, RolloutRow


@dataclass(frozen=True)
class RolloutMetadata:
    """Who sampled a batch, when, and with which policy step."""

    worker_id: str
    timestamp: float
    weight_step: int


@dataclass(frozen=True)
class RecordedFailure:
    """An example that produced no group in one attempt of a sampling call."""

    example_id: str
    reason: str
    attempt: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (for ready markers and metrics)."""
        return {"example_id": self.example_id, "reason": self.reason, "attempt": self.attempt}


@dataclass
class RolloutBatch:
    """The rows of one sampling call with their metadata.

    `rows` are `schemas.RolloutRow`s (`schemas.EvalRow`s from evaluation), grouped by `group_key`; every row
    carries `policy_step == metadata.weight_step`, `worker_id == metadata.worker_id` and the batch temperature.
    `failures` lists every per-example failure (all attempts); `env_metrics` the environment's metrics of
    the last attempt plus totals. `successes[i]` says whether row i counts as a success (the environment's
    own `info["success"]` when it gives one, else `episode_reward >= SUCCESS_REWARD`; not persisted).
    """

    batch_id: str
    lesson_id: str
    mode: str
    temperature: float
    metadata: RolloutMetadata
    rows: list[RolloutRow]
    failures: list[RecordedFailure] = field(default_factory=list)
    n_examples_requested: int = 0
    n_response_tokens: int = 0
    generate_s: float = 0.0
    env_metrics: dict[str, float] = field(default_factory=dict)
    successes: list[bool] = field(default_factory=list)
    sampling: dict[str, float] = field(default_factory=dict)
    """The sampling controls every row of this batch was drawn with (temperature, top_p, top_k, min_p, max_tokens)."""

    @property
    def groups(self) -> dict[str, list[RolloutRow]]:
        """Rows by group key (insertion order)."""
        out: dict[str, list[RolloutRow]] = {}
        for r in self.rows:
            out.setdefault(r.group_key, []).append(r)
        return out


@dataclass(frozen=True)
class RolloutBatchStats:
    """Summary of a batch; a pure function of the batch."""

    lesson_id: str
    policy_step: int
    n_examples: int
    n_groups: int
    n_rows: int
    n_failures: int
    mean_reward: float
    success_rate: float
    mean_response_tokens: float
    truncation_rate: float
    temperature: float

    def to_summary_row(self, eval_type: str, source: str, timestamp: float | None = None) -> EvalSummaryRow:
        """The `schemas.EvalSummaryRow` of an evaluation batch (for `evals/step-S/<lesson>.summary.parquet`)."""
        return EvalSummaryRow(
            policy_step=self.policy_step,
            lesson_id=self.lesson_id,
            eval_type=eval_type,
            n_examples=self.n_groups,
            mean_reward=self.mean_reward,
            success_rate=self.success_rate,
            mean_response_tokens=self.mean_response_tokens,
            truncation_rate=self.truncation_rate,
            temperature=self.temperature,
            source=source,
            timestamp=time.time() if timestamp is None else timestamp,
            n_failures=self.n_failures,
        )


SUCCESS_REWARD = 1.0
"""An episode without an environment success flag counts as a success when its reward is >= this."""


def is_success(env_rollout: Any) -> bool:
    """The environment's `info["success"]` when present, else `episode_reward >= SUCCESS_REWARD`."""
    info = getattr(env_rollout, "info", None) or {}
    if "success" in info:
        return bool(info["success"] > 0)
    return float(env_rollout.episode_reward) >= SUCCESS_REWARD


def batch_stats(batch: RolloutBatch) -> RolloutBatchStats:
    """Summary statistics of a batch: mean_reward and success_rate per episode (an episode written as several
    segment rows counts once; success = `batch.successes`, or reward >= SUCCESS_REWARD when the batch carries no
    success flags); response length and truncation per row."""
    rows = batch.rows
    n = len(rows)
    successes = batch.successes if len(batch.successes) == n else [r.episode_reward >= SUCCESS_REWARD for r in rows]
    firsts = [i for i, r in enumerate(rows) if r.segment_index == 0]
    return RolloutBatchStats(
        lesson_id=batch.lesson_id,
        policy_step=batch.metadata.weight_step,
        n_examples=batch.n_examples_requested,
        n_groups=len(batch.groups),
        n_rows=n,
        n_failures=len(batch.failures),
        mean_reward=float(np.mean([rows[i].episode_reward for i in firsts])) if firsts else 0.0,
        success_rate=float(np.mean([successes[i] for i in firsts])) if firsts else 0.0,
        mean_response_tokens=float(np.mean([len(r.response_tokens) for r in rows])) if n else 0.0,
        truncation_rate=float(np.mean([r.truncated for r in rows])) if n else 0.0,
        temperature=batch.temperature,
    )


def schema_rows(
    rows_src: list[tuple[str, Any]],
    lesson_id: str,
    batch_id: str,
    sampling: SamplingParams,
    step: int,
    worker_id: str,
    timestamp: float,
    eval_type: str | None,
) -> list[RolloutRow]:
    """The `schemas` rows of (env group key, EnvRollout) pairs: `RolloutRow`s, or `EvalRow`s with `eval_type`.

    `rollout_id` is `<batch_id>-<i>` and `group_key` `<lesson>/<env group key>/<batch_id>`; every row records the
    temperature and top-p / top-k / min-p of `sampling` (what every backend applied or refused), and the
    episode's text, answer, ground truth, reward components and segment as the environment gave them.
    `token_policy_steps`: the episode's own (partial rollouts), else every token at the row's policy step.
    """
    rows: list[RolloutRow] = []
    for i, (gkey, r) in enumerate(rows_src):
        row_step = int(step if r.policy_step is None else r.policy_step)
        token_steps = getattr(r, "token_policy_steps", None)
        common: dict[str, Any] = dict(
            rollout_id=f"{batch_id}-{i}",
            env_name=r.env_name,
            example_id=str(r.example_id),
            lesson_id=lesson_id,
            group_key=f"{lesson_id}/{gkey}/{batch_id}",
            prompt_tokens=list(r.prompt_tokens),
            response_tokens=list(r.response_tokens),
            response_logprobs=list(r.response_logprobs),
            token_rewards=list(r.token_rewards),
            response_loss_mask=list(r.response_loss_mask),
            episode_reward=float(r.episode_reward),
            truncated=bool(r.truncated),
            finish_reason=r.finish_reason,
            temperature=float(sampling.temperature),
            policy_step=row_step,
            worker_id=worker_id,
            timestamp=timestamp,
            top_p=float(sampling.top_p),
            top_k=int(sampling.top_k),
            min_p=float(sampling.min_p),
            response_text=r.response_text,
            extracted_answer=r.extracted_answer,
            ground_truth=r.ground_truth,
            reward_components={str(k): float(v) for k, v in r.reward_components.items()},
            episode_id=r.episode_id,
            segment_index=int(r.segment_index),
            token_policy_steps=(
                [int(x) for x in token_steps] if token_steps is not None else [row_step] * len(r.response_tokens)
            ),
        )
        rows.append(EvalRow(**common, eval_type=eval_type) if eval_type else RolloutRow(**common))
    return rows


def controls_of(sampling: SamplingParams) -> SamplingControls:
    """The top-p / top-k / min-p controls of a lesson's sampling params."""
    return SamplingControls(top_p=sampling.top_p, top_k=sampling.top_k, min_p=sampling.min_p)
