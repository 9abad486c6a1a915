"""The job's live progress, read from the run root alone: learner step of N, batch slot, batch reward,
staleness, and rollout rows per second over the job's wall time.

On a terminal (stderr is a tty) it is one tqdm bar that reaches N when the learner finishes. Otherwise it is
plain log lines: one at start, one per learner step, and one every `QUIET_LOG_S` seconds while the learner
has not moved (saying what the job waits for).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from pipeline.process.step_kind import StepKind
from pipeline.store import run_state
from pipeline.telemetry.metrics import MetricsTail

logger = logging.getLogger("pipeline.jobs.runner")

REFRESH_S = 1.0
"""How often the run root is read for progress."""
QUIET_LOG_S = 10.0
"""Without a terminal: how often a line says the job still waits for the next learner step."""


class RunProgress:
    """What a run root says about progress (see the module docstring); reads each metrics file once."""

    def __init__(self, store: Any, t0: float | None = None) -> None:
        self._store = store
        self._tail = MetricsTail(store, (StepKind.LEARNER, StepKind.BATCHMAKER, StepKind.ROLLOUT))
        self._t0 = time.time() if t0 is None else t0
        self._rows = 0
        self._learner_step = 0
        self._last_batch: dict[str, Any] = {}

    def snapshot(self) -> dict[str, Any]:
        """{learner_step, batch_slot, reward?, staleness?, rollout_rows_per_s, elapsed_s} right now."""
        for rec in self._tail.new_records():
            kind = rec.get("kind")
            if kind == StepKind.LEARNER:
                self._learner_step = max(self._learner_step, int(rec.get("step", 0)))
            elif kind == StepKind.BATCHMAKER:
                self._last_batch = rec
            elif kind == StepKind.ROLLOUT and float(rec.get("time", 0.0)) >= self._t0:
                self._rows += int(rec.get("rows", 0))
        step = max(self._learner_step, run_state.latest_policy_step(self._store) or 0)
        elapsed = max(time.time() - self._t0, 1e-9)
        info: dict[str, Any] = {"learner_step": step, "batch_slot": run_state.last_committed_slot(self._store)}
        if "mean_reward" in self._last_batch:
            info["reward"] = round(float(self._last_batch["mean_reward"]), 3)
        if "staleness_mean" in self._last_batch:
            info["staleness"] = round(float(self._last_batch["staleness_mean"]), 2)
        info["rollout_rows_per_s"] = round(self._rows / elapsed, 1)
        info["elapsed_s"] = round(elapsed, 1)
        return info


class JobProgress:
    """The job runner's progress display (tqdm bar on a terminal, log lines otherwise)."""

    def __init__(
        self,
        store: Any,
        total: int,
        callback: Callable[[dict[str, Any]], None] | None = None,
        *,
        terminal: bool | None = None,
    ) -> None:
        self._run = RunProgress(store)
        self._total = total
        self._callback = callback
        self._terminal = sys.stderr.isatty() if terminal is None else terminal
        self._last_read = 0.0
        self._shown_step = -1
        self._last_line = time.monotonic()
        self._bar: Any = None
        self._redirect: Any = None
        if self._terminal:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=total, desc="learner", unit="step", dynamic_ncols=True, file=sys.stderr)
            # log lines of the runner print above the bar instead of through it
            self._redirect = logging_redirect_tqdm(tqdm_class=tqdm)
            self._redirect.__enter__()
        else:
            logger.info("job started: %d learner steps; one progress line per learner step follows", total)

    def update(self, *, force: bool = False) -> dict[str, Any] | None:
        """Read the run root (at most every REFRESH_S unless `force`) and show what changed."""
        now = time.monotonic()
        if not force and now - self._last_read < REFRESH_S:
            return None
        self._last_read = now
        info = self._run.snapshot()
        step = min(info["learner_step"], self._total)
        shown = {k: info[k] for k in ("batch_slot", "reward", "staleness", "rollout_rows_per_s") if k in info}
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(shown, refresh=True)
        elif step > self._shown_step and step > 0:
            fields = " ".join(f"{k}={v}" for k, v in shown.items())
            for s in range(max(self._shown_step + 1, 1), step + 1):  # one line per step, even if several passed
                logger.info("learner step %d/%d (%.0fs) %s", s, self._total, info["elapsed_s"], fields)
            self._last_line = now
        elif now - self._last_line >= QUIET_LOG_S:
            logger.info(
                "waiting for learner step %d/%d (%.0fs): batch slot %d committed, %s rollout rows/s",
                step + 1,
                self._total,
                info["elapsed_s"],
                info["batch_slot"],
                info["rollout_rows_per_s"],
            )
            self._last_line = now
        self._shown_step = max(self._shown_step, step)
        if self._callback:
            self._callback(info)
        return info

    def close(self) -> None:
        """Show the final state (the bar reaches the last step the learner committed) and release the terminal."""
        self.update(force=True)
        if self._bar is not None:
            self._bar.close()
            self._redirect.__exit__(None, None, None)
            self._bar = None
