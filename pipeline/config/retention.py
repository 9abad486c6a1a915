"""Retention: what garbage collection keeps and deletes on a run root (`retention:` in the job config), and the
`python -m steps.gc` step config."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config.base import require
from pipeline.config.steps import StoreConfig


@dataclass(frozen=True)
class RetentionConfig:
    """What garbage collection keeps. Policies and checkpoints are kept by step; rollout and batch data files by
    batch slot, and only once a committed lineage index records the fate of every row they hold."""

    enabled: bool = False
    """Run garbage collection from the job runner every `gc_every_slots` batch slots and once at the end
    (`make gc` runs it by hand whatever this says)."""
    keep_policies: int = 4
    """The newest this many committed policies are kept."""
    keep_every: int = 10
    """Every policy whose step is a multiple of this is kept (0: none beyond the other rules)."""
    keep_checkpoints: int = 1
    """The newest this many committed full checkpoints are kept (at least 1: the learner resumes from it)."""
    keep_checkpoint_every: int = 0
    """Every checkpoint whose step is a multiple of this is kept (0: none beyond the newest)."""
    data_window_slots: int = 4
    """Rollout and batch data files are deleted only once the batch slot that last used or dropped their rows
    is at least this many slots older than the newest committed slot."""
    gc_every_slots: int = 5
    """With `enabled`, the job runner starts a garbage collection each time this many new slots are committed."""
    max_deletions: int = 10000
    """Upper bound on the files and folders one garbage-collection run deletes (the rest waits for the next)."""

    def __post_init__(self) -> None:
        require(self.keep_policies >= 1, "retention.keep_policies", self.keep_policies, "must be >= 1")
        require(self.keep_every >= 0, "retention.keep_every", self.keep_every, "must be >= 0")
        require(self.keep_checkpoints >= 1, "retention.keep_checkpoints", self.keep_checkpoints, "must be >= 1")
        require(
            self.keep_checkpoint_every >= 0,
            "retention.keep_checkpoint_every",
            self.keep_checkpoint_every,
            "must be >= 0",
        )
        require(self.data_window_slots >= 1, "retention.data_window_slots", self.data_window_slots, "must be >= 1")
        require(self.gc_every_slots >= 1, "retention.gc_every_slots", self.gc_every_slots, "must be >= 1")
        require(self.max_deletions >= 1, "retention.max_deletions", self.max_deletions, "must be >= 1")


@dataclass(frozen=True)
class GcStepConfig:
    """`python -m steps.gc`: one bounded garbage-collection run over a run root."""

    store: StoreConfig = field(default_factory=StoreConfig)
    """The run root to collect."""
    retention: RetentionConfig | None = None
    """What to keep; None: the `retention` section of the run's run.json (defaults if it has none)."""
    holder_id: str = "gc"
    """Name under which this run holds the `gc` lease (one garbage collection at a time per run root)."""
    lease_ttl_s: float = 120.0
    """A garbage collection that stops renewing its lease for this long is presumed dead."""

    def __post_init__(self) -> None:
        require(self.lease_ttl_s > 0, "lease_ttl_s", self.lease_ttl_s, "must be > 0")
