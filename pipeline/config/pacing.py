"""Parameter objects that the job config and the step configs share (levanter's TrainerConfig style).

Each is one section under the same name in the job config and in every step config that uses it
(`cadence:` in the job and the learner step, `polling:` in the job and the learner, BatchMaker and rollout steps,
`pacing:` in the job and the rollout step): `RLJob.to_worker_configs()` hands the job's object to the steps as it
is, and a dotted flag reads the same on both command lines (`--cadence.policy_interval 2`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.base import require


@dataclass(frozen=True)
class LearnerCadence:
    """`cadence:` how often the learner publishes policies and writes checkpoints, and how long it waits for a
    batch."""

    policy_interval: int = 1
    """Publish a policy every this many steps (and at step 0 and the last step)."""
    checkpoint_interval: int = 10
    """Write a full training checkpoint every this many steps (and at the last step)."""
    batch_wait_timeout_s: float = 600.0
    """Fail loudly, naming the file, when the next batch has not appeared in this long."""

    def __post_init__(self) -> None:
        require(self.policy_interval >= 1, "cadence.policy_interval", self.policy_interval, "must be >= 1")
        require(self.checkpoint_interval >= 1, "cadence.checkpoint_interval", self.checkpoint_interval, "must be >= 1")
        require(self.batch_wait_timeout_s > 0, "cadence.batch_wait_timeout_s", self.batch_wait_timeout_s, "must be > 0")


@dataclass(frozen=True)
class PollingConfig:
    """`polling:` how often a waiting step looks at the run root again (for the next batch, rollout files, a
    newer policy)."""

    interval_s: float = 0.2
    """Seconds between two looks (listings or marker reads) while waiting."""
    bounded_wait_s: float = 10.0
    """A bounded step (a scheduled job: `learn --max_steps`, `batches --max_batches`, a rollout worker not
    following) waits at most this long for work (the next batch slot; the learner or enough rollouts for a slot; a
    first policy or the end of a pacing pause), then exits 0 with one line saying what is missing; what it
    committed stands. Steps that follow the run wait by their own timeouts instead."""

    def __post_init__(self) -> None:
        require(self.interval_s > 0, "polling.interval_s", self.interval_s, "must be > 0")
        require(self.bounded_wait_s > 0, "polling.bounded_wait_s", self.bounded_wait_s, "must be > 0")


@dataclass(frozen=True)
class RolloutPacing:
    """`pacing:` how far rollout workers may run ahead of the learner."""

    max_steps_ahead: int = 1
    """A worker pauses while rollouts from the current policy already cover this many unconsumed batches."""

    def __post_init__(self) -> None:
        require(self.max_steps_ahead >= 0, "pacing.max_steps_ahead", self.max_steps_ahead, "must be >= 0")
