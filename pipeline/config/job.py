"""`RLJobConfig`: one config for a whole run (`configs/*.yaml`, `python -m steps.run`).

It composes every part of a run (model, tokenizer, optimizer, TrainParams, curriculum, loss module, inference,
workers, run root) and the parameter objects it shares with the step configs (`cadence`, `polling`, `pacing`,
`pipeline.config.pacing`). `pipeline.jobs.job.RLJob` validates it (`pipeline.config.validate.validate_job`) and
splits it into the step configs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config.backend import JobBackendConfig, LocalBackendConfig
from pipeline.config.base import at_least, require
from pipeline.config.curriculum import CurriculumConfig, LessonConfig
from pipeline.config.mesh import LearnerPlacement
from pipeline.config.model import DenseInferenceConfig, InferenceConfig, ModelSpec
from pipeline.config.pacing import LearnerCadence, PollingConfig, RolloutPacing, RolloutPoolConfig
from pipeline.config.retention import RetentionConfig
from pipeline.config.steps import NoTrackerConfig, StoreConfig, TrackerConfig
from pipeline.config.train import LossConfig, OptimizerSpec, RLOOLossConfig, TrainParams


@dataclass(frozen=True)
class RLJobConfig:
    """A complete RL training job."""

    store: StoreConfig = field(default_factory=StoreConfig)
    """Where the run root lives (every step's files)."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """The policy model and tokenizer (learner, rollout workers and evaluator)."""
    train: TrainParams = field(default_factory=TrainParams)
    """What the BatchMaker and the learner agree on: number of steps, batch shape, staleness, reuse."""
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    """The learner's optimizer and learning-rate schedule."""
    loss: LossConfig = field(default_factory=RLOOLossConfig)
    """The RL loss module, a registered choice (`loss: {type: rloo}`; see the loss types)."""
    curriculum: CurriculumConfig = field(
        default_factory=lambda: CurriculumConfig(lessons={"cats": LessonConfig(lesson_id="cats")})
    )
    """Lessons (environments), their dependencies, sampling and evaluation."""
    inference: InferenceConfig = field(default_factory=DenseInferenceConfig)
    """How rollout workers and the evaluator generate completions, a registered choice (`inference: {type: dense}`)."""
    tracker: TrackerConfig = field(default_factory=NoTrackerConfig)
    """Optional experiment tracker (levanter's json / tensorboard / wandb) for the learner's metrics."""
    num_rollout_workers: int = 2
    """Rollout worker processes (at the start, with an elastic `rollout_pool`)."""
    rollout_pool: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)
    """An elastic rollout pool: with `rollout_pool.enabled`, the job runner adds a worker while the learner waits
    for batches and removes one while workers are paused by pacing or waste is high (`pipeline.jobs.pool`)."""
    evaluator: bool = True
    """Run the evaluate step alongside (follow mode): full evaluation per curriculum.eval_frequency."""
    cadence: LearnerCadence = field(default_factory=LearnerCadence)
    """The learner's policy and checkpoint intervals and its batch wait timeout (the learner step's `cadence`)."""
    polling: PollingConfig = field(default_factory=PollingConfig)
    """How often the learner, the BatchMaker and the rollout workers look again while waiting (their `polling`;
    the evaluator polls every second)."""
    pacing: RolloutPacing = field(default_factory=RolloutPacing)
    """How far rollout workers may run ahead of the learner (the rollout step's `pacing`)."""
    backend: JobBackendConfig = field(default_factory=LocalBackendConfig)
    """Where the steps run: `{type: local}` (child processes) or `{type: ray, address, resources}` (Ray tasks)."""
    max_restarts: int = 5
    """Restarts per step before the job fails."""
    restart_backoff_s: float = 1.0
    """First restart delay; doubles per restart of the same step (up to `restart_backoff_max_s`)."""
    restart_backoff_max_s: float = 30.0
    """Longest restart delay."""
    seed: int = 0
    """Seeds example choice: rollout worker i gets seed × 1000 + i, the evaluator gets seed."""
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    """What garbage collection keeps; with `retention.enabled` the job runner collects every few slots
    (`pipeline.retention`)."""
    learner: LearnerPlacement = field(default_factory=LearnerPlacement)
    """The learner's device mesh and process count (`learner: {mesh: {data, fsdp, model}, num_processes}`)."""

    def __post_init__(self) -> None:
        at_least(self, 1, "num_rollout_workers")
        if self.rollout_pool.enabled:
            pool = self.rollout_pool
            require(
                pool.min_workers <= self.num_rollout_workers <= pool.max_workers,
                "num_rollout_workers",
                self.num_rollout_workers,
                f"must lie within rollout_pool.min_workers..max_workers ({pool.min_workers}..{pool.max_workers}): "
                "the pool starts with num_rollout_workers",
            )
        at_least(self, 0, "max_restarts", "restart_backoff_s")
