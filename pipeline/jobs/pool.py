"""The elastic rollout pool (`rollout_pool:` in the job config): when to add or remove a rollout worker.

The job runner asks a `PoolController` once per supervision tick; the controller reads only the metrics records
the steps already write to the run root (`pipeline.telemetry.metrics.MetricsTail`):

- learner idle: the learner's per-step records, `wait_s / (wait_s + train_s)` (how much of its time it waited for
  its next batch; the first step, which waits for every step to start, is left out);
- workers paused: the rollout workers' `pause` records (`paused_s`: time paused by pacing, ahead of the learner or
  waiting for a newer policy; a paused worker logs one every `pipeline.rollout.worker.PAUSE_RECORD_S` seconds and
  one when it produces again) per worker-second of the window, each counted only for its part inside the window;
- waste: the BatchMaker's per-slot records, `rows_wasted / n_rollouts` (`pipeline.batch_maker.slot_metrics`).

Signals are taken over the last `window_s` seconds, and only from records written after the last change, so a
decision never counts what the pool did before its previous one. Up: the learner waited at least
`scale_up_learner_wait`, the workers were not paused and waste was below `scale_down_waste`. Down: the workers were
paused at least `scale_down_paused` while the learner did not wait, or waste was at least `scale_down_waste` (a
learner that waits while most rows are dropped, e.g. on a saturated lesson whose groups all score the same, waits
for rows with signal: more workers would only drop more). At most one change per `cooldown_s`, always within
`min_workers..max_workers`.

Every decision (and the pool's size at the start) is one immutable JSON-lines file `pool/<runner>-<seq>.jsonl`
under the run root (`read_pool_records`), so the report can show the pool's size over time.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.config.pacing import RolloutPoolConfig
from pipeline.process.step_kind import StepKind
from pipeline.telemetry.metrics import MetricsTail

if TYPE_CHECKING:
    from pipeline.store.storage import RunStore

logger = logging.getLogger(__name__)

POOL_DIR = "pool"
"""Run-root folder of the pool's records: `pool/<runner>-<seq>.jsonl`, one file per record."""
MIN_LEARNER_STEPS = 2
"""Learner records needed in the window before the learner-idle signal counts."""
MIN_SLOTS = 2
"""BatchMaker records needed in the window before the waste signal counts."""


@dataclass(frozen=True)
class PoolSignals:
    """What the run root said over one window (None: too few records to tell)."""

    learner_wait: float | None
    """Fraction of the learner's step time spent waiting for its batch."""
    paused: float | None
    """Fraction of the workers' time spent paused by pacing."""
    waste: float | None
    """Rows dropped for a waste reason per row trained."""

    def describe(self) -> str:
        """`learner_wait=0.42 paused=0.05 waste=0.10` (`-` for a signal without records)."""

        def f(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        return f"learner_wait={f(self.learner_wait)} paused={f(self.paused)} waste={f(self.waste)}"


@dataclass(frozen=True)
class PoolDecision:
    """One change of the pool: `delta` +1 (add a worker) or -1 (remove one), and why."""

    delta: int
    reason: str
    signals: PoolSignals


class PoolSignalReader:
    """Follows the learner, BatchMaker and rollout metrics records of a run root (each file read once)."""

    def __init__(self, store: RunStore) -> None:
        self._tail = MetricsTail(store, (StepKind.LEARNER, StepKind.BATCHMAKER, StepKind.ROLLOUT))
        self._records: list[dict[str, Any]] = []

    def read(self, since: float, workers: int, now: float | None = None) -> PoolSignals:
        """The signals over the records written at or after unix time `since` (older ones are forgotten), with
        `workers` rollout workers in the pool."""
        now = time.time() if now is None else now
        self._records = [r for r in (*self._records, *self._tail.new_records()) if float(r.get("time", 0)) >= since]
        learner = [r for r in self._records if r.get("kind") == StepKind.LEARNER and int(r.get("step", 0)) > 1]
        learner = [r for r in learner if "wait_s" in r and "train_s" in r]
        wait = sum(float(r["wait_s"]) for r in learner)
        busy = sum(float(r["train_s"]) for r in learner)
        learner_wait = wait / (wait + busy) if len(learner) >= MIN_LEARNER_STEPS and wait + busy > 0 else None
        rollout = [
            r for r in self._records if r.get("kind") == StepKind.ROLLOUT and r.get("event") in ("write", "pause")
        ]
        span = max(now - since, 1e-9) * max(workers, 1)
        # a pause record covers the `paused_s` before its `time`: only the part inside the window counts (a worker
        # that paused long before the last change must not count that time against the new pool)
        pause_s = sum(
            min(float(r.get("paused_s", 0.0)), max(0.0, float(r["time"]) - since))
            for r in rollout
            if r["event"] == "pause"
        )
        paused = min(1.0, pause_s / span) if rollout else None
        slots = [r for r in self._records if r.get("kind") == StepKind.BATCHMAKER and "n_rollouts" in r]
        trained = sum(int(r["n_rollouts"]) for r in slots)
        wasted = sum(int(r.get("rows_wasted", 0)) for r in slots)
        waste = wasted / trained if len(slots) >= MIN_SLOTS and trained > 0 else None
        return PoolSignals(learner_wait, paused, waste)


def decide(cfg: RolloutPoolConfig, workers: int, s: PoolSignals) -> PoolDecision | None:
    """The change the signals call for with `workers` workers now (None: keep the pool as it is); see the module
    docstring for the rules."""
    waits = s.learner_wait is not None and s.learner_wait >= cfg.scale_up_learner_wait
    paused = s.paused is not None and s.paused >= cfg.scale_down_paused
    wasteful = s.waste is not None and s.waste >= cfg.scale_down_waste
    if waits and not paused and not wasteful and workers < cfg.max_workers:
        return PoolDecision(
            +1, f"learner waited {s.learner_wait:.0%} of its steps (>= {cfg.scale_up_learner_wait:.0%})", s
        )
    if ((paused and not waits) or wasteful) and workers > cfg.min_workers:
        why = (
            f"workers paused by pacing {s.paused:.0%} of the time (>= {cfg.scale_down_paused:.0%})"
            if paused
            else f"waste {s.waste:.2f} rows per trained row (>= {cfg.scale_down_waste:g})"
        )
        return PoolDecision(-1, why, s)
    return None


class PoolController:
    """Decides the pool's changes from the run root's records and records each under `pool/`."""

    def __init__(self, store: RunStore, cfg: RolloutPoolConfig, *, now: float | None = None) -> None:
        self._store = store
        self.cfg = cfg
        self._reader = PoolSignalReader(store)
        self._last_change = time.time() if now is None else now
        self._last_check = 0.0
        self._name = f"{socket.gethostname()}-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
        self._seq = 0

    def tick(self, workers: int, now: float | None = None) -> PoolDecision | None:
        """The change due now with `workers` live workers, if any (at most one per `cooldown_s`); reads the run
        root at most once a second."""
        now = time.time() if now is None else now
        if now - self._last_change < self.cfg.cooldown_s or now - self._last_check < 1.0:
            return None
        self._last_check = now
        signals = self._reader.read(max(self._last_change, now - self.cfg.window_s), workers, now)
        decision = decide(self.cfg, workers, signals)
        if decision is not None:
            self._last_change = now
        return decision

    def record(self, event: str, workers: int, **fields: Any) -> None:
        """Write one pool record (`event`: start, up, down, end; `workers`: the pool's size after it)."""
        rec = {"time": time.time(), "event": event, "workers": workers, **fields}
        rel = f"{POOL_DIR}/{self._name}-{self._seq:06d}.jsonl"
        self._seq += 1
        try:
            self._store.put_unique(rel, (json.dumps(rec, sort_keys=True) + "\n").encode())
        except Exception as e:  # the record is for the report: the pool itself goes on
            logger.warning("could not write the pool record %s: %s", rel, e)


def read_pool_records(store: RunStore) -> list[dict[str, Any]]:
    """Every pool record of a run root (`start`, `up`, `down`, `end`; each with `time` and `workers`), oldest
    first; [] for a run without an elastic pool."""
    out: list[dict[str, Any]] = []
    try:
        names = store.list(POOL_DIR)
    except FileNotFoundError:
        return out
    for rel in names:
        if rel.endswith(".jsonl"):
            for line in store.get(rel).decode().splitlines():
                if line.strip():
                    out.append(json.loads(line))
    out.sort(key=lambda r: float(r.get("time", 0.0)))
    return out
