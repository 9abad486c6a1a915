"""One garbage-collection run over a run root (see `pipeline.retention` for the rules).

Phases: take the `gc` lease; finish every earlier plan that has no done record; read the run's state; extend the
lineage index over the newly deletable slots (committed before anything is deleted); choose what to delete; write
the plan (create-if-absent) and carry it out in the safe order; write the done record; release the lease.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import defaultdict
from typing import Any

import pipeline.retention.keep as keep
import pipeline.retention.lineage as lineage
from pipeline.config import RetentionConfig
from pipeline.store import layout, run_state, staleness
from pipeline.store.lease import Lease
from pipeline.store.storage import RunStore
from schemas.records import CommitMarker, GcPlan, RecordError

logger = logging.getLogger(__name__)

COLLECTED = "COLLECTED"
"""Tombstone the learner leaves in a checkpoint folder whose data it deleted (its own keep_checkpoints)."""


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What garbage collection needs from run.json."""

    max_lag: int
    eval_frequency: int
    lessons: list[str]
    final_step: int | None
    evaluator: bool
    retention: dict[str, Any]

    @classmethod
    def read(cls, store: RunStore) -> RunFacts:
        """The facts of the run root's run.json (FileNotFoundError if it has none: not a run root)."""
        cfg = run_state.read_run_record(store)["config"]  # DamagedInputError when run.json is damaged
        train, curriculum = cfg.get("train", {}), cfg.get("curriculum", {})
        return cls(
            max_lag=int(train.get("max_lag", 1)),
            eval_frequency=int(curriculum.get("eval_frequency", 0)),
            lessons=sorted(curriculum.get("lessons", {})),
            final_step=train.get("num_train_steps"),
            evaluator=bool(cfg.get("evaluator", True)),
            retention=dict(cfg.get("retention") or {}),
        )


@dataclasses.dataclass
class GcResult:
    """What one run did."""

    run: int | None = None
    """Number of the plan this run wrote (None: nothing to delete)."""
    finished_plans: list[int] = dataclasses.field(default_factory=list)
    """Earlier interrupted plans this run completed."""
    lineage_file: str | None = None
    covered_through: int = 0
    deleted_files: int = 0
    deleted_folders: int = 0
    kept_unaccounted: int = 0
    """Old rollout files kept because some row has no recorded fate (yet)."""


class Collector:
    """Garbage collection of one run root under `retention` (call `run()` once)."""

    def __init__(
        self,
        store: RunStore,
        retention: RetentionConfig,
        facts: RunFacts,
        *,
        holder: str = "gc",
        lease_ttl_s: float = 120.0,
    ) -> None:
        self.store = store
        self.retention = retention
        self.facts = facts
        self.lease = Lease(store, "gc", holder, lease_ttl_s)
        self.result = GcResult()
        self._budget = retention.max_deletions

    # phases ----------------------------------------------------------------------------
    def run(self) -> GcResult:
        """One bounded collection; raises LeaseHeldError if another collection holds the lease."""
        self.lease.acquire(take_over_own=True)
        try:
            self._finish_open_plans()
            plan = self._plan()
            if plan is not None:
                self._execute(plan)
                self.result.run = plan.run
        finally:
            self.lease.release()
        return self.result

    def _finish_open_plans(self) -> None:
        for run in self._plan_runs():
            if self.store.exists(layout.gc_done(run)):
                continue
            path = layout.gc_plan(run)
            plan = GcPlan.from_json(self.store.get(path), path=path)
            logger.info("finishing interrupted garbage collection %d", run)
            self._execute(plan)
            self.result.finished_plans.append(run)

    def _plan_runs(self) -> list[int]:
        runs = []
        for rel in self.store.list(layout.GC):
            name = rel.rsplit("/", 1)[-1]
            if name.startswith("plan-") and name.endswith(".json") and not name.endswith(".done.json"):
                runs.append(int(name[len("plan-") : -len(".json")]))
        return sorted(runs)

    def _plan(self) -> GcPlan | None:
        """Extend the lineage index, then choose the deletions; the plan (None: nothing to delete)."""
        last = run_state.last_committed_slot(self.store)
        live, collected = self._checkpoints()
        checkpoint_slot = self._checkpoint_slot(max(live)) if live else None
        horizon = keep.data_horizon(last, self.retention, checkpoint_slot)
        files = lineage.index_files(self.store)
        covered = lineage.covered_through(files)
        if horizon > covered:
            table = lineage.build_index(self.store, covered + 1, horizon)
            self.result.lineage_file = lineage.write_index(self.store, covered + 1, horizon, table)
            files = lineage.index_files(self.store)
            covered = lineage.covered_through(files)
        self.result.covered_through = covered
        data = self._take(self._batch_files(covered)) + self._take(self._rollout_files(last, covered, files))
        folders = self._take(self._policy_folders(last)) + self._take(
            [layout.checkpoint_dir(s) for s in sorted(set(live) - keep.kept_checkpoints(live, self.retention))]
            + [layout.checkpoint_dir(s) for s in collected]
        )
        if not data and not folders:
            return None
        runs = self._plan_runs()
        plan = GcPlan(
            run=(runs[-1] + 1) if runs else 1,
            holder=self.lease.holder,
            time=time.time(),
            lineage_file=self.result.lineage_file,
            data_files=data,
            folders=folders,
        )
        if not self.store.put_if_absent(layout.gc_plan(plan.run), plan.to_json()):
            logger.warning("garbage collection %d was planned concurrently; deleting nothing this time", plan.run)
            return None
        return plan

    def _take(self, items: list[str]) -> list[str]:
        """At most the remaining deletion budget of `items`."""
        taken = items[: max(self._budget, 0)]
        self._budget -= len(taken)
        return taken

    # what may go ---------------------------------------------------------------------------
    def _checkpoints(self) -> tuple[list[int], list[int]]:
        """(live, collected) committed checkpoint steps: collected ones carry the learner's tombstone."""
        committed = run_state.committed_steps(self.store, layout.CHECKPOINTS)
        gone = [s for s in committed if self.store.exists(layout.join(layout.checkpoint_dir(s), COLLECTED))]
        return [s for s in committed if s not in gone], gone

    def _checkpoint_slot(self, step: int) -> int:
        path = layout.checkpoint_marker(step)
        try:
            marker = CommitMarker.from_json(self.store.get(path), path=path)
        except (RecordError, FileNotFoundError) as e:
            logger.warning("checkpoint %d: unreadable marker (%s); keeping every batch file", step, e)
            return 0
        return marker.batch_slot if marker.batch_slot is not None else step

    def _batch_files(self, covered: int) -> list[str]:
        """Batch data files of slots the lineage index covers (attempts that lost their slot included)."""
        out = []
        for rel in self.store.list(layout.BATCH_DATA):
            try:
                if rel.endswith(".parquet") and layout.parse_step(rel) <= covered:
                    out.append(rel)
            except ValueError:
                continue
        return out

    def _rollout_files(self, last: int, covered: int, files: list[lineage.IndexFile]) -> list[str]:
        """Committed rollout files out of the scan window, not in the BatchMaker's reservoir, every row of which
        has a fate in the lineage index."""
        oldest_usable = staleness.oldest_allowed_policy(last + 1, self.facts.max_lag)
        folders = [p for p in run_state.rollout_folders(self.store) if p < oldest_usable]
        if not folders or covered == 0:
            return []
        live = {f.path for f in self.store.read_log_entry(last).cursor.reservoir.files} if last else set()
        index = lineage.read_index(self.store, files, since_slot=folders[0] + 1)
        ids: dict[str, set[str]] = defaultdict(set)
        for rid, src in zip(
            index.column("rollout_id").to_pylist(), index.column("source_file").to_pylist(), strict=True
        ):
            ids[src].add(rid)
        out = []
        for p in folders:
            for rel in self.store.list_committed(layout.rollout_step_dir(p)):
                if rel in live:
                    continue
                if len(ids.get(rel, ())) == self.store.read_marker(rel).rows:
                    out.append(rel)
                else:
                    self.result.kept_unaccounted += 1
        return out

    def _pending_evaluations(self, candidates: list[int]) -> set[int]:
        """Candidates whose scheduled (or started) evaluation misses a lesson summary."""
        out = set()
        for s in candidates:
            started = bool(self.store.list(layout.eval_dir(s)))
            scheduled = self.facts.evaluator and keep.scheduled_evaluation(
                s, self.facts.eval_frequency, self.facts.final_step
            )
            if (started or scheduled) and any(
                not self.store.exists(layout.eval_summary_file(s, lesson)) for lesson in self.facts.lessons
            ):
                out.add(s)
        return out

    def _policy_folders(self, last: int) -> list[str]:
        committed = run_state.committed_steps(self.store, layout.POLICIES)
        keep_set = keep.kept_policies(committed, self.retention, last, self.facts.max_lag, [])
        candidates = [s for s in committed if s not in keep_set]
        pending = self._pending_evaluations(candidates)
        return [layout.policy_dir(s) for s in candidates if s not in pending]

    # deletion --------------------------------------------------------------------------------
    def _execute(self, plan: GcPlan) -> None:
        """Delete what `plan` names in the safe order, then write its done record."""
        for i, rel in enumerate(plan.data_files):
            if rel.endswith(".parquet"):
                self.store.delete(layout.ready_marker(rel))  # uncommitted first: no reader sees a marker alone
            self.store.delete(rel)
            self.result.deleted_files += 1
            if i % 200 == 199:
                self.lease.renew()
        for folder in plan.folders:
            self.store.delete(layout.join(folder, layout.COMMIT_MARKER))  # uncommitted first, then the files
            self._delete_tree(folder)
            self.result.deleted_folders += 1
            self.lease.renew()
        self._remove_empty_dirs(plan)
        self.store.put_json_if_absent(layout.gc_done(plan.run), {"run": plan.run, "time": time.time()})
        logger.info(
            "garbage collection %d: %d data files, %d folders", plan.run, len(plan.data_files), len(plan.folders)
        )

    def _delete_tree(self, folder: str) -> None:
        for rel in self.store.list(folder):
            if self.store.list(rel):  # a sub-folder (e.g. an exported HF folder inside a policy)
                self._delete_tree(rel)
            self.store.delete(rel)
        self._rmdir(folder)

    def _remove_empty_dirs(self, plan: GcPlan) -> None:
        for folder in sorted({rel.rsplit("/", 1)[0] for rel in plan.data_files}):
            if not self.store.list(folder):
                self._rmdir(folder)

    def _rmdir(self, folder: str) -> None:
        """Remove an empty local folder (object stores have no folders)."""
        if self.store.is_local:
            try:
                os.rmdir(self.store.full_path(folder))
            except OSError:
                pass


def collect(
    store: RunStore, retention: RetentionConfig | None = None, *, holder: str = "gc", lease_ttl_s: float = 120.0
) -> GcResult:
    """One garbage collection of `store` under `retention` (None: the run.json's `retention` section)."""
    facts = RunFacts.read(store)
    if retention is None:
        import draccus

        retention = draccus.decode(RetentionConfig, facts.retention) if facts.retention else RetentionConfig()
    return Collector(store, retention, facts, holder=holder, lease_ttl_s=lease_ttl_s).run()
