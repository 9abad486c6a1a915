"""Run-root invariants every end-to-end and crash test checks, from files alone.

- I1 reuse limit: no rollout is in more than `max_samples_per_rollout` committed batches;
- I2 batch slots are contiguous from 1;
- I3 every batch log entry's data file (and dropped file) exists and reads with its schema;
- I4 every committed rollout is accounted for: used or dropped with a reason (never both), or still usable by
  the next slot, or in a file committed after the BatchMaker's last scans began.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas import BATCH, ROLLOUT
from schemas.dropped import DROPPED

_CLOCK_SLACK_S = 1.0
"""A marker's `time` is taken just before its put; allow that much between the two."""


@dataclass
class RunAudit:
    """What the files of a finished run say."""

    slots: list[int]
    uses: collections.Counter[str]
    dropped: dict[str, str]
    rollouts: dict[str, int]  # rollout_id -> policy_step, every committed rollout row
    policies: list[int]
    problems: list[str] = field(default_factory=list)


def audit_run(store: RunStore, max_samples_per_rollout: int, max_lag: int) -> RunAudit:
    """Collect lineage and check the invariants; `problems` lists every violation found."""
    problems: list[str] = []
    slots = sorted(layout.parse_step(p) for p in store.list(layout.BATCH_LOG) if p.endswith(".json"))
    # I2: slots contiguous from 1
    if slots != list(range(1, len(slots) + 1)):
        problems.append(f"batch slots not contiguous from 1: {slots}")
    uses: collections.Counter[str] = collections.Counter()
    dropped: dict[str, str] = {}
    ingested: set[str] = set()
    entry_time: dict[int, float] = {}
    for slot in slots:
        entry = store.read_log_entry(slot)  # I0: a valid BatchLogEntry
        ingested.update(entry.ingested_files)
        entry_time[slot] = entry.time
        table = store.read_parquet(entry.data_file, BATCH)  # I3: named data exists and reads
        for ids in table.column("rollout_ids").to_pylist():
            uses.update(ids)
        if entry.dropped_file:
            d = store.read_parquet(entry.dropped_file, DROPPED)
            for rid, reason in zip(d.column("rollout_id").to_pylist(), d.column("reason").to_pylist(), strict=True):
                dropped[rid] = reason
    last = slots[-1] if slots else 0
    rollouts: dict[str, int] = {}
    unseen: set[str] = set()  # rows of files committed after the maker's final scan
    for step_dir in store.list(layout.ROLLOUTS):
        for path in store.list_committed(step_dir):
            t = store.read_committed(path, ROLLOUT)
            if t is None:
                continue
            ids = t.column("rollout_id").to_pylist()
            for rid, p in zip(ids, t.column("policy_step").to_pylist(), strict=True):
                if rid in rollouts:
                    problems.append(f"rollout id {rid} committed twice")
                rollouts[rid] = p
            if path in ingested:
                continue
            # I4: every scan for the final slot started after slot last-2 was committed (the BatchMaker writes slot
            # T-1 while it gathers T), so an unread file committed later may be legitimately unseen; an older one
            # must still be usable (the policy check below), e.g. left on disk because the batch was full.
            scans_began = entry_time[last - 2] if last >= 3 else float("-inf")
            if store.read_marker(path).time + _CLOCK_SLACK_S > scans_began:
                unseen.update(ids)
    for rid, n in uses.items():
        if n > max_samples_per_rollout:  # I1: reuse limit
            problems.append(f"rollout {rid} used {n} times > {max_samples_per_rollout}")
        if rid not in rollouts:
            problems.append(f"batch uses rollout {rid} that is not committed")
        if rid in dropped:
            problems.append(f"rollout {rid} both used and dropped ({dropped[rid]})")
    for rid, p in rollouts.items():
        if rid in uses or rid in dropped or rid in unseen:
            continue
        # Still pending when the run ended: allowed only while it was usable by the next slot.
        if p < last - 1 - max_lag:
            problems.append(f"rollout {rid} (policy {p}) neither used nor dropped, and too old for slot {last + 1}")
    policies = sorted(
        layout.parse_step(p) for p in store.list(layout.POLICIES) if store.exists(p + "/" + layout.COMMIT_MARKER)
    )
    return RunAudit(slots, uses, dropped, rollouts, policies, problems)


def check_checkpoint_lineage(store: RunStore, last: int) -> list[int]:
    """Walk checkpoint markers from checkpoint `last` through their parents; assert that every marker records the
    slots it consumed since its parent, and that together they cover batch slots 1..last exactly once. Returns
    the checkpoint steps of the lineage, oldest first."""
    from schemas.records import CommitMarker

    covered: list[int] = []
    chain: list[int] = []
    step: int | None = last
    while step is not None:
        rec = CommitMarker.from_json(store.get(layout.checkpoint_marker(step)), path=layout.checkpoint_marker(step))
        assert rec.slots is not None, f"checkpoint {step} records no slots"
        first, end = rec.slots
        assert end == step and rec.batch_slot == step and first == (rec.parent or 0) + 1, (step, rec)
        covered = list(range(first, end + 1)) + covered
        chain.insert(0, step)
        step = rec.parent
    assert covered == list(range(1, last + 1)), f"lineage of checkpoint {last} covers slots {covered}"
    return chain


def half_written_checkpoints(store: RunStore) -> list[str]:
    """Checkpoint folders holding data files but no COMMITTED marker (what a kill mid-save leaves)."""
    folders = [f for f in store.list(layout.CHECKPOINTS) if any(r.endswith(".safetensors") for r in store.list(f))]
    return [f for f in folders if not store.exists(layout.join(f, layout.COMMIT_MARKER))]
