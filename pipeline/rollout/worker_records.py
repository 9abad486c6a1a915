"""What a rollout worker records: every metric it logs (defined once), its per-write record, its summary."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.rollout.rollout_batch import RolloutBatch, RolloutBatchStats
from pipeline.store import staleness

METRICS: dict[str, str] = {
    "rows": "rollout rows written in this write",
    "groups": "RLOO/GRPO groups in this write",
    "failures": "examples that failed in this write (each attempt counts; reasons in the ready marker)",
    "failed_examples": "examples still missing after all retries (requested - produced)",
    "tokens": "response tokens sampled by the policy in this write (loss-mask 1)",
    "rollouts_per_s": "rows / generation seconds of this write",
    "tokens_per_s": "tokens / generation seconds of this write",
    "mean_reward": "mean episode reward of the rows of this write",
    "reward/<lesson>": "mean episode reward of this write, keyed by its lesson",
    "truncation_rate": "fraction of rows whose response hit max_tokens",
    "env/n_skipped_prompts": "prompt draws passed over as solved or hopeless (curriculum.skip_after)",
    "env/n_retested_prompts": "draws of skipped prompts kept anyway as re-tests (curriculum.retest_rate)",
    "policy_lag": "learner's newest committed policy minus the policy that sampled this write, at write time",
    "slot_lag": "(T-1) - P for the next batch slot T at write time (usable iff 0 <= slot_lag <= max_lag)",
    "time/generate_s": "seconds in manager.sample_batch",
    "time/write_s": "seconds committing the parquet + marker",
    "time/weight_load_s": "seconds loading policies since the previous write",
    "time/pause_s": "seconds paused by pacing since the previous write",
    "time/sample_lesson_s": "seconds reading curriculum state and drawing the lesson",
    "worker_noticed_at": "unix time this worker saw the sampling policy committed (before loading it)",
    "generate_started_at / generated_at": "unix times generation of this write started / ended",
    "rollout_committed_at": "unix time the write's ready marker was committed",
}
"""Every metric the rollout step logs, defined once."""


def incarnation_nonce() -> str:
    """A name part unique to this process start: `<unix ms, hex><4 random hex digits>`."""
    return f"{int(time.time() * 1000):x}{secrets.token_hex(2)}"


@dataclass
class WorkerSummary:
    """What one `RolloutWorker.run` did."""

    files: list[str] = field(default_factory=list)
    rows: int = 0
    failures: int = 0
    policy_steps: list[int] = field(default_factory=list)
    stop_reason: str = ""


def write_record(
    batch: RolloutBatch,
    m: dict[str, float],
    rel: str,
    stats: RolloutBatchStats,
    *,
    latest: int | None,
    last_slot: int,
    max_lag: int,
    times: dict[str, float],
) -> dict[str, Any]:
    """The metrics record of one committed rollout file `rel` (keys as in `METRICS`)."""
    P = batch.metadata.weight_step
    gen_s = max(batch.generate_s, 1e-9)
    return {
        "event": "write",
        "file": rel,
        "lesson_id": batch.lesson_id,
        "policy_step": P,
        **{k: v for k, v in m.items() if not k.startswith("time/")},
        "rollouts_per_s": len(batch.rows) / gen_s,
        "tokens_per_s": batch.n_response_tokens / gen_s,
        "mean_reward": stats.mean_reward,
        f"reward/{batch.lesson_id}": stats.mean_reward,
        "truncation_rate": stats.truncation_rate,
        "policy_lag": (latest if latest is not None else P) - P,
        "slot_lag": staleness.lag(last_slot + 1, P),
        "max_lag": max_lag,
        "time/generate_s": batch.generate_s,
        **times,
    }
