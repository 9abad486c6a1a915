"""Retention: what garbage collection keeps and deletes on a run root (`retention:` in the job config), and the
`python -m steps.gc` step config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from pipeline.config.base import at_least, positive
from pipeline.config.steps import StoreConfig


@dataclass(frozen=True)
class RetentionConfig:
    """What garbage collection keeps. Policies and checkpoints are kept by step; rollout and batch data files by
    batch slot, and only once a committed lineage index records the fate of every row they hold."""

    SECTION: ClassVar[str] = "retention"

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
        at_least(self, 1, "keep_policies")
        at_least(self, 0, "keep_every")
        at_least(self, 1, "keep_checkpoints")
        at_least(self, 0, "keep_checkpoint_every")
        at_least(self, 1, "data_window_slots", "gc_every_slots", "max_deletions")


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
        positive(self, "lease_ttl_s")
