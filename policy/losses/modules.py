"""Registered loss modules: one per `LossConfig` subclass, built from the pure terms of `terms.py`.

Notation as in `terms.py`; agg is the configured aggregation (`loss.aggregation`):
  token:    Σ_t x_t m_t / Σ_t m_t over every loss token of the batch (long responses weigh more);
  sequence: mean over sequences (packed segments) with ≥ 1 loss token of Σ_seq x m / Σ_seq m (every response
            weighs the same). The two agree when every response has the same number of loss tokens.
π_old is the sampler (`generator_logprobs`) in every module, except RLOO with `tis_cap` (below). Every module
adds β · agg(KL_k(logp, logp_ref)) when `kl_coef` = β > 0 (no reference model is built when β = 0), and
clamps log-ratios to ±`max_log_ratio` before `exp`. With `overlong_filter` (RLOO, GSPO, CISPO), tokens of
truncated responses get m = 0.

RLOOLoss (`type: rloo`): L = −agg( min(r·A, clip(r, 1−ε_low, 1+ε_high)·A) ) with r = π_θ/π_sampler.
  Dual clip (`dual_clip` = c, rloo and ppo): for A < 0 the objective is max(that, c·A), bounded as r grows.
  With truncated importance sampling (`tis_cap` = C set), the ratio is taken to the learner's own
  pre-update policy, π_old = stop_gradient(π_θ), and the sampler mismatch is corrected by a capped weight:
  L = −agg( min(π_old/π_sampler, C) · min(r'·A, clip(r')·A) ), r' = π_θ/π_old. With one optimizer update per
  batch slot (the default) r' ≡ 1, so the clip never acts and `clip_fraction` is 0 by construction: the
  gradient is the TIS-weighted policy gradient C-capped. With several updates per slot (`train.ppo_epochs`,
  `train.minibatches_per_slot`) π_old is the learner's policy before the slot's first update (batch key
  `old_logprobs`), so r' moves away from 1 and the clip acts. This is the decoupled form of TIS (the clip is
  to the proximal policy, the weight to the sampler); clipping against the sampler as well would correct the
  mismatch twice.
  Rollout correction (every loss type; off unless set): `tis_level: sequence` weighs every token of response i
  by min(Π_{t∈i} π_old/π_sampler, C) instead of its own token weight; `mis_level: token | sequence` (masked IS)
  drops the tokens whose ratio π_old/π_sampler, or the responses whose product of ratios, lies outside
  [`mis_low`, `mis_high`] from the whole loss (policy term and KL), denominator included (`rejection`).
PPOClipLoss (`type: ppo`): the same with a symmetric clip ε and no overlong filter (TIS and masked IS as RLOO).
GSPOLoss (`type: gspo`): sequence-level ratio s_i = (π_θ(y_i|x)/π_sampler(y_i|x))^{1/|y_i|}, clipped per
  sequence: L = −(1/N) Σ_i min(s_i·A_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i) over the N sequences with loss
  tokens (always sequence-level aggregation, as in the GSPO paper). With `tis_cap` = C (decoupled, as RLOO):
  s_i = (π_θ/π_old)^{1/|y_i|} and L = −(1/N) Σ_i w_i · min(s_i·A_i, clip(s_i)·A_i), w_i = min(ρ_i, C) with
  ρ_i = (Π_t π_old/π_sampler)^{1/|y_i|} (`tis_level: token`, GSPO's own length normalisation) or
  ρ_i = Π_t π_old/π_sampler (`tis_level: sequence`). Masked IS: token rejection removes tokens from s_i's mean.
CISPOLoss (`type: cispo`): L = −agg( sg(clip(r_t, 1−ε_low, 1+ε_high)) · A_t · log π_θ(y_t) ), r_t = π_θ/π_sampler
  (token aggregation by default, as in MiniMax-M1). Every token keeps a gradient; only its weight is clipped.
  With `tis_cap` (decoupled): r_t = π_θ/π_old and the weight is multiplied by the capped TIS weight (token or
  sequence level, as RLOO).
On-policy distillation (`loss.distill`, any type): before the policy term the batch advantage becomes
  A_t = coef · (log π_teacher(y_t) − log π_old(y_t)) + rl_coef · A_rl,t (`terms.reverse_kl_advantage`), the
  teacher's logprobs computed by the learner from a frozen teacher model (held with the reference in
  `FrozenModels`), π_old the learner's pre-update policy (fixed over a slot's updates), no gradient.

References:
    PPO clip: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347.
    RLOO: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
        Feedback in LLMs", arXiv:2402.14740; Kool, van Hoof, Welling 2019, "Buy 4 REINFORCE Samples, Get a Baseline
        for Free!" (ICLR 2019 workshop).
    GRPO (sequence aggregation, k3 KL to a reference): Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300.
    Dr.GRPO (token aggregation without per-response normalisation): Liu et al. 2025, "Understanding R1-Zero-Like
        Training: A Critical Perspective", arXiv:2503.20783.
    clip-higher (ε_high > ε_low), token-level aggregation, overlong filtering: Yu et al. 2025, "DAPO: An Open-Source
        LLM Reinforcement Learning System at Scale", arXiv:2503.14476.
    GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071.
    CISPO: MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
        arXiv:2506.13585.
    KL estimators k1/k2/k3: Schulman 2020, "Approximating KL Divergence", blog post
        (http://joschu.net/blog/kl-approx.html).
    dual-clip PPO: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning",
        arXiv:1912.09729.
    on-policy distillation: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
        Self-Generated Mistakes" (GKD), arXiv:2306.13649; Lu and Thinking Machines Lab 2025, "On-Policy
        Distillation" (blog post, thinkingmachines.ai).
    truncated importance sampling: Espeholt et al. 2018, "IMPALA: Scalable Distributed Deep-RL with Importance
        Weighted Actor-Learner Architectures", arXiv:1802.01561; for the sampler/learner mismatch of LLM RL, Yao et
        al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (blog post,
        fengyao.notion.site).
    sequence-level IS and masked IS (rollout correction): Liu et al. 2025, "When Speed Kills Stability: Demystifying
        RL Collapse from the Training-Inference Mismatch" (blog post, yingru.notion.site); verl (github.com/volcengine
        /verl pull 3915) and slime (github.com/THUDM/slime pull 657).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import equinox as eqx
import jax
import jax.numpy as jnp

import policy.losses.terms as T
from pipeline.config import CISPOLossConfig, GSPOLossConfig, LossConfig, PPOClipLossConfig, RLOOLossConfig
from policy.losses.batch import Batch
from policy.losses.microbatch_metrics import POLICY_MEANS, normaliser

Array = jax.Array

LogprobFn = Callable[[Any, Batch], tuple[Array, Array]]
"""(model, batch) -> (logprobs [B, S], entropy [B, S]) at the batch temperatures."""

LossFn = Callable[[Any, Any, Batch], tuple[Array, dict[str, Array]]]
"""(model, reference_model | None, batch) -> (loss, metrics); the reference is an argument (not a closure)
so that a jitted step does not bake its weights in as constants."""


class FrozenModels(eqx.Module):
    """The frozen models a loss reads besides the policy: the KL reference and the distillation teacher (either
    None). Passed as the loss function's `reference` argument only when a teacher exists (`frozen_models`), so
    every caller that passes a bare reference model keeps working."""

    reference: Any
    teacher: Any


def frozen_models(reference: Any, teacher: Any) -> Any:
    """What the learner passes as `reference`: the bare reference without a teacher, else `FrozenModels`."""
    return reference if teacher is None else FrozenModels(reference, teacher)


def split_frozen(frozen: Any) -> tuple[Any, Any]:
    """(reference, teacher) of a `frozen_models` value."""
    if isinstance(frozen, FrozenModels):
        return frozen.reference, frozen.teacher
    return frozen, None


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

    def objective(
        self,
        logp: Array,
        batch: Batch,
        logp_ref: Array | None,
        entropy: Array | None = None,
        logp_teacher: Array | None = None,
    ) -> tuple[Array, dict[str, Array]]:
        """Loss and metrics from per-token policy logprobs (pure); `logp_teacher` with `loss.distill`."""
        ...

    def create_loss_fn(self, reference_model: Any | None, logprob_fn: LogprobFn) -> LossFn:
        """(model, reference, batch) -> (loss, metrics): differentiable in `model`; the reference is held constant.

        `reference_model` here only validates the configuration (a KL loss without one is an error when given);
        the learner passes the built reference as the second argument of every call."""
        ...


@dataclasses.dataclass(frozen=True)
class _LossModuleBase:
    """Shared machinery: mask, KL term, common metrics, the loss function; subclasses give the policy term."""

    config: LossConfig

    eps_low: float = 0.2
    eps_high: float = 0.2
    tis_cap: float | None = None
    overlong_filter: bool = False
    tis_level: str = "token"
    mis_level: str | None = None
    mis_low: float = 0.5
    mis_high: float = 2.0

    @property
    def needs_reference(self) -> bool:
        return self.config.kl_coef > 0

    @property
    def needs_teacher(self) -> bool:
        """Whether a distillation teacher must be loaded (`loss.distill` set)."""
        return self.config.distill is not None

    @property
    def uses_old_logprobs(self) -> bool:
        """Whether the slot's pre-update learner logprobs (`Batch.old_logprobs`) are needed once the policy moves
        within a slot: TIS weights, rejection masks and the distillation advantage are to the learner's pre-update
        policy."""
        return self.tis_cap is not None or self.mis_level is not None or self.needs_teacher

    @property
    def sequence_aggregation(self) -> bool:
        return self.config.aggregation == "sequence"

    def ratio_metrics(
        self,
        ratio: Array,
        adv: Array,
        weight: Array,
        mean: Callable[[Array], Array],
        clamped: Array,
        clamp_mask: Array,
    ) -> dict[str, Array]:
        """The metrics of a clipped-ratio policy term: `ratio_mean`, `clip_fraction` (of `[eps_low, eps_high]`)
        and `tis_weight_mean`, each averaged by `mean` (over tokens or sequences), and `clamped_*` over
        `clamp_mask`."""
        return {
            "ratio_mean": mean(jax.lax.stop_gradient(ratio)),
            "clip_fraction": mean(T.clip_indicator(ratio, adv, self.eps_low, self.eps_high)),
            "tis_weight_mean": mean(weight),
            **_clamp_metrics(clamped, clamp_mask),
        }

    def metric_normaliser(self, name: str) -> str:
        """How metric `name` of microbatches combines into the slot's (`policy.losses.microbatch_metrics`)."""
        return normaliser(name, kept=self.mis_level is not None, sequences=self.sequence_aggregation)

    @property
    def max_log_ratio(self) -> float:
        return self.config.max_log_ratio

    def build(self, reference_model: Any | None) -> Any | None:
        return reference_model if self.needs_reference else None

    def aggregate(self, x: Array, mask: Array, seq_index: Array) -> Array:
        """`agg` of the module docstring, per `config.aggregation`."""
        if self.config.aggregation == "sequence":
            return T.sequence_mean(x, mask, seq_index, seq_index.size + 1)
        return T.token_mean(x, mask)

    def policy_term(self, logp: Array, batch: Batch, mask: Array) -> tuple[Array, dict[str, Array]]:
        """(pg_loss, metrics) of this module's policy-gradient term."""
        raise NotImplementedError

    def rejection(self, logp: Array, batch: Batch, loss_mask: Array) -> tuple[Array, dict[str, Array]]:
        """(mask, metrics): the loss mask with the tokens / sequences that masked IS rejects set to 0, and the
        counts and fractions of what it kept; `loss_mask` and no metrics when `mis_level` is None.

        The ratio is π_old/π_sampler, π_old the learner's pre-update policy (as for TIS). Rejected tokens leave
        the whole loss, denominator included (kept_tokens / kept_sequences), so a rejection does not scale the
        gradient of the kept ones down (the normalisation of verl and slime, slime pull 657)."""
        if self.mis_level is None:
            return loss_mask, {}
        logp_old = jax.lax.stop_gradient(logp if batch.old_logprobs is None else batch.old_logprobs)
        seq_index, n = batch.seq_index, batch.seq_index.size + 1
        if self.mis_level == "sequence":
            keep = T.sequence_rejection_mask(
                logp_old, batch.generator_logprobs, loss_mask, seq_index, n, self.mis_low, self.mis_high
            )
        else:
            keep = T.token_rejection_mask(logp_old, batch.generator_logprobs, self.mis_low, self.mis_high)
        mask = loss_mask * keep
        kept_counts = T.segment_sums(jnp.ones_like(mask), mask, seq_index, n)
        _, counts = T.segment_means(jnp.ones_like(mask), loss_mask, seq_index, n)
        has = counts > 0
        any_rejected = has & (kept_counts < counts)
        return mask, {
            "kept_tokens": jnp.sum(mask),
            "kept_sequences": jnp.sum((kept_counts > 0).astype(jnp.float32)),
            "mis_masked_fraction": T.token_mean(1.0 - keep, loss_mask),
            "mis_masked_seq_fraction": T.mean_over_sequences(any_rejected.astype(jnp.float32), counts),
        }

    def distill_advantages(self, logp: Array, batch: Batch, logp_teacher: Array) -> tuple[Batch, dict[str, Array]]:
        """(batch with the on-policy distillation advantage, its metrics): A_t = coef · (log π_teacher −
        log π_old) + rl_coef · A_rl on loss tokens (`terms.reverse_kl_advantage`), π_old the learner's pre-update
        policy. Metrics: `teacher_kl` (token mean of log π_old − log π_teacher, the one-sample estimate of the
        per-token reverse KL(π_student‖π_teacher)) and `opd_advantage_mean` (token mean of the distillation part)."""
        distill = self.config.distill
        assert distill is not None
        logp_old = jax.lax.stop_gradient(logp if batch.old_logprobs is None else batch.old_logprobs)
        logp_teacher = jax.lax.stop_gradient(logp_teacher)
        mask = batch.loss_mask.astype(jnp.float32)
        rl = batch.advantages * distill.rl_coef if distill.rl_coef else None
        adv = T.reverse_kl_advantage(logp_teacher, logp_old, mask, rl, distill.coef)
        metrics = {
            "teacher_kl": T.token_mean(logp_old - logp_teacher, mask),
            "opd_advantage_mean": T.token_mean(distill.coef * (logp_teacher - logp_old), mask),
        }
        return dataclasses.replace(batch, advantages=adv), metrics

    def objective(
        self,
        logp: Array,
        batch: Batch,
        logp_ref: Array | None,
        entropy: Array | None = None,
        logp_teacher: Array | None = None,
    ) -> tuple[Array, dict[str, Array]]:
        """Loss and metrics from per-token policy logprobs (pure; used by the tests directly). With a distillation
        config, `logp_teacher` (the teacher's logprobs of the batch tokens) is required."""
        distill_metrics: dict[str, Array] = {}
        if self.needs_teacher:
            if logp_teacher is None:
                raise ValueError("loss.distill is set: the objective needs the teacher's logprobs")
            batch, distill_metrics = self.distill_advantages(logp, batch, logp_teacher)
        loss_mask = batch.loss_mask.astype(jnp.float32)
        if self.overlong_filter:
            loss_mask = loss_mask * (1.0 - batch.truncated.astype(jnp.float32))
        seq_index, n = batch.seq_index, batch.seq_index.size + 1
        mask, rejection = self.rejection(logp, batch, loss_mask)
        pg_loss, metrics = self.policy_term(logp, batch, mask)
        # sampler mismatch of the current (pre-update) policy, per token, clamped like every ratio
        mismatch, _ = T.clamp_log_ratio(jax.lax.stop_gradient(logp) - batch.generator_logprobs, self.max_log_ratio)
        abs_mismatch = jnp.abs(mismatch)
        seq_abs_mean, counts = T.segment_means(abs_mismatch, loss_mask, seq_index, n)
        metrics.update(
            pg_loss=pg_loss,
            mismatch_abs_logp=T.token_mean(abs_mismatch, loss_mask),
            # k3 estimate of KL(π_sampler‖π_θ), i.e. kl_k3(logp_gen, logp_old), on the clamped log-ratio
            mismatch_kl=T.token_mean(T.k3(mismatch), loss_mask),
            # per sequence: mean and max |log π_θ/π_sampler| over its tokens, |Σ log-ratio| (the log of the
            # sequence ratio that sequence-level TIS / rejection use), each averaged over sequences
            mismatch_seq_abs_logp_mean=T.mean_over_sequences(seq_abs_mean, counts),
            mismatch_seq_abs_logp_max=T.mean_over_sequences(
                T.segment_max_abs(mismatch, loss_mask, seq_index, n), counts
            ),
            mismatch_seq_abs_log_ratio=T.mean_over_sequences(
                jnp.abs(T.segment_sums(mismatch, loss_mask, seq_index, n)), counts
            ),
            mismatch_abs_logp_max=jnp.max(abs_mismatch * (loss_mask > 0)),
            advantage_mean=T.token_mean(batch.advantages, loss_mask),
            loss_tokens=jnp.sum(loss_mask),
            loss_sequences=jnp.sum((counts > 0).astype(jnp.float32)),
            **rejection,
            **distill_metrics,
        )
        loss = pg_loss
        if logp_ref is not None and self.needs_reference:
            kl = T.KL_ESTIMATORS[self.config.kl_estimator](logp, logp_ref, self.max_log_ratio)
            kl_term = self.aggregate(kl, mask, seq_index)
            loss = loss + self.config.kl_coef * kl_term
            metrics["kl"] = kl_term
        if entropy is not None:
            metrics["entropy"] = T.token_mean(entropy, loss_mask)
        metrics["loss"] = loss
        return loss, metrics

    def create_loss_fn(self, reference_model: Any | None, logprob_fn: LogprobFn) -> LossFn:
        needs_reference = self.needs_reference

        def loss_fn(model: Any, frozen: Any, batch: Batch) -> tuple[Array, dict[str, Array]]:
            reference, teacher = split_frozen(frozen)
            if needs_reference and reference is None:
                raise ValueError(f"kl_coef={self.config.kl_coef} > 0 needs a reference model")
            if self.needs_teacher and teacher is None:
                raise ValueError("loss.distill is set: the loss needs a teacher model")
            logp, entropy = logprob_fn(model, batch)
            logp_ref = None
            if needs_reference:
                logp_ref = jax.lax.stop_gradient(logprob_fn(reference, batch)[0])
            # the teacher scores the same tokens at the same temperatures, as the reference does
            logp_teacher = jax.lax.stop_gradient(logprob_fn(teacher, batch)[0]) if self.needs_teacher else None
            return self.objective(logp, batch, logp_ref, jax.lax.stop_gradient(entropy), logp_teacher)

        return loss_fn


def _clamp_metrics(clamped: Array, weights: Array) -> dict[str, Array]:
    """clamped_count (Σ clamped·w) and clamped_fraction (its share of Σ w) over loss tokens or sequences."""
    count = jnp.sum(clamped * weights)
    return {"clamped_count": count, "clamped_fraction": count / jnp.maximum(jnp.sum(weights), 1.0)}


def _correction(config: LossConfig) -> dict[str, Any]:
    """The rollout-correction fields of a loss config, as `_LossModuleBase` keyword arguments."""
    return {
        "tis_cap": config.tis_cap,
        "tis_level": config.tis_level,
        "mis_level": config.mis_level,
        "mis_low": config.mis_low,
        "mis_high": config.mis_high,
    }


def _tis_weight(module: _LossModuleBase, logp_old: Array, batch: Batch, mask: Array) -> Array:
    """[B, S] the TIS weight of `module` per token (token or sequence level; `tis_cap` must be set)."""
    assert module.tis_cap is not None
    if module.tis_level == "sequence":
        n = batch.seq_index.size + 1
        return T.sequence_truncated_is_weight(
            logp_old, batch.generator_logprobs, mask, batch.seq_index, n, module.tis_cap, module.max_log_ratio
        )
    return T.truncated_is_weight(logp_old, batch.generator_logprobs, module.tis_cap, module.max_log_ratio)


@dataclasses.dataclass(frozen=True)
class _ClipLossBase(_LossModuleBase):
    """Token-level PPO clip with an optional TIS weight and dual clip (RLOO and PPO)."""

    dual_clip: float | None = None

    def policy_term(self, logp: Array, batch: Batch, mask: Array) -> tuple[Array, dict[str, Array]]:
        adv, logp_gen = batch.advantages, batch.generator_logprobs
        # the slot's pre-update learner logprobs when the learner makes several updates per slot, else π_θ itself
        logp_old = jax.lax.stop_gradient(logp if batch.old_logprobs is None else batch.old_logprobs)
        sampler_ratio, clamped = T.importance_ratio(logp, logp_gen, self.max_log_ratio)
        if self.tis_cap is None:
            ratio = sampler_ratio
            weight = jnp.ones_like(logp)
        else:
            ratio, _ = T.importance_ratio(logp, logp_old, self.max_log_ratio)  # see the module docstring
            weight = _tis_weight(self, logp_old, batch, mask)
        if self.dual_clip is None:
            surrogate = weight * T.clipped_surrogate(ratio, adv, self.eps_low, self.eps_high)
        else:
            surrogate = weight * T.dual_clipped_surrogate(ratio, adv, self.eps_low, self.eps_high, self.dual_clip)
        pg_loss = -self.aggregate(surrogate, mask, batch.seq_index)
        metrics = self.ratio_metrics(ratio, adv, weight, lambda x: T.token_mean(x, mask), clamped, mask)
        if self.dual_clip is not None:
            metrics["dual_clip_fraction"] = T.token_mean(T.dual_clip_indicator(ratio, adv, self.dual_clip), mask)
        return pg_loss, metrics


@dataclasses.dataclass(frozen=True)
class RLOOLoss(_ClipLossBase):
    """Clip-higher PPO ratio to the sampler, optional TIS cap and overlong filter (advantages from the batch).

    References:
        Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
            Feedback in LLMs", arXiv:2402.14740.
        Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347.
        clip-higher, overlong filter: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
            Scale", arXiv:2503.14476.
        TIS: Espeholt et al. 2018, "IMPALA: Scalable Distributed Deep-RL with Importance Weighted Actor-Learner
            Architectures", arXiv:1802.01561; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
            Off-Policy RL Training" (blog post, fengyao.notion.site).
    """

    @classmethod
    def from_config(cls, config: RLOOLossConfig) -> RLOOLoss:
        return cls(
            config,
            config.clip_low,
            config.clip_high,
            overlong_filter=config.overlong_filter,
            dual_clip=config.dual_clip,
            **_correction(config),
        )


@dataclasses.dataclass(frozen=True)
class PPOClipLoss(_ClipLossBase):
    """Plain PPO-clip: symmetric ε, ratio to the sampler, no TIS, no overlong filter.

    References:
        Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347.
    """

    @classmethod
    def from_config(cls, config: PPOClipLossConfig) -> PPOClipLoss:
        return cls(
            config,
            config.clip_epsilon,
            config.clip_epsilon,
            overlong_filter=False,
            dual_clip=config.dual_clip,
            **_correction(config),
        )


@dataclasses.dataclass(frozen=True)
class GSPOLoss(_LossModuleBase):
    """GSPO: sequence-level ratio to the sampler, clipped per sequence, mean over sequences.

    Metrics `ratio_mean`, `clip_fraction`, `clamped_*` are per sequence (over sequences with loss tokens).

    References:
        Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071.
    """

    @classmethod
    def from_config(cls, config: GSPOLossConfig) -> GSPOLoss:
        return cls(
            config, config.clip_low, config.clip_high, overlong_filter=config.overlong_filter, **_correction(config)
        )

    @property
    def sequence_aggregation(self) -> bool:
        return True

    def metric_normaliser(self, name: str) -> str:
        if name in POLICY_MEANS:  # GSPO's ratio and clip metrics are per sequence (the kept ones under MIS)
            return "kept_sequences" if self.mis_level is not None else "loss_sequences"
        return super().metric_normaliser(name)

    def policy_term(self, logp: Array, batch: Batch, mask: Array) -> tuple[Array, dict[str, Array]]:
        seq_index = batch.seq_index
        n = seq_index.size + 1
        logp_gen = batch.generator_logprobs
        weight = None
        if self.tis_cap is None:
            log_s, counts = T.sequence_log_ratio(logp, logp_gen, mask, seq_index, n)
        else:  # decoupled: s_i to the learner's pre-update policy, the sampler mismatch in a capped weight
            logp_old = jax.lax.stop_gradient(logp if batch.old_logprobs is None else batch.old_logprobs)
            log_s, counts = T.sequence_log_ratio(logp, logp_old, mask, seq_index, n)
            if self.tis_level == "sequence":
                weight = T.sequence_truncated_is_weight(
                    logp_old, logp_gen, mask, seq_index, n, self.tis_cap, self.max_log_ratio
                )
            else:  # GSPO's length-normalised sequence ratio (geometric mean of the token ratios), capped
                log_rho, _ = T.sequence_log_ratio(logp_old, logp_gen, mask, seq_index, n)
                log_rho, _ = T.clamp_log_ratio(log_rho, self.max_log_ratio)
                weight = jax.lax.stop_gradient(jnp.minimum(jnp.exp(log_rho), self.tis_cap)[seq_index])
        log_s, clamped = T.clamp_log_ratio(log_s, self.max_log_ratio)
        s = jnp.exp(log_s)
        adv = T.sequence_advantage(batch.advantages, mask, seq_index, n)
        surrogate = T.clipped_surrogate(s, adv, self.eps_low, self.eps_high)
        w_seq = jnp.ones_like(s) if weight is None else T.segment_means(weight, mask, seq_index, n)[0]
        pg_loss = -T.mean_over_sequences(w_seq * surrogate, counts)
        has = (counts > 0).astype(jnp.float32)
        return pg_loss, self.ratio_metrics(s, adv, w_seq, lambda x: T.mean_over_sequences(x, counts), clamped, has)


@dataclasses.dataclass(frozen=True)
class CISPOLoss(_LossModuleBase):
    """CISPO: REINFORCE on every token weighted by the stop-gradient clipped IS ratio to the sampler.

    `clip_fraction` counts tokens whose weight was clipped (they still contribute a gradient).

    References:
        MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", arXiv:2506.13585
           .
    """

    @classmethod
    def from_config(cls, config: CISPOLossConfig) -> CISPOLoss:
        return cls(
            config, config.clip_low, config.clip_high, overlong_filter=config.overlong_filter, **_correction(config)
        )

    def policy_term(self, logp: Array, batch: Batch, mask: Array) -> tuple[Array, dict[str, Array]]:
        if self.tis_cap is None:
            behaviour, tis = batch.generator_logprobs, jnp.ones_like(logp)
        else:  # decoupled: the clipped weight's ratio to the learner's pre-update policy, times the capped TIS weight
            behaviour = jax.lax.stop_gradient(logp if batch.old_logprobs is None else batch.old_logprobs)
            tis = _tis_weight(self, behaviour, batch, mask)
        ratio, clamped = T.importance_ratio(jax.lax.stop_gradient(logp), behaviour, self.max_log_ratio)
        weight = T.cispo_weight(ratio, self.eps_low, self.eps_high) * tis
        surrogate = T.cispo_surrogate(weight, batch.advantages, logp)
        pg_loss = -self.aggregate(surrogate, mask, batch.seq_index)
        metrics = {
            "ratio_mean": T.token_mean(ratio, mask),
            "clip_fraction": T.token_mean(T.weight_clip_indicator(ratio, self.eps_low, self.eps_high), mask),
            "is_weight_mean": T.token_mean(weight, mask),
            "tis_weight_mean": T.token_mean(tis, mask),
            **_clamp_metrics(clamped, mask),
        }
        return pg_loss, metrics


LOSS_MODULES: dict[type[LossConfig], Any] = {
    RLOOLossConfig: RLOOLoss,
    PPOClipLossConfig: PPOClipLoss,
    GSPOLossConfig: GSPOLoss,
    CISPOLossConfig: CISPOLoss,
}


def loss_module_from_config(config: LossConfig) -> RLLossModule:
    """The registered module for `config` (exact class match; raises ValueError naming the type)."""
    try:
        cls = LOSS_MODULES[type(config)]
    except KeyError:
        raise ValueError(f"loss config {type(config).__name__} has no registered loss module") from None
    return cls.from_config(config)  # type: ignore[no-any-return]
