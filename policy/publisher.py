"""Policy publishing behind the learner's compute, and the per-hop timing of a batch slot's chain of events."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from pipeline.config import LearnerStepConfig
from pipeline.store.storage import RunStore
from policy import mesh as mesh_lib
from policy import policy_format as pf
from policy.learner import prepare_publish
from policy.policy_format import LearnerState
from schemas.records import BatchLogEntry

logger = logging.getLogger(__name__)


class PolicyPublisher:
    """Commits policies on one background thread, in submission order, so the next step's compute overlaps.

    Contracts: policies are committed in step order (one FIFO thread), each exactly as `publish_policy` does;
    every learner process runs one: `submit` (called in step order on every process) does the collectives on the
    caller's thread, and each process's thread then writes the blocks that process holds, in parallel files, while
    process 0's thread also commits the marker once every process's shards are durable (`policy.policy_format.
    sharded`: no collective on this thread, so no ordering hazard with the next step's collectives);
    the state handed over is immutable (JAX arrays), so training the next step cannot change what is written;
    a failed publish is raised from the next `check`, `submit` or `drain` on the caller's thread (the learner
    checks before each step and while it waits for a batch, so a publish that failed stops it: no batch comes
    while the BatchMaker waits for that policy); `drain` returns once every submitted policy is committed.
    Checkpoints do not wait for it: resuming from checkpoint S publishes policy S if a crash lost it.
    """

    def __init__(self, store: RunStore, config: LearnerStepConfig) -> None:
        self.store = store
        self.config = config
        self.published_at: dict[int, float] = {}
        """policy step -> unix time its COMMITTED marker (and LATEST) were written by this process."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="policy-publish")
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()

    def _publish(self, pub: pf.PolicyPublish) -> None:
        pf.commit_policy(self.store, pub)
        if mesh_lib.is_writer():
            with self._lock:
                self.published_at[pub.step] = time.time()

    def _reap(self, wait: bool) -> None:
        keep = []
        for f in self._pending:
            if wait or f.done():
                f.result()  # re-raises a failed publish here, on the caller's thread
            else:
                keep.append(f)
        self._pending = keep

    MAX_PENDING = 2
    """Policies in flight at most (each holds a model in memory): a slower store makes the learner wait."""

    def submit(self, state: LearnerState) -> None:
        """Queue policy `state.step` for commit (after every policy queued before it)."""
        pub = prepare_publish(state, self.config)  # collectives: issued here, in step order on every process
        if pub is None:  # a LoRA policy, gathered: process 0 writes it alone
            return
        self._reap(wait=False)
        while len(self._pending) >= self.MAX_PENDING:
            self._pending.pop(0).result()
        self._pending.append(self._pool.submit(self._publish, pub))

    def check(self) -> None:
        """Raise the error of a queued publish that has failed (e.g. `StorageFaultError`: no space under
        `policies/`); a no-op while every publish succeeded or is still running."""
        self._reap(wait=False)

    def drain(self) -> None:
        """Block until every queued policy is committed; raise the first failure."""
        self._reap(wait=True)

    def time_of(self, step: int) -> float | None:
        """When this process committed policy `step` (None: not by this process, or not yet)."""
        with self._lock:
            return self.published_at.get(step)

    def close(self) -> None:
        """Finish queued publishes (errors are logged, not raised: used on the way out)."""
        try:
            self.drain()
        except Exception as e:  # already failing or stopping; the checkpoint covers a lost policy
            logger.error("a queued policy publish failed: %s", e)
        self._pool.shutdown(wait=True)


def batch_events(store: RunStore, entry: BatchLogEntry, publisher: PolicyPublisher | None) -> dict[str, float | None]:
    """The chain's events (`pipeline.telemetry.hops.EVENTS`) up to `batch_committed_at`, from the slot's log entry
    and the ready marker of the rollout file the BatchMaker read last for it (missing ones are None)."""
    timing = entry.timing or {}
    events: dict[str, float | None] = {
        "batch_noticed_at": timing.get("batch_noticed_at"),
        "batch_committed_at": timing.get("batch_committed_at", entry.time),
    }
    last = timing.get("last_file")
    if not last:
        return events
    try:
        marker = store.read_marker(last)
    except Exception as e:  # timing is best effort (the file may be quarantined or gone): never fail a step on it
        logger.debug("no ready marker for %s (%s): hops before the BatchMaker merged", last, e)
        return events
    extra = marker.extra
    events["rollout_committed_at"] = marker.time
    for k in ("worker_noticed_at", "generate_started_at", "generated_at"):
        v = extra.get(k)
        events[k] = float(v) if isinstance(v, int | float) else None
    policy = extra.get("policy_step")
    if isinstance(policy, int) and publisher is not None:
        events["policy_published_at"] = publisher.time_of(policy)
    return events
