"""The configuration tree of rlpipe: frozen draccus dataclasses, validated when built.

Every error names the offending field (dotted path) and its value. Configs are composed,
not subclassed; a choice between real variants (loss modules) is a registered subclass.
Importable without JAX: the JAX side (steps/) turns these into levanter objects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import draccus


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the value."""

    def __init__(self, field_name: str, value: Any, why: str) -> None:
        super().__init__(f"{field_name}={value!r}: {why}")
        self.field = field_name
        self.value = value


def _require(cond: bool, field_name: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(field_name, value, why)


# ---------------------------------------------------------------------------------------
# sampling and curriculum
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """How rollouts are sampled from an environment."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    n_prompts: int = 8
    """Prompts (examples) per rollout write."""
    n_generations_per_prompt: int = 4
    """Completions per prompt: the RLOO/GRPO group size."""
    max_tokens: int = 32
    """Maximum new tokens per completion (per turn in multi-turn environments)."""
    stop_tokens: tuple[int, ...] | None = None
    """Token ids that end a completion (the stop token is kept in the output); None: the tokenizer's EOS."""

    def __post_init__(self) -> None:
        _require(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _require(self.n_prompts >= 1, "n_prompts", self.n_prompts, "must be >= 1")
        _require(
            self.n_generations_per_prompt >= 1,
            "n_generations_per_prompt",
            self.n_generations_per_prompt,
            "must be >= 1",
        )
        _require(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")


@dataclass(frozen=True)
class EnvConfig:
    """An environment named by dotted class path plus keyword arguments."""

    env_class: str = "pipeline.environments.cats.CatsEnv"
    """Dotted path `package.module.Class` of an `Environment` subclass."""
    env_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the class."""

    def __post_init__(self) -> None:
        _require(
            "." in self.env_class and not self.env_class.startswith("."),
            "env_class",
            self.env_class,
            "must be a dotted path like 'package.module.ClassName'",
        )


@dataclass(frozen=True)
class LessonDependency:
    """A lesson unlocks only when `dependency_id` reached `reward_threshold` and plateaued."""

    dependency_id: str
    reward_threshold: float = 0.8

    def __post_init__(self) -> None:
        _require(bool(self.dependency_id), "dependencies.dependency_id", self.dependency_id, "must be non-empty")
        _require(
            0.0 <= self.reward_threshold <= 1.0,
            f"dependencies.{self.dependency_id}.reward_threshold",
            self.reward_threshold,
            "must be in [0, 1]",
        )


@dataclass(frozen=True)
class LessonConfig:
    """One lesson of the curriculum."""

    lesson_id: str
    env: EnvConfig = field(default_factory=EnvConfig)
    dependencies: list[LessonDependency] = field(default_factory=list)
    start_threshold: float = 0.0
    """Eval success needed before an unlocked lesson becomes active (is sampled for training)."""
    stop_threshold: float = 1.0
    """Eval success at which a plateaued lesson graduates (stops being sampled, except the floor)."""
    plateau_window: int = 50
    """Number of most recent rewards the plateau regression looks at."""
    plateau_threshold: float = 0.01
    """|slope| × window below which the lesson counts as plateaued."""
    sampling_params: SamplingParams | None = None
    """Per-lesson training sampling; None: the curriculum's default."""
    eval_sampling_params: SamplingParams | None = None
    """Per-lesson evaluation sampling; None: the curriculum's eval default."""

    def __post_init__(self) -> None:
        _require(bool(self.lesson_id), "lesson_id", self.lesson_id, "must be non-empty")
        from pipeline.layout import check_component

        try:
            check_component(self.lesson_id, "lesson_id")  # it names eval files
        except ValueError as e:
            raise ConfigError(f"lessons.{self.lesson_id}.lesson_id", self.lesson_id, str(e)) from None
        for name in ("start_threshold", "stop_threshold"):
            v = getattr(self, name)
            _require(0.0 <= v <= 1.0, f"lessons.{self.lesson_id}.{name}", v, "must be in [0, 1]")
        _require(
            self.plateau_window >= 2,
            f"lessons.{self.lesson_id}.plateau_window",
            self.plateau_window,
            "must be >= 2",
        )
        _require(
            self.plateau_threshold >= 0.0,
            f"lessons.{self.lesson_id}.plateau_threshold",
            self.plateau_threshold,
            "must be >= 0",
        )


@dataclass(frozen=True)
class CurriculumConfig:
    """Lessons, their dependency DAG, and how often they are evaluated."""

    lessons: dict[str, LessonConfig] = field(default_factory=dict)
    eval_frequency: int = 10
    """Full evaluation of every lesson every this many policy steps (0: never)."""
    eval_n_examples: int = 16
    micro_eval_frequency: int = 0
    """Micro-evaluation of the sampled lesson every this many rollout writes (0: never). Logged only."""
    micro_eval_n_examples: int = 4
    minimum_sample_probability: float = 0.02
    """Floor of every active or graduated lesson's sampling probability (graduated lessons get exactly this)."""
    default_sampling: SamplingParams = field(default_factory=SamplingParams)
    eval_sampling: SamplingParams = field(
        default_factory=lambda: SamplingParams(temperature=0.0, n_prompts=16, n_generations_per_prompt=1)
    )
    seed: int = 0

    def __post_init__(self) -> None:
        _require(len(self.lessons) > 0, "curriculum.lessons", self.lessons, "must hold at least one lesson")
        for key, lesson in self.lessons.items():
            _require(
                key == lesson.lesson_id,
                f"curriculum.lessons.{key}.lesson_id",
                lesson.lesson_id,
                f"must equal its key {key!r}",
            )
            for dep in lesson.dependencies:
                _require(
                    dep.dependency_id in self.lessons,
                    f"curriculum.lessons.{key}.dependencies",
                    dep.dependency_id,
                    "names an unknown lesson",
                )
        cycle = find_cycle({k: [d.dependency_id for d in v.dependencies] for k, v in self.lessons.items()})
        if cycle:
            raise ConfigError(
                f"curriculum.lessons.{cycle[0]}.dependencies",
                cycle[0],
                "dependency cycle: " + " -> ".join(cycle),
            )
        _require(
            0.0 <= self.minimum_sample_probability * len(self.lessons) <= 1.0,
            "curriculum.minimum_sample_probability",
            self.minimum_sample_probability,
            "times the number of lessons must be in [0, 1]",
        )
        roots = sorted(k for k, v in self.lessons.items() if not v.dependencies)
        _require(
            any(self.lessons[k].start_threshold == 0.0 for k in roots),
            "curriculum.lessons",
            {k: self.lessons[k].start_threshold for k in roots},
            "some lesson without dependencies must have start_threshold 0, or nothing can be sampled before the "
            "first evaluation",
        )

    def sampling_for(self, lesson_id: str) -> SamplingParams:
        """Training sampling params of a lesson (its override or the default)."""
        return self.lessons[lesson_id].sampling_params or self.default_sampling

    def eval_sampling_for(self, lesson_id: str) -> SamplingParams:
        """Evaluation sampling params of a lesson (its override or the eval default)."""
        return self.lessons[lesson_id].eval_sampling_params or self.eval_sampling


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """A dependency cycle as a node list that starts and ends at the same node, or None."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if color.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if color.get(nxt, 0) == 0:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = 2
        return None

    for n in sorted(graph):
        if color.get(n, 0) == 0:
            found = visit(n)
            if found:
                return found
    return None


# ---------------------------------------------------------------------------------------
# batching (TrainParams)
# ---------------------------------------------------------------------------------------

ADVANTAGE_ESTIMATORS = ("rloo", "grpo", "dr_grpo")
OVERLONG_RULES = ("truncate", "drop")


@dataclass(frozen=True)
class TrainParams:
    """What the BatchMaker and the learner agree on: batch shape, staleness, reuse."""

    num_train_steps: int = 100
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
    (a solved or hopeless task), admit the next files' groups with advantage 0 so the slot fills and the learner
    keeps stepping (logged; counted in the slot's log entry). 0: never (wait, then fail after max_batch_latency_s)."""
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

    def __post_init__(self) -> None:
        _require(self.num_train_steps >= 1, "train.num_train_steps", self.num_train_steps, "must be >= 1")
        _require(self.batch_size >= 1, "train.batch_size", self.batch_size, "must be >= 1")
        _require(self.seq_len >= 2, "train.seq_len", self.seq_len, "must be >= 2")
        _require(
            1 <= self.pad_multiple <= self.seq_len,
            "train.pad_multiple",
            self.pad_multiple,
            "must be in [1, seq_len]",
        )
        _require(self.max_lag >= 0, "train.max_lag", self.max_lag, "must be >= 0")
        _require(self.max_batches_ahead >= 1, "train.max_batches_ahead", self.max_batches_ahead, "must be >= 1")
        _require(
            self.advantage_estimator in ADVANTAGE_ESTIMATORS,
            "train.advantage_estimator",
            self.advantage_estimator,
            f"must be one of {ADVANTAGE_ESTIMATORS}",
        )
        _require(
            self.replay_buffer_capacity >= self.batch_size,
            "train.replay_buffer_capacity",
            self.replay_buffer_capacity,
            "must be >= batch_size",
        )
        _require(self.replay_buffer_alpha >= 0, "train.replay_buffer_alpha", self.replay_buffer_alpha, "must be >= 0")
        _require(
            self.max_samples_per_rollout >= 1,
            "train.max_samples_per_rollout",
            self.max_samples_per_rollout,
            "must be >= 1",
        )
        _require(
            self.no_signal_fill_after >= 0,
            "train.no_signal_fill_after",
            self.no_signal_fill_after,
            "must be >= 0 (0: never fill)",
        )
        _require(self.max_batch_latency_s > 0, "train.max_batch_latency_s", self.max_batch_latency_s, "must be > 0")
        _require(self.overlong in OVERLONG_RULES, "train.overlong", self.overlong, f"must be one of {OVERLONG_RULES}")


# ---------------------------------------------------------------------------------------
# learner: optimizer and loss modules
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW with warmup and cosine decay."""

    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    epsilon: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 1.0
    """Final LR as a fraction of learning_rate (1.0: constant after warmup)."""
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        _require(self.learning_rate > 0, "optimizer.learning_rate", self.learning_rate, "must be > 0")
        _require(self.warmup_steps >= 0, "optimizer.warmup_steps", self.warmup_steps, "must be >= 0")
        _require(0 <= self.min_lr_ratio <= 1, "optimizer.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")


KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token", "sequence")


@dataclass(frozen=True)
class LossConfig(draccus.ChoiceRegistry):
    """A registered RL loss module, chosen once from config (`type:` rloo, ppo, gspo or cispo)."""

    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference model; 0 builds no reference model at all."""
    kl_estimator: str = "k3"
    """k1 (log ratio), k2 (squared log ratio / 2) or k3 (ratio - 1 - log ratio, non-negative)."""
    aggregation: str = "token"
    """'token': mean over all loss tokens of the batch; 'sequence': mean over sequences of per-sequence means."""
    max_log_ratio: float = 20.0
    """Learner/sampler log-ratios are clamped to [-max_log_ratio, max_log_ratio] before exp (float32 overflows
    past ~88); clamped tokens get no gradient through the ratio and are counted (metric clamped_fraction)."""

    def __post_init__(self) -> None:
        _require(self.kl_coef >= 0, "loss.kl_coef", self.kl_coef, "must be >= 0")
        _require(self.max_log_ratio > 0, "loss.max_log_ratio", self.max_log_ratio, "must be > 0")
        _require(self.kl_estimator in KL_ESTIMATORS, "loss.kl_estimator", self.kl_estimator, f"one of {KL_ESTIMATORS}")
        _require(self.aggregation in AGGREGATIONS, "loss.aggregation", self.aggregation, f"one of {AGGREGATIONS}")

    @classmethod
    def default_choice_name(cls) -> str | None:
        return "rloo"


@LossConfig.register_subclass("rloo")
@dataclass(frozen=True)
class RLOOLossConfig(LossConfig):
    """RLOO advantages with a PPO-style clipped importance ratio (clip-higher)."""

    clip_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 - ε_low."""
    clip_high: float = 0.28
    """ε_high: the ratio is clipped above at 1 + ε_high (clip-higher)."""
    tis_cap: float | None = None
    """Truncated importance sampling: weight each token by min(π_learner_old/π_sampler, cap); None: off.
    When set, the clipped ratio is taken to the learner's own pre-update policy (stop-gradient), not to the
    sampler: with one optimizer step per batch it is exactly 1, so clipping never acts (clip_fraction 0)."""
    overlong_filter: bool = False
    """Zero the loss of truncated responses (overlong filtering)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(0 <= self.clip_low < 1, "loss.clip_low", self.clip_low, "must be in [0, 1)")
        _require(self.clip_high >= 0, "loss.clip_high", self.clip_high, "must be >= 0")
        _require(self.tis_cap is None or self.tis_cap >= 1, "loss.tis_cap", self.tis_cap, "must be >= 1 or null")


@LossConfig.register_subclass("ppo")
@dataclass(frozen=True)
class PPOClipLossConfig(LossConfig):
    """Plain PPO-clip with a symmetric clip range."""

    clip_epsilon: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(0 < self.clip_epsilon < 1, "loss.clip_epsilon", self.clip_epsilon, "must be in (0, 1)")


@LossConfig.register_subclass("gspo")
@dataclass(frozen=True)
class GSPOLossConfig(LossConfig):
    """GSPO: the sequence-level ratio s_i = (π_θ(y_i|x)/π_sampler(y_i|x))^(1/|y_i|), clipped per sequence,
    averaged over sequences. No TIS (s_i is already taken to the sampler)."""

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
        _require(self.aggregation == "sequence", "loss.aggregation", self.aggregation, "GSPO needs 'sequence'")
        _require(0 <= self.clip_low < 1, "loss.clip_low", self.clip_low, "must be in [0, 1)")
        _require(self.clip_high >= 0, "loss.clip_high", self.clip_high, "must be >= 0")


@LossConfig.register_subclass("cispo")
@dataclass(frozen=True)
class CISPOLossConfig(LossConfig):
    """CISPO: every token's A·log π_θ weighted by sg(clip(π_θ/π_sampler, 1 - ε_low, 1 + ε_high)); token-level
    aggregation by default. No TIS (the clipped weight is itself a truncated importance weight)."""

    clip_low: float = 1.0
    """ε_low: the weight is clipped below at 1 - ε_low; 1.0 (the default) sets no lower bound."""
    clip_high: float = 0.28
    """ε_high: the weight is clipped above at 1 + ε_high."""
    overlong_filter: bool = False
    """Zero the loss of truncated responses (overlong filtering)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(0 <= self.clip_low <= 1, "loss.clip_low", self.clip_low, "must be in [0, 1]")
        _require(self.clip_high >= 0, "loss.clip_high", self.clip_high, "must be >= 0")


# ---------------------------------------------------------------------------------------
# model, tokenizer, inference
# ---------------------------------------------------------------------------------------

MODEL_FAMILIES = ("llama", "qwen3")


@dataclass(frozen=True)
class ModelSpec:
    """A levanter decoder, built from scratch (tiny configs) or loaded from an HF folder."""

    family: str = "llama"
    hidden_dim: int = 64
    intermediate_dim: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    max_seq_len: int = 256
    hf_checkpoint: str | None = None
    """Local path or gs:// folder of a Hugging Face checkpoint; None: initialise from `seed`."""
    tokenizer: str = "builtin:tiny"
    """A local tokenizer folder, or `builtin:tiny` (built deterministically in code)."""
    seed: int = 0
    compute_dtype: str = "float32"
    """Activation dtype: float32 on CPU, bfloat16 on GPU."""
    attention_backend: str = "default"
    """levanter attention backend: default, vanilla, jax_flash, splash."""

    def __post_init__(self) -> None:
        _require(self.family in MODEL_FAMILIES, "model.family", self.family, f"one of {MODEL_FAMILIES}")
        _require(self.hidden_dim % self.num_heads == 0, "model.hidden_dim", self.hidden_dim, "must divide by num_heads")
        _require(
            self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", self.num_kv_heads, "must divide num_heads"
        )


INFERENCE_BACKENDS = ("levanter", "dense", "openai")


@dataclass(frozen=True)
class InferenceConfig:
    """Which inference backend produces completions, and its sizing."""

    backend: str = "dense"
    """'dense': fixed-shape jitted sampler with a dense KV cache (default);
    'levanter': levanter's InferenceEngine; 'openai': an OpenAI-compatible server."""
    max_seqs: int = 64
    """Most sequences decoded at once."""
    page_size: int = 16
    """levanter engine only: KV page size."""
    openai_base_url: str | None = None
    """openai backend: the server's base URL (e.g. http://localhost:8000/v1)."""
    openai_model: str = "policy"
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        _require(self.backend in INFERENCE_BACKENDS, "inference.backend", self.backend, f"one of {INFERENCE_BACKENDS}")
        _require(
            self.backend != "openai" or bool(self.openai_base_url),
            "inference.openai_base_url",
            self.openai_base_url,
            "is required with backend 'openai'",
        )


def replace(cfg: Any, **changes: Any) -> Any:
    """A copy of a frozen config with fields changed (validated again)."""
    return dataclasses.replace(cfg, **changes)


# ---------------------------------------------------------------------------------------
# per-step configs (what RLJob.to_worker_configs() produces; each step's main() takes one)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreConfig:
    """Where the run root lives."""

    run_root: str = "runs/demo"
    """A local folder, file://, memory:// or gs://bucket/prefix."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options (e.g. gcsfs `endpoint_url`, `token`)."""

    def __post_init__(self) -> None:
        _require(bool(self.run_root), "run_root", self.run_root, "must be non-empty")


@dataclass(frozen=True)
class BatchMakerStepConfig:
    """`python -m steps.make_batches`."""

    store: StoreConfig = field(default_factory=StoreConfig)
    train: TrainParams = field(default_factory=TrainParams)
    curriculum: CurriculumConfig | None = None
    """When set, the BatchMaker also folds and publishes curriculum state (the one writer)."""
    follow: bool = False
    """Run until the learner reaches num_train_steps or control/STOP appears."""
    max_batches: int | None = None
    """Bounded mode: write at most this many batches, then exit (a rerun continues)."""
    poll_interval_s: float = 0.2
    """Seconds between listings while waiting for rollout files or for the learner."""
    read_ahead: int = 2
    """Rollout files read and verified in background threads ahead of the one being ingested (0: none)."""
    write_behind: bool = True
    """Write slot T's batch files and log entry from a background thread while slot T+1 is gathered."""
    late_sweep_folders: int = 2
    """Policy folders below the scan window listed per slot to find late files (0: none; the final slot: all)."""
    lease_ttl_s: float = 30.0
    """The BatchMaker lease expires this long after its last renewal; another maker may then take over."""
    holder_id: str | None = None
    """Lease holder name; None: host-pid."""
    lease_take_over_own: bool = False
    """Take the lease over at once from a live epoch held under this same holder_id (its process is known dead)."""

    def __post_init__(self) -> None:
        _require(self.read_ahead >= 0, "read_ahead", self.read_ahead, "must be >= 0")
        _require(self.poll_interval_s > 0, "poll_interval_s", self.poll_interval_s, "must be > 0")
        _require(self.lease_ttl_s > 0, "lease_ttl_s", self.lease_ttl_s, "must be > 0")
        _require(self.late_sweep_folders >= 0, "late_sweep_folders", self.late_sweep_folders, "must be >= 0")


TRACKER_TYPES = ("none", "json", "tensorboard", "wandb")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass(frozen=True)
class TrackerConfig:
    """An optional experiment tracker for the learner's per-step metrics, through levanter's trackers (the run
    root's metrics files and `make report` need none)."""

    type: str = "none"
    """'none'; 'json' (levanter's JSON-lines logger, into the learner's log); 'tensorboard' (event files); 'wandb'."""
    logdir: str | None = None
    """Local folder for tensorboard / wandb files; None: `<run root>/trackers` for a local run root, else ./trackers."""
    name: str | None = None
    """Run name in the tracker; None: the run root's last path component."""
    project: str = "rlpipe"
    """wandb project."""
    mode: str = "offline"
    """wandb mode: 'offline' (files only; `wandb sync` uploads them later), 'online' or 'disabled'."""

    def __post_init__(self) -> None:
        _require(self.type in TRACKER_TYPES, "tracker.type", self.type, f"must be one of {TRACKER_TYPES}")
        _require(self.mode in WANDB_MODES, "tracker.mode", self.mode, f"must be one of {WANDB_MODES}")


@dataclass(frozen=True)
class LearnerStepConfig:
    """`python -m steps.learn`."""

    store: StoreConfig = field(default_factory=StoreConfig)
    model: ModelSpec = field(default_factory=ModelSpec)
    train: TrainParams = field(default_factory=TrainParams)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    loss: LossConfig = field(default_factory=RLOOLossConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    policy_interval: int = 1
    """Publish a policy every this many steps (and at step 0 and the last step)."""
    checkpoint_interval: int = 10
    """Write a full training checkpoint every this many steps (and at the last step)."""
    keep_checkpoints: int = 2
    """Full checkpoints kept (older ones are garbage collected); policies are all kept."""
    max_steps: int | None = None
    """Bounded mode: train at most this many steps in this process, then exit."""
    batch_wait_timeout_s: float = 600.0
    """Fail loudly, naming the file, when the next batch has not appeared in this long."""
    poll_interval_s: float = 0.2
    """Seconds between checks for the next batch."""

    def __post_init__(self) -> None:
        _require(self.policy_interval >= 1, "policy_interval", self.policy_interval, "must be >= 1")
        _require(self.checkpoint_interval >= 1, "checkpoint_interval", self.checkpoint_interval, "must be >= 1")
        _require(
            self.train.seq_len <= self.model.max_seq_len,
            "train.seq_len",
            self.train.seq_len,
            f"must be <= model.max_seq_len ({self.model.max_seq_len})",
        )


@dataclass(frozen=True)
class RolloutStepConfig:
    """`python -m steps.rollout`."""

    store: StoreConfig = field(default_factory=StoreConfig)
    model: ModelSpec = field(default_factory=ModelSpec)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    curriculum: CurriculumConfig = field(
        default_factory=lambda: CurriculumConfig(lessons={"cats": LessonConfig(lesson_id="cats")})
    )
    train: TrainParams = field(default_factory=TrainParams)
    worker_id: str = "worker0"
    """Names this worker's rollout files (`<worker_id>.<instance>-<seq>`) and metrics; one path component."""
    follow: bool = True
    """Keep sampling until the learner finishes or control/STOP appears (else stop at a bound)."""
    max_rollouts: int | None = None
    """Bounded mode: stop after writing this many rollout rows."""
    max_seconds: float | None = None
    """Bounded mode: stop after this long."""
    max_steps_ahead: int = 1
    """Pause while rollouts from the current policy already cover this many unconsumed batches."""
    poll_interval_s: float = 0.2
    """Seconds between checks for a newer policy while paused."""
    weight_load_timeout_s: float = 300.0
    """Watchdog: a policy load or model update taking longer ends the process loudly (the runner restarts it)."""
    generation_timeout_s: float = 600.0
    """Watchdog for one generation call (and one micro-evaluation)."""
    write_timeout_s: float = 120.0
    """Watchdog for writing and committing one rollout file."""
    wait_for_policy_timeout_s: float = 600.0
    """Fail, naming the marker waited for, when no committed policy appears in this long."""
    max_example_retries: int = 2
    """An example whose environment call failed is re-drawn (a replacement example) up to this many times."""
    seed: int = 0
    """Seeds example choice (mixed with the start time, so restarted workers do not repeat their draws)."""

    def __post_init__(self) -> None:
        from pipeline.layout import check_component

        try:
            check_component(self.worker_id, "worker_id")
        except ValueError as e:
            raise ConfigError("worker_id", self.worker_id, str(e)) from None


@dataclass(frozen=True)
class EvaluateStepConfig:
    """`python -m steps.evaluate`."""

    store: StoreConfig = field(default_factory=StoreConfig)
    model: ModelSpec = field(default_factory=ModelSpec)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    curriculum: CurriculumConfig = field(
        default_factory=lambda: CurriculumConfig(lessons={"cats": LessonConfig(lesson_id="cats")})
    )
    steps: list[int] = field(default_factory=list)
    """Policy steps to evaluate."""
    all: bool = False
    """Evaluate every committed policy."""
    follow: bool = False
    """Evaluate each new policy as it appears, until the learner finishes or control/STOP."""
    hf_checkpoint: str | None = None
    """Evaluate an external HF checkpoint folder as a baseline (written under evals/external-<name>)."""
    force: bool = False
    """Re-evaluate what is already there."""
    n_examples: int | None = None
    """Examples per lesson; None: curriculum.eval_n_examples."""
    stop_after_step: int | None = None
    """Follow mode: exit once this policy step (the last of training) is evaluated."""
    poll_interval_s: float = 1.0
    """Follow mode: seconds between checks for new policies."""
    seed: int = 0
    """Seeds example choice per lesson: every policy is scored on the same examples."""
