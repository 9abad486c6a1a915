"""Training parameters: BatchMaker/learner shared `train`, the optimizer and the registered loss modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import draccus

from pipeline.config.base import at_least, default_choice, in_range, one_of, positive, require

# ---------------------------------------------------------------------------------------
# batching (TrainParams)
# ---------------------------------------------------------------------------------------

ADVANTAGE_ESTIMATORS = ("rloo", "grpo", "dr_grpo")
OVERLONG_RULES = ("truncate", "drop")


@dataclass(frozen=True)
class TrainParams:
    """What the BatchMaker and the learner agree on: batch shape, staleness, reuse."""

    SECTION: ClassVar[str] = "train"

    num_train_steps: int = 100
    """Learner steps (batch slots) of the run; the job ends when the learner has trained this many."""
    batch_size: int = 32
    """Rows per batch (with packing, a row holds several rollouts)."""
    seq_len: int = 128
    """Tokens per batch row (prompt + response, padded)."""
    pad_multiple: int = 1
    """Batch rows are padded to a multiple of this many tokens (<= seq_len)."""
    pack: bool = False
    """Pack several rollouts per row with segment ids."""
    max_lag: int = 1
    """A rollout from policy P is usable in batch T iff 0 <= (T-1) - P <= max_lag (0: on-policy)."""
    max_batches_ahead: int = 1
    """The BatchMaker writes batch T only while T <= learner_step + max_batches_ahead."""
    advantage_estimator: str = "rloo"
    """One of rloo, grpo, dr_grpo."""
    filter_zero_variance: bool = True
    """Drop groups whose rewards are all equal (no learning signal)."""
    no_signal_fill_after: int = 4
    """With filter_zero_variance: once this many rollout files read for one batch slot had every group filtered
    (a solved or hopeless task), or fewer such files holding a batch of rows, admit the next files' groups with
    advantage 0 so the slot fills and the learner keeps stepping (logged; counted in the slot's log entry). 0: never
    (wait, then fail after max_batch_latency_s)."""
    replay_buffer_capacity: int = 4096
    """Maximum rollouts held for sampling; the oldest are dropped (reason: evicted) beyond it."""
    replay_buffer_alpha: float = 3.0
    """Recency bias: sampling weight ∝ (1 + rank_from_oldest/n)^alpha; 0 is uniform."""
    max_samples_per_rollout: int = 1
    """How many batches one rollout may appear in."""
    max_batch_latency_s: float = 600.0
    """Longest the BatchMaker waits to fill a batch before failing loudly."""
    overlong: str = "truncate"
    """A response longer than fits in seq_len: 'truncate' (recorded) or 'drop' (recorded)."""
    seed: int = 0
    """Seeds the BatchMaker's replay-buffer draws (per batch slot)."""
    microbatch_size: int | None = None
    """Learner rows per forward/backward pass: the batch slot is split into batch_size / microbatch_size pieces
    whose gradients are accumulated into one optimizer step with the loss of the whole slot (token-level
    aggregation divides by the slot's loss tokens, sequence-level by its sequences). None: the whole slot.
    With `minibatches_per_slot` > 1 it splits each minibatch (batch_size / minibatches_per_slot rows) instead."""
    minibatches_per_slot: int = 1
    """Optimizer updates per pass over a batch slot: the slot's rows are split into this many minibatches (rows
    i, i+k, i+2k, … for k minibatches), each one optimizer update. The learner step is still the slot: policy
    T is published after all of slot T's updates."""
    ppo_epochs: int = 1
    """Passes over each batch slot's minibatches: a slot makes ppo_epochs × minibatches_per_slot optimizer
    updates. After the first update the policy differs from the one that sampled, so the importance ratio
    (always to the pre-update policy: the sampler's logprobs, or with `loss.tis_cap` the learner's own logprobs
    at the start of the slot) moves and clipping acts; `ppo_critic`'s values, GAE advantages and returns are
    likewise fixed at the start of the slot, so its value clip acts too. The learning-rate schedule stays counted
    in slots: every update of slot T uses the rate of step T."""

    def __post_init__(self) -> None:
        at_least(self, 1, "microbatch_size", or_null=True)
        at_least(self, 1, "ppo_epochs", "minibatches_per_slot", "num_train_steps", "batch_size")
        at_least(self, 2, "seq_len")
        at_least(self, 1, "pad_multiple")
        at_least(self, 0, "max_lag")
        at_least(self, 1, "max_batches_ahead")
        require(
            self.advantage_estimator in ADVANTAGE_ESTIMATORS,
            "train.advantage_estimator",
            self.advantage_estimator,
            f"must be one of {ADVANTAGE_ESTIMATORS}",
        )
        at_least(self, 1, "replay_buffer_capacity")
        at_least(self, 0, "replay_buffer_alpha")
        at_least(self, 1, "max_samples_per_rollout")
        require(
            self.no_signal_fill_after >= 0,
            "train.no_signal_fill_after",
            self.no_signal_fill_after,
            "must be >= 0 (0: never fill)",
        )
        positive(self, "max_batch_latency_s")
        require(self.overlong in OVERLONG_RULES, "train.overlong", self.overlong, f"must be one of {OVERLONG_RULES}")


# ---------------------------------------------------------------------------------------
# learner: optimizer and loss modules
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW with warmup and cosine decay."""

    SECTION: ClassVar[str] = "optimizer"

    learning_rate: float = 1e-3
    """Peak learning rate (reached after warmup)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.99
    """Adam's second-moment decay."""
    epsilon: float = 1e-8
    """Adam's denominator epsilon."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to learning_rate."""
    min_lr_ratio: float = 1.0
    """Final LR as a fraction of learning_rate (1.0: constant after warmup)."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; None: no clipping."""

    def __post_init__(self) -> None:
        positive(self, "learning_rate")
        at_least(self, 0, "warmup_steps")
        in_range(self, 0, 1, "min_lr_ratio")


KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token", "sequence")
RATIO_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class DistillConfig:
    """On-policy distillation (`loss.distill`): the learner scores every sampled token with a frozen teacher, as it
    does with the KL reference, and trains on the per-token reverse-KL advantage
    A_t = coef · (log π_teacher(y_t) − log π_student(y_t)) + rl_coef · A_rl (the batch's RL advantage), with any
    loss type (docs/guides/distillation.md)."""

    SECTION: ClassVar[str] = "loss.distill"

    teacher: str = ""
    """The teacher: a run root (local or gs://; its newest committed policy), one of its `policies/step-S` folders
    (the student's shape and tokenizer), or a Hugging Face folder (one with a config.json: the student's family
    and vocabulary, any size). Checked before anything starts."""
    coef: float = 1.0
    """Weight of the reverse-KL (distillation) advantage."""
    rl_coef: float = 0.0
    """Weight of the batch's RL advantage (RLOO, GRPO, ...) added to it: 0 is pure on-policy distillation (no
    reward needed; set `train.filter_zero_variance: false` so groups of equal rewards still reach the learner)."""

    def __post_init__(self) -> None:
        require(bool(self.teacher), "loss.distill.teacher", self.teacher, "must name a run root, policy or HF folder")
        positive(self, "coef")
        at_least(self, 0, "rl_coef")


@dataclass(frozen=True)
class LossConfig(draccus.ChoiceRegistry):
    """A registered RL loss module, chosen once from config (`type:` rloo, ppo, gspo, cispo or ppo_critic)."""

    SECTION: ClassVar[str] = "loss"

    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference model; 0 builds no reference model at all."""
    kl_estimator: str = "k3"
    """k1 (log ratio), k2 (squared log ratio / 2) or k3 (ratio - 1 - log ratio, non-negative)."""
    aggregation: str = "token"
    """'token': mean over all loss tokens of the batch; 'sequence': mean over sequences of per-sequence means."""
    max_log_ratio: float = 20.0
    """Learner/sampler log-ratios are clamped to [-max_log_ratio, max_log_ratio] before exp (float32 overflows
    past ~88); clamped tokens get no gradient through the ratio and are counted (metric clamped_fraction)."""
    tis_cap: float | None = None
    """Truncated importance sampling (rollout correction): weight the policy term by min(π_learner_old/π_sampler,
    cap); None: off. When set, the loss's own ratio (rloo/ppo: the clipped token ratio; gspo: the sequence ratio;
    cispo: the clipped weight's ratio) is taken to the learner's pre-update policy (stop-gradient), not to the
    sampler: with one optimizer update per batch slot it is exactly 1, so clipping never acts (clip_fraction 0);
    with several (`train.ppo_epochs`, `train.minibatches_per_slot`) it is taken to the learner's policy before
    the slot's first update, and clipping acts. Per loss: see docs/guides/distillation.md#rollout-correction."""
    tis_level: str = "token"
    """Level of the TIS weight (with tis_cap): 'token' weighs each token by its own capped ratio (gspo: each
    response by its length-normalised ratio (Π_t π_learner_old/π_sampler)^(1/|y|), like its own ratio);
    'sequence' weighs every token of a response by min(Π_t π_learner_old/π_sampler, cap) over the response's
    loss tokens (sequence-level TIS)."""
    mis_level: str | None = None
    """Masked importance sampling (rollout correction by rejection): 'token' drops every token whose ratio
    π_learner_old/π_sampler lies outside [mis_low, mis_high] from the loss, 'sequence' drops every response whose
    sequence ratio Π_t π_learner_old/π_sampler does; dropped tokens leave the denominator too (gspo: a response's
    sequence ratio is then over its kept tokens). None: off."""
    mis_low: float = 0.5
    """Lower ratio bound of masked IS (0: no lower bound)."""
    mis_high: float = 2.0
    """Upper ratio bound of masked IS."""
    distill: DistillConfig | None = None
    """On-policy distillation from a teacher policy (see `DistillConfig`, docs/guides/distillation.md); None: off."""

    def __post_init__(self) -> None:
        at_least(self, 0, "kl_coef")
        positive(self, "max_log_ratio")
        one_of(self, "kl_estimator", KL_ESTIMATORS)
        one_of(self, "aggregation", AGGREGATIONS)
        at_least(self, 1, "tis_cap", or_null=True)
        one_of(self, "tis_level", RATIO_LEVELS)
        require(
            self.tis_level == "token" or self.tis_cap is not None,
            "loss.tis_level",
            self.tis_level,
            "'sequence' needs loss.tis_cap",
        )
        require(
            self.mis_level is None or self.mis_level in RATIO_LEVELS,
            "loss.mis_level",
            self.mis_level,
            f"one of {RATIO_LEVELS} or null",
        )
        in_range(self, 0, 1, "mis_low")
        at_least(self, 1, "mis_high")

    default_choice_name = default_choice("rloo")


@dataclass(frozen=True)
class ClippedTokenLossConfig(LossConfig):
    """The token-level PPO clip's shared field (rloo, ppo)."""

    dual_clip: float | None = None
    """Dual clip c (> 1; None: off): a token with negative advantage contributes at least c·A, so a ratio far above
    1 (a stale row the policy now much prefers) cannot make its loss, or its gradient, unbounded; such tokens get
    no gradient (metric `dual_clip_fraction`). 3 in the paper that introduced it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.dual_clip is None or self.dual_clip > 1, "loss.dual_clip", self.dual_clip, "must be > 1 or null")


@LossConfig.register_subclass("rloo")
@dataclass(frozen=True)
class RLOOLossConfig(ClippedTokenLossConfig):
    """RLOO advantages with a PPO-style clipped importance ratio (clip-higher)."""

    clip_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 - ε_low."""
    clip_high: float = 0.28
    """ε_high: the ratio is clipped above at 1 + ε_high (clip-higher)."""
    overlong_filter: bool = False
    """Zero the loss of truncated responses (overlong filtering)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.clip_low < 1, "loss.clip_low", self.clip_low, "must be in [0, 1)")
        at_least(self, 0, "clip_high")


@LossConfig.register_subclass("ppo")
@dataclass(frozen=True)
class PPOClipLossConfig(ClippedTokenLossConfig):
    """Plain PPO-clip with a symmetric clip range."""

    clip_epsilon: float = 0.2
    """ε: the ratio is clipped to [1 - ε, 1 + ε]."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 < self.clip_epsilon < 1, "loss.clip_epsilon", self.clip_epsilon, "must be in (0, 1)")


@LossConfig.register_subclass("gspo")
@dataclass(frozen=True)
class GSPOLossConfig(LossConfig):
    """GSPO: the sequence-level ratio s_i = (π_θ(y_i|x)/π_sampler(y_i|x))^(1/|y_i|), clipped per sequence,
    averaged over sequences. With `tis_cap`, s_i is taken to the learner's pre-update policy and the sampler
    mismatch corrected by a per-response capped weight."""

    aggregation: str = "sequence"
    """Must be 'sequence': GSPO's objective is a mean over sequences (the KL term, if any, follows it)."""
    clip_low: float = 3e-4
    """ε_low: s_i is clipped below at 1 - ε_low (sequence-level ratios stay near 1, hence a small range)."""
    clip_high: float = 4e-4
    """ε_high: s_i is clipped above at 1 + ε_high."""
    overlong_filter: bool = False
    """Zero the loss of truncated responses (overlong filtering)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.aggregation == "sequence", "loss.aggregation", self.aggregation, "GSPO needs 'sequence'")
        require(0 <= self.clip_low < 1, "loss.clip_low", self.clip_low, "must be in [0, 1)")
        at_least(self, 0, "clip_high")


@LossConfig.register_subclass("cispo")
@dataclass(frozen=True)
class CISPOLossConfig(LossConfig):
    """CISPO: every token's A·log π_θ weighted by sg(clip(π_θ/π_sampler, 1 - ε_low, 1 + ε_high)); token-level
    aggregation by default. With `tis_cap`, the clipped weight's ratio is to the learner's pre-update policy and
    the sampler mismatch corrected by a capped TIS weight on top."""

    clip_low: float = 1.0
    """ε_low: the weight is clipped below at 1 - ε_low; 1.0 (the default) sets no lower bound."""
    clip_high: float = 0.28
    """ε_high: the weight is clipped above at 1 + ε_high."""
    overlong_filter: bool = False
    """Zero the loss of truncated responses (overlong filtering)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        in_range(self, 0, 1, "clip_low")
        at_least(self, 0, "clip_high")


@LossConfig.register_subclass("ppo_critic")
@dataclass(frozen=True)
class CriticPPOLossConfig(LossConfig):
    """Critic PPO (actor-critic, as NeMo-RL / AReaL / SkyRL / verl's `gae` estimator): a value head on the
    policy's final hidden states, GAE(γ, λ) advantages computed by the learner from the rollouts' per-token rewards
    (`token_rewards`, which carry the episode reward on the last policy token plus any process rewards of the
    environment), the PPO clip with a symmetric ε to the sampler, and a clipped value loss weighted by `vf_coef`.
    The batch's RLOO/GRPO advantage is not used (docs/guides/critic-ppo.md)."""

    clip_epsilon: float = 0.2
    """ε: the policy ratio is clipped to [1 - ε, 1 + ε]."""
    gamma: float = 1.0
    """γ: discount per policy (loss) token; tool and environment tokens are not steps of the MDP."""
    lam: float = 0.95
    """λ of GAE: 1 gives Monte-Carlo returns minus V (high variance), 0 one-step TD errors (high bias)."""
    value_clip: float | None = 0.2
    """ε_v: the new value is clipped to V_old ± ε_v and the larger of the two squared errors taken (the PPO
    reference implementation's value clipping); None: the plain squared error. V_old is the critic before the
    slot's first update, so the clip acts only with several updates per slot (`train.ppo_epochs`,
    `train.minibatches_per_slot`)."""
    vf_coef: float = 0.1
    """Weight of the value loss in the total loss (the value head shares the policy's trunk)."""
    whiten_advantages: bool = True
    """Normalise the GAE advantages to mean 0 and standard deviation 1 over the loss tokens of the slot (with one
    update per slot and `train.microbatch_size` set: of each microbatch; with several updates per slot: of the
    whole slot, once, before its first update), as verl and TRL do; the value targets stay unwhitened."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 < self.clip_epsilon < 1, "loss.clip_epsilon", self.clip_epsilon, "must be in (0, 1)")
        in_range(self, 0, 1, "gamma", "lam")
        require(self.value_clip is None or self.value_clip > 0, "loss.value_clip", self.value_clip, "must be > 0")
        positive(self, "vf_coef")
        require(self.mis_level is None, "loss.mis_level", self.mis_level, "is not supported by ppo_critic (null)")
