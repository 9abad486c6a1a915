"""RLJob: one config for a whole run, validated before anything starts, split into step configs.

`RLJobConfig` composes every part of a run (model, tokenizer, optimizer, TrainParams, curriculum,
loss module, inference, workers, run root). `RLJob(config)` validates the whole tree (field-level
checks live in each dataclass; cross-field checks here), `to_worker_configs()` gives the per-step
configs, and `check_run_config()` writes `run.json` once or refuses a run root whose recorded
contract differs, naming every differing field. The process runner lives in `pipeline.runner`.
"""

from __future__ import annotations

import dataclasses
import importlib
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
    EvaluateStepConfig,
    InferenceConfig,
    LearnerStepConfig,
    LessonConfig,
    LossConfig,
    ModelSpec,
    NoTrackerConfig,
    OptimizerSpec,
    RLOOLossConfig,
    RolloutStepConfig,
    StoreConfig,
    TrackerConfig,
    TrainParams,
)

logger = logging.getLogger(__name__)

RUN_SCHEMA_VERSION = 1
BACKENDS = ("local", "ray")

# The fields of run.json that define the run's data contract: a step started with a different
# value of one of these on the same run root would produce incompatible files.
CONTRACT_FIELDS = ("model", "train", "optimizer", "loss", "curriculum")


@dataclass(frozen=True)
class StepResources:
    """Resources per step on the Ray backend (ignored by the local backend)."""

    learner_cpus: float = 1.0
    learner_gpus: float = 0.0
    rollout_cpus: float = 1.0
    rollout_gpus: float = 0.0
    batches_cpus: float = 0.5
    evaluate_cpus: float = 0.5
    evaluate_gpus: float = 0.0


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
    inference: InferenceConfig = field(default_factory=InferenceConfig)
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
    backend: str = "local"
    """'local': steps as local processes; 'ray': steps as Ray tasks on a cluster (`ray_address`)."""
    ray_address: str | None = None
    """Ray cluster address for backend 'ray' (None: start or join a local cluster)."""
    resources: StepResources = field(default_factory=StepResources)
    max_restarts: int = 5
    """Restarts per step before the job fails."""
    restart_backoff_s: float = 1.0
    """First restart delay; doubles per restart of the same step (capped at 30 s)."""
    batch_wait_timeout_s: float = 600.0
    poll_interval_s: float = 0.2
    seed: int = 0
    run_id: str = "rlpipe"

    def __post_init__(self) -> None:
        if self.num_rollout_workers < 1:
            raise ConfigError("num_rollout_workers", self.num_rollout_workers, "must be >= 1")
        if self.backend not in BACKENDS:
            raise ConfigError("backend", self.backend, f"must be one of {BACKENDS}")
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


def validate_job(c: RLJobConfig, *, check_environments: bool = True) -> None:
    """Cross-field checks, before any process starts; raises ConfigError naming the field."""
    t, cur = c.train, c.curriculum
    if t.seq_len > c.model.max_seq_len:
        raise ConfigError("train.seq_len", t.seq_len, f"exceeds model.max_seq_len={c.model.max_seq_len}")
    needs_groups = t.advantage_estimator in ("rloo", "grpo", "dr_grpo") and t.filter_zero_variance
    for lesson_id in cur.lessons:
        sp = cur.sampling_for(lesson_id)
        if needs_groups and sp.n_generations_per_prompt < 2:
            raise ConfigError(
                f"curriculum.lessons.{lesson_id}.sampling_params.n_generations_per_prompt",
                sp.n_generations_per_prompt,
                "groups of one have zero advantage and are all filtered: batches could never fill "
                f"(train.batch_size={t.batch_size}); use >= 2",
            )
        if sp.max_tokens >= t.seq_len:
            raise ConfigError(
                f"curriculum.lessons.{lesson_id}.sampling_params.max_tokens",
                sp.max_tokens,
                f"leaves no room for a prompt in train.seq_len={t.seq_len}",
            )
        produced = sp.n_prompts * sp.n_generations_per_prompt * t.max_samples_per_rollout
        window = (t.max_lag + 1) * c.num_rollout_workers * max(1, c.max_steps_ahead)
        if not t.pack and produced * window < t.batch_size:
            raise ConfigError(
                "train.batch_size",
                t.batch_size,
                f"lesson {lesson_id!r}: n_prompts×n_generations×max_samples_per_rollout = {produced} rows per write, "
                f"and the staleness window (max_lag+1={t.max_lag + 1}) × workers × steps ahead allows {window} writes "
                "per batch: the batch cannot be filled",
            )
    if check_environments:
        for lesson_id, lesson in cur.lessons.items():
            _check_importable(f"curriculum.lessons.{lesson_id}.env.env_class", lesson.env.env_class)


def _check_importable(field_name: str, dotted: str) -> None:
    module_name, _, cls_name = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(field_name, dotted, f"module cannot be imported ({e})") from None
    if not hasattr(module, cls_name):
        raise ConfigError(field_name, dotted, f"module {module_name!r} has no class {cls_name!r}")


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


def job_from_run_root(store: Any) -> RLJobConfig:
    """The job config recorded in a run root's run.json."""
    record = json.loads(store.get(layout.RUN_CONFIG))
    return draccus.decode(RLJobConfig, record["config"])


def with_run_root(c: RLJobConfig, run_root: str | None) -> RLJobConfig:
    """The config with its run root replaced (if given)."""
    if not run_root:
        return c
    return dataclasses.replace(c, store=dataclasses.replace(c.store, run_root=run_root))
