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
  metrics/batchmaker/…                      one metrics record per batch (`METRICS` below)

Algorithm (the phases of `main`):
  1. acquire the `batchmaker` lease (held elsewhere: exit code 3, message names the holder);
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
     (follow mode), `max_batches` were written (bounded mode), or control/STOP exists. Every wait fails
     loudly after train.max_batch_latency_s (exit code 4) naming what it waited for.

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

import bisect
import dataclasses
import hashlib
import json
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from pipeline import layout, run_state
from pipeline.batch_maker import BatchMaker, BatchResult
from pipeline.config import BatchMakerStepConfig, ConfigError
from pipeline.curriculum import CurriculumWriter
from pipeline.lease import Lease, LeaseHeldError, LeaseLostError
from pipeline.metrics import MetricsWriter
from pipeline.prefetch import read_ahead
from pipeline.storage import RunStore, new_attempt_id
from schemas import BATCH, ROLLOUT
from schemas.dropped import DROPPED

logger = logging.getLogger("steps.make_batches")

LEASE_NAME = "batchmaker"
LEARNER_DONE = getattr(layout, "LEARNER_DONE", "control/LEARNER_DONE")
LATE_SCAN_STEPS = 4
"""Policy folders scanned below the staleness window, so late files are recorded as dropped `stale`."""
CURSOR_VERSION = 1
"""Version 1 cursors without `late` / `sweep_next` (written before late sweeps) still restore."""

EXIT_CONFIG = 2
EXIT_LEASE_HELD = 3
EXIT_TIMEOUT = 4
EXIT_LEASE_LOST = 5

METRICS = {
    "slot": "batch slot T",
    "n_rollouts": "rollout rows in the batch (segments)",
    "n_groups": "distinct (file, group) groups in the batch",
    "staleness_min/mean/max": "(T-1) - policy_step over the batch's rollouts",
    "mean_reward": "mean episode reward of the batch's rollouts",
    "advantage_mean/std/abs_mean/min/max": "advantage statistics over the batch's rollouts",
    "tokens / loss_tokens": "non-padding tokens / tokens with loss_mask 1",
    "padding_fraction": "1 - tokens / (batch_size * seq_len)",
    "dropped_<reason>": "rollout rows dropped while building this slot, per reason",
    "groups_filtered_zero_variance": "groups dropped because all their rewards were equal",
    "rows_filled_no_signal": "rows admitted with advantage 0 (train.no_signal_fill_after)",
    "files_ingested": "rollout files first read for this slot",
    "wait_s / ingest_s / build_s / write_s": "time waiting for the learner or rollouts / reading / building / writing",
}


class BatchWaitTimeout(RuntimeError):
    """A wait exceeded train.max_batch_latency_s; the message names what was awaited."""


class StopRequested(Exception):
    """control/STOP appeared."""


class SlotLost(Exception):
    """Another maker committed the slot this one was writing; its state must be recovered from the log."""


@dataclasses.dataclass
class PendingCommit:
    """A slot whose files and log entry are being written by the writer thread (write-behind)."""

    slot: int
    batch: BatchResult
    log: dict[str, Any]
    future: Future[bool]


# ---------------------------------------------------------------------------------------------- helpers
def config_hash(config: BatchMakerStepConfig) -> str:
    """Short hash of the batch-shaping parameters (train.*), stamped into every log entry."""
    blob = json.dumps(dataclasses.asdict(config.train), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def learner_step(store: RunStore) -> int | None:
    """The newest committed policy step, or None before policy 0."""
    return run_state.latest_policy_step(store)


last_committed_slot = run_state.last_committed_slot
rollout_folders = run_state.rollout_folders


def folder_of(path: str) -> int:
    """The policy step P of a `rollouts/step-P/...` path."""
    return layout.parse_step(path)


@dataclasses.dataclass
class MakerState:
    """What the maker knows between slots: the reservoir, seen files, and the next slot to build."""

    bm: BatchMaker
    next_slot: int
    seen: set[str]
    restored_from: int
    late: set[str] = dataclasses.field(default_factory=set)
    """Files found by late sweeps in folders already below the scan window (recorded as dropped)."""
    sweep_next: int = 0
    """The policy folder the next late sweep starts from (round robin over folders below the window)."""


class Maker:
    """One BatchMaker process's loop state (store, lease, config, metrics)."""

    def __init__(self, config: BatchMakerStepConfig, store: RunStore, lease: Lease) -> None:
        self.config = config
        self.train = config.train
        self.store = store
        self.lease = lease
        self.holder = lease.holder
        self.hash = config_hash(config)
        self.metrics = MetricsWriter(store, "batchmaker", re.sub(r"[^A-Za-z0-9_.=+-]", "_", self.holder))
        # the one writer of curriculum state: folds each committed slot's rollouts and named evals
        self.curriculum = CurriculumWriter(store, config.curriculum) if config.curriculum is not None else None
        self._last_renew = time.monotonic()
        # write-behind: one thread encodes and writes slot T's files and log entry while slot T+1 is gathered
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="batch-writer") if config.write_behind else None
        self._pending: PendingCommit | None = None
        self._seals: dict[int, frozenset[str]] = {}  # policy folder -> files seen in it when it left the window
        self._unsealed_warned: set[int] = set()
        self.after_commit: Callable[[int, BatchResult, dict[str, Any]], None] = lambda slot, batch, log: None
        """Called (main thread) once slot T's log entry exists: curriculum, metrics, progress."""

    # --- lease + stop -------------------------------------------------------------------------
    def keep_lease(self) -> None:
        """Renew the lease when a third of its ttl passed; check the stop file."""
        if time.monotonic() - self._last_renew > self.lease.ttl_s / 3:
            self.lease.renew()
            self._last_renew = time.monotonic()

    def stop_requested(self) -> bool:
        return self.store.exists(layout.STOP_FILE)

    def wait_until(self, cond: Callable[[], bool], what: Callable[[], str], progress: Callable[[], Any]) -> float:
        """Poll `cond` until true; the deadline restarts whenever `progress()` changes. Returns seconds waited."""
        t0 = time.monotonic()
        last_progress = progress()
        deadline = t0 + self.train.max_batch_latency_s
        while not cond():
            if self.stop_requested():
                raise StopRequested
            now = time.monotonic()
            p = progress()
            if p != last_progress:
                last_progress, deadline = p, now + self.train.max_batch_latency_s
            if now > deadline:
                raise BatchWaitTimeout(
                    f"waited {now - t0:.1f}s (> train.max_batch_latency_s={self.train.max_batch_latency_s}) "
                    f"for {what()}"
                )
            self.settle()  # about to wait anyway: finish the previous slot's commit first
            self.keep_lease()
            time.sleep(self.config.poll_interval_s)
        return time.monotonic() - t0

    def learner_now(self) -> int:
        """Newest committed policy step; -1 before policy 0."""
        s = learner_step(self.store)
        return -1 if s is None else s

    def pace(self, slot: int) -> float:
        """Wait until slot <= learner_step + max_batches_ahead; returns seconds waited."""
        ahead = self.train.max_batches_ahead
        need = slot - ahead
        return self.wait_until(
            lambda: self.learner_now() >= need,
            lambda: (
                f"the learner to publish policy {need} ({layout.policy_marker(max(0, need))}; newest is "
                f"{self.learner_now()}) before batch slot {slot} (max_batches_ahead={ahead})"
            ),
            self.learner_now,
        )

    # --- recovery ------------------------------------------------------------------------------
    def recover(self) -> MakerState:
        """Rebuild state from the newest committed log entry's cursor (nothing at all: a fresh start)."""
        t0 = time.monotonic()
        self._seals.clear()  # a lost slot may have cached seals that never committed
        last = last_committed_slot(self.store)
        bm = BatchMaker(self.train)
        if last == 0:
            logger.info("no committed batch slot yet: starting at slot 1")
            return MakerState(bm, 1, set(), 0)
        entry = self.store.get_json(layout.batch_log_entry(last))
        if entry.get("config_hash") != self.hash:
            logger.warning(
                "slot %d was built with train config %s, this process has %s", last, entry.get("config_hash"), self.hash
            )
        cursor = entry.get("cursor") or {}
        if cursor.get("version") != CURSOR_VERSION:
            raise RuntimeError(f"{layout.batch_log_entry(last)}: unknown cursor version {cursor.get('version')!r}")
        reservoir = cursor["reservoir"]
        for f in reservoir["files"]:
            table = self.store.read_committed(f["path"], ROLLOUT)
            if table is None:
                logger.error("live rollout file %s became unreadable (quarantined); its live rows are lost", f["path"])
                continue
            bm.restore_file(
                table, f["path"], seq=f["seq"], policy_step=f["policy_step"], rows=f["rows"], uses=f["uses"]
            )
            self.keep_lease()
        bm.set_next_seq(reservoir["next_seq"])
        logger.info(
            "recovered from slot %d in %.2fs: %d live rollouts in %d files, %d files seen",
            last,
            time.monotonic() - t0,
            bm.n_live,
            len(reservoir["files"]),
            len(cursor["seen"]),
        )
        return MakerState(
            bm, last + 1, set(cursor["seen"]), last, set(cursor.get("late", [])), int(cursor.get("sweep_next", 0))
        )

    # --- one slot ----------------------------------------------------------------------------
    def scan_low(self, slot: int) -> int:
        return max(0, slot - 1 - self.train.max_lag - LATE_SCAN_STEPS)

    def discover(self, slot: int, seen: set[str], folders: list[int] | None = None) -> list[tuple[int, str]]:
        """Committed, unseen, unquarantined rollout files of scanned policy folders, as (P, path), sorted.

        `folders`: the policy folders listed by the caller (None: list them now).
        """
        low = self.scan_low(slot)
        out = []
        for p in rollout_folders(self.store, low) if folders is None else [f for f in folders if f >= low]:
            for path in self.store.list_committed(layout.rollout_step_dir(p)):
                if path not in seen:
                    out.append((p, path))
        return sorted(out)

    # --- late files ----------------------------------------------------------------------------
    def sealed_folders(self, slot: int, seen: set[str]) -> dict[str, list[str]]:
        """The folders that leave the scan window with slot `slot`, each with the files seen in it.

        Stamped into slot `slot`'s log entry (so it commits atomically with the slot); a late sweep later
        treats any other committed file of such a folder as late.
        """
        leaving = range(self.scan_low(slot), self.scan_low(slot + 1))
        out: dict[str, list[str]] = {str(p): [] for p in leaving}
        for path in seen:
            p = folder_of(path)
            if p in leaving:
                out[str(p)].append(path)
        return {p: sorted(v) for p, v in out.items()}

    def seal(self, p: int) -> frozenset[str] | None:
        """Files seen in policy folder `p` when it left the scan window; None if that is not (yet) known."""
        if p in self._seals:
            return self._seals[p]
        at = p + 1 + self.train.max_lag + LATE_SCAN_STEPS  # the slot whose commit moved the window past p
        try:
            sealed = self.store.get_json(layout.batch_log_entry(at)).get("sealed")
        except FileNotFoundError:
            return None  # not committed yet (or still being written behind)
        if sealed is None or str(p) not in sealed:
            if p not in self._unsealed_warned:  # older log format, or max_lag changed since: cannot tell
                self._unsealed_warned.add(p)
                logger.warning("no seal for rollout folder %d in %s: late files there are not swept", p,
                               layout.batch_log_entry(at))  # fmt: skip
            return None
        self._seals[p] = frozenset(sealed[str(p)])
        return self._seals[p]

    def sweep_late(
        self, st: MakerState, slot: int, latest: int, folders: list[int], log: dict[str, Any], limit: int | None
    ) -> None:
        """Record, as dropped, the rows of files committed into folders that already left the scan window.

        Sweeps up to `limit` such folders (None: all), round robin from `st.sweep_next`. A file is late when
        its folder's seal (the files seen when the folder left the window) does not name it and no earlier
        sweep found it; its rows go through `ingest`, which drops them all as `stale`.
        """
        low = self.scan_low(slot)
        old = [p for p in folders if p < low]
        if not old or limit == 0:
            return
        start = bisect.bisect_left(old, st.sweep_next)
        picks = old[start:] + old[:start]
        for p in picks if limit is None else picks[:limit]:
            st.sweep_next = p + 1
            seal = self.seal(p)
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

    def gather(self, st: MakerState, slot: int, log: dict[str, Any]) -> None:
        """Feed files until batch `slot` can be built (waiting for more files if needed)."""
        bm = st.bm
        window_low = slot - 1 - self.train.max_lag
        t0 = time.monotonic()
        deadline = t0 + self.train.max_batch_latency_s
        newest = -1
        swept = False
        while True:
            folders = rollout_folders(self.store)
            files = self.discover(slot, st.seen, folders)  # list rollouts BEFORE reading the learner step:
            latest = learner_step(self.store)  # every file listed was produced by a published policy
            latest = -1 if latest is None else latest
            if not swept:  # once per slot; every old folder at the final slot, so a finished run is complete
                final = slot >= self.train.num_train_steps
                self.sweep_late(st, slot, latest, folders, log, None if final else self.config.late_sweep_folders)
                swept = True
            # Read (and verify) the next files while this one is being ingested; a file read ahead but not
            # needed stays unconsumed (reading has no effect but quarantining a corrupt file, which is final).
            reads = read_ahead(lambda f: self.store.read_committed(f[1], ROLLOUT), files, self.config.read_ahead)
            for (p, path), table in reads:
                in_window = window_low <= p <= latest
                if in_window and not bm.wants_more(slot):
                    continue  # leave it on disk: never consume more than needed
                self.ingest(st, slot, latest, p, path, table.result(), log)
                newest = max(newest, p)
                self.keep_lease()
            if bm.ready(slot):
                return
            if self.stop_requested():
                raise StopRequested
            now = time.monotonic()
            if now > deadline:
                n, _ = bm.eligible(slot)
                raise BatchWaitTimeout(
                    f"waited {now - t0:.1f}s (> train.max_batch_latency_s={self.train.max_batch_latency_s}) for "
                    f"rollouts for batch slot {slot}: have {n} eligible of {self.train.batch_size} needed, from "
                    f"committed files under {layout.ROLLOUTS}/step-P with {max(0, window_low)} <= P <= "
                    f"{slot - 1} (newest published policy {latest})"
                )
            self.settle()  # about to wait anyway: finish the previous slot's commit first
            self.keep_lease()
            time.sleep(self.config.poll_interval_s)
            log["wait_s"] += self.config.poll_interval_s

    def ingest(
        self, st: MakerState, slot: int, latest: int, p: int, path: str, table: pa.Table | None, log: dict[str, Any]
    ) -> None:
        """Feed one committed rollout file, as read by `read_committed` (None: quarantined, skipped)."""
        t0 = time.monotonic()
        st.seen.add(path)
        if table is None:
            log["quarantined_files"].append(path)
            logger.warning("slot %d: skipping quarantined rollout file %s", slot, path)
            return
        after = self.train.no_signal_fill_after
        if self.train.filter_zero_variance and 0 < after <= log["no_signal_files"] and not log["no_signal_fill"]:
            log["no_signal_fill"] = True
            logger.warning("slot %d: %d rollout files read for this slot had every group filtered as zero variance (no "
                           "learning signal); admitting zero-variance groups with advantage 0 to fill this slot "
                           "(train.no_signal_fill_after=%d)", slot, log["no_signal_files"], after)  # fmt: skip
        rep = st.bm.add_rollouts(
            table, path, slot=slot, latest_policy=latest, dir_policy_step=p, admit_no_signal=log["no_signal_fill"]
        )
        if rep.admitted == 0 and rep.filtered_groups.get("zero_variance", 0):
            log["no_signal_files"] += 1
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

    def commit(self, st: MakerState, batch: BatchResult, log: dict[str, Any], learner: int) -> bool:
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
        low = self.scan_low(slot + 1)
        sealed = self.sealed_folders(slot, st.seen)
        seen = sorted(s for s in st.seen if folder_of(s) >= low)
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
        if self.curriculum is not None:
            # which eval summaries the curriculum folds at this slot, fixed now so a rebuild folds the same ones
            entry["curriculum_evals"] = self.curriculum.evals_to_fold(slot)
            entry["curriculum_eval_values"] = self.curriculum.eval_values(entry["curriculum_evals"])
        self.keep_lease()
        st.seen = set(seen)  # if the slot is lost, recover() replaces the whole state anyway
        self._seals.update((int(p), frozenset(v)) for p, v in sealed.items())

        def write() -> bool:
            t0 = time.monotonic()
            info = self.store.write_parquet(layout.batch_data_file(slot, attempt), batch.table, BATCH)
            dropped_counts: dict[str, int] = {}
            dropped_path = None
            if dropped.num_rows:
                dropped_path = layout.dropped_file(slot, attempt)
                self.store.write_parquet(dropped_path, dropped, DROPPED)
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
            ok = self.store.put_json_if_absent(layout.batch_log_entry(slot), entry)
            log["write_s"] = time.monotonic() - t0
            log["dropped"] = dropped_counts
            if not ok:
                logger.warning("slot %d was committed by another maker; discarding %s and recovering", slot, info.path)
            return ok

        if self._writer is None:
            ok = write()
            if ok:
                self.after_commit(slot, batch, log)
            return ok
        self._pending = PendingCommit(slot, batch, log, self._writer.submit(write))
        return True

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

    def sync_curriculum(self, slot: int, tables: dict[str, pa.Table] | None = None) -> None:
        """Publish curriculum state up to committed slot `slot` (no-op without a curriculum or before slot 1)."""
        if self.curriculum is not None and slot >= 1:
            t0 = time.monotonic()
            self.curriculum.sync(slot, tables)
            logger.debug("curriculum synced to slot %d in %.3fs", slot, time.monotonic() - t0)

    def record(self, batch: BatchResult, log: dict[str, Any]) -> None:
        """One metrics record per committed batch."""
        s = batch.stats
        rec: dict[str, Any] = {
            "slot": batch.slot,
            "n_rollouts": s["n_rollouts"],
            "n_groups": s["n_groups"],
            "staleness_min": s["lag_min"],
            "staleness_mean": s["lag_mean"],
            "staleness_max": s["lag_max"],
            "mean_reward": s["reward_mean"],
            "advantage_mean": s["advantage_mean"],
            "advantage_std": s["advantage_std"],
            "advantage_abs_mean": s["advantage_abs_mean"],
            "advantage_min": s["advantage_min"],
            "advantage_max": s["advantage_max"],
            "tokens": s["tokens"],
            "loss_tokens": s["loss_tokens"],
            "padding_fraction": s["padding_fraction"],
            "segments_per_row": s["segments_per_row"],
            "n_truncated": s["n_truncated"],
            "n_cut_overlong": s["n_cut_overlong"],
            "files_ingested": len(log["ingested_files"]),
            "groups_filtered_zero_variance": log["groups_filtered_zero_variance"],
            "rows_filled_no_signal": log["filled_no_signal"],
            "wait_s": log["wait_s"],
            "ingest_s": log["ingest_s"],
            "build_s": log["build_s"],
            "write_s": log["write_s"],
        }
        for reason, n in log["dropped"].items():
            rec[f"dropped_{reason}"] = n
        self.metrics.log(rec)


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
        "no_signal_fill": False,
        "filled_no_signal": 0,
        "dropped": {},
        "tables": {},
    }


# ---------------------------------------------------------------------------------------------- main
def main(config: BatchMakerStepConfig) -> None:
    """Run the BatchMaker step (see the module docstring). Raises LeaseHeldError, BatchWaitTimeout, ConfigError."""
    train = config.train
    if config.max_batches is not None and config.max_batches < 1:
        raise ConfigError("max_batches", config.max_batches, "must be >= 1 or null")
    BatchMaker(train)  # validates what the BatchMaker needs of the config (pad_multiple)

    # phase 1: storage and lease
    store = RunStore(config.store.run_root, config.store.storage_options)
    holder = config.holder_id or f"{socket.gethostname()}-{os.getpid()}"
    lease = Lease(store, LEASE_NAME, holder, config.lease_ttl_s)
    lease.acquire(take_over_own=config.lease_take_over_own)
    maker = Maker(config, store, lease)
    written = 0  # slots committed (or being written) by this process
    try:
        # phase 2: recover consumed state from the committed batch log
        st = maker.recover()
        maker.sync_curriculum(st.next_slot - 1)
        progress = _progress_bar(st.next_slot - 1, train.num_train_steps)

        def after_commit(slot: int, batch: BatchResult, log: dict[str, Any]) -> None:
            # 3e. curriculum, 3f. metrics and progress, once the slot's log entry exists
            maker.sync_curriculum(slot, log["tables"])
            maker.record(batch, log)
            progress(slot, batch)

        maker.after_commit = after_commit

        # phase 3: one slot at a time
        while True:
            slot = st.next_slot
            try:
                if maker.stop_requested():
                    maker.settle()
                    logger.info("control/STOP found: stopping before slot %d", slot)
                    break
                if config.max_batches is not None and written >= config.max_batches:
                    maker.settle()
                    logger.info("bounded mode: wrote %d batches; next slot %d", written, slot)
                    break
                if slot > train.num_train_steps:
                    maker.settle()
                    if config.follow:
                        _wait_for_learner_finish(maker, train.num_train_steps)
                    logger.info("all %d batch slots are committed", train.num_train_steps)
                    break
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
                written += 1
                st.next_slot = slot + 1
            except SlotLost as lost:
                # another maker committed that slot first: everything built since is discarded
                logger.warning("slot %s was taken by another maker; recovering from the batch log", lost)
                if lost.args[0] < slot:
                    written -= 1  # counted when it was handed to the writer
                st = maker.recover()
                maker.sync_curriculum(st.next_slot - 1)
    except StopRequested:
        logger.info("control/STOP found: stopping")
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
    logger.info("BatchMaker done: %d batches written by this process", written)


def _wait_for_learner_finish(maker: Maker, num_train_steps: int) -> None:
    """Follow mode, after the last slot: wait until the learner consumed it (policy num_train_steps)."""
    maker.wait_until(
        lambda: maker.learner_now() >= num_train_steps or maker.store.exists(LEARNER_DONE),
        lambda: f"the learner to finish step {num_train_steps} ({layout.policy_marker(num_train_steps)})",
        maker.learner_now,
    )


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

    return run_program(
        BatchMakerStepConfig,
        lambda config: main(config) or 0,
        argv,
        exit_codes={
            LeaseHeldError: (EXIT_LEASE_HELD, "another BatchMaker holds the run's lease; exiting"),
            LeaseLostError: (EXIT_LEASE_LOST, "lost the BatchMaker lease"),
            BatchWaitTimeout: (EXIT_TIMEOUT, "timed out"),
        },
    )


if __name__ == "__main__":
    sys.exit(cli())
