"""The machinery of the BatchMaker step (`python -m steps.make_batches`), free of JAX.

`maker.Maker` is one process's loop state (lease upkeep, pacing, gathering, write-behind commits, recovery);
`scan` owns which rollout folders a slot lists and their seals; `state` what is carried between slots;
`metrics` the per-batch metrics record.
"""

from pipeline.batch_step.maker import Maker, PendingCommit
from pipeline.batch_step.metrics import METRICS, batch_metrics
from pipeline.batch_step.scan import LATE_SCAN_STEPS, ScanWindow, folder_of
from pipeline.batch_step.state import CURSOR_VERSION, MakerState, SlotLost, StopRequested, config_hash, new_slot_log

__all__ = [
    "CURSOR_VERSION",
    "LATE_SCAN_STEPS",
    "METRICS",
    "Maker",
    "MakerState",
    "PendingCommit",
    "ScanWindow",
    "SlotLost",
    "StopRequested",
    "batch_metrics",
    "config_hash",
    "folder_of",
    "new_slot_log",
]
