"""The learner batch: the fixed-shape [B, S] arrays of one batch slot (or a microbatch of it), as a pytree."""

from __future__ import annotations

import equinox as eqx
import jax

Array = jax.Array


class Batch(eqx.Module):
    """Learner batch arrays, all [B, S] (B rows of S packed tokens); every field is a pytree leaf, so a `Batch`
    goes through `jit`, `device_put` and sharding like the arrays it holds.

    Built by `policy.learner.batch_arrays` / `read_batch` from committed batch rows (on the host, a dict of numpy
    arrays named like these fields: `policy.learner.host_batch_arrays`); cut into strided microbatches by
    `policy.sharding.microbatch`; read by the loss modules (`policy.losses.modules`)."""

    tokens: Array
    """int32 token ids; 0 in padding."""
    segment_ids: Array
    """int32 packed-segment index within the row (one sequence per segment); -1 in padding."""
    position_ids: Array
    """int32 position of each token within its segment (rotary positions)."""
    loss_mask: Array
    """float32 1 on tokens that carry loss (sampled tokens), 0 elsewhere."""
    advantages: Array
    """float32 per-token advantage (the sequence's advantage repeated over its tokens)."""
    generator_logprobs: Array
    """float32 log π_sampler(y_t) recorded by the sampler (0 where no loss)."""
    temperature: Array
    """float32 sampling temperature of the token's segment (1 in padding)."""
    truncated: Array
    """bool: the token's response was cut at the length limit (the overlong filter drops it)."""
    seq_index: Array
    """int32 global sequence id b·S + segment_id; B·S for padding (the segment sums' extra bucket)."""
    old_logprobs: Array | None = None
    """float32 learner logprobs before the slot's first update; set only with several updates per slot and TIS."""
    token_rewards: Array | None = None
    """float32 per-token reward of the rollouts (episode reward on the last policy token plus any process rewards),
    0 on prompt tokens and padding; read by critic PPO's GAE. The learner always sets it (zeros for batch files of
    version 1); None only where a caller builds a `Batch` without it."""
    old_values: Array | None = None
    """float32 critic values V_old before the slot's first update; set only for critic PPO with several updates per
    slot, together with `returns` (and then `advantages` holds the slot's fixed GAE advantage Â, whitened if
    configured): `policy.losses.critic.CriticPPOLoss.slot_targets`."""
    returns: Array | None = None
    """float32 GAE value targets R = A + V_old, fixed for the slot (set with `old_values`)."""
