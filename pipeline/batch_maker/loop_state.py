"""What the BatchMaker step carries between slots and within one slot, and how its loop is interrupted."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from pipeline.batch_maker import BatchMaker
from pipeline.config import BatchMakerStepConfig
from schemas.records import Cursor

CURSOR_VERSION = Cursor.VERSION
"""Version 1 cursors without `late` / `sweep_next` (written before late sweeps) still restore."""


class StopRequested(Exception):
    """control/STOP appeared."""


class SlotLost(Exception):
    """Another maker committed the slot this one was writing; its state must be recovered from the log."""


@dataclasses.dataclass
class LoopState:
    """What the maker knows between slots: the reservoir, seen files, and the next slot to build."""

    bm: BatchMaker
    next_slot: int
    seen: set[str]
    restored_from: int
    late: set[str] = dataclasses.field(default_factory=set)
    """Files found by late sweeps in folders already below the scan window (recorded as dropped)."""
    sweep_next: int = 0
    """The policy folder the next late sweep starts from (round robin over folders below the window)."""


def config_hash(config: BatchMakerStepConfig) -> str:
    """Short hash of the batch-shaping parameters (train.*), stamped into every log entry."""
    blob = json.dumps(dataclasses.asdict(config.train), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def new_slot_log() -> dict[str, Any]:
    """Per-slot bookkeeping while building one slot."""
    return {
        "ingested_files": [],
        "quarantined_files": [],
        "late_files": [],
        "wait_s": 0.0,
        "ingest_s": 0.0,
        "build_s": 0.0,
        "write_s": 0.0,
        "groups_filtered_zero_variance": 0,
        "no_signal_files": 0,
        "no_signal_rows": 0,
        "no_signal_fill": False,
        "filled_no_signal": 0,
        "dropped": {},
        "tables": {},
        "noticed": {},
        "batch_noticed_at": None,
    }
