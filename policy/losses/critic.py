"""Critic PPO (`loss.type: ppo_critic`): PPO clip with GAE advantages from a value head, plus a clipped value loss.

With V = the value head on the policy's trunk (`policy.value_head`), V_old the critic before the slot's first
update, r_t the per-token rewards of the batch (`Batch.token_rewards`: the rollouts' `token_rewards`, i.e. the
episode reward on the last policy token plus any process rewards):

    A, R  = GAE(γ, λ)(r, V_old) over each sequence's loss tokens      (`terms.gae_advantages`; R = A + V_old)
    Â     = whiten(A) over the slot's loss tokens if `whiten_advantages`, else A
    L     = −agg( min(ρ·Â, clip(ρ, 1−ε, 1+ε)·Â) ) + β·agg(KL) + c_v · agg( ½·max((V−R)², (V_clip−R)²) )

ρ = π_θ/π_sampler (or the decoupled TIS form with `tis_cap`, as `RLOOLoss`), V_clip = V_old + clip(V − V_old,
±ε_v), c_v = `vf_coef`, agg the configured aggregation (`modules` docstring). The advantages are computed here,
on the learner, from the critic; the batch's sequence-level RLOO/GRPO advantage is ignored, so the two
families keep their meaning: RLOO/GRPO/GSPO/CISPO train on the episode reward (through the BatchMaker's
advantage), critic PPO on the per-token rewards.

Updates per slot. With one optimizer update per slot, V_old = sg(V) is computed inside the objective (the value
clip cannot act) and whitening is over the objective's tokens (each microbatch's). With several
(`train.ppo_epochs` × `train.minibatches_per_slot` > 1) the learner computes V_old once, before the slot's first
update, over the whole slot (`slot_targets`, called by `policy.sharding.make_mesh_train_step`, as it records
`old_logprobs`); V_old, R and Â (whitened over the slot's loss tokens) are then fixed for every minibatch and
epoch of the slot (as PPO computes its advantages once per rollout batch), so V moves away from V_old and the
value clip acts as the policy ratio's clip does.

Metrics besides the PPO ones: value_loss, value_clip_fraction, explained_variance (1 − Var(R − V_old)/Var(R)),
value_mean (V_old), return_mean (R), gae_advantage_mean (A before whitening; R − V_old with targets fixed per
slot); `advantage_mean` is that of Â.

References:
    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
        arXiv:1506.02438.
    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347.
    Ouyang et al. 2022, "Training language models to follow instructions with human feedback", arXiv:2203.02155
        (PPO with a value head for language models).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

import policy.losses.terms as T
from pipeline.config import CriticPPOLossConfig
from policy.losses.batch import Batch
from policy.losses.modules import LOSS_MODULES, LogprobFn, LossFn, _ClipLossBase, _correction, split_frozen

Array = jax.Array

_CRITIC_TOKEN_MEANS = frozenset(
    {"value_clip_fraction", "explained_variance", "value_mean", "return_mean", "gae_advantage_mean"}
)
"""Token means over all loss tokens (explained_variance: see `combine_microbatch_metrics`' caveat in the guide)."""


@dataclasses.dataclass(frozen=True)
class CriticPPOLoss(_ClipLossBase):
    """PPO clip on GAE advantages from a value head, plus the clipped value loss (module docstring).

    References:
        Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
            arXiv:1506.02438.
        Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347.
    """

    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float | None = 0.2
    vf_coef: float = 0.1
    whiten_advantages: bool = True

    @classmethod
    def from_config(cls, config: CriticPPOLossConfig) -> CriticPPOLoss:
        return cls(
            config,
            config.clip_epsilon,
            config.clip_epsilon,
            overlong_filter=False,
            **_correction(config),  # mis_level is None: ppo_critic refuses masked IS
            gamma=config.gamma,
            lam=config.lam,
            value_clip=config.value_clip,
            vf_coef=config.vf_coef,
            whiten_advantages=config.whiten_advantages,
        )

    @property
    def needs_value_head(self) -> bool:
        """The learner must hold a value head beside the policy (`policy.value_head.PolicyWithValue`)."""
        return True

    def metric_normaliser(self, name: str) -> str:
        if name == "value_loss":  # a term of the loss: the loss's own denominator
            return super().metric_normaliser("loss")
        if name in _CRITIC_TOKEN_MEANS:
            return "loss_tokens"
        return super().metric_normaliser(name)

    def objective(  # type: ignore[override]
        self,
        logp: Array,
        batch: Batch,
        logp_ref: Array | None,
        entropy: Array | None = None,
        logp_teacher: Array | None = None,
        values: Array | None = None,
    ) -> tuple[Array, dict[str, Array]]:
        """Loss and metrics from per-token policy logprobs and values [B, S] (pure; values aligned to tokens as
        logprobs are: `policy.value_head.logprobs_entropy_and_values`)."""
        if values is None:
            raise ValueError("loss.type ppo_critic: the objective needs the value head's per-token values")
        if batch.token_rewards is None:
            raise ValueError("loss.type ppo_critic: the batch has no token_rewards")
        mask = batch.loss_mask.astype(jnp.float32)
        if batch.old_values is None:
            old_values = jax.lax.stop_gradient(values)  # one update per slot: the critic before it (no clip acts)
            adv, returns, pg_adv = self._gae(batch, old_values, mask)
        else:  # several updates per slot: V_old, R and Â fixed at the slot's first update (`slot_targets`)
            if batch.returns is None:
                raise ValueError("loss.type ppo_critic: the batch has old_values but no returns")
            old_values, returns, pg_adv = batch.old_values, batch.returns, batch.advantages
            adv = returns - old_values
        extra = {} if logp_teacher is None else {"logp_teacher": logp_teacher}
        pg_batch = dataclasses.replace(batch, advantages=pg_adv)
        loss, metrics = super().objective(logp, pg_batch, logp_ref, entropy, **extra)
        per_token, clipped = T.clipped_value_loss(values, old_values, returns, self.value_clip)
        value_loss = self.aggregate(per_token, mask, batch.seq_index)
        loss = loss + self.vf_coef * value_loss
        metrics.update(
            value_loss=value_loss,
            value_clip_fraction=T.token_mean(clipped.astype(jnp.float32), mask),
            explained_variance=T.explained_variance(old_values, returns, mask),
            value_mean=T.token_mean(old_values, mask),
            return_mean=T.token_mean(returns, mask),
            gae_advantage_mean=T.token_mean(adv, mask),
            loss=loss,
        )
        return loss, metrics

    def _gae(self, batch: Batch, old_values: Array, mask: Array) -> tuple[Array, Array, Array]:
        """(A, R, Â) from the batch's token rewards and V_old (Â whitened over `mask`'s tokens if configured)."""
        assert batch.token_rewards is not None
        adv, returns = T.gae_advantages(batch.token_rewards, old_values, mask, batch.segment_ids, self.gamma, self.lam)
        pg_adv = T.whiten(adv, mask) if self.whiten_advantages else adv
        return adv, returns, pg_adv

    def slot_targets(self, batch: Batch, old_values: Array) -> dict[str, Array]:
        """The `Batch` fields fixed for a whole slot of several updates, from the slot's pre-update values V_old
        [B, S] (the slot's rows): `old_values`, `returns` R = A + V_old and `advantages` Â (whitened over all the
        slot's loss tokens if configured). GAE runs within each row, so a minibatch's rows of these equal what
        the minibatch alone would give; the whitening statistics are the slot's."""
        if batch.token_rewards is None:
            raise ValueError("loss.type ppo_critic: the batch has no token_rewards")
        old_values = jax.lax.stop_gradient(old_values)
        _, returns, pg_adv = self._gae(batch, old_values, batch.loss_mask.astype(jnp.float32))
        return {"old_values": old_values, "returns": returns, "advantages": pg_adv}

    def create_loss_fn(self, reference_model: Any | None, logprob_fn: LogprobFn) -> LossFn:
        """As `_LossModuleBase.create_loss_fn`, the model being a `PolicyWithValue`: `logprob_fn` must carry the
        one-pass `values_fn` (`policy.learner.make_logprob_fn` does)."""
        values_fn = getattr(logprob_fn, "values_fn", None)
        if values_fn is None:
            raise ValueError("loss.type ppo_critic needs a logprob function from policy.learner.make_logprob_fn")
        needs_reference, needs_teacher = self.needs_reference, self.needs_teacher

        def loss_fn(model: Any, frozen: Any, batch: Batch) -> tuple[Array, dict[str, Array]]:
            reference, teacher = split_frozen(frozen)
            if needs_reference and reference is None:
                raise ValueError(f"kl_coef={self.config.kl_coef} > 0 needs a reference model")
            if needs_teacher and teacher is None:
                raise ValueError("loss.distill is set: the loss needs a teacher model")
            logp, entropy, values = values_fn(model, batch)
            logp_ref = jax.lax.stop_gradient(logprob_fn(reference, batch)[0]) if needs_reference else None
            logp_teacher = jax.lax.stop_gradient(logprob_fn(teacher, batch)[0]) if needs_teacher else None
            return self.objective(logp, batch, logp_ref, jax.lax.stop_gradient(entropy), logp_teacher, values)

        return loss_fn


LOSS_MODULES[CriticPPOLossConfig] = CriticPPOLoss  # registered on import (policy.losses imports this module)
