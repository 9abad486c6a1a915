"""RL loss modules for the learner: one pure function per term, a registered module per `LossConfig`.

Notation, per token t of a batch row (arrays [B, S]): `logp` = log π_θ(y_t) of the policy being trained,
`logp_gen` = log π_sampler(y_t) recorded by the sampler, `logp_ref` = log π_ref(y_t) of the frozen initial
model, `A` = advantage, `m` = loss mask (response tokens), all at the batch's sampling temperature.

RLOOLoss (`type: rloo`), the objective maximised (its negative is the loss):

    r   = exp(logp − logp_gen)                                  (importance ratio to the sampler)
    J   = agg( min(r·A, clip(r, 1−ε_low, 1+ε_high)·A) )         (PPO-style clip, clip-higher)
    L   = −J + β · agg(KL_k(logp, logp_ref))                     (β = kl_coef; no reference model if β = 0)

  with truncated importance sampling (`tis_cap` = C set), the ratio is taken to the learner's own
  pre-update policy (π_old = stop_gradient(π_θ); one optimizer step per batch) and the sampler mismatch
  is corrected by a capped weight:  J = agg( min(π_old/π_sampler, C) · min(r'·A, clip(r')·A) ),
  r' = exp(logp − sg(logp)).  With `overlong_filter`, tokens of truncated responses get m = 0.

PPOClipLoss (`type: ppo`): the same with a symmetric clip ε and no TIS / overlong filter.

Aggregation `agg` (documented and tested, it changes results):
  token:    Σ_t x_t m_t / Σ_t m_t over every loss token of the batch (long responses weigh more);
  sequence: mean over sequences (packed segments) with ≥ 1 loss token of Σ_seq x m / Σ_seq m (every response
            weighs the same). The two agree when every response has the same number of loss tokens.

Advantages arrive precomputed in the batch (the BatchMaker's RLOO/GRPO); `compute_advantages` is the
same estimator for callers that hold raw rewards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from pipeline.config import LossConfig, PPOClipLossConfig, RLOOLossConfig

Array = jax.Array
Batch = dict[str, Array]
"""Learner batch arrays, all [B, S]: tokens, segment_ids, position_ids, loss_mask (f32), advantages,
generator_logprobs, temperature (per token), truncated (bool per token), seq_index (int: b·S + segment,
B·S for padding)."""


# ---------------------------------------------------------------------------------------------
# pure terms
# ---------------------------------------------------------------------------------------------


def importance_ratio(logp: Array, logp_behaviour: Array) -> Array:
    """r = exp(logp − logp_behaviour) = π_θ / π_behaviour."""
    return jnp.exp(logp - logp_behaviour)


def clipped_surrogate(ratio: Array, advantages: Array, eps_low: float, eps_high: float) -> Array:
    """min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A) — the PPO objective per token (clip-higher if ε_high > ε_low)."""
    return jnp.minimum(ratio * advantages, jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages)


def clip_indicator(ratio: Array, advantages: Array, eps_low: float, eps_high: float) -> Array:
    """1 where the clipped branch is active (no gradient): (A > 0 ∧ r > 1 + ε_high) ∨ (A < 0 ∧ r < 1 − ε_low)."""
    return ((advantages > 0) & (ratio > 1.0 + eps_high)) | ((advantages < 0) & (ratio < 1.0 - eps_low))


def kl_k1(logp: Array, logp_ref: Array) -> Array:
    """k1 = log(π_θ/π_ref) = logp − logp_ref (unbiased for KL(π_θ‖π_ref) under π_θ; can be negative)."""
    return logp - logp_ref


def kl_k2(logp: Array, logp_ref: Array) -> Array:
    """k2 = ½ (logp − logp_ref)² (low variance, biased, ≥ 0)."""
    return 0.5 * jnp.square(logp - logp_ref)


def kl_k3(logp: Array, logp_ref: Array) -> Array:
    """k3 = π_ref/π_θ − 1 − log(π_ref/π_θ) = exp(δ) − 1 − δ with δ = logp_ref − logp (unbiased, ≥ 0)."""
    delta = logp_ref - logp
    return jnp.expm1(delta) - delta


KL_ESTIMATORS: dict[str, Callable[[Array, Array], Array]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def truncated_is_weight(logp_old: Array, logp_gen: Array, cap: float) -> Array:
    """w = min(π_old / π_sampler, C) = min(exp(logp_old − logp_gen), C), no gradient (TIS)."""
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(logp_old - logp_gen), cap))


def token_mean(x: Array, mask: Array) -> Array:
    """Σ x·m / max(Σ m, 1): the mean over all loss tokens of the batch."""
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def sequence_mean(x: Array, mask: Array, seq_index: Array, num_segments: int) -> Array:
    """mean_{seq: Σ_seq m > 0} (Σ_seq x·m / Σ_seq m): each sequence's token mean, then the mean over sequences.

    `seq_index` [B, S] assigns each token a global sequence id in [0, num_segments).
    """
    flat_idx = seq_index.reshape(-1)
    sums = jax.ops.segment_sum((x * mask).reshape(-1), flat_idx, num_segments=num_segments)
    counts = jax.ops.segment_sum(mask.reshape(-1), flat_idx, num_segments=num_segments)
    has = counts > 0
    per_seq = jnp.where(has, sums / jnp.maximum(counts, 1.0), 0.0)
    return jnp.sum(per_seq) / jnp.maximum(jnp.sum(has), 1)


def rloo_advantages(rewards: np.ndarray) -> np.ndarray:
    """A_i = R_i − mean_{j≠i} R_j within each group (rows of `rewards` [G, n], n ≥ 2)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    n = rewards.shape[-1]
    if n < 2:
        raise ValueError(f"RLOO needs at least 2 samples per group, got {n}")
    total = rewards.sum(axis=-1, keepdims=True)
    return (rewards - (total - rewards) / (n - 1)).astype(np.float32)


def mismatch_kl(logp_learner: Array, logp_gen: Array) -> Array:
    """Per-token k3 estimate of KL(π_sampler‖π_learner) from sampler draws: exp(δ) − 1 − δ, δ = logp − logp_gen."""
    delta = logp_learner - logp_gen
    return jnp.expm1(delta) - delta


# ---------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------

LogprobFn = Callable[[Any, Batch], tuple[Array, Array]]
"""(model, batch) -> (logprobs [B, S], entropy [B, S]) at the batch temperatures."""

LossFn = Callable[[Any, Any, Batch], tuple[Array, dict[str, Array]]]
"""(model, reference_model | None, batch) -> (loss, metrics); the reference is an argument (not a closure)
so that a jitted step does not bake its weights in as constants."""


class RLLossModule(Protocol):
    """What the learner needs from a loss module (chosen once from `LossConfig`)."""

    config: LossConfig

    @property
    def needs_reference(self) -> bool:
        """Whether a reference model must exist (False: the learner never builds one)."""
        ...

    def build(self, reference_model: Any | None) -> Any | None:
        """The reference model to keep (frozen), or None when KL is off."""
        ...

    def compute_advantages(self, rewards: np.ndarray) -> np.ndarray:
        """Per-sample advantages for groups of rewards [G, n]."""
        ...

    def create_loss_fn(self, reference_model: Any | None, logprob_fn: LogprobFn) -> LossFn:
        """(model, reference, batch) -> (loss, metrics): differentiable in `model`; the reference is held constant.

        `reference_model` here only validates the configuration (a KL loss without one is an error when given);
        the learner passes the built reference as the second argument of every call."""
        ...


@dataclasses.dataclass(frozen=True)
class _ClipLossBase:
    """Shared machinery of the clipped-ratio modules; subclasses fix (ε_low, ε_high, TIS, overlong)."""

    config: LossConfig

    eps_low: float = 0.2
    eps_high: float = 0.2
    tis_cap: float | None = None
    overlong_filter: bool = False

    @property
    def needs_reference(self) -> bool:
        return self.config.kl_coef > 0

    def build(self, reference_model: Any | None) -> Any | None:
        return reference_model if self.needs_reference else None

    def compute_advantages(self, rewards: np.ndarray) -> np.ndarray:
        return rloo_advantages(rewards)

    def aggregate(self, x: Array, mask: Array, seq_index: Array) -> Array:
        """`agg` of the module docstring, per `config.aggregation`."""
        if self.config.aggregation == "sequence":
            return sequence_mean(x, mask, seq_index, seq_index.size + 1)
        return token_mean(x, mask)

    def objective(
        self,
        logp: Array,
        batch: Batch,
        logp_ref: Array | None,
        entropy: Array | None = None,
    ) -> tuple[Array, dict[str, Array]]:
        """Loss and metrics from per-token policy logprobs (pure; used by the tests directly)."""
        mask = batch["loss_mask"].astype(jnp.float32)
        if self.overlong_filter:
            mask = mask * (1.0 - batch["truncated"].astype(jnp.float32))
        adv = batch["advantages"]
        logp_gen = batch["generator_logprobs"]
        seq_index = batch["seq_index"]
        logp_old = jax.lax.stop_gradient(logp)
        if self.tis_cap is None:
            ratio = importance_ratio(logp, logp_gen)
            weight = jnp.ones_like(logp)
        else:
            ratio = importance_ratio(logp, logp_old)
            weight = truncated_is_weight(logp_old, logp_gen, self.tis_cap)
        surrogate = weight * clipped_surrogate(ratio, adv, self.eps_low, self.eps_high)
        pg_loss = -self.aggregate(surrogate, mask, seq_index)
        metrics: dict[str, Array] = {
            "pg_loss": pg_loss,
            "ratio_mean": token_mean(jax.lax.stop_gradient(ratio), mask),
            "clip_fraction": token_mean(clip_indicator(ratio, adv, self.eps_low, self.eps_high), mask),
            "tis_weight_mean": token_mean(weight, mask),
            "mismatch_abs_logp": token_mean(jnp.abs(logp_old - logp_gen), mask),
            "mismatch_kl": token_mean(mismatch_kl(logp_old, logp_gen), mask),
            "advantage_mean": token_mean(adv, mask),
            "loss_tokens": jnp.sum(mask),
        }
        loss = pg_loss
        if logp_ref is not None and self.needs_reference:
            kl = KL_ESTIMATORS[self.config.kl_estimator](logp, logp_ref)
            kl_term = self.aggregate(kl, mask, seq_index)
            loss = loss + self.config.kl_coef * kl_term
            metrics["kl"] = kl_term
        if entropy is not None:
            metrics["entropy"] = token_mean(entropy, mask)
        metrics["loss"] = loss
        return loss, metrics

    def create_loss_fn(self, reference_model: Any | None, logprob_fn: LogprobFn) -> LossFn:
        needs_reference = self.needs_reference

        def loss_fn(model: Any, reference: Any, batch: Batch) -> tuple[Array, dict[str, Array]]:
            if needs_reference and reference is None:
                raise ValueError(f"kl_coef={self.config.kl_coef} > 0 needs a reference model")
            logp, entropy = logprob_fn(model, batch)
            logp_ref = None
            if needs_reference:
                logp_ref = jax.lax.stop_gradient(logprob_fn(reference, batch)[0])
            return self.objective(logp, batch, logp_ref, jax.lax.stop_gradient(entropy))

        return loss_fn


@dataclasses.dataclass(frozen=True)
class RLOOLoss(_ClipLossBase):
    """RLOO advantages, clip-higher PPO ratio to the sampler, optional TIS cap and overlong filter."""

    @classmethod
    def from_config(cls, config: RLOOLossConfig) -> RLOOLoss:
        return cls(config, config.clip_low, config.clip_high, config.tis_cap, config.overlong_filter)


@dataclasses.dataclass(frozen=True)
class PPOClipLoss(_ClipLossBase):
    """Plain PPO-clip: symmetric ε, ratio to the sampler, no TIS, no overlong filter."""

    @classmethod
    def from_config(cls, config: PPOClipLossConfig) -> PPOClipLoss:
        return cls(config, config.clip_epsilon, config.clip_epsilon, None, False)


LOSS_MODULES: dict[type[LossConfig], Any] = {RLOOLossConfig: RLOOLoss, PPOClipLossConfig: PPOClipLoss}


def loss_module_from_config(config: LossConfig) -> RLLossModule:
    """The registered module for `config` (exact class match; raises ValueError naming the type)."""
    try:
        cls = LOSS_MODULES[type(config)]
    except KeyError:
        raise ValueError(f"loss config {type(config).__name__} has no registered loss module") from None
    return cls.from_config(config)
