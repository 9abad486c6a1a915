"""RLJob: one config for a whole run, validated before anything starts, split into step configs.

`RLJobConfig` composes every part of a run (model, tokenizer, optimizer, TrainParams, curriculum,
loss module, inference, workers, run root). `RLJob(config)` validates the whole tree (field-level
checks live in each dataclass; cross-field checks in `pipeline.config.validate`), `to_worker_configs()` gives
the per-step configs, and `check_run_config()` writes `run.json` once or refuses a run root whose recorded
contract differs, naming every differing field. The process runner lives in `pipeline.runner`; where the steps
run is the `backend` choice (`pipeline.config.backend`, launchers in `pipeline.runners`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import draccus

from pipeline import layout
from pipeline.config import (
    BatchMakerStepConfig,
    ConfigError,
    CurriculumConfig,
    DenseInferenceConfig,
    DistributedConfig,
    EvaluateStepConfig,
    InferenceConfig,
    JobBackendConfig,
    LearnerPlacement,
    LearnerStepConfig,
    LessonConfig,
    LocalBackendConfig,
    LossConfig,
    ModelSpec,
    NoTrackerConfig,
    OptimizerSpec,
    RLOOLossConfig,
    RolloutStepConfig,
    StoreConfig,
    TrackerConfig,
    TrainParams,
    validate_job,
)

logger = logging.getLogger(__name__)

RUN_SCHEMA_VERSION = 1

# The fields of run.json that define the run's data contract: a step started with a different
# value of one of these on the same run root would produce incompatible files.
CONTRACT_FIELDS = ("model", "train", "optimizer", "loss", "curriculum")


@dataclass(frozen=True)
class RLJobConfig:
    """A complete RL training job."""

    store: StoreConfig = field(default_factory=StoreConfig)
    model: ModelSpec = field(default_factory=ModelSpec)
    train: TrainParams = field(default_factory=TrainParams)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    loss: LossConfig = field(default_factory=RLOOLossConfig)
    curriculum: CurriculumConfig = field(
        default_factory=lambda: CurriculumConfig(lessons={"cats": LessonConfig(lesson_id="cats")})
    )
    inference: InferenceConfig = field(default_factory=DenseInferenceConfig)
    tracker: TrackerConfig = field(default_factory=NoTrackerConfig)
    """Optional experiment tracker (levanter's json / tensorboard / wandb) for the learner's metrics."""
    num_rollout_workers: int = 2
    """Rollout worker processes."""
    evaluator: bool = True
    """Run the evaluate step alongside (follow mode): full evaluation per curriculum.eval_frequency."""
    policy_interval: int = 1
    checkpoint_interval: int = 10
    max_steps_ahead: int = 1
    """Rollout pacing: steps of unconsumed rollouts a worker may be ahead."""
    backend: JobBackendConfig = field(default_factory=LocalBackendConfig)
    """Where the steps run: `{type: local}` (child processes) or `{type: ray, address, resources}` (Ray tasks)."""
    max_restarts: int = 5
    """Restarts per step before the job fails."""
    restart_backoff_s: float = 1.0
    """First restart delay; doubles per restart of the same step (capped at 30 s)."""
    batch_wait_timeout_s: float = 600.0
    poll_interval_s: float = 0.2
    seed: int = 0
    learner: LearnerPlacement = field(default_factory=LearnerPlacement)
    """The learner's device mesh and process count (`learner: {mesh: {data, fsdp, model}, num_processes}`)."""

    def __post_init__(self) -> None:
        if self.num_rollout_workers < 1:
            raise ConfigError("num_rollout_workers", self.num_rollout_workers, "must be >= 1")
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", self.max_restarts, "must be >= 0")


class RLJob:
    """A validated job; `to_worker_configs()` splits it, `run()` runs it (see pipeline.runner)."""

    def __init__(self, config: RLJobConfig, *, check_environments: bool = True) -> None:
        self.config = config
        validate_job(config, check_environments=check_environments)

    def to_worker_configs(self) -> dict[str, Any]:
        """Per-step configs: keys `learner`, `batches`, `rollout` (a list), `evaluate`."""
        c = self.config
        learner = LearnerStepConfig(
            store=c.store,
            model=c.model,
            train=c.train,
            optimizer=c.optimizer,
            loss=c.loss,
            tracker=c.tracker,
            policy_interval=c.policy_interval,
            checkpoint_interval=c.checkpoint_interval,
            batch_wait_timeout_s=c.batch_wait_timeout_s,
            poll_interval_s=c.poll_interval_s,
            mesh=c.learner.mesh,
            distributed=DistributedConfig(num_processes=c.learner.num_processes),
        )
        batches = BatchMakerStepConfig(
            store=c.store,
            train=c.train,
            curriculum=c.curriculum,
            follow=True,
            poll_interval_s=c.poll_interval_s,
        )
        rollouts = [
            RolloutStepConfig(
                store=c.store,
                model=c.model,
                inference=c.inference,
                curriculum=c.curriculum,
                train=c.train,
                worker_id=f"worker{i}",
                follow=True,
                max_steps_ahead=c.max_steps_ahead,
                poll_interval_s=c.poll_interval_s,
                seed=c.seed * 1000 + i,
            )
            for i in range(c.num_rollout_workers)
        ]
        evaluate = EvaluateStepConfig(
            store=c.store,
            model=c.model,
            inference=c.inference,
            curriculum=c.curriculum,
            follow=True,
            stop_after_step=c.train.num_train_steps,
            seed=c.seed,
        )
        return {"learner": learner, "batches": batches, "rollout": rollouts, "evaluate": evaluate}

    def run(self) -> int:
        """Run the job to completion with the configured backend; returns the process exit code."""
        from pipeline.runner import JobRunner

        return JobRunner(self).run()


# ------------------------------------------------------------------------------------------
# run.json: written once, compared on every start
# ------------------------------------------------------------------------------------------


def encode_config(cfg: Any) -> Any:
    """A JSON-ready dict of a config tree (draccus encoding: choice types carry `type`)."""
    return json.loads(json.dumps(draccus.encode(cfg), default=str))


def run_record(c: RLJobConfig) -> dict[str, Any]:
    """The content of run.json for a job config."""
    from schemas import BATCH, ROLLOUT

    return {
        "run_schema_version": RUN_SCHEMA_VERSION,
        "schemas": {"rollout": ROLLOUT.tag, "batch": BATCH.tag},
        "config": encode_config(c),
        "code_version": _code_version(),
    }


def _code_version() -> str:
    try:
        from importlib.metadata import version

        return version("rlpipe")
    except Exception:
        return "unknown"


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted-key view of nested dicts (lists kept as values)."""
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def contract_diff(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences of the contract fields between two run.json configs."""
    a = flatten({k: recorded.get(k) for k in CONTRACT_FIELDS})
    b = flatten({k: current.get(k) for k in CONTRACT_FIELDS})
    return [
        f"{k}: run.json has {a.get(k)!r}, this config has {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


class RunConfigMismatchError(RuntimeError):
    """The run root was created with a different config; the message lists the differing fields."""


def check_run_config(store: Any, c: RLJobConfig) -> None:
    """Write run.json if absent; otherwise refuse (RunConfigMismatchError) when the contract differs."""
    record = run_record(c)
    data = json.dumps(record, indent=2, sort_keys=True).encode()
    if store.put_if_absent(layout.RUN_CONFIG, data):
        logger.info("wrote %s", layout.RUN_CONFIG)
        return
    existing = json.loads(store.get(layout.RUN_CONFIG))
    diffs = contract_diff(existing.get("config", {}), record["config"])
    if diffs:
        raise RunConfigMismatchError(
            f"run root {c.store.run_root} was created with a different config; differing fields:\n  "
            + "\n  ".join(diffs)
        )
