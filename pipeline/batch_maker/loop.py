"""One BatchMaker process's loop machinery: lease upkeep, pacing by the learner, gathering committed rollout
files (with late sweeps), write-behind commits of batch slots, and recovery from the newest log entry's cursor.

`pipeline.batch_maker.step` drives it slot by slot for the step program `steps/make_batches.py`, whose docstring
states the contract (what is read and written under the run root, and in which order).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from pipeline.batch_maker import BatchMaker, BatchResult
from pipeline.batch_maker.loop_state import CURSOR_VERSION, LoopState, SlotLost, StopRequested, config_hash
from pipeline.batch_maker.scan import ScanWindow
from pipeline.batch_maker.slot_metrics import batch_metrics, fill_starts, fills_at_once
from pipeline.config import BatchMakerStepConfig
from pipeline.curriculum import CurriculumWriter
from pipeline.process.step_kind import StepKind
from pipeline.store import layout, run_state, staleness
from pipeline.store.lease import Lease
from pipeline.store.notify import waker_for
from pipeline.store.poll import poll_until
from pipeline.store.prefetch import read_ahead
from pipeline.store.storage import RunStore, new_attempt_id
from pipeline.telemetry.metrics import MetricsWriter
from schemas import BATCH, ROLLOUT
from schemas.dropped import DROPPED
from schemas.records import BatchLogEntry

logger = logging.getLogger(__name__)

LATENCY_SETTING = "train.max_batch_latency_s"
"""The config field that bounds every wait of the step (named in the timeout message)."""


@dataclasses.dataclass
class PendingCommit:
    """A slot whose files and log entry are being written by the writer thread (write-behind)."""

    slot: int
    batch: BatchResult
    log: dict[str, Any]
    future: Future[bool]


class BatchMakerLoop:
    """One BatchMaker process's loop state (store, lease, config, metrics)."""

    def __init__(self, config: BatchMakerStepConfig, store: RunStore, lease: Lease) -> None:
        self.config = config
        self.train = config.train
        self.store = store
        self.lease = lease
        self.holder = lease.holder
        self.hash = config_hash(config)
        # One file per slot: the slot's record reaches the tracker and the progress line before the learner trains it.
        self.metrics = MetricsWriter(
            store, StepKind.BATCHMAKER, re.sub(r"[^A-Za-z0-9_.=+-]", "_", self.holder), flush_every=1
        )
        # the one writer of curriculum state: folds each committed slot's rollouts and named evals
        self.curriculum = CurriculumWriter(store, config.curriculum) if config.curriculum is not None else None
        self.scan = ScanWindow(store, config.train.max_lag)
        self.waker = waker_for(store)
        self._last_renew = time.monotonic()
        # write-behind: one thread encodes and writes slot T's files and log entry while slot T+1 is gathered
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="batch-writer") if config.write_behind else None
        self._pending: PendingCommit | None = None
        self.prev_filled: tuple[int, int, bool] = (0, 0, False)
        """(slot, its `filled_no_signal`, `no_signal_fill_from_start`) of the newest slot committed or recovered:
        `fills_at_once` for the next."""
        self.after_commit: Callable[[int, BatchResult, dict[str, Any]], None] = lambda slot, batch, log: None
        """Called (main thread) once slot T's log entry exists: curriculum, metrics, progress."""
        self.signalled: Callable[[], str | None] = lambda: None
        """The name of a stop signal received (SIGTERM/SIGINT), else None: a stop as clean as control/STOP."""
        self.bounded = config.max_batches is not None  # a bound wins over a `follow` inherited from the job config
        """Bounded mode (a scheduled job): every wait ends after `polling.bounded_wait_s`, and the step exits 0 saying
        what it waited for, instead of failing after train.max_batch_latency_s."""
        self.wait_s = config.polling.bounded_wait_s if self.bounded else self.train.max_batch_latency_s
        self.wait_setting = "polling.bounded_wait_s" if self.bounded else LATENCY_SETTING

    # --- lease, stop, waits -------------------------------------------------------------------
    def keep_lease(self) -> None:
        """Renew the lease when a third of its ttl passed."""
        if time.monotonic() - self._last_renew > self.lease.ttl_s / 3:
            self.lease.renew()
            self._last_renew = time.monotonic()

    def stop_requested(self) -> bool:
        """Whether a stop signal arrived or control/STOP exists."""
        return self.signalled() is not None or self.store.exists(layout.STOP_FILE)

    def stop_reason(self) -> str:
        """What stopped the step: the signal's name, else control/STOP."""
        return self.signalled() or f"{layout.STOP_FILE} found"

    def raise_if_stopped(self) -> None:
        """Raise StopRequested when control/STOP exists (checked by every wait before its deadline)."""
        if self.stop_requested():
            raise StopRequested

    def _before_sleep(self) -> None:
        self.settle()  # about to wait anyway: finish the previous slot's commit first
        self.keep_lease()

    def wait(self, cond: Callable[[], bool], what: Callable[[], str], progress: Callable[[], Any]) -> float:
        """Poll `cond` until true; returns seconds waited.

        Raises StopRequested when control/STOP appears, `pipeline.store.poll.WaitTimeout` naming `what()` after
        train.max_batch_latency_s (bounded mode: `polling.bounded_wait_s`); the deadline restarts whenever `progress()`
        changes.
        """

        def done() -> bool | None:
            if cond():
                return True
            self.raise_if_stopped()
            return None

        return self._poll(done, what, progress)

    def _poll(
        self, round_: Callable[[], bool | None], what: Callable[[], str], progress: Callable[[], Any] | None = None
    ) -> float:
        """Call `round_` until it returns True, under the loop's one wait policy (its deadline and setting, its
        polling interval, the lease kept and the previous commit settled before each sleep, woken by the run
        root's changes); returns seconds waited."""
        _, waited = poll_until(
            round_,
            timeout_s=self.wait_s,
            what=what,
            interval_s=self.config.polling.interval_s,
            setting=self.wait_setting,
            on_wait=self._before_sleep,
            progress=progress,
            waker=self.waker,
        )
        return waited

    def learner_now(self) -> int:
        """Newest committed policy step; -1 before policy 0."""
        s = run_state.latest_policy_step(self.store)
        return -1 if s is None else s

    def pace(self, slot: int) -> float:
        """Wait until slot <= learner_step + max_batches_ahead; returns seconds waited."""
        ahead = self.train.max_batches_ahead
        need = slot - ahead
        return self.wait(
            lambda: self.learner_now() >= need,
            lambda: (
                f"the learner to publish policy {need} ({layout.policy_marker(max(0, need))}; newest is "
                f"{self.learner_now()}) before batch slot {slot} (max_batches_ahead={ahead})"
            ),
            self.learner_now,
        )

    def wait_for_learner_finish(self, num_train_steps: int) -> None:
        """Follow mode, after the last slot: wait until the learner consumed it (policy num_train_steps)."""
        self.wait(
            lambda: self.learner_now() >= num_train_steps or self.store.exists(layout.LEARNER_DONE),
            lambda: f"the learner to finish step {num_train_steps} ({layout.policy_marker(num_train_steps)})",
            self.learner_now,
        )

    # --- recovery ------------------------------------------------------------------------------
    def recover(self) -> LoopState:
        """Rebuild state from the newest committed log entry's cursor (nothing at all: a fresh start)."""
        t0 = time.monotonic()
        self.scan.forget()
        last = run_state.last_committed_slot(self.store)
        bm = BatchMaker(self.train)
        if last == 0:
            logger.info("no committed batch slot yet: starting at slot 1")
            self.prev_filled = (0, 0, False)
            return LoopState(bm, 1, set(), 0)
        entry = self.store.read_log_entry(last)  # an unknown cursor version is refused here, by name
        self.prev_filled = (last, entry.filled_no_signal, entry.no_signal_fill_from_start)
        if entry.config_hash != self.hash:
            logger.warning(
                "slot %d was built with train config %s, this process has %s", last, entry.config_hash, self.hash
            )
        cursor = entry.cursor
        reservoir = cursor.reservoir
        for f in reservoir.files:
            table = self.store.read_committed(f.path, ROLLOUT)
            if table is None:
                logger.error("live rollout file %s became unreadable (quarantined); its live rows are lost", f.path)
                continue
            bm.restore_file(table, f.path, seq=f.seq, policy_step=f.policy_step, rows=f.rows, uses=f.uses)
            self.keep_lease()
        bm.set_next_seq(reservoir.next_seq)
        logger.info(
            "recovered from slot %d in %.2fs: %d live rollouts in %d files, %d files seen",
            last,
            time.monotonic() - t0,
            bm.n_live,
            len(reservoir.files),
            len(cursor.seen),
        )
        return LoopState(bm, last + 1, set(cursor.seen), last, set(cursor.late), cursor.sweep_next)

    # --- one slot ----------------------------------------------------------------------------
    def gather(self, st: LoopState, slot: int, log: dict[str, Any]) -> None:
        """Feed files until batch `slot` can be built (waiting for more files if needed).

        Raises StopRequested when control/STOP appears, `pipeline.store.poll.WaitTimeout` after
        train.max_batch_latency_s without enough eligible rollouts.
        """
        bm = st.bm
        window_low, window_high = staleness.window(slot, self.train.max_lag)
        _, prev, prev_start = self.prev_filled if self.prev_filled[0] == slot - 1 else (0, 0, False)
        t = self.train
        if fills_at_once(prev, prev_start, t.batch_size, filter_zero_variance=t.filter_zero_variance,
                         no_signal_fill_after=t.no_signal_fill_after):  # fmt: skip
            log["no_signal_fill"] = log["no_signal_fill_from_start"] = True  # saturated: fill T from its start
            logger.info("slot %d: slot %d was filled with %d rows without learning signal; admitting zero-variance "
                        "groups with advantage 0 from the first file", slot, slot - 1, prev)  # fmt: skip
        latest = -1  # the newest published policy, as of the latest listing
        swept = False

        def one_round() -> bool | None:
            nonlocal latest, swept
            # only the folders from the scan window on (a start-offset listing: O(window), not O(run))
            folders = run_state.rollout_folders(self.store, self.scan.scan_low(slot))
            files = self.scan.discover(slot, st.seen, folders)  # list rollouts BEFORE reading the learner step:
            latest = self.learner_now()  # every file listed was produced by a published policy
            if not swept:  # once per slot; every old folder at the final slot, so a finished run is complete
                final = slot >= self.train.num_train_steps
                self.sweep_late(st, slot, latest, log, None if final else self.config.late_sweep_folders)
                swept = True
            # Read (and verify) the next files while this one is being ingested; a file read ahead but not
            # needed stays unconsumed (reading has no effect but quarantining a corrupt file, which is final).
            reads = read_ahead(lambda f: self.store.read_committed(f[1], ROLLOUT), files, self.config.read_ahead)
            for (p, path), table in reads:
                in_window = window_low <= p <= latest
                if in_window and not bm.wants_more(slot):
                    continue  # leave it on disk: never consume more than needed
                self.ingest(st, slot, latest, p, path, table.result(), log)
                self.keep_lease()
            if bm.ready(slot):
                return True
            self.raise_if_stopped()
            return None

        ingest_before = log["ingest_s"]

        def what() -> str:
            n, _ = bm.eligible(slot)
            return (
                f"rollouts for batch slot {slot}: have {n} eligible of {self.train.batch_size} needed, from "
                f"committed files under {layout.ROLLOUTS}/step-P with {max(0, window_low)} <= P <= "
                f"{window_high} (newest published policy {latest})"
            )

        waited = self._poll(one_round, what)
        log["wait_s"] += max(0.0, waited - (log["ingest_s"] - ingest_before))
        log["batch_noticed_at"] = time.time()

    def sweep_late(self, st: LoopState, slot: int, latest: int, log: dict[str, Any], limit: int | None) -> None:
        """Record, as dropped, the rows of files committed into folders that already left the scan window.

        Sweeps up to `limit` policy folders P < scan_low (None: every existing one, found by listing rollouts/),
        round robin from `st.sweep_next`: with a limit the folders are named (P = sweep_next, sweep_next + 1, …,
        wrapping to 0), so a slot's sweep costs `limit` listings however long the run (an absent folder lists
        empty). A file is late when its folder's seal (the files seen when the folder left the window) does not
        name it and no earlier sweep found it; its rows go through `ingest`, which drops them all as `stale`.
        """
        low = self.scan.scan_low(slot)
        if low == 0 or limit == 0:
            return
        if limit is None:
            old = [p for p in run_state.rollout_folders(self.store) if p < low]
            start = bisect.bisect_left(old, st.sweep_next)
            picks = old[start:] + old[:start]
        else:
            first = st.sweep_next if st.sweep_next < low else 0
            picks = [(first + i) % low for i in range(min(limit, low))]
        for p in picks:
            st.sweep_next = p + 1
            seal = self.scan.seal(p)
            if seal is None:
                continue
            for path in self.store.list_committed(layout.rollout_step_dir(p)):
                if path in seal or path in st.late:
                    continue
                logger.warning("slot %d: %s was committed after rollout folder %d left the scan window "
                               "(slot %d scans policies >= %d); its rows are recorded as dropped", slot, path, p,
                               slot, low)  # fmt: skip
                st.late.add(path)
                log["late_files"].append(path)
                self.ingest(st, slot, latest, p, path, self.store.read_committed(path, ROLLOUT), log)

    def ingest(
        self, st: LoopState, slot: int, latest: int, p: int, path: str, table: pa.Table | None, log: dict[str, Any]
    ) -> None:
        """Feed one committed rollout file, as read by `read_committed` (None: quarantined, skipped)."""
        t0 = time.monotonic()
        log["noticed"][path] = time.time()
        st.seen.add(path)
        if table is None:
            log["quarantined_files"].append(path)
            logger.warning("slot %d: skipping quarantined rollout file %s", slot, path)
            return
        t = self.train
        starts = fill_starts(log["no_signal_files"], log["no_signal_rows"], t.batch_size, t.no_signal_fill_after)
        if t.filter_zero_variance and starts and not log["no_signal_fill"]:
            log["no_signal_fill"] = True
            logger.warning("slot %d: %d rollout files (%d rows) read for this slot had every group filtered as zero "
                           "variance (no learning signal); admitting zero-variance groups with advantage 0 to fill "
                           "this slot (train.no_signal_fill_after=%d)", slot, log["no_signal_files"],
                           log["no_signal_rows"], t.no_signal_fill_after)  # fmt: skip
        rep = st.bm.add_rollouts(
            table, path, slot=slot, latest_policy=latest, dir_policy_step=p, admit_no_signal=log["no_signal_fill"]
        )
        if rep.without_signal:
            log["no_signal_files"] += 1
            log["no_signal_rows"] += table.num_rows
        if log["no_signal_fill"]:
            log["filled_no_signal"] += rep.admitted_no_signal
        log["ingested_files"].append(path)
        if self.curriculum is not None:
            log["tables"][path] = table  # folded into the curriculum right after the commit, without a re-read
        log["ingest_s"] += time.monotonic() - t0
        log["groups_filtered_zero_variance"] += rep.filtered_groups.get("zero_variance", 0)
        if rep.dropped:
            logger.info("slot %d: %s: %d rows, admitted %d, dropped %s", slot, path, rep.rows, rep.admitted,
                        rep.dropped)  # fmt: skip

    # --- commit ------------------------------------------------------------------------------
    def commit(self, st: LoopState, batch: BatchResult, log: dict[str, Any], learner: int) -> bool:
        """Commit slot T: write the data + dropped files, then create the slot's log entry.

        The previous slot's commit is settled first (raising SlotLost if another maker took it). Everything
        that reads the BatchMaker's state (dropped rows, the cursor) happens here, on the calling thread. With
        `write_behind` the writing itself goes to the writer thread and this returns True at once: the outcome
        arrives through `settle()` (`after_commit` on success, SlotLost otherwise). Without it, returns True iff
        this maker took the slot (then `after_commit` has run).
        """
        self.settle()
        slot = batch.slot
        attempt = new_attempt_id()
        dropped = st.bm.take_dropped(slot)
        low = self.scan.scan_low(slot + 1)
        sealed = self.scan.sealed_folders(slot, st.seen)
        seen = sorted(s for s in st.seen if layout.parse_step(s) >= low)
        entry = self.slot_entry(st, batch, log, learner, attempt, sealed, seen)
        self.prev_filled = (slot, int(log["filled_no_signal"]), bool(log.get("no_signal_fill_from_start")))
        self.keep_lease()
        st.seen = set(seen)  # if the slot is lost, recover() replaces the whole state anyway
        self.scan.remember(sealed)

        def write() -> bool:
            return write_slot(self.store, slot, attempt, batch, dropped, entry, log)

        if self._writer is None:
            ok = write()
            if ok:
                self.after_commit(slot, batch, log)
            return ok
        self._pending = PendingCommit(slot, batch, log, self._writer.submit(write))
        return True

    def slot_entry(
        self,
        st: LoopState,
        batch: BatchResult,
        log: dict[str, Any],
        learner: int,
        attempt: str,
        sealed: dict[str, list[str]],
        seen: list[str],
    ) -> dict[str, Any]:
        """Slot T's log entry as far as it is known before the files are written (with its cursor)."""
        slot = batch.slot
        s = batch.stats
        entry: dict[str, Any] = {
            "slot": slot,
            "attempt_id": attempt,
            "seq_len": s["row_len"],
            "schema": BATCH.tag,
            "holder": self.holder,
            "lease_epoch": self.lease.epoch,
            "config_hash": self.hash,
            "learner_step": learner,
            "ingested_files": list(log["ingested_files"]),
            "quarantined_files": list(log["quarantined_files"]),
            "late_files": list(log["late_files"]),
            "filled_no_signal": log["filled_no_signal"],
            "no_signal_fill_from_start": bool(log.get("no_signal_fill_from_start")),
            "sealed": sealed,
            "lineage": {
                "n_rollouts": s["n_rollouts"],
                "n_groups": s["n_groups"],
                "policy_steps": [s["policy_step_min"], s["policy_step_max"]],
                "staleness": [s["lag_min"], s["lag_mean"], s["lag_max"]],
                "source_files": sorted(set(batch.source_files)),
            },
            "cursor": {
                "version": CURSOR_VERSION,
                "seen": seen,
                "reservoir": st.bm.snapshot(),
                "late": sorted(st.late),
                "sweep_next": st.sweep_next,
            },
        }
        entry["timing"] = slot_timing(batch, log)
        if self.curriculum is not None:
            # which eval summaries the curriculum folds at this slot, fixed now so a rebuild folds the same ones
            entry["curriculum_evals"] = self.curriculum.evals_to_fold(slot)
            entry["curriculum_eval_values"] = self.curriculum.eval_values(entry["curriculum_evals"])
        return entry

    def settle(self) -> None:
        """Wait for the slot being written (if any): run `after_commit`, or raise SlotLost if it was taken."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if not pending.future.result():
            raise SlotLost(pending.slot)
        self.after_commit(pending.slot, pending.batch, pending.log)

    def close(self) -> None:
        """Let a write in flight finish (its commit stands; `after_commit` is not run for it)."""
        self._pending = None
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    # --- after a commit ------------------------------------------------------------------------
    def sync_curriculum(self, slot: int, tables: dict[str, pa.Table] | None = None) -> None:
        """Publish curriculum state up to committed slot `slot` (no-op without a curriculum or before slot 1)."""
        if self.curriculum is not None and slot >= 1:
            t0 = time.monotonic()
            self.curriculum.sync(slot, tables)
            logger.debug("curriculum synced to slot %d in %.3fs", slot, time.monotonic() - t0)

    def record(self, batch: BatchResult, log: dict[str, Any]) -> None:
        """One metrics record per committed batch (fields: `pipeline.batch_maker.slot_metrics.METRICS`)."""
        self.metrics.log(batch_metrics(batch, log))


def write_slot(
    store: RunStore,
    slot: int,
    attempt: str,
    batch: BatchResult,
    dropped: pa.Table,
    entry: dict[str, Any],
    log: dict[str, Any],
) -> bool:
    """Write slot T's data and dropped files, then create its log entry; True iff this maker took the slot.

    Safe on the writer thread: touches only its arguments and the store (a function, not a method, so it cannot
    reach the loop's state).
    """
    t0 = time.monotonic()
    info = store.write_parquet(layout.batch_data_file(slot, attempt), batch.table, BATCH)
    dropped_counts: dict[str, int] = {}
    dropped_path = None
    if dropped.num_rows:
        dropped_path = layout.dropped_file(slot, attempt)
        store.write_parquet(dropped_path, dropped, DROPPED)
        for r in dropped.column("reason").to_pylist():
            dropped_counts[r] = dropped_counts.get(r, 0) + 1
    entry.update(
        data_file=info.path,
        data_size=info.size,
        data_sha256=info.sha256,
        rows=info.rows,
        time=time.time(),
        dropped_file=dropped_path,
        dropped=dropped_counts,
    )
    entry["timing"]["batch_committed_at"] = entry["time"]
    log["batch_committed_at"] = entry["time"]
    path = layout.batch_log_entry(slot)
    ok = store.put_if_absent(path, BatchLogEntry.from_json(entry, path=path).to_json())
    log["write_s"] = time.monotonic() - t0
    log["dropped"] = dropped_counts
    if not ok:
        logger.warning("slot %d was committed by another maker; discarding %s and recovering", slot, info.path)
    return ok


def slot_timing(batch: BatchResult, log: dict[str, Any]) -> dict[str, Any]:
    """The log entry's `timing` (see `schemas.records.BatchLogEntry.timing`) as known before the write."""
    noticed = {f: log["noticed"][f] for f in batch.source_files if f in log["noticed"]}
    last = max(noticed, key=lambda f: noticed[f]) if noticed else None
    return {
        "batch_noticed_at": log["batch_noticed_at"],
        "last_file": last,
        "last_file_noticed_at": noticed[last] if last is not None else None,
    }
