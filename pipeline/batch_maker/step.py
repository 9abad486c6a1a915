"""The BatchMaker step's phases around `BatchMakerLoop`: taking the lease, the slot loop with its stop conditions,
recovery after a lost slot, and letting go; plus the stop signals and the progress report.

`steps/make_batches.py` runs them in order (its `main` reads as the phases; its docstring states the contract: what
is read and written under the run root, and in which order); this module holds how each phase is done.
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
from pipeline.config import BatchMakerStepConfig
from pipeline.process.step_kind import StepKind
from pipeline.store.lease import Lease
from pipeline.store.poll import WaitTimeout
from pipeline.store.storage import RunStore

logger = logging.getLogger("steps.make_batches")  # the step's own logger: its lines read as the step's

LEASE_NAME = StepKind.BATCHMAKER
"""`leases/batchmaker/`: the one BatchMaker lease of a run root."""


class StopSignals:
    """SIGTERM/SIGINT: a clean stop, as with control/STOP (the slot being written is settled, the lease released);
    a second signal stops at once (KeyboardInterrupt; the lease is still released on the way out)."""

    def __init__(self) -> None:
        self.name: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Handle SIGTERM and SIGINT from now on (only in the main thread: elsewhere nothing changes)."""
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (e.g. a step run in-process by a test)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Put back the handlers `install` replaced."""
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


def acquire_lease(store: RunStore, config: BatchMakerStepConfig, signals: StopSignals) -> Lease | None:
    """Phase 1: the `batchmaker` lease, held; None when a stop signal arrived while waiting for it (the signal
    handlers are then restored, as they are when anything else is raised)."""
    holder = config.holder_id or f"{socket.gethostname()}-{os.getpid()}"
    lease = Lease(store, LEASE_NAME, holder, config.lease_ttl_s)
    try:
        # a lease left by a stopped holder (killed: no release) is waited for until it lapses; a live one is refused
        lease.acquire_waiting(
            take_over_own=config.lease_take_over_own, interval_s=config.polling.interval_s, sleep=signals.sleep
        )
    except StopRequested:
        signals.restore()
        logger.info("%s while waiting for the lease: stopping", signals.name)
        return None
    except BaseException:
        signals.restore()
        raise
    return lease


def make_slots(maker: BatchMakerLoop, config: BatchMakerStepConfig) -> int:
    """Phases 2-4 until a stop condition holds: recover from the batch log, then make one slot at a time (again
    from the log when another maker took a slot); returns the number of slots this process committed."""
    written = 0  # slots committed (or being written) by this process
    try:
        # phase 2: recover consumed state from the committed batch log
        st = recover(maker)
        progress = progress_bar(st.next_slot - 1, config.train.num_train_steps)

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
                if should_stop(maker, config, slot, written):
                    break
                make_slot(maker, st, slot)
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
                st = recover(maker)
    except StopRequested:
        logger.info("%s: stopping", maker.stop_reason())
        try:
            maker.settle()
        except SlotLost as lost:
            logger.warning("slot %s was taken by another maker", lost)
    return written


def let_go(maker: BatchMakerLoop, lease: Lease, signals: StopSignals) -> None:
    """Phase 4's end, whatever stopped the slots: finish a write in flight, flush the metrics, release the lease
    (best effort: it lapses by itself) and restore the signal handlers."""
    maker.close()
    maker.metrics.flush()
    try:
        lease.release()
    except Exception as e:  # best effort on the way out; the lease lapses by itself
        logger.warning("could not release the lease: %s", e)
    signals.restore()


def recover(maker: BatchMakerLoop) -> LoopState:
    """Phase 2: the state after the newest committed slot, with the curriculum published up to it."""
    st = maker.recover()
    maker.sync_curriculum(st.next_slot - 1)
    return st


def make_slot(maker: BatchMakerLoop, st: LoopState, slot: int) -> None:
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


def should_stop(maker: BatchMakerLoop, config: BatchMakerStepConfig, slot: int, written: int) -> bool:
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


def progress_bar(start: int, total: int) -> Callable[[int, BatchResult], None]:
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
