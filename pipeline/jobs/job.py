"""RLJob: one config for a whole run, validated before anything starts, split into step configs.

`RLJobConfig` composes every part of a run (model, tokenizer, optimizer, TrainParams, curriculum,
loss module, inference, workers, run root). `RLJob(config)` validates the whole tree (field-level
checks live in each dataclass; cross-field checks in `pipeline.config.validate`), `to_worker_configs()` gives
the per-step configs, and `check_run_config()` writes `run.json` once or refuses a run root whose recorded
contract differs, naming every differing field; `check_step_config()` does the same for one step's config (every
step program, started by the runner, by `steps.run step NAME` or directly). `--allow_config_change true` accepts
the change: run.json then holds the new values and its `history` lists what changed, when and by which step.
The process runner lives in `pipeline.jobs.runner`; where the steps run is the `backend` choice
(`pipeline.config.backend`, launchers in `pipeline.jobs.launchers`).
"""

from __future__ import annotations

import datetime
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import draccus

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
    RetentionConfig,
    RLOOLossConfig,
    RolloutStepConfig,
    StoreConfig,
    TrackerConfig,
    TrainParams,
    validate_job,
)
from pipeline.store import layout

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
    """First restart delay; doubles per restart of the same step (up to `restart_backoff_max_s`)."""
    restart_backoff_max_s: float = 30.0
    """Longest restart delay."""
    batch_wait_timeout_s: float = 600.0
    poll_interval_s: float = 0.2
    seed: int = 0
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    """What garbage collection keeps; with `retention.enabled` the job runner collects every few slots
    (`pipeline.retention`)."""
    learner: LearnerPlacement = field(default_factory=LearnerPlacement)
    """The learner's device mesh and process count (`learner: {mesh: {data, fsdp, model}, num_processes}`)."""

    def __post_init__(self) -> None:
        if self.num_rollout_workers < 1:
            raise ConfigError("num_rollout_workers", self.num_rollout_workers, "must be >= 1")
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", self.max_restarts, "must be >= 0")
        if not 0 <= self.restart_backoff_s <= self.restart_backoff_max_s:
            raise ConfigError("restart_backoff_s", self.restart_backoff_s,
                              f"must be in [0, restart_backoff_max_s={self.restart_backoff_max_s}]")  # fmt: skip


class RLJob:
    """A validated job; `to_worker_configs()` splits it, `run()` runs it (see pipeline.jobs.runner)."""

    def __init__(
        self, config: RLJobConfig, *, check_environments: bool = True, allow_config_change: bool = False
    ) -> None:
        self.config = config
        self.allow_config_change = allow_config_change
        """Accept (and record in run.json's history) contract fields that differ from run.json."""
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
            # with retention on, garbage collection decides which checkpoints go (the learner keeps them all)
            **({"keep_checkpoints": 1_000_000_000} if c.retention.enabled else {}),
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
            # the evaluator scores the policies it loads itself: a rollout server's config would not fit it
            inference=DenseInferenceConfig(max_seqs=c.inference.max_seqs)
            if c.inference.backend == "server"
            else c.inference,
            curriculum=c.curriculum,
            follow=True,
            stop_after_step=c.train.num_train_steps,
            seed=c.seed,
        )
        return {"learner": learner, "batches": batches, "rollout": rollouts, "evaluate": evaluate}

    def run(self) -> int:
        """Run the job to completion with the configured backend; returns the process exit code."""
        from pipeline.jobs.runner import JobRunner

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


def contract_diff(
    recorded: dict[str, Any], current: dict[str, Any], fields: tuple[str, ...] = CONTRACT_FIELDS
) -> list[str]:
    """Human-readable differences of the contract `fields` between two run.json configs."""
    return [f"{k}: run.json has {a!r}, this config has {b!r}" for k, a, b in _changes(recorded, current, fields)]


def _changes(recorded: dict[str, Any], current: dict[str, Any], fields: tuple[str, ...]) -> list[tuple[str, Any, Any]]:
    """(dotted field, value in run.json, value now) for every differing leaf of the contract `fields`."""
    a = flatten({k: recorded.get(k) for k in fields})
    b = flatten({k: current.get(k) for k in fields})
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


ALLOW_CHANGE_FLAG = "--allow_config_change"


class RunConfigMismatchError(ConfigError):
    """The run root was created with a different config; the message names every differing field and the values."""

    def __init__(self, run_root: str, changes: list[tuple[str, Any, Any]]) -> None:
        field_name, _, value = changes[0]
        listed = "; ".join(f"{k}: run.json has {a!r}, given {b!r}" for k, a, b in changes)
        super().__init__(
            field_name,
            value,
            f"differs from {layout.RUN_CONFIG} of run root {run_root} ({listed}); "
            f"pass {ALLOW_CHANGE_FLAG} true to accept the change (recorded in run.json's history)",
        )
        self.changes = changes


def check_run_config(store: Any, c: RLJobConfig, *, allow_change: bool = False, by: str = "job") -> None:
    """Write run.json if absent; otherwise refuse (RunConfigMismatchError) when the contract differs, unless
    `allow_change`: then run.json takes the new values and its `history` records what changed, when, by `by`."""
    record = run_record(c)
    data = json.dumps(record, indent=2, sort_keys=True).encode()
    if store.put_if_absent(layout.RUN_CONFIG, data):
        logger.info("wrote %s", layout.RUN_CONFIG)
        return
    _check_against_run(store, record["config"], CONTRACT_FIELDS, allow_change=allow_change, by=by)


def check_step_config(store: Any, step_config: Any, *, by: str, allow_change: bool = False) -> None:
    """Refuse (RunConfigMismatchError) a step config whose contract fields (those it has of model, train,
    optimizer, loss, curriculum) differ from the run root's run.json, unless `allow_change` (then recorded as in
    `check_run_config`). A run root without run.json is not checked."""
    if not store.exists(layout.RUN_CONFIG):
        return
    fields = tuple(f for f in CONTRACT_FIELDS if getattr(step_config, f, None) is not None)
    encoded = encode_config(step_config)  # the whole tree: a choice field's `type` is encoded by its parent
    current = {f: encoded[f] for f in fields}
    _check_against_run(store, current, fields, allow_change=allow_change, by=by)


def _check_against_run(
    store: Any, current: dict[str, Any], fields: tuple[str, ...], *, allow_change: bool, by: str
) -> None:
    existing = json.loads(store.get(layout.RUN_CONFIG))
    changes = _changes(existing.get("config", {}), current, fields)
    if not changes:
        return
    if not allow_change:
        raise RunConfigMismatchError(store.url, changes)
    for k, a, b in changes:
        logger.warning("config change accepted (%s): %s: %r -> %r", ALLOW_CHANGE_FLAG, k, a, b)
    existing.setdefault("config", {}).update({f: current[f] for f in fields})
    existing.setdefault("history", []).append(
        {
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "by": by,
            "changes": [{"field": k, "from": a, "to": b} for k, a, b in changes],
        }
    )
    # An atomic overwrite: readers see the old or the new record. Two concurrent accepted changes may lose one
    # history entry, never the file.
    store.put_unique(layout.RUN_CONFIG, json.dumps(existing, indent=2, sort_keys=True).encode())
