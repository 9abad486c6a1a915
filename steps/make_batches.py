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

Algorithm (the phases of `main`; the machinery they call is `pipeline.batch_maker.loop`):
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
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from pipeline.batch_maker import BatchResult
from pipeline.batch_maker.loop import BatchMakerLoop
from pipeline.batch_maker.loop_state import LoopState, SlotLost, StopRequested, new_slot_log
from pipeline.config import BatchMakerStepConfig, validate_batch_maker
from pipeline.process.step_kind import StepKind
from pipeline.store.lease import Lease
from pipeline.store.poll import WaitTimeout
from pipeline.store.storage import RunStore

logger = logging.getLogger("steps.make_batches")

LEASE_NAME = StepKind.BATCHMAKER
"""`leases/batchmaker/`: the one BatchMaker lease of a run root."""

BatchWaitTimeout = WaitTimeout
"""A wait exceeded train.max_batch_latency_s (exit code 4, `Exit.TIMEOUT`); the message names what was awaited."""


# ---------------------------------------------------------------------------------------------- main
def main(config: BatchMakerStepConfig) -> int:
    """Run the BatchMaker step (see the module docstring); returns 0 once it stopped as configured.

    Raises ConfigError, LeaseHeldError, LeaseLostError, BatchWaitTimeout (`pipeline.store.poll.WaitTimeout`).
    """
    train = config.train
    validate_batch_maker(config)

    # phase 1: storage and lease
    store = RunStore(config.store.run_root, config.store.storage_options)
    holder = config.holder_id or f"{socket.gethostname()}-{os.getpid()}"
    lease = Lease(store, LEASE_NAME, holder, config.lease_ttl_s)
    signals = _StopSignals()
    signals.install()
    try:
        # a lease left by a stopped holder (killed: no release) is waited for until it lapses; a live one is refused
        lease.acquire_waiting(
            take_over_own=config.lease_take_over_own, interval_s=config.polling.interval_s, sleep=signals.sleep
        )
    except StopRequested:
        signals.restore()
        logger.info("%s while waiting for the lease: stopping", signals.name)
        return 0
    except BaseException:
        signals.restore()
        raise
    maker = BatchMakerLoop(config, store, lease)
    maker.signalled = lambda: signals.name
    written = 0  # slots committed (or being written) by this process
    try:
        # phase 2: recover consumed state from the committed batch log
        st = _recover(maker)
        progress = _progress_bar(st.next_slot - 1, train.num_train_steps)

        def after_commit(slot: int, batch: BatchResult, log: dict[str, Any]) -> None:
            # 3e. curriculum, 3f. metrics and progress, once the slot's log entry exists
            maker.sync_curriculum(slot, log["tables"])
            maker.record(batch, log)
            progress(slot, batch)

        maker.after_commit = after_commit

        # phase 3: one slot at a time, until a stop condition of phase 4 holds
        while True:
            slot = st.next_slot
            try:
                if _should_stop(maker, config, slot, written):
                    break
                _make_slot(maker, st, slot)
                written += 1
                st.next_slot = slot + 1
            except WaitTimeout as e:
                if not maker.bounded:
                    raise
                # a scheduled job with nothing more to do: what was committed stands, a rerun continues
                maker.settle()
                logger.info("bounded mode: nothing more to do: committed %d of max_batches=%s batches; next slot %d "
                            "%s", written, config.max_batches, slot, e)  # fmt: skip
                break
            except SlotLost as lost:
                # another maker committed that slot first: everything built since is discarded
                logger.warning("slot %s was taken by another maker; recovering from the batch log", lost)
                if lost.args[0] < slot:
                    written -= 1  # counted when it was handed to the writer
                st = _recover(maker)
    except StopRequested:
        logger.info("%s: stopping", maker.stop_reason())
        try:
            maker.settle()
        except SlotLost as lost:
            logger.warning("slot %s was taken by another maker", lost)
    finally:
        # phase 4: finish a write in flight, flush and let go
        maker.close()
        maker.metrics.flush()
        try:
            lease.release()
        except Exception as e:  # best effort on the way out; the lease lapses by itself
            logger.warning("could not release the lease: %s", e)
        signals.restore()
    logger.info("BatchMaker done: %d batches written by this process", written)
    return 0


def _recover(maker: BatchMakerLoop) -> LoopState:
    """Phase 2: the state after the newest committed slot, with the curriculum published up to it."""
    st = maker.recover()
    maker.sync_curriculum(st.next_slot - 1)
    return st


def _make_slot(maker: BatchMakerLoop, st: LoopState, slot: int) -> None:
    """Phases 3a-3d for one slot; raises SlotLost if another maker committed it (or the previous one) first."""
    log = new_slot_log()

    # 3a. pace: T <= learner_step + max_batches_ahead
    log["wait_s"] += maker.pace(slot)

    # 3b. gather rollouts, 3c. build
    maker.gather(st, slot, log)
    t0 = time.monotonic()
    batch = st.bm.make_batch(slot)
    log["build_s"] = time.monotonic() - t0
    if batch is None:  # cannot happen after gather() returned ready; be loud if it does
        raise RuntimeError(f"batch slot {slot}: BatchMaker reported ready but built nothing")

    # 3d. commit: settles the previous slot, then writes this one (behind, with write_behind)
    if not maker.commit(st, batch, log, maker.learner_now()):
        raise SlotLost(slot)


def _should_stop(maker: BatchMakerLoop, config: BatchMakerStepConfig, slot: int, written: int) -> bool:
    """Phase 4, checked before slot `slot`: whether to stop (the slot being written is settled first)."""
    if maker.stop_requested():
        maker.settle()
        logger.info("%s: stopping before slot %d", maker.stop_reason(), slot)
        return True
    if config.max_batches is not None and written >= config.max_batches:
        maker.settle()
        logger.info("bounded mode: wrote %d batches; next slot %d", written, slot)
        return True
    if slot > config.train.num_train_steps:
        maker.settle()
        if config.follow:
            maker.wait_for_learner_finish(config.train.num_train_steps)
        logger.info("all %d batch slots are committed", config.train.num_train_steps)
        return True
    return False


class _StopSignals:
    """SIGTERM/SIGINT: a clean stop, as with control/STOP (the slot being written is settled, the lease released);
    a second signal stops at once (KeyboardInterrupt; the lease is still released on the way out)."""

    def __init__(self) -> None:
        self.name: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (e.g. a step run in-process by a test)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.name is not None:
            raise KeyboardInterrupt
        self.name = signal.Signals(signum).name

    def sleep(self, seconds: float) -> None:
        """A sleep that ends the lease wait with StopRequested once a stop signal arrived."""
        if self.name is None:
            time.sleep(seconds)
        if self.name is not None:
            raise StopRequested


def _progress_bar(start: int, total: int) -> Callable[[int, BatchResult], None]:
    """A progress callback: tqdm when stderr is a terminal, a log line per batch otherwise."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc="batches", unit="batch")

        def update(slot: int, b: BatchResult) -> None:
            bar.update(1)
            bar.set_postfix(reward=f"{b.stats['reward_mean']:.3f}", lag=f"{b.stats['lag_mean']:.2f}")

        return update

    def log_line(slot: int, b: BatchResult) -> None:
        s = b.stats
        logger.info(
            "committed slot %d/%d: %d rollouts, reward %.3f, staleness %.2f, padding %.2f",
            slot, total, s["n_rollouts"], s["reward_mean"], s["lag_mean"], s["padding_fraction"],
        )  # fmt: skip

    return log_line


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
    from steps.cli import run_program

    # LeaseHeldError, LeaseLostError and WaitTimeout map to their exit codes in steps.cli's one table
    return run_program(BatchMakerStepConfig, lambda config: main(config) or 0, argv)


if __name__ == "__main__":
    sys.exit(cli())
