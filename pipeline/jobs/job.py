"""RLJob: a job config validated before anything starts, split into step configs.

`RLJob(config)` validates the whole `RLJobConfig` tree (`pipeline.config.job`; field-level checks live in each
dataclass, cross-field checks in `pipeline.config.validate.validate_job`) and `to_worker_configs()` gives the
per-step configs, handing the job's shared parameter objects (`cadence`, `polling`, `pacing`) to the steps as they
are. Running it is `pipeline.jobs.runner.JobRunner(job).run()`; where the steps run is the `backend` choice
(`pipeline.config.backend`, launchers in `pipeline.jobs.launchers`). The run.json contract (`check_run_config`,
`check_step_config`, ...) lives in `pipeline.run_contract`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.config.job import RLJobConfig
from pipeline.config.mesh import DistributedConfig
from pipeline.config.model import DenseInferenceConfig
from pipeline.config.steps import BatchMakerStepConfig, EvaluateStepConfig, LearnerStepConfig, RolloutStepConfig
from pipeline.config.validate import validate_job
from pipeline.process.step_kind import StepKind

if TYPE_CHECKING:
    from pipeline.store.storage import RunStore


class RLJob:
    """A validated job; `to_worker_configs()` splits it (`pipeline.jobs.runner.JobRunner(job).run()` runs it)."""

    def __init__(
        self, config: RLJobConfig, *, check_environments: bool = True, allow_config_change: bool = False
    ) -> None:
        self.config = config
        self.allow_config_change = allow_config_change
        """Accept (and record in run.json's history) contract fields that differ from run.json."""
        validate_job(config, check_environments=check_environments)

    def rollout_config(self, index: int) -> RolloutStepConfig:
        """The config of rollout worker `index`: id `worker<index>`, seed `seed × 1000 + index`. The elastic pool
        (`pipeline.jobs.pool`) numbers the workers it adds on from `num_rollout_workers` and never reuses an
        index (a worker's file names also carry a per-start nonce, so even a reused id could not collide)."""
        c = self.config
        return RolloutStepConfig(
            store=c.store,
            model=c.model,
            inference=c.inference,
            curriculum=c.curriculum,
            train=c.train,
            worker_id=f"worker{index}",
            follow=True,
            pacing=c.pacing,
            polling=c.polling,
            seed=c.seed * 1000 + index,
        )

    def to_worker_configs(self) -> dict[str, Any]:
        """Per-step configs, keyed by each step kind's `job_name`: `learner`, `batches`, `rollout` (a list),
        `evaluate`."""
        c = self.config
        learner = LearnerStepConfig(
            store=c.store,
            model=c.model,
            train=c.train,
            optimizer=c.optimizer,
            loss=c.loss,
            tracker=c.tracker,
            cadence=c.cadence,
            polling=c.polling,
            # with retention on, garbage collection decides which checkpoints go (the learner keeps them all)
            **({"keep_checkpoints": 1_000_000_000} if c.retention.enabled else {}),
            mesh=c.learner.mesh,
            distributed=DistributedConfig(num_processes=c.learner.num_processes),
        )
        batches = BatchMakerStepConfig(
            store=c.store, train=c.train, curriculum=c.curriculum, follow=True, polling=c.polling
        )
        rollouts = [self.rollout_config(i) for i in range(c.num_rollout_workers)]
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
        return {
            StepKind.LEARNER.job_name: learner,
            StepKind.BATCHMAKER.job_name: batches,
            StepKind.ROLLOUT.job_name: rollouts,
            StepKind.EVALUATE.job_name: evaluate,
        }


def recorded_step_config(store: RunStore, kind: StepKind) -> Any:
    """The config of step `kind` as the run's run.json gives it (the job's own step config, as the job runner would
    start it): what read-only commands (evaluate, replay) run with. ConfigError naming `store.run_root` when
    run.json holds no readable job config."""
    import draccus

    from pipeline.config.base import ConfigError
    from pipeline.store import layout
    from pipeline.store.run_state import read_run_record

    record = read_run_record(store)  # DamagedInputError naming run.json and the field when it is damaged
    try:
        job = draccus.decode(RLJobConfig, record["config"])
    except (KeyError, TypeError, draccus.utils.ParsingError) as e:
        raise ConfigError("store.run_root", store.url, f"{layout.RUN_CONFIG} has no readable job config ({e})") from e
    return RLJob(job, check_environments=False).to_worker_configs()[kind.job_name]
