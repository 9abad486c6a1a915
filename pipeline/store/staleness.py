"""The staleness rule, in one place.

The learner turns policy S into S+1 using batch slot S+1, so batch slot T is trained on policy T-1. A rollout
sampled from policy P, used in batch slot T, has lag `(T-1) - P`; it is allowed iff `0 <= lag <= max_lag`
(`max_lag = 0`: strictly on-policy). A negative lag means the rollout comes from a policy newer than the one
being trained (impossible unless files are foreign) and is refused.

Partial rollouts (rollout schema v4): one response can be sampled by several policies, `token_policy_steps`
recording each token's. The rule applies to the oldest token: a row is as stale as the
oldest policy that sampled any of its tokens. The worker writes a sampling call's oldest token step as every
row's `policy_step` (rows of one file and group share it), and the BatchMaker refuses a row with a token older
than its `policy_step`, so applying the rule to `policy_step` never lets a row count fresher than its oldest token.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def lag(slot: int, policy_step: int) -> int:
    """Lag of a rollout from policy `policy_step` used in batch slot `slot`: `(slot-1) - policy_step`."""
    return (slot - 1) - policy_step


def lags(slot: int, policy_steps: Any) -> np.ndarray:
    """`lag` for an array of policy steps (vectorised; same formula)."""
    return (slot - 1) - np.asarray(policy_steps, dtype=np.int64)


def allowed(slot: int, policy_step: int, max_lag: int) -> bool:
    """Whether a rollout of policy `policy_step` may be used in batch slot `slot` under `max_lag`."""
    return 0 <= lag(slot, policy_step) <= max_lag


def oldest_allowed_policy(slot: int, max_lag: int) -> int:
    """The oldest policy step whose rollouts batch slot `slot` may still use: `(slot-1) - max_lag`.

    Rollouts of older policies are stale for `slot` and for every later slot.
    """
    return (slot - 1) - max_lag


def window(slot: int, max_lag: int) -> tuple[int, int]:
    """The inclusive range of policy steps usable in batch slot `slot`: `((slot-1) - max_lag, slot-1)`."""
    return oldest_allowed_policy(slot, max_lag), slot - 1


def newest_slot_allowing(policy_step: int, max_lag: int) -> int:
    """The newest batch slot that may still use rollouts of policy `policy_step`: `policy_step + 1 + max_lag`."""
    return policy_step + 1 + max_lag
