"""Pure loss terms: one function per formula, no config and no model.

Notation, per token t of a batch row (arrays [B, S] unless stated): `logp` = log π_θ(y_t) of the policy being
trained, `logp_gen` = log π_sampler(y_t) recorded by the sampler, `logp_ref` = log π_ref(y_t) of the frozen
initial model, `A` = advantage, `m` = loss mask. δ = logp − logp_gen is the learner/sampler log-ratio.

Every ratio is formed from a log-ratio clamped to [−M, M] (`max_log_ratio`) before `exp`, so no float32
overflow can reach the loss: exp(20) ≈ 4.9e8 is finite, exp(100) is inf and inf · 0 is NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# ratios
# ---------------------------------------------------------------------------------------------


def clamp_log_ratio(log_ratio: Array, max_log_ratio: float) -> tuple[Array, Array]:
    """(δ̂, clamped) with δ̂ = clip(δ, −M, M) and clamped = |δ| > M.

    ∂δ̂/∂δ is exactly 1 for |δ| ≤ M and exactly 0 beyond (no tie split at the bound, no NaN from the
    discarded branch)."""
    clamped = jnp.abs(log_ratio) > max_log_ratio
    bounded = jnp.clip(jax.lax.stop_gradient(log_ratio), -max_log_ratio, max_log_ratio)
    return jnp.where(clamped, bounded, log_ratio), clamped


def importance_ratio(logp: Array, logp_behaviour: Array, max_log_ratio: float) -> tuple[Array, Array]:
    """(r, clamped): r = exp(clip(logp − logp_behaviour, −M, M)) = π_θ / π_behaviour, finite in float32."""
    log_ratio, clamped = clamp_log_ratio(logp - logp_behaviour, max_log_ratio)
    return jnp.exp(log_ratio), clamped


def truncated_is_weight(logp_old: Array, logp_gen: Array, cap: float, max_log_ratio: float = 20.0) -> Array:
    """w = min(π_old / π_sampler, C) = min(exp(clip(logp_old − logp_gen, −M, M)), C), no gradient (TIS).

    References:
        Espeholt et al. 2018, "IMPALA: Scalable Distributed Deep-RL with Importance Weighted Actor-Learner
            Architectures", arXiv:1802.01561 (truncated importance weights).
        Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (blog post,
            fengyao.notion.site) (TIS for the sampler/learner mismatch).
    """
    ratio, _ = importance_ratio(logp_old, logp_gen, max_log_ratio)
    return jax.lax.stop_gradient(jnp.minimum(ratio, cap))


# ---------------------------------------------------------------------------------------------
# PPO clip (token level for RLOO / PPO, sequence level for GSPO)
# ---------------------------------------------------------------------------------------------


def clip_indicator(ratio: Array, advantages: Array, eps_low: float, eps_high: float) -> Array:
    """1 where the clipped branch is strictly the minimum (no gradient):
    (A > 0 ∧ r > 1 + ε_high) ∨ (A < 0 ∧ r < 1 − ε_low)."""
    return ((advantages > 0) & (ratio > 1.0 + eps_high)) | ((advantages < 0) & (ratio < 1.0 - eps_low))


def clipped_surrogate(ratio: Array, advantages: Array, eps_low: float, eps_high: float) -> Array:
    """min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A), the PPO objective (clip-higher if ε_high > ε_low).

    The active branch is selected explicitly: r·A wherever r·A ≤ clip(r)·A (ties included), else the
    constant clip(r)·A. So ∂/∂r = A exactly when `clip_indicator` is 0 and 0 when it is 1, the published
    PPO gradient, also when r sits exactly on a bound (ε = 0); `jnp.minimum` would split a tie's gradient.

    References:
        Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347.
        clip-higher: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
            arXiv:2503.14476.
    """
    clipped = clip_indicator(ratio, advantages, eps_low, eps_high)
    bounded = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
    return jnp.where(clipped, bounded * advantages, ratio * advantages)


def dual_clip_indicator(ratio: Array, advantages: Array, c: float) -> Array:
    """1 where the dual clip bounds the objective (no gradient): A < 0 ∧ r > c."""
    return (advantages < 0) & (ratio > c)


def dual_clipped_surrogate(ratio: Array, advantages: Array, eps_low: float, eps_high: float, c: float) -> Array:
    """max(min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A), c·A) for A < 0, the PPO objective otherwise (c > 1).

    With A < 0 and r > c the PPO objective r·A is unbounded below as r grows; the dual clip replaces it with the
    constant c·A (no gradient), as `clipped_surrogate` replaces its clipped branch.

    References:
        Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning" (dual-clip PPO),
            AAAI 2020, arXiv:1912.09729.
    """
    return jnp.where(dual_clip_indicator(ratio, advantages, c), c * advantages,
                     clipped_surrogate(ratio, advantages, eps_low, eps_high))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# CISPO
# ---------------------------------------------------------------------------------------------


def cispo_weight(ratio: Array, eps_low: float, eps_high: float) -> Array:
    """w_t = sg(clip(r_t, 1 − ε_low, 1 + ε_high)): the clipped IS weight, no gradient through it.

    References:
        MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", arXiv:2506.13585.
    """
    return jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))


def weight_clip_indicator(ratio: Array, eps_low: float, eps_high: float) -> Array:
    """1 where the CISPO weight is clipped: r_t > 1 + ε_high ∨ r_t < 1 − ε_low (the token still has a gradient)."""
    return (ratio > 1.0 + eps_high) | (ratio < 1.0 - eps_low)


def cispo_surrogate(weight: Array, advantages: Array, logp: Array) -> Array:
    """w_t · A_t · log π_θ(y_t): ∂/∂ log π_θ(y_t) = w_t·A_t (REINFORCE weighted by the clipped IS weight).

    References:
        MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", arXiv:2506.13585.
    """
    return jax.lax.stop_gradient(weight) * advantages * logp


# ---------------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------------


def k3(log_ratio: Array) -> Array:
    """exp(δ) − 1 − δ ≥ 0 for a log-ratio δ (zero at δ = 0)."""
    return jnp.expm1(log_ratio) - log_ratio


def kl_k1(logp: Array, logp_ref: Array, max_log_ratio: float = 20.0) -> Array:
    """k1 = log(π_θ/π_ref) = logp − logp_ref (unbiased for KL(π_θ‖π_ref) under π_θ; can be negative).

    No exp: finite for every finite log-ratio, so `max_log_ratio` is accepted (uniform estimator signature) and
    unused.

    References:
        Schulman 2020, "Approximating KL Divergence", blog post (http://joschu.net/blog/kl-approx.html).
    """
    return logp - logp_ref


def kl_k2(logp: Array, logp_ref: Array, max_log_ratio: float = 20.0) -> Array:
    """k2 = ½ (logp − logp_ref)² (low variance, biased, ≥ 0).

    No exp: finite for every finite log-ratio (½·100² = 5000), so `max_log_ratio` is accepted and unused.

    References:
        Schulman 2020, "Approximating KL Divergence", blog post (http://joschu.net/blog/kl-approx.html).
    """
    return 0.5 * jnp.square(logp - logp_ref)


def kl_k3(logp: Array, logp_ref: Array, max_log_ratio: float = 20.0) -> Array:
    """k3 = π_ref/π_θ − 1 − log(π_ref/π_θ) = exp(δ̂) − 1 − δ̂ with δ̂ = clip(logp_ref − logp, −M, M) (≥ 0).

    The log-ratio is clamped like every ratio (`clamp_log_ratio`, M = `max_log_ratio`, 20 by default): exp(δ)
    overflows float32 past δ ≈ 88.7 (loss inf, gradient −inf, and the update guard would drop the whole slot for
    one token), while exp(20) ≈ 4.9e8 stays finite even summed over 10⁶ tokens (≈ 4.9e14 ≪ 3.4e38). A clamped
    token contributes the constant k3(±M) and no gradient, as a clamped policy ratio does; unclamped (|δ| ≤ M)
    it is the unbiased estimator, gradient ∂k3/∂logp = 1 − exp(δ).

    With logp = log π_sampler and logp_ref = log π_learner it estimates KL(π_sampler‖π_learner) from sampler
    draws (the learner's `mismatch_kl` metric).

    References:
        Schulman 2020, "Approximating KL Divergence", blog post (http://joschu.net/blog/kl-approx.html); used as the
            KL penalty of GRPO, Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300.
    """
    return k3(clamp_log_ratio(logp_ref - logp, max_log_ratio)[0])


KL_ESTIMATORS: dict[str, Callable[[Array, Array, float], Array]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
"""name -> estimator(logp, logp_ref, max_log_ratio)."""


# ---------------------------------------------------------------------------------------------
# aggregation
# ---------------------------------------------------------------------------------------------


def token_mean(x: Array, mask: Array) -> Array:
    """Σ x·m / max(Σ m, 1): the mean over all loss tokens of the batch (0 when there is none)."""
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def segment_means(x: Array, mask: Array, seq_index: Array, num_segments: int) -> tuple[Array, Array]:
    """(means [N], counts [N]): per sequence i, Σ_{t∈i} x·m / Σ_{t∈i} m (0 if empty) and |y_i| = Σ_{t∈i} m.

    `seq_index` [B, S] assigns each token a global sequence id in [0, num_segments)."""
    flat_idx = seq_index.reshape(-1)
    sums = jax.ops.segment_sum((x * mask).reshape(-1), flat_idx, num_segments=num_segments)
    counts = jax.ops.segment_sum(mask.reshape(-1), flat_idx, num_segments=num_segments)
    return jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), 0.0), counts


def segment_sums(x: Array, mask: Array, seq_index: Array, num_segments: int) -> Array:
    """[N]: per sequence i, Σ_{t∈i} x·m (0 for a sequence without loss tokens)."""
    return jax.ops.segment_sum((x * mask).reshape(-1), seq_index.reshape(-1), num_segments=num_segments)


def segment_max_abs(x: Array, mask: Array, seq_index: Array, num_segments: int) -> Array:
    """[N]: per sequence i, max_{t∈i, m_t>0} |x_t| (0 for a sequence without loss tokens)."""
    flat = (jnp.abs(x) * (mask > 0)).reshape(-1)
    out = jax.ops.segment_max(flat, seq_index.reshape(-1), num_segments=num_segments)
    return jnp.maximum(out, 0.0)  # an empty segment's max is −inf


def mean_over_sequences(per_seq: Array, counts: Array) -> Array:
    """mean of `per_seq` [N] over the sequences with ≥ 1 loss token (0 when there is none)."""
    has = counts > 0
    return jnp.sum(jnp.where(has, per_seq, 0.0)) / jnp.maximum(jnp.sum(has), 1)


def sequence_mean(x: Array, mask: Array, seq_index: Array, num_segments: int) -> Array:
    """mean_{seq: Σ_seq m > 0} (Σ_seq x·m / Σ_seq m): each sequence's token mean, then the mean over sequences."""
    means, counts = segment_means(x, mask, seq_index, num_segments)
    return mean_over_sequences(means, counts)


# ---------------------------------------------------------------------------------------------
# GSPO
# ---------------------------------------------------------------------------------------------


def sequence_log_ratio(
    logp: Array, logp_gen: Array, mask: Array, seq_index: Array, num_segments: int
) -> tuple[Array, Array]:
    """(log s_i [N], |y_i| [N]): log s_i = (1/|y_i|) Σ_{t∈y_i} (logp_t − logp_gen_t) over the loss tokens of
    sequence i, i.e. log of (π_θ(y_i|x)/π_sampler(y_i|x))^{1/|y_i|}; 0 for a sequence without loss tokens.

    References:
        Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071.
    """
    return segment_means(logp - logp_gen, mask, seq_index, num_segments)


def sequence_advantage(advantages: Array, mask: Array, seq_index: Array, num_segments: int) -> Array:
    """A_i [N] = mean of A over the loss tokens of sequence i (the sequence's advantage when A is constant on it)."""
    return segment_means(advantages, mask, seq_index, num_segments)[0]


# ---------------------------------------------------------------------------------------------
# rollout correction: sequence-level TIS and masked IS (rejection) against the sampler
# ---------------------------------------------------------------------------------------------


def sequence_truncated_is_weight(
    logp_old: Array,
    logp_gen: Array,
    mask: Array,
    seq_index: Array,
    num_segments: int,
    cap: float,
    max_log_ratio: float = 20.0,
) -> Array:
    """[B, S] per token: w_i = min(Π_{t∈i} π_old(y_t)/π_sampler(y_t), C) of the token's sequence i, no gradient.

    The product is formed as exp(clip(Σ_{t∈i} m_t (logp_old − logp_gen), −M, M)) over the loss tokens of i
    (finite in float32, see the module docstring); a sequence without loss tokens gets w = 1 (its tokens carry no
    loss). Sequence-level TIS: unbiased for the sequence-level objective up to the truncation at C, where the
    token-level weight is the per-token (biased, lower-variance) approximation.

    References:
        Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (blog post,
            fengyao.notion.site); Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
            Training-Inference Mismatch" (blog post, yingru.notion.site) (sequence-level IS); rollout correction in verl
            (github.com/volcengine/verl pull 3915) and slime (github.com/THUDM/slime pull 657).
    """
    log_ratio = segment_sums(logp_old - logp_gen, mask, seq_index, num_segments)
    log_ratio, _ = clamp_log_ratio(log_ratio, max_log_ratio)
    per_seq = jnp.minimum(jnp.exp(log_ratio), cap)
    return jax.lax.stop_gradient(per_seq[seq_index])


def _within(log_ratio: Array, low: float, high: float) -> Array:
    """1.0 where low ≤ exp(log_ratio) ≤ high, compared in log space (no exp, no overflow); low = 0: no lower bound."""
    keep = log_ratio <= math.log(high)
    if low > 0:
        keep = keep & (log_ratio >= math.log(low))
    return keep.astype(jnp.float32)


def token_rejection_mask(logp_old: Array, logp_gen: Array, low: float, high: float) -> Array:
    """[B, S] keep_t = 1[low ≤ π_old(y_t)/π_sampler(y_t) ≤ high], no gradient (token-level masked IS).

    References:
        Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
            Mismatch" (blog post, yingru.notion.site) (masked importance sampling); rollout correction in verl
            (github.com/volcengine/verl pull 3915) and slime (github.com/THUDM/slime pull 657).
    """
    return jax.lax.stop_gradient(_within(logp_old - logp_gen, low, high))


def sequence_rejection_mask(
    logp_old: Array,
    logp_gen: Array,
    mask: Array,
    seq_index: Array,
    num_segments: int,
    low: float,
    high: float,
) -> Array:
    """[B, S] keep of the token's sequence i: 1[low ≤ Π_{t∈i} π_old/π_sampler ≤ high] over the loss tokens of i
    (compared as Σ log-ratio against log bounds: no overflow), no gradient (sequence-level masked IS).

    References:
        Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
            Mismatch" (blog post, yingru.notion.site); rollout correction in verl
            (github.com/volcengine/verl pull 3915) and slime (github.com/THUDM/slime pull 657).
    """
    log_ratio = segment_sums(logp_old - logp_gen, mask, seq_index, num_segments)
    return jax.lax.stop_gradient(_within(log_ratio, low, high)[seq_index])


# ---------------------------------------------------------------------------------------------
# on-policy distillation (math only: no teacher model is wired to the learner yet)
# ---------------------------------------------------------------------------------------------


def reverse_kl_advantage(
    logp_teacher: Array,
    logp_student: Array,
    mask: Array,
    rl_advantages: Array | None = None,
    coef: float = 1.0,
) -> Array:
    """[B, S] per-token on-policy distillation advantage A_t = coef · (log π_teacher(y_t) − log π_student(y_t)),
    plus the RL (e.g. RLOO) advantage when `rl_advantages` is given; 0 where m = 0; no gradient.

    For tokens sampled from the student, −(log π_student − log π_teacher) is the one-sample estimate of the
    negative per-token reverse KL(π_student‖π_teacher): a policy gradient with this advantage descends the
    reverse KL (mode seeking), token by token, with no reward needed. Both logprobs must be at the sampling
    temperature of the token.

    References:
        Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes"
            (GKD), arXiv:2306.13649; Lu and Thinking Machines Lab 2025, "On-Policy Distillation" (blog post,
            thinkingmachines.ai) (per-token reverse-KL advantage, mixed with RL rewards).
    """
    adv = coef * (logp_teacher - logp_student)
    if rl_advantages is not None:
        adv = adv + rl_advantages
    return jax.lax.stop_gradient(adv * mask)


# ---------------------------------------------------------------------------------------------
# critic PPO: GAE and the clipped value loss
# ---------------------------------------------------------------------------------------------


def gae_advantages(
    rewards: Array, values: Array, mask: Array, segment_ids: Array, gamma: float, lam: float
) -> tuple[Array, Array]:
    """(A, R) [B, S]: generalised advantage estimates and value targets R = A + V per loss token (0 elsewhere).

    Every packed segment of a row is one episode; its steps are its loss tokens (m = 1) only, in order (tool and
    environment tokens, m = 0, are not actions of the policy). For consecutive steps t < t' of one segment,
        δ_t = r_t + γ·V_{t'} − V_t,   A_t = δ_t + γλ·A_{t'},
    and the segment's last step has V_{t'} = A_{t'} = 0 (the episode ends). r_t is the step's own reward plus
    the rewards of the m = 0 tokens after it, up to the next step (what the environment returned for that
    action); rewards before a segment's first step are not any action's. No gradient flows through `values`.

    References:
        Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
            arXiv:1506.02438 (GAE(γ, λ), eq. 16, computed backwards).
    """
    values = jax.lax.stop_gradient(values)
    step_mask = mask > 0

    Carry = tuple[Array, Array, Array, Array]

    def step(carry: Carry, xs: tuple[Array, ...]) -> tuple[Carry, Array]:
        next_v, next_a, pending, next_seg = carry
        r, v, m, seg = xs
        boundary = seg != next_seg  # scanning backwards: the segment after this token ended here
        next_v = jnp.where(boundary, 0.0, next_v)
        next_a = jnp.where(boundary, 0.0, next_a)
        reward = r + jnp.where(boundary, 0.0, pending)
        a = reward + gamma * next_v - v + gamma * lam * next_a
        carry = (
            jnp.where(m, v, next_v),
            jnp.where(m, a, next_a),
            jnp.where(m, 0.0, reward),
            seg,
        )
        return carry, jnp.where(m, a, 0.0)

    B = rewards.shape[0]
    zeros = jnp.zeros((B,), jnp.float32)
    init = (zeros, zeros, zeros, jnp.full((B,), -2, segment_ids.dtype))
    xs = tuple(x.T[::-1] for x in (rewards.astype(jnp.float32), values.astype(jnp.float32), step_mask, segment_ids))
    _, adv_reversed = jax.lax.scan(step, init, xs)
    adv = adv_reversed[::-1].T
    returns = jnp.where(step_mask, adv + values, 0.0)
    return jax.lax.stop_gradient(adv), jax.lax.stop_gradient(returns)


def whiten(x: Array, mask: Array, eps: float = 1e-8) -> Array:
    """(x − μ) / sqrt(σ² + eps) with μ, σ² the mean and (population) variance of x over the tokens with m > 0;
    0 where m = 0; no gradient (advantage whitening, as verl's `masked_whiten`)."""
    mu = token_mean(x, mask)
    var = token_mean(jnp.square(x - mu), mask)
    return jax.lax.stop_gradient(jnp.where(mask > 0, (x - mu) * jax.lax.rsqrt(var + eps), 0.0))


def clipped_value_loss(values: Array, old_values: Array, returns: Array, clip: float | None) -> tuple[Array, Array]:
    """(loss, clipped) per token: ½·max((V − R)², (V_clip − R)²) with V_clip = V_old + clip(V − V_old, −ε_v, ε_v),
    and clipped = 1 where the clipped error is strictly the larger (V gets no gradient there). `clip` None:
    ½·(V − R)², never clipped. The larger branch is selected explicitly (no tie split of the gradient).

    References:
        Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347 (value-function loss
            of the PPO objective; the clipped form is that of its reference implementation, OpenAI baselines ppo2).
    """
    err = jnp.square(values - returns)
    if clip is None:
        return 0.5 * err, jnp.zeros_like(err, dtype=bool)
    v_clip = old_values + jnp.clip(values - old_values, -clip, clip)
    err_clip = jnp.square(v_clip - returns)
    clipped = err_clip > err
    return 0.5 * jnp.where(clipped, err_clip, err), clipped


def explained_variance(values: Array, returns: Array, mask: Array) -> Array:
    """1 − Var(R − V) / Var(R) over the tokens with m > 0 (1: V predicts R exactly; ≤ 0: no better than the mean
    of R); 0 when Var(R) = 0."""
    var_r = token_mean(jnp.square(returns - token_mean(returns, mask)), mask)
    diff = returns - values
    var_d = token_mean(jnp.square(diff - token_mean(diff, mask)), mask)
    return jnp.where(var_r > 0, 1.0 - var_d / jnp.where(var_r > 0, var_r, 1.0), 0.0)
