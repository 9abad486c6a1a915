"""Valid batch log entries for tests that commit batch slots without running the BatchMaker.

Every reader validates a log entry through `schemas.records.BatchLogEntry`, so a test that fakes a committed
slot writes a complete record: the fields it cares about, plus neutral values for the rest.
"""

from __future__ import annotations

import time
from typing import Any

from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas import BATCH
from schemas.records import BatchLogEntry, Cursor, Lineage, Reservoir


def log_entry(slot: int, **fields: Any) -> BatchLogEntry:
    """A valid log entry of `slot` (an empty slot: no files, an empty reservoir) with `fields` overriding."""
    base: dict[str, Any] = {
        "slot": slot,
        "attempt_id": f"test-{slot}",
        "seq_len": 0,
        "schema": BATCH.tag,
        "holder": "test",
        "lease_epoch": 1,
        "config_hash": "test",
        "learner_step": max(slot - 1, 0),
        "ingested_files": [],
        "quarantined_files": [],
        "late_files": [],
        "filled_no_signal": 0,
        "sealed": {},
        "lineage": Lineage(n_rollouts=0, n_groups=0, policy_steps=[0, 0], staleness=[0.0, 0.0, 0.0], source_files=[]),
        "cursor": Cursor(version=1, seen=[], reservoir=Reservoir(next_seq=0, files=[]), late=[], sweep_next=0),
        "data_file": layout.batch_data_file(slot, "test"),
        "data_size": 0,
        "data_sha256": "",
        "rows": 0,
        "time": time.time(),
        "dropped_file": None,
        "dropped": {},
    }
    return BatchLogEntry(**{**base, **fields})


def put_log_entry(store: RunStore, slot: int, **fields: Any) -> bool:
    """Commit a valid log entry of `slot` (create-if-absent); True if this call created it."""
    return store.put_if_absent(layout.batch_log_entry(slot), log_entry(slot, **fields).to_json())
