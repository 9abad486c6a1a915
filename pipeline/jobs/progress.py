"""The job's live progress, read from the run root alone: learner step of N, batch slot, batch reward,
staleness, and rollout rows per second over the last `ROWS_WINDOW_S` seconds.

A learner step counts once it is committed (its policy, or its metrics record, is in the run root). Each step's
line carries that step's own numbers: its loss (the learner's record of the step) and its batch's reward and
staleness (the BatchMaker's record of its slot), never another step's. The learner and the BatchMaker each commit
one metrics file per step, so a committed step's line waits for those two records, in step order, at most
`STEP_RECORDS_WAIT_S` (then it is printed with what is there, so the display never stalls) and never past
`finish()`. The batch slot and the rollout rate are "now" values, shown on the newest step's line.

On a terminal (stderr is a tty) it is one tqdm bar that reaches N when the learner finishes. Otherwise it is
plain log lines: one at start, one per learner step, and one every `QUIET_LOG_S` seconds while the learner
has not moved (saying what the job waits for). Nothing is printed after `finish()` (the learner finished).
`summary_lines` is the job's closing summary: first and last batch reward, the last evaluation, the report command.
"""

from __future__ import annotations

import logging
import shlex
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipeline.process.step_kind import StepKind
from pipeline.store import run_state
from pipeline.telemetry.metrics import MetricsTail, read_metrics

if TYPE_CHECKING:
    from pipeline.store.storage import RunStore

logger = logging.getLogger("pipeline.jobs.runner")

REFRESH_S = 1.0
"""How often the run root is read for progress."""
QUIET_LOG_S = 10.0
"""Without a terminal: how often a line says the job still waits for the next learner step."""
STEP_RECORDS_WAIT_S = 30.0
"""Without a terminal: how long a committed learner step's line waits for the step's own metrics records."""
ROWS_WINDOW_S = 30.0
"""`rollout_rows_per_s`: rows the rollout workers committed over the last this many seconds (or since the job
started, when shorter), by each write's commit time."""


class RunProgress:
    """What a run root says about progress (see the module docstring); reads each metrics file once."""

    def __init__(self, store: RunStore, t0: float | None = None) -> None:
        self._store = store
        self._tail = MetricsTail(store, (StepKind.LEARNER, StepKind.BATCHMAKER, StepKind.ROLLOUT))
        self._t0 = time.time() if t0 is None else t0
        self._writes: deque[tuple[float, int]] = deque()
        """(commit time, rows) of each rollout write since t0 within the window."""
        self._learner_step = 0
        self._batches: dict[int, dict[str, Any]] = {}
        self._learner: dict[int, dict[str, Any]] = {}
        self._last_batch: dict[str, Any] = {}

    def _read(self) -> None:
        for rec in self._tail.new_records():
            kind = rec.get("kind")
            if kind == StepKind.LEARNER and "step" in rec:
                step = int(rec["step"])
                self._learner_step = max(self._learner_step, step)
                self._learner[step] = rec
            elif kind == StepKind.BATCHMAKER and "slot" in rec:
                self._batches[int(rec["slot"])] = rec
                if int(rec["slot"]) >= int(self._last_batch.get("slot", -1)):
                    self._last_batch = rec
            elif kind == StepKind.ROLLOUT and rec.get("event") == "write":
                at = float(rec.get("rollout_committed_at") or rec.get("time", 0.0))
                if at >= self._t0:
                    self._writes.append((at, int(rec.get("rows", 0))))

    def rows_per_s(self, now: float | None = None) -> float:
        """Rollout rows committed per second over the last ROWS_WINDOW_S seconds (or since t0 when shorter)."""
        now = time.time() if now is None else now
        while self._writes and self._writes[0][0] < now - ROWS_WINDOW_S:
            self._writes.popleft()
        window = max(min(ROWS_WINDOW_S, now - self._t0), 1e-9)
        return sum(rows for _, rows in self._writes) / window

    def has_step_records(self, step: int) -> bool:
        """Whether both records of learner step `step` were read: the learner's and its batch slot's."""
        return step in self._learner and step in self._batches

    def step_fields(self, step: int) -> dict[str, Any]:
        """The fields of learner step `step` itself: its batch's reward and staleness, its loss (when known)."""
        out: dict[str, Any] = {}
        batch = self._batches.get(step, {})
        if "mean_reward" in batch:
            out["reward"] = round(float(batch["mean_reward"]), 3)
        if "staleness_mean" in batch:
            out["staleness"] = round(float(batch["staleness_mean"]), 2)
        if "loss" in self._learner.get(step, {}):
            out["loss"] = round(float(self._learner[step]["loss"]), 4)
        return out

    def snapshot(self) -> dict[str, Any]:
        """{learner_step, batch_slot, reward?, staleness?, rollout_rows_per_s, elapsed_s} right now (reward and
        staleness: of the newest batch slot whose record is in the run root)."""
        self._read()
        step = max(self._learner_step, run_state.latest_policy_step(self._store) or 0)
        now = time.time()
        elapsed = max(now - self._t0, 1e-9)
        info: dict[str, Any] = {"learner_step": step, "batch_slot": run_state.last_committed_slot(self._store)}
        if "mean_reward" in self._last_batch:
            info["reward"] = round(float(self._last_batch["mean_reward"]), 3)
        if "staleness_mean" in self._last_batch:
            info["staleness"] = round(float(self._last_batch["staleness_mean"]), 2)
        info["rollout_rows_per_s"] = round(self.rows_per_s(now), 1)
        info["elapsed_s"] = round(elapsed, 1)
        return info


def summary_lines(store: RunStore, run_root: str) -> list[str]:
    """The job's closing summary: the first and last batch reward, the last evaluation (if any), and the
    `make report` command line that renders the run's report."""
    batches = sorted(
        (r for r in read_metrics(store, StepKind.BATCHMAKER) if "slot" in r and "mean_reward" in r),
        key=lambda r: int(r["slot"]),
    )
    lines = []
    if batches:
        first, last = batches[0], batches[-1]
        lines.append(
            f"batch reward: {float(first['mean_reward']):.3f} (slot {int(first['slot'])}) -> "
            f"{float(last['mean_reward']):.3f} (slot {int(last['slot'])})"
        )
    else:
        lines.append("batch reward: no batch committed")
    evals = [r for r in read_metrics(store, StepKind.EVALUATE) if "policy_step" in r and "mean_reward" in r]
    if evals:
        step = max(int(r["policy_step"]) for r in evals)
        parts = [
            f"{r.get('lesson_id', '?')} reward {float(r['mean_reward']):.3f}"
            + (f" success {float(r['success_rate']):.3f}" if r.get("success_rate") is not None else "")
            for r in evals
            if int(r["policy_step"]) == step and not r.get("external")
        ]
        if parts:
            lines.append(f"last evaluation (policy {step}): " + ", ".join(parts))
    lines.append(f"report: make report RUN={shlex.quote(run_root)}")
    return lines


class JobProgress:
    """The job runner's progress display (tqdm bar on a terminal, log lines otherwise)."""

    def __init__(
        self,
        store: RunStore,
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
        """The last learner step whose line was printed (or that was committed before this job started)."""
        self._committed_at: dict[int, float] = {}
        """Committed learner steps whose line is not printed yet -> monotonic time they were first seen."""
        self._last_line = time.monotonic()
        self._bar: Any = None
        self._redirect: Any = None
        self._finished = False
        self._finishing = False
        if self._terminal:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=total, desc="learner", unit="step", dynamic_ncols=True, file=sys.stderr)
            # log lines of the runner print above the bar instead of through it
            self._redirect = logging_redirect_tqdm(tqdm_class=tqdm)
            self._redirect.__enter__()
        else:
            logger.info("job started: %d learner steps; one progress line per learner step follows", total)
        # A resumed run: the steps committed before this job started are not shown again (a learner that restarts
        # without a checkpoint re-trains them in seconds, which would print a burst of old lines).
        done = min(self._run.snapshot()["learner_step"], total)
        if done > 0:
            self._shown_step = done
            logger.info("resuming: learner step %d/%d was committed before this job started", done, total)
            if self._bar is not None:
                self._bar.n = done
                self._bar.refresh()

    def update(self, *, force: bool = False) -> dict[str, Any] | None:
        """Read the run root (at most every REFRESH_S unless `force`) and show what changed (nothing once
        `finish()` was called)."""
        now = time.monotonic()
        if self._finished or (not force and now - self._last_read < REFRESH_S):
            return None
        self._last_read = now
        info = self._run.snapshot()
        step = min(info["learner_step"], self._total)
        shown = {k: info[k] for k in ("batch_slot", "reward", "staleness", "rollout_rows_per_s") if k in info}
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(shown, refresh=True)
            self._shown_step = max(self._shown_step, step)
        elif step > self._shown_step and step > 0:
            self._show_steps(step, info, now, everything=self._finishing)
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
        if self._callback:
            self._callback(info)
        return info

    def _show_steps(self, step: int, info: dict[str, Any], now: float, *, everything: bool) -> None:
        """One line per committed step up to `step`, in order, each once its own records are in (or it waited
        STEP_RECORDS_WAIT_S, or `everything`: the learner finished and flushed its records); "now" values on the
        line of `step` only."""
        for s in range(max(self._shown_step + 1, 1), step + 1):
            self._committed_at.setdefault(s, now)
        while self._shown_step < step:
            s = max(self._shown_step + 1, 1)
            waited = now - self._committed_at[s]
            if not (everything or self._run.has_step_records(s) or waited >= STEP_RECORDS_WAIT_S):
                return
            fields = self._run.step_fields(s)
            if s == step:
                fields = {"batch_slot": info["batch_slot"], **fields}
                fields["rollout_rows_per_s"] = info["rollout_rows_per_s"]
            text = " ".join(f"{k}={v}" for k, v in fields.items())
            logger.info("learner step %d/%d (%.0fs) %s", s, self._total, info["elapsed_s"], text)
            del self._committed_at[s]
            self._shown_step = s
            self._last_line = now

    def finish(self) -> None:
        """The learner finished (its records are flushed): show its last steps now, and nothing after."""
        self._finishing = True
        self.update(force=True)
        self._finished = True

    def close(self) -> None:
        """Show the final state (the bar reaches the last step the learner committed, every committed step's line
        is printed) and release the terminal."""
        self._finishing = True
        self.update(force=True)
        if self._bar is not None:
            self._bar.close()
            self._redirect.__exit__(None, None, None)
            self._bar = None
