"""What retention keeps: pure decisions over step numbers (no storage access).

- Policies: policy 0 (the learner's reference model, reloaded at every restart), the newest `keep_policies`
  committed ones, every multiple of `keep_every`, every policy whose
  rollouts the next batch slot may still use (the staleness window: a rollout worker may be sampling from it),
  and every policy with an unfinished evaluation (supplied by the caller).
- Checkpoints: the newest `keep_checkpoints` committed ones (the learner resumes from the newest) and every
  multiple of `keep_checkpoint_every`.
- Data: batch slots up to `data_horizon` may lose their data files: at least `data_window_slots` older than the
  newest committed slot, and already consumed by the newest kept checkpoint (a restarted learner resumes after it
  and never reads them again; slots the BatchMaker wrote ahead of the learner are newer still).
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.config import RetentionConfig
from pipeline.store import staleness


def kept_policies(
    committed: list[int], retention: RetentionConfig, last_slot: int, max_lag: int, pending_evals: Iterable[int]
) -> set[int]:
    """The committed policy steps retention keeps (see the module doc)."""
    keep = set(sorted(committed)[-retention.keep_policies :]) | ({0} & set(committed))
    if retention.keep_every > 0:
        keep |= {s for s in committed if s % retention.keep_every == 0}
    oldest_usable = staleness.oldest_allowed_policy(last_slot + 1, max_lag)
    keep |= {s for s in committed if s >= oldest_usable}
    keep |= set(pending_evals) & set(committed)
    return keep


def kept_checkpoints(live: list[int], retention: RetentionConfig) -> set[int]:
    """The live (committed, not collected) checkpoint steps retention keeps (see the module doc)."""
    keep = set(sorted(live)[-retention.keep_checkpoints :])
    if retention.keep_checkpoint_every > 0:
        keep |= {s for s in live if s % retention.keep_checkpoint_every == 0}
    return keep


def data_horizon(last_slot: int, retention: RetentionConfig, checkpoint_slot: int | None) -> int:
    """The newest batch slot whose data files may be deleted (0: none): `data_window_slots` behind the newest
    committed slot and no later than the newest checkpoint's consumed slot (None: no checkpoint, nothing)."""
    if checkpoint_slot is None:
        return 0
    return max(0, min(last_slot - retention.data_window_slots, checkpoint_slot))


def scheduled_evaluation(step: int, eval_frequency: int, final_step: int | None) -> bool:
    """Whether the job's evaluator evaluates policy `step` (a multiple of eval_frequency, or the final one)."""
    return (eval_frequency > 0 and step % eval_frequency == 0) or step == final_step
