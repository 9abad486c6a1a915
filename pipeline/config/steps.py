"""Per-step configs (what `RLJob.to_worker_configs()` produces; each step's `main()` takes one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import draccus

from pipeline.config.base import ConfigError, at_least, default_choice, positive, require
from pipeline.config.curriculum import CurriculumConfig, LessonConfig
from pipeline.config.mesh import DistributedConfig, MeshConfig
from pipeline.config.model import DenseInferenceConfig, InferenceConfig, ModelSpec
from pipeline.config.pacing import LearnerCadence, PollingConfig, RolloutPacing
from pipeline.config.train import LossConfig, OptimizerSpec, RLOOLossConfig, TrainParams

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
        require(bool(self.run_root), "run_root", self.run_root, "must be non-empty")


@dataclass(frozen=True)
class BatchMakerStepConfig:
    """`python -m steps.make_batches`."""

    store: StoreConfig = field(default_factory=StoreConfig)
    """The run root."""
    train: TrainParams = field(default_factory=TrainParams)
    """Batch shape, staleness window and reuse (must match the learner's: part of run.json's contract)."""
    curriculum: CurriculumConfig | None = None
    """When set, the BatchMaker also folds and publishes curriculum state (the one writer)."""
    follow: bool = False
    """Run until the learner reaches num_train_steps or control/STOP appears."""
    max_batches: int | None = None
    """Bounded mode: write at most this many batches, then exit (a rerun continues)."""
    polling: PollingConfig = field(default_factory=PollingConfig)
    """How often the BatchMaker lists the run root again while waiting for rollout files or for the learner."""
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
        at_least(self, 0, "read_ahead")
        positive(self, "lease_ttl_s")
        at_least(self, 0, "late_sweep_folders")
        bounded = self.max_batches is None or self.max_batches >= 1
        require(bounded, "max_batches", self.max_batches, "must be >= 1 or null")


WANDB_MODES = ("offline", "online", "disabled")


@dataclass(frozen=True)
class TrackerConfig(draccus.ChoiceRegistry):
    """An optional experiment tracker for the learner's per-step metrics, through levanter's trackers (the run
    root's metrics files and `make report` need none). A registered choice: `tracker: {type: json}` in YAML,
    `--tracker.type tensorboard` on the command line; `policy.trackers` builds the tracker of each type."""

    name: str | None = None
    """Run name in the tracker; None: the run root's last path component."""

    default_choice_name = default_choice("none")


@TrackerConfig.register_subclass("none")
@dataclass(frozen=True)
class NoTrackerConfig(TrackerConfig):
    """No tracker (the default)."""


@TrackerConfig.register_subclass("json")
@dataclass(frozen=True)
class JsonTrackerConfig(TrackerConfig):
    """levanter's JSON-lines logger, into the learner's log."""


@TrackerConfig.register_subclass("tensorboard")
@dataclass(frozen=True)
class TensorboardTrackerConfig(TrackerConfig):
    """TensorBoard event files under `<logdir>/<run name>/`."""

    logdir: str | None = None
    """Local folder for the event files; None: `<run root>/trackers` for a local run root, else ./trackers."""


@TrackerConfig.register_subclass("wandb")
@dataclass(frozen=True)
class WandbTrackerConfig(TrackerConfig):
    """Weights & Biases."""

    logdir: str | None = None
    """Local folder for wandb files; None: `<run root>/trackers` for a local run root, else ./trackers."""
    project: str = "rlpipe"
    """wandb project."""
    mode: str = "offline"
    """wandb mode: 'offline' (files only; `wandb sync` uploads them later), 'online' or 'disabled'."""

    def __post_init__(self) -> None:
        require(self.mode in WANDB_MODES, "tracker.mode", self.mode, f"must be one of {WANDB_MODES}")


@dataclass(frozen=True)
class LearnerStepConfig:
    """`python -m steps.learn`."""

    store: StoreConfig = field(default_factory=StoreConfig)
    """The run root."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """The model trained (and the tokenizer)."""
    train: TrainParams = field(default_factory=TrainParams)
    """Number of steps, batch shape and the updates per batch slot."""
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    """The optimizer and learning-rate schedule."""
    loss: LossConfig = field(default_factory=RLOOLossConfig)
    """The RL loss module (a registered choice, `--loss.type`)."""
    tracker: TrackerConfig = field(default_factory=NoTrackerConfig)
    """Optional experiment tracker (levanter's json / tensorboard / wandb) for the learner's metrics."""
    cadence: LearnerCadence = field(default_factory=LearnerCadence)
    """How often policies and checkpoints are written, and how long the next batch is waited for."""
    polling: PollingConfig = field(default_factory=PollingConfig)
    """How often the learner looks for the next batch while waiting."""
    keep_checkpoints: int = 2
    """Full checkpoints kept (older ones are garbage collected); policies are deleted only by retention."""
    max_steps: int | None = None
    """Bounded mode: train at most this many steps in this process, then exit."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Device mesh of the learner (data × fsdp × model), see `pipeline.config.mesh`."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Multi-host start-up (coordinator address, process count and id)."""
    final_eval_wait_s: float = 0.0
    """With a tracker: after the final step, wait up to this long for the final policy's evaluations and forward
    them before the tracker run closes (the job runner sets it when it runs an evaluator; 0: close at once)."""

    def __post_init__(self) -> None:
        at_least(self, 0, "final_eval_wait_s")
        at_least(self, 1, "keep_checkpoints")
        at_least(self, 1, "max_steps", or_null=True)


@dataclass(frozen=True)
class RolloutStepConfig:
    """`python -m steps.rollout`."""

    store: StoreConfig = field(default_factory=StoreConfig)
    """The run root."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """The policy model the worker samples from (weights: the newest committed policy)."""
    inference: InferenceConfig = field(default_factory=DenseInferenceConfig)
    """The inference backend that generates completions (a registered choice, `--inference.type`)."""
    curriculum: CurriculumConfig = field(
        default_factory=lambda: CurriculumConfig(lessons={"cats": LessonConfig(lesson_id="cats")})
    )
    """The lessons the worker samples from and their sampling parameters."""
    train: TrainParams = field(default_factory=TrainParams)
    """The batch shape and staleness window: what pacing counts rollouts against."""
    worker_id: str = "worker0"
    """Names this worker's rollout files (`<worker_id>.<instance>-<seq>`) and metrics; one path component."""
    follow: bool = True
    """Keep sampling until the learner finishes or control/STOP appears (else stop at a bound)."""
    max_rollouts: int | None = None
    """Bounded mode: stop after writing this many rollout rows."""
    max_seconds: float | None = None
    """Bounded mode: stop after this long."""
    pacing: RolloutPacing = field(default_factory=RolloutPacing)
    """How far this worker may run ahead of the learner."""
    polling: PollingConfig = field(default_factory=PollingConfig)
    """How often the worker looks for a newer policy while paused."""
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
        from pipeline.store.layout import check_component

        try:
            check_component(self.worker_id, "worker_id")
        except ValueError as e:
            raise ConfigError("worker_id", self.worker_id, str(e)) from None
        bounded = self.max_rollouts is None or self.max_rollouts >= 1
        require(bounded, "max_rollouts", self.max_rollouts, "must be >= 1 or null")
        require(
            self.max_seconds is None or self.max_seconds > 0, "max_seconds", self.max_seconds, "must be > 0 or null"
        )
        for name in ("weight_load_timeout_s", "generation_timeout_s", "write_timeout_s", "wait_for_policy_timeout_s"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        at_least(self, 0, "max_example_retries")


@dataclass(frozen=True)
class EvaluateTargets:
    """What an evaluation evaluates: the evaluator's config and the `python -m steps.evaluate` command's flags."""

    steps: list[int] = field(default_factory=list)
    """Policy steps to evaluate: `3,5` or `[3,5]`."""
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


@dataclass(frozen=True)
class EvaluateStepConfig(EvaluateTargets):
    """`python -m steps.evaluate`."""

    store: StoreConfig = field(default_factory=StoreConfig)
    """The run root whose policies are evaluated."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """The policy model (weights: each evaluated policy)."""
    inference: InferenceConfig = field(default_factory=DenseInferenceConfig)
    """The inference backend that generates the evaluated completions."""
    curriculum: CurriculumConfig = field(
        default_factory=lambda: CurriculumConfig(lessons={"cats": LessonConfig(lesson_id="cats")})
    )
    """The lessons evaluated, their evaluation sampling and example counts."""
    stop_after_step: int | None = None
    """Follow mode: exit once this policy step (the last of training) is evaluated."""
    polling: PollingConfig = field(default_factory=lambda: PollingConfig(interval_s=1.0))
    """Follow mode: how often the evaluator looks for new policies."""
    seed: int = 0
    """Seeds example choice per lesson: every policy is scored on the same examples."""

    def __post_init__(self) -> None:
        require(all(s >= 0 for s in self.steps), "steps", self.steps, "policy steps must be >= 0")
        at_least(self, 1, "n_examples", or_null=True)
        at_least(self, 0, "stop_after_step", or_null=True)


@dataclass(frozen=True)
class EvaluateCommand(EvaluateTargets):
    """`python -m steps.evaluate --store.run_root R …` (`make evaluate`): evaluate policies of an existing run with
    the model, curriculum, inference and seed its run.json records; these flags say only what to evaluate."""

    store: StoreConfig = field(default_factory=StoreConfig)
    """The run root whose policies are evaluated (it must hold run.json)."""
