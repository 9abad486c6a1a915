"""The critic of `loss.type: ppo_critic`: a linear value head on the policy's final hidden states.

The value head is held beside the policy in the learner state (`PolicyWithValue`: `LearnerState.model` is the
wrapper when the loss needs a critic), shares the policy's trunk (one forward pass feeds both the LM head and the
value head: `logprobs_entropy_and_values`), and is trained with the policy by the same optimizer (the value loss's
gradient reaches the trunk too, as in the shared-trunk actor-critic of PPO, Schulman et al. 2017).

Where it lives:
  - learner checkpoints: a separate `value_head` pytree beside `model` and `opt_state`
    (`policy.policy_format.checkpoints`), so a resume or `make replay` restores it bitwise;
  - published policies and the Hugging Face export: never (the learner publishes `policy_of(model)` only), so
    rollout workers, evaluation and export see the plain policy.

Values are aligned like the logprobs (`policy.model.shifted_logprobs_and_entropy`): values[b, t] = V(s_t), the
value of the state in which token t is sampled, read from the hidden state at t − 1 (the one whose logits give
token t); 0 at t = 0 and at segment starts.

References:
    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
        arXiv:1506.02438 (the critic GAE needs).
    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347 (shared policy/value
        network, clipped value loss in its reference implementation).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp

from policy import model as M
from policy.attention import fused_attention
from policy.losses import Batch, loss_module_from_config

VALUE_BLOB = "value_head"
"""The pytree name of the value head in a learner checkpoint (beside `model` and `opt_state`)."""


class ValueHead(eqx.Module):
    """V(h) = h · w + b on a hidden state h [..., E], computed in float32."""

    weight: jax.Array
    """[E] float32."""
    bias: jax.Array
    """[] float32."""

    def __call__(self, hidden: jax.Array) -> jax.Array:
        """Values [...] of hidden states [..., E] (float32 whatever the compute dtype of `hidden`)."""
        h = hidden.astype(jnp.float32)
        return jnp.einsum("...e,e->...", h, self.weight.astype(jnp.float32)) + self.bias.astype(jnp.float32)


def init_value_head(embed_size: int) -> ValueHead:
    """A deterministic zero head (V ≡ 0 at step 0): no RNG, so a fresh run's learner state depends only on the
    policy's seed; the first value-loss gradient is nonzero whenever a return is (∂V/∂w = h)."""
    return ValueHead(jnp.zeros((embed_size,), jnp.float32), jnp.zeros((), jnp.float32))


def value_head_template(embed_size: int) -> ValueHead:
    """The shape/dtype template of a value head (for restoring a checkpoint)."""
    return ValueHead(
        jax.ShapeDtypeStruct((embed_size,), jnp.float32),  # type: ignore[arg-type]
        jax.ShapeDtypeStruct((), jnp.float32),  # type: ignore[arg-type]
    )


class PolicyWithValue(eqx.Module):
    """The learner's model under a critic loss: the policy (a levanter LM, possibly sharded) and its value head."""

    policy: Any
    value_head: ValueHead

    @property
    def Vocab(self) -> Any:  # levanter's axis-property name: callers read `model.Vocab`
        """The policy's vocabulary axis (as a plain levanter model has it)."""
        return self.policy.Vocab


def policy_of(model: Any) -> Any:
    """The policy alone: `model.policy` of a `PolicyWithValue`, else `model` itself (what is published)."""
    return model.policy if isinstance(model, PolicyWithValue) else model


def value_head_of(model: Any) -> ValueHead | None:
    """The value head of a `PolicyWithValue`, else None."""
    return model.value_head if isinstance(model, PolicyWithValue) else None


def embed_size(policy: Any) -> int:
    """The hidden size E of a levanter LM (the value head's input width)."""
    return int(policy.Embed.size)


def attach(policy: Any, head: ValueHead | None = None) -> PolicyWithValue:
    """`policy` with `head` (default: a fresh `init_value_head`)."""
    return PolicyWithValue(policy, head if head is not None else init_value_head(embed_size(policy)))


def logprobs_entropy_and_values(
    model: PolicyWithValue,
    batch: Batch,
    compute_dtype: str,
    block_size: int | None = None,
    attention: str = "default",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logprobs, entropy, values) [B, S] of `batch`: logprobs and entropy exactly as `policy.learner.
    make_logprob_fn` computes them, values aligned to tokens (module docstring).

    Without `block_size` the trunk runs once: its hidden states feed the LM head (the same `hax.dot` the levanter
    model's `__call__` applies) and the value head. With `block_size` (`model.logprob_block_size`) the blocked
    logprob path computes its own hidden states, so the values take a second trunk pass (XLA may merge the two
    identical computations, but this is not guaranteed): about one more forward pass per step."""
    policy = M.cast_for_compute(model.policy, compute_dtype)
    with fused_attention(attention):
        B = batch.tokens.shape[0]
        ids = hax.named(batch.tokens.astype(jnp.int32), (M.BATCH_AXIS, M.POS_AXIS))
        pos = hax.named(batch.position_ids.astype(jnp.int32), (M.BATCH_AXIS, M.POS_AXIS))
        hidden = policy.activations(ids, M.attention_mask(batch.segment_ids), pos_ids=pos)
        if block_size is None:
            logits = hax.dot(hidden, policy.get_lm_head(), axis=policy.Embed)
            logits = logits.rearrange((M.BATCH_AXIS, M.POS_AXIS, "vocab")).array.astype(jnp.float32)
            logp, entropy = M.shifted_logprobs_and_entropy(logits, batch.tokens, batch.segment_ids, batch.temperature)
        else:
            logp, entropy = M.blocked_logprobs_and_entropy(
                policy, batch.tokens, batch.segment_ids, batch.position_ids, batch.temperature, block_size
            )
    h = hidden.rearrange((M.BATCH_AXIS, M.POS_AXIS, policy.Embed.name)).array
    v = model.value_head(h[:, :-1])  # V(s_t) from the hidden state that predicts token t
    valid = batch.segment_ids[:, 1:] == batch.segment_ids[:, :-1]
    values = jnp.concatenate([jnp.zeros((B, 1), jnp.float32), jnp.where(valid, v, 0.0)], axis=1)
    return logp, entropy, values


def needs_value_head(loss: Any) -> bool:
    """Whether the loss config's module trains a critic (`needs_value_head`: critic PPO)."""
    return bool(getattr(loss_module_from_config(loss), "needs_value_head", False))
