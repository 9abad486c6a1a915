"""Parameter objects that the job config and the step configs share (levanter's TrainerConfig style).

Each is one section under the same name in the job config and in every step config that uses it
(`cadence:` in the job and the learner step, `polling:` in the job and the learner, BatchMaker and rollout steps,
`pacing:` in the job and the rollout step): `RLJob.to_worker_configs()` hands the job's object to the steps as it
is, and a dotted flag reads the same on both command lines (`--cadence.policy_interval 2`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeline.config.base import at_least, positive, require


@dataclass(frozen=True)
class LearnerCadence:
    """`cadence:` how often the learner publishes policies and writes checkpoints, and how long it waits for a
    batch."""

    SECTION: ClassVar[str] = "cadence"

    policy_interval: int = 1
    """Publish a policy every this many steps (and at step 0 and the last step)."""
    checkpoint_interval: int = 10
    """Write a full training checkpoint every this many steps (and at the last step)."""
    batch_wait_timeout_s: float = 600.0
    """Fail loudly, naming the file, when the next batch has not appeared in this long."""

    def __post_init__(self) -> None:
        at_least(self, 1, "policy_interval", "checkpoint_interval")
        positive(self, "batch_wait_timeout_s")


@dataclass(frozen=True)
class PollingConfig:
    """`polling:` how often a waiting step looks at the run root again (for the next batch, rollout files, a
    newer policy)."""

    SECTION: ClassVar[str] = "polling"

    interval_s: float = 0.2
    """Seconds between two looks (listings or marker reads) while waiting."""
    bounded_wait_s: float = 10.0
    """A bounded step (a scheduled job: `learn --max_steps`, `batches --max_batches`, a rollout worker not
    following) waits at most this long for work (the next batch slot; the learner or enough rollouts for a slot; a
    first policy or the end of a pacing pause), then exits 0 with one line saying what is missing; what it
    committed stands. Steps that follow the run wait by their own timeouts instead."""

    def __post_init__(self) -> None:
        positive(self, "interval_s", "bounded_wait_s")


@dataclass(frozen=True)
class RolloutPacing:
    """`pacing:` how far rollout workers may run ahead of the learner."""

    SECTION: ClassVar[str] = "pacing"

    max_steps_ahead: int = 1
    """A worker pauses while rollouts from the current policy already cover this many unconsumed batches (or the
    run's remaining batch slots, if fewer): the committed unconsumed rows (with zero-variance filtering, those with
    signal) plus, with `count_claims`, the rows other workers are generating now. Once every batch slot of the run
    (`train.num_train_steps`) is committed a worker generates nothing more (no row sampled then can be trained): a
    following worker waits for the learner's last policy, a scheduled one stops."""
    count_claims: bool = True
    """Before generating, a worker announces an in-flight claim (one empty object under `pacing/claims/`, naming its
    policy step and rows, expiring after 3× its last generate-and-commit cycle: 30 s at least, 120 s for a first
    claim) and counts the standing claims of the workers that claimed before it against `max_steps_ahead`, so that
    workers passing the pacing check at the same moment do not all generate rows for one slot (they would go stale:
    waste). Costs one listing of that folder per check that would produce, and one put and one delete per rollout
    file. Off: only committed rows count."""
    fit_room: bool = True
    """A worker generates only as many prompts as cover the rows still missing from the backlog (`max_steps_ahead`
    batches minus the unconsumed and claimed rows; at most the lesson's `n_prompts`): a whole file for a backlog a
    few rows short would mostly go stale. With zero-variance filtering the backlog counts rows with signal, so the
    rows generated are the missing ones divided by the share of recent rows with signal (at least 0.1): files stay
    large instead of shrinking to a group or two, whose no-signal files would start the BatchMaker's no-signal fill;
    while the run is saturated (the newest slot says the next one admits rows without signal from its first file
    on) every row is taken, so the rows generated are just the missing ones. Off: always `n_prompts` prompts."""

    def __post_init__(self) -> None:
        at_least(self, 0, "max_steps_ahead")


@dataclass(frozen=True)
class RolloutPoolConfig:
    """`rollout_pool:` an elastic pool of rollout workers (job config only): with `enabled`, the job runner starts
    `num_rollout_workers` and adds or removes one at a time from what the steps' metrics records say, between
    `min_workers` and `max_workers` (`pipeline.jobs.pool`; every decision is recorded under `pool/` in the run
    root)."""

    SECTION: ClassVar[str] = "rollout_pool"

    enabled: bool = False
    """Resize the pool while the job runs (off: `num_rollout_workers` workers throughout)."""
    min_workers: int = 1
    """Never fewer rollout workers than this."""
    max_workers: int = 4
    """Never more rollout workers than this (a Ray backend checks up front that the cluster can hold them all)."""
    scale_up_learner_wait: float = 0.3
    """Add a worker when the learner spent at least this fraction of its recent steps waiting for its batch
    (`wait_s / (wait_s + train_s)` over the learner's records in the window) and the workers are not paused."""
    scale_down_paused: float = 0.5
    """Remove a worker when the workers spent at least this fraction of the window paused by pacing (ahead of the
    learner, or waiting for a newer policy: `time/pause_s` of their write records) and the learner is not waiting."""
    scale_down_waste: float = 0.5
    """Remove a worker when the BatchMaker dropped at least this many generated rows (stale, zero-variance,
    superseded, zero-advantage) per row trained over the window and the learner is not waiting."""
    window_s: float = 60.0
    """The signals are read over the records of the last this many seconds (and only those after the last change)."""
    cooldown_s: float = 30.0
    """Seconds after a change (and after the job starts) before the next one: a new worker needs time to load its
    policy before the signals can show its effect."""

    def __post_init__(self) -> None:
        at_least(self, 1, "min_workers")
        require(
            self.max_workers >= self.min_workers,
            "rollout_pool.max_workers",
            self.max_workers,
            f"must be >= rollout_pool.min_workers ({self.min_workers})",
        )
        for name in ("scale_up_learner_wait", "scale_down_paused"):
            v = getattr(self, name)
            require(0.0 < v <= 1.0, f"rollout_pool.{name}", v, "must be a fraction in (0, 1]")
        positive(self, "scale_down_waste", "window_s")
        at_least(self, 0, "cooldown_s")
