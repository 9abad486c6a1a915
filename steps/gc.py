"""The garbage-collection step: one bounded, rerunnable retention pass over a run root.

Reads   run.json (staleness window, evaluation schedule, the `retention` section unless `--retention.*` is
        given), batches/log, checkpoints/*/COMMITTED, policies/*/COMMITTED, rollout ready markers, evals/
Writes  lineage/slots-<first>-<last>-<attempt>.parquet (+ ready marker) before deleting anything,
        gc/plan-N.json before its first deletion and gc/plan-N.done.json after its last, leases/gc/…
Deletes what `pipeline.retention` allows, markers first (see its docstring for the rules and the order).

Run
    python -m steps.gc --store.run_root runs/demo
    python -m steps.gc --store.run_root runs/demo --retention.keep_policies 2 --retention.data_window_slots 2
    make gc RUN=runs/demo

Exit codes (docs/reference/exit-codes.md): 0 done (or nothing to do), 2 bad config, 6 (`Exit.LEASE_HELD`) another
garbage collection holds the lease, 8 the run root's storage refused a write.
"""

from __future__ import annotations

import logging
import sys

from pipeline.config import ConfigError, GcStepConfig
from pipeline.retention import collect
from pipeline.store.storage import RunStore

logger = logging.getLogger("rlpipe.gc")


def main(cfg: GcStepConfig) -> int:
    """Collect once; log what was deleted; 0."""
    store = RunStore(cfg.store.run_root, cfg.store.storage_options)
    if not store.exists("run.json"):
        raise ConfigError("store.run_root", cfg.store.run_root, "is not a run root (no run.json)")
    result = collect(store, cfg.retention, holder=cfg.holder_id, lease_ttl_s=cfg.lease_ttl_s)
    logger.info(
        "garbage collection done: lineage through slot %d (%s new), %d data files and %d folders deleted, "
        "%d old rollout files kept with rows of unrecorded fate, interrupted runs finished: %s",
        result.covered_through,
        result.lineage_file or "none",
        result.deleted_files,
        result.deleted_folders,
        result.kept_unaccounted,
        result.finished_plans or "none",
    )
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`python -m steps.gc [--config_path F] [--field value …]`; returns the exit code."""
    from steps.cli import run_program

    return run_program(GcStepConfig, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
