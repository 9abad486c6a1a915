"""The BatchMaker step: committed rollout files in, committed batch slots out, each rollout row used exactly
as often as allowed or dropped with a recorded reason.

Reads:
  policies/step-S/COMMITTED          learner progress: learner_step = newest committed policy step S
  rollouts/step-P/*.ready.json       committed rollout files (schemas.ROLLOUT), through `RunStore.read_committed`
                                     (a corrupt file is quarantined there and skipped here)
  batches/log/step-T.json            its own committed slots: the newest one holds the cursor to resume from
  evals/step-S/<lesson>.summary.parquet  evaluation summaries (with a curriculum: folded into its state)
  control/STOP, control/LEARNER_DONE stop signals (follow mode)
Writes:
  batches/data/step-T-<attempt>.parquet     the batch (schemas.BATCH): the learner's complete input, with lineage
                                            columns rollout_ids / source_files / policy_steps per segment
  batches/dropped/step-T-<attempt>.parquet  rollout rows dropped while building slot T (schemas.dropped.DROPPED)
  batches/log/step-T.json                   the commit of slot T (create-if-absent), written last
  curriculum/state-T.json                   curriculum state after slot T (with a curriculum; the one writer)
  leases/batchmaker/…                       the lease (a second maker exits non-zero naming the holder)
  metrics/batchmaker/…                      one metrics record per batch (`pipeline.batch_maker.slot_metrics.METRICS`)

Algorithm (the phases of `main`; how each is done is `pipeline.batch_maker.step`, over the machinery of
`pipeline.batch_maker.loop`):
  1. acquire the `batchmaker` lease: one whose holder process is dead on this host is taken over at once; one
     left by a holder elsewhere that stopped renewing it is waited for until it lapses (at most lease_ttl_s, one
     log line); held by a live maker (it renews meanwhile): exit code 6, `Exit.LEASE_HELD`, one line naming the
     holder (docs/reference/exit-codes.md);
  2. recover: list batches/log, read the newest entry K, rebuild the BatchMaker's reservoir from its
     `cursor` (re-reading only the few files that still have live rows) -> next slot T = K + 1;
  3. for each slot T (up to train.num_train_steps):
     a. pace: wait until T <= learner_step + max_batches_ahead;
     b. gather: list committed rollout files of policy folders P >= T-1-max_lag-late_scan_steps. Files
        not yet seen are fed to the BatchMaker (pipeline/batch_maker.py): those of policies below the
        staleness window or above the newest published policy at once (all their rows are dropped
        `stale` / `future_policy`), those inside the window oldest policy first and only while the batch
        still needs rows (never consuming more than needed). Not enough yet: poll again. Once per slot a
        late sweep lists `late_sweep_folders` older folders (round robin; every one at the final slot)
        and drops, as `stale`, the rows of any file committed there after the folder left the window.
        With filter_zero_variance, once `train.no_signal_fill_after` files read for T had every group filtered
        (the task is solved, or hopeless, for the current policy), the rest of slot T admits zero-variance
        groups with advantage 0, so the learner keeps stepping instead of the job stalling (logged, and
        counted as `filled_no_signal` in the entry);
     c. build batch T (staleness window, reuse limit, recency-biased seeded sampling, packing);
     d. commit: put_unique the data file and the dropped file, then put_json_if_absent the log entry.
        If another maker took slot T first, everything built is discarded and state is recovered
        again from the log (the commit, not the lease, is what makes double use impossible). The entry
        also names the eval summaries the curriculum folds at T and their values (`curriculum_evals`,
        `curriculum_eval_values`). With `write_behind`
        (default) the writing runs on one writer thread while slot T+1 is paced and gathered; it is settled
        (waited for) before slot T+1 is committed and before any wait, so at most one slot is in flight and
        slots are still committed in order;
     e. curriculum: once entry T exists, fold slot T's ingested rollouts and named evals, publish
        curriculum/state-T.json (pipeline.curriculum.CurriculumWriter; a restart re-derives the same bytes
        from committed files);
     f. metrics + progress.
  4. stop when: slot num_train_steps is committed (bounded / plain mode), the learner has consumed it
     (follow mode), `max_batches` were written (bounded mode), or control/STOP exists or SIGTERM/SIGINT
     arrived (the slot in flight is settled and the lease released: the next maker starts at once). Every wait
     fails loudly after train.max_batch_latency_s (exit code 4, `Exit.TIMEOUT`) naming what it waited for;
     in bounded mode (`max_batches` set, even with a `follow` inherited from the job config: a scheduled job) a
     wait ends after `polling.bounded_wait_s` and the
     step exits 0 with one line naming what it waited for, the slots it committed standing.

Durable memory (why a restart is fast and exact): each log entry carries a `cursor`: the reservoir's live
rows (per source file: arrival seq, policy step, live row indices and their use counts) and the rollout
files already seen in the scanned policy folders. Slot T's state is therefore a function of the entry of
slot T-1 and the files read while building T; restart reads one log entry plus the live files. A rollout
row's fate is on disk: its uses are the batch files' lineage, a drop is a row of a dropped file named by
a log entry, and a still-live row is in the newest cursor. When a policy folder leaves the scanned range,
the entry of that slot `sealed` it with the files seen there; a file committed into it later (a very slow
worker) is found by a late sweep, listed in that slot's `late_files` (and in the cursor's `late`), and its
rows are dropped `stale`. The final slot sweeps every folder, so a finished run accounts for every file
committed before its last scan.

Run:
  python -m steps.make_batches --store.run_root runs/demo --follow true
  python -m steps.make_batches --store.run_root runs/demo --max_batches 3 --train.batch_size 8
  python -m steps.make_batches --config_path batches.yaml
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from pipeline.batch_maker.loop import BatchMakerLoop
from pipeline.batch_maker.step import StopSignals, acquire_lease, let_go, make_slots
from pipeline.config import BatchMakerStepConfig, validate_batch_maker
from pipeline.store.poll import WaitTimeout
from pipeline.store.storage import RunStore

logger = logging.getLogger("steps.make_batches")

BatchWaitTimeout = WaitTimeout
"""A wait exceeded train.max_batch_latency_s (exit code 4, `Exit.TIMEOUT`); the message names what was awaited."""


# ---------------------------------------------------------------------------------------------- main
def main(config: BatchMakerStepConfig) -> int:
    """Run the BatchMaker step (see the module docstring); returns 0 once it stopped as configured.

    Raises ConfigError, LeaseHeldError, LeaseLostError, BatchWaitTimeout (`pipeline.store.poll.WaitTimeout`).
    """
    validate_batch_maker(config)

    # phase 1: storage and lease (a stop signal while waiting for it: nothing was made, exit 0)
    store = RunStore(config.store.run_root, config.store.storage_options)
    signals = StopSignals()
    signals.install()
    lease = acquire_lease(store, config, signals)
    if lease is None:
        return 0
    maker = BatchMakerLoop(config, store, lease)
    maker.signalled = lambda: signals.name
    try:
        # phases 2-4: recover from the batch log, then one slot at a time until a stop condition holds
        written = make_slots(maker, config)
    finally:
        # phase 4: finish a write in flight, flush and let go
        let_go(maker, lease, signals)
    logger.info("BatchMaker done: %d batches written by this process", written)
    return 0


class _NoPandas:
    """Import finder that reports pandas as absent (see `cli`)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"{name} is not used by the BatchMaker step", name=name)
        return None


def cli(argv: list[str] | None = None) -> int:
    """`python -m steps.make_batches [--config_path F] [--field value …]`; returns the exit code.

    pyarrow imports pandas (when installed) on its first array conversion, which costs seconds of process
    start on a busy machine; this step never needs pandas, so the CLI tells pyarrow it is absent.
    """
    if "pandas" not in sys.modules:
        sys.meta_path.insert(0, _NoPandas())  # type: ignore[arg-type]
    from steps.cli import run_program, step_main

    # LeaseHeldError, LeaseLostError and WaitTimeout map to their exit codes in steps.cli's one table
    return run_program(BatchMakerStepConfig, step_main(main), argv, validate=validate_batch_maker)


if __name__ == "__main__":
    sys.exit(cli())
