"""The job runner: starts the learner, the BatchMaker, N rollout workers and the evaluator on the job's backend
(`backend: {type: local}`: child processes; `{type: ray}`: Ray tasks; see `pipeline.jobs.launchers`), restarts a crashed
one with bounded exponential backoff (`restart_backoff_s` doubling up to `restart_backoff_max_s`), shows live
progress, and stops everything cleanly when the learner reaches `num_train_steps` or on Ctrl-C. With
`rollout_pool.enabled` it also resizes the pool of rollout workers while the job runs (`pipeline.jobs.pool`): a
worker it adds gets the next unused id (`worker<N>`), a worker it removes is stopped like any step (SIGTERM: it
commits nothing half-done, and what it committed stays for the BatchMaker; killed after `STOP_GRACE_S`).

Restart rules, by the step's exit code (`pipeline.process.exits.Exit`): a code in `NEVER_RESTARTED` (`CONFIG` 2: a
refused configuration, or an error the step hit starting up that fails the same way on every start; `DAMAGED_INPUT`
7; `STORAGE_FAULT` 8: no space, a read-only or misplaced run root; `NO_PROGRESS` 9) is never restarted and stops
the job at once with that code, and the step's one-line reason is printed (the line it wrote off the run root,
`pipeline.jobs.step_logs.read_reason`, so a full run root whose step logs are empty still names the cause; else
the last `error: …` line of its log); `STORAGE_UNAVAILABLE` (75: the run root's storage
could not be reached) is restarted with backoff outside `max_restarts` until the outage has lasted
`STORAGE_OUTAGE_S`; any other failure is restarted with backoff up to `max_restarts` times.

One job per run root: the runner holds the run root's job lease (`leases/job/`, `job_lease`: the lease machinery of
the BatchMaker, `pipeline.store.lease`, whose claims record host and process id) from before its first step starts
until its last has stopped, renewing it as it supervises. A second job on a run root whose job is alive is refused
before anything starts, in one line naming the holder's host, process id and start time (`JobRunningError`, exit 6
"lease held"); the lease of a job that died on this host (SIGKILL, a crash) is taken over at once, one that died
on another host lapses `JOB_LEASE_TTL_S` after its last renewal. Bounded steps started on their own (`steps.run
step …`, scheduled jobs) do not take it: they run side by side as before, but never beside a job
(`pipeline.jobs.job_lease`: either side is refused in one line, exit 6).

Every step is the same program on every backend: `python -m steps.<module> --config_path <yaml>`, with the step
config written as YAML (no pickle). The run root is the only channel between steps, so a restart of any step is
safe at any instant.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import draccus

from pipeline.jobs.job import RLJob
from pipeline.jobs.job_lease import JobLeaseKeeper
from pipeline.jobs.launchers.base import STOP_GRACE_S, StepSpec, make_launcher
from pipeline.jobs.pool import PoolController
from pipeline.jobs.progress import JobProgress, RunProgress
from pipeline.jobs.step_logs import LogTarget, location, log_target, read_reason
from pipeline.process.backoff import backoff_delay
from pipeline.process.exits import LABELS, NEVER_RESTARTED, Exit
from pipeline.process.interrupts import exit_code
from pipeline.process.step_kind import StepKind
from pipeline.run_contract import check_run_config
from pipeline.store import layout, run_state
from pipeline.store.committed import StorageUnavailableError

if TYPE_CHECKING:
    from pipeline.store.storage import RunStore

STORAGE_OUTAGE_S = 600.0
"""How long a step that exits with Exit.STORAGE_UNAVAILABLE (its run root's storage cannot be reached) is
restarted with backoff before the job gives up; these restarts do not count against `max_restarts`."""
HEALTHY_AFTER_S = 60.0
"""A step that has run this long since its start after a storage outage has seen the outage end."""

logger = logging.getLogger(__name__)

EVALUATOR_DRAIN_S = 300.0
"""After the learner finishes, how long the evaluator may take to score the last policies."""
FINAL_EVAL_WAIT_S = 300.0
"""How long the job's learner keeps its tracker run open for the final policy's evaluations (only with an
evaluator; the learner's `final_eval_wait_s`)."""


class JobRunner:
    """Supervises the steps of one RLJob until the learner finishes, a step exhausts its restarts,
    or the user interrupts. Returns 0 on success."""

    def __init__(self, job: RLJob, *, on_progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        from pipeline.store.storage import RunStore

        self.job = job
        self.cfg = job.config
        self.store = RunStore(self.cfg.store.run_root, self.cfg.store.storage_options)
        self._stopping = False
        self._stop_signal: int = signal.SIGINT
        """The signal that stopped the job (its exit code is 128 + it)."""
        self.job_lease = JobLeaseKeeper(self.store, self.cfg.store.run_root)
        """The run root's job lease, held from before the first step starts until the last has stopped."""
        self._on_progress = on_progress
        self._progress: JobProgress | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="rlpipe-job-")
        self.log_dir = location(self.store, layout.LOGS)
        self.logs: dict[str, LogTarget] = {}
        """The log of each step's newest start (`logs/<step>/<attempt>.log` under the run root)."""
        self._started_at: dict[str, float] = {}
        self._outage: dict[str, tuple[float, int]] = {}
        """Per step in a storage outage: (monotonic time of its first Exit.STORAGE_UNAVAILABLE, restarts since)."""
        self.failure: int = Exit.FAILED
        """The job's exit code if a step stops it: Exit.FAILED, or the step's code in NEVER_RESTARTED."""
        self.launcher = make_launcher(self.cfg.backend)
        self._next_worker = self.cfg.num_rollout_workers
        """The index of the next rollout worker the elastic pool adds (indices are never reused)."""
        self._removed: set[str] = set()
        """Rollout workers the elastic pool removed."""
        self._removing: dict[str, float] = {}
        """Rollout workers the pool removed that still run -> monotonic time to kill them by."""
        self.pool: PoolController | None = None
        self.steps = self._build_specs()

    # phases ----------------------------------------------------------------------------
    def run(self) -> int:
        """Take the run root's job lease, check run.json, start every step, supervise, stop cleanly."""
        self.job_lease.take()
        try:
            return self._run()
        finally:
            self.job_lease.release()

    def _run(self) -> int:
        check_run_config(self.store, self.cfg, allow_change=self.job.allow_config_change)
        if self.store.exists(layout.STOP_FILE):
            logger.warning("removing a stale %s left by an earlier run", layout.STOP_FILE)
            self.store.delete(layout.STOP_FILE)
        # Ctrl-C / SIGTERM from here on: every step started is stopped, the job ends with 130 / 143
        previous = {sig: signal.signal(sig, self._on_sigint) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.launcher.prepare(self.steps + self._pool_headroom())
            if self._stopping:  # stopped while the backend was being prepared: no step starts
                return exit_code(self._stop_signal)
            return self._supervise()
        finally:
            self._stop_all()
            close = getattr(self.launcher, "close", None)  # optional for a backend registered outside rlpipe
            if close is not None:
                close()
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            logger.info("logs of every step are under %s (<step>/<attempt>.log)", self.log_dir)

    def _build_specs(self) -> list[StepSpec]:
        configs = self.job.to_worker_configs()
        # The BatchMaker's lease is held under a name of this runner's: when the runner restarts its crashed
        # maker (it has seen it exit), the new one takes the lease over instead of waiting out lease_ttl_s. A
        # second runner on the same run root has another name and is refused as before.
        learner, maker = StepKind.LEARNER.job_name, StepKind.BATCHMAKER.job_name
        configs[maker] = dataclasses.replace(
            configs[maker], holder_id=f"{maker}@{socket.gethostname()}-{os.getpid()}", lease_take_over_own=True
        )
        if self.cfg.evaluator:  # it scores the final policy after the learner's last step: the tracker waits for it
            configs[learner] = dataclasses.replace(configs[learner], final_eval_wait_s=FINAL_EVAL_WAIT_S)
        specs = [
            StepSpec(
                learner,
                StepKind.LEARNER,
                self._write_config(learner, configs[learner]),
                processes=configs[learner].distributed.num_processes,
            ),
            StepSpec(maker, StepKind.BATCHMAKER, self._write_config(maker, configs[maker])),
        ]
        for rc in configs[StepKind.ROLLOUT.job_name]:
            name = f"{StepKind.ROLLOUT.job_name}-{rc.worker_id}"
            specs.append(StepSpec(name, StepKind.ROLLOUT, self._write_config(rc.worker_id, rc)))
        if self.cfg.evaluator:
            evaluate = StepKind.EVALUATE.job_name
            specs.append(StepSpec(evaluate, StepKind.EVALUATE, self._write_config(evaluate, configs[evaluate])))
        return specs

    def _pool_headroom(self) -> list[StepSpec]:
        """Specs of the rollout workers an elastic pool may add beyond those it starts with, for the launcher's
        `prepare` only (a Ray cluster must be able to hold `rollout_pool.max_workers` workers at once)."""
        pool = self.cfg.rollout_pool
        if not pool.enabled:
            return []
        rollout = StepKind.ROLLOUT.job_name
        return [
            StepSpec(f"{rollout}-worker{i}", StepKind.ROLLOUT, "")
            for i in range(self.cfg.num_rollout_workers, pool.max_workers)
        ]

    def live_rollout_workers(self) -> list[StepSpec]:
        """The pool's rollout workers: running or due to (re)start, not finished and not being removed."""
        return [s for s in self.steps if s.kind == StepKind.ROLLOUT and not s.finished and not s.terminated]

    def _tend_pool(self) -> None:
        """Apply the elastic pool's decision, if one is due; kill a removed worker that outlived STOP_GRACE_S."""
        now = time.monotonic()
        for spec in [s for s in self.steps if s.name in self._removing]:
            if spec.finished or spec.process is None:
                del self._removing[spec.name]
            elif now > self._removing[spec.name] and spec.process.poll() is None:
                logger.warning("%s did not stop in %.0f s; killing it", spec.name, STOP_GRACE_S)
                spec.process.kill()
                del self._removing[spec.name]
        if self.pool is None:
            return
        live = self.live_rollout_workers()
        decision = self.pool.tick(len(live))
        if decision is None:
            return
        if decision.delta > 0:
            self._add_rollout_worker()
        else:
            spec = live[-1]  # the newest: the workers the job started with are the last to go
            spec.terminated = True
            self._removed.add(spec.name)
            if spec.process is not None:
                spec.process.terminate()
                self._removing[spec.name] = now + STOP_GRACE_S
        size = len(self.live_rollout_workers())
        what = "added" if decision.delta > 0 else "removing"
        name = self.steps[-1].name if decision.delta > 0 else spec.name
        logger.info("rollout pool: %s %s -> %d workers (%s; %s)", what, name, size, decision.reason,
                    decision.signals.describe())  # fmt: skip
        self.pool.record("up" if decision.delta > 0 else "down", size, step=name, reason=decision.reason,
                         **{k: v for k, v in dataclasses.asdict(decision.signals).items()})  # fmt: skip

    def _add_rollout_worker(self) -> StepSpec:
        """Start rollout worker `worker<next index>` (a new step of the job, supervised like the others)."""
        index = self._next_worker
        self._next_worker += 1
        rc = self.job.rollout_config(index)
        spec = StepSpec(f"{StepKind.ROLLOUT.job_name}-{rc.worker_id}", StepKind.ROLLOUT,
                        self._write_config(rc.worker_id, rc))  # fmt: skip
        self.steps.append(spec)
        self._start(spec)
        return spec

    def _write_config(self, name: str, cfg: Any) -> str:
        path = Path(self._tmp.name) / f"{name}.yaml"
        path.write_text(str(draccus.dump(cfg)))
        return str(path)

    def log_location(self, name: str) -> str:
        """Where the newest start of step `name` logs (a path or URL under the run root)."""
        return self.logs[name].location

    def config_reason(self, name: str) -> str | None:
        """The one-line reason step `name`'s newest start gave for its exit (see `failure_reason`)."""
        return self.failure_reason(name)

    def failure_reason(self, name: str) -> str | None:
        """The one-line reason step `name`'s newest start gave for an expected failure: the line it wrote off the
        run root (`pipeline.jobs.step_logs.read_reason`: still there when the run root is full and its log is
        empty), else the last `error: <label>: …` line of its log (as `steps.cli.report` prints it), else None."""
        target = self.logs.get(name)
        if target is None:
            return None
        reason = read_reason(target)
        if reason is not None:
            return reason
        try:
            data = self.store.get(target.rel)
        except Exception as e:  # the reason is a courtesy: the log's location is printed anyway
            logger.debug("cannot read %s: %s", target.location, e)
            return None
        return failure_reason(data.decode(errors="replace"))

    def _start(self, spec: StepSpec) -> None:
        target = log_target(self.cfg.store.run_root, self.cfg.store.storage_options, spec.name)
        self.logs[spec.name] = target
        self._started_at[spec.name] = time.monotonic()
        spec.process = self.launcher.start(spec, target)
        pid = f" pid={spec.process.pid}" if spec.process.pid is not None else ""
        if getattr(spec.process, "forked", False):  # the local backend's fork server started it
            pid += " (forked)"
        logger.info("started %s (%s)%s; log: %s", spec.name, spec.module, pid, target.location)

    def _supervise(self) -> int:
        """Poll every step until the job ends; returns the job's exit code (Exit.OK; Exit.FAILED: a step failed too
        often; a step's code in NEVER_RESTARTED: that step's failure stopped the job; Exit.INTERRUPTED)."""
        for spec in self.steps:
            self._start(spec)
        progress = self._progress = JobProgress(self.store, self.cfg.train.num_train_steps, self._on_progress)
        gc = _Collections(self.store, self.cfg.retention)
        learner = self.steps[0]
        if self.cfg.rollout_pool.enabled:
            self.pool = PoolController(self.store, self.cfg.rollout_pool)
            self.pool.record("start", len(self.live_rollout_workers()))
        drain_deadline: float | None = None
        try:
            while True:
                now = time.monotonic()
                if not self.job_lease.renew(now):
                    self.failure = Exit.LEASE_LOST
                    return self.failure
                for spec in self.steps:
                    if not self._tend(spec, now):
                        return self.failure
                self._unless_storage_unavailable(progress.update)
                self._unless_storage_unavailable(gc.tick)
                if drain_deadline is None and not self._stopping:
                    self._unless_storage_unavailable(self._tend_pool)
                if self._stopping:
                    name = signal.Signals(self._stop_signal).name
                    logger.info("interrupted (%s): stopping every step", name)
                    return exit_code(self._stop_signal)
                if learner.finished and drain_deadline is None:
                    drain_deadline = now + EVALUATOR_DRAIN_S
                    if self.pool is not None:
                        self.pool.record("end", len(self.live_rollout_workers()))
                    self._stop_producers()
                if drain_deadline is not None and (
                    all(s.finished or s.process is None for s in self.steps) or now > drain_deadline
                ):
                    gc.final()
                    return Exit.OK
                time.sleep(0.25)
        finally:
            progress.close()
            gc.wait()

    def _tend(self, spec: StepSpec, now: float) -> bool:
        """Start a step that is due, record an exit, schedule a restart; False when it failed too often."""
        if spec.finished:
            return True
        if spec.process is None:
            if now >= spec.next_start and not self._stopping and not spec.terminated:
                self._start(spec)
            return True
        rc = spec.process.poll()
        if rc is None:
            if spec.name in self._outage and now - self._started_at.get(spec.name, now) > HEALTHY_AFTER_S:
                logger.info("%s reaches the storage again", spec.name)
                del self._outage[spec.name]
            return True
        spec.exit_codes.append(rc)
        if spec.name in self._removed:  # the elastic pool stopped it: whatever its code, it is not restarted
            spec.finished = True
            logger.info("%s left the rollout pool (exit %d)", spec.name, rc)
            return True
        # a refused config (drift, bad value), damaged input, a storage fault (full, read-only) or no progress fails
        # the same way on every restart: never restarted, and a failure even when the runner has asked the step to
        # stop since (it failed before it could stop cleanly)
        if rc in NEVER_RESTARTED and not self._stopping:
            reason = self.failure_reason(spec.name) or "no reason in its log"
            # (the reason comes from outside the run root when the step could not write its log: a full disk)
            what = "refused its configuration" if rc == Exit.CONFIG else f"stopped ({LABELS.get(rc, 'failed')})"
            logger.error("%s %s (exit %d, not restarted): %s; stopping the job; see %s",
                         spec.name, what, rc, reason, self.log_location(spec.name))  # fmt: skip
            self.failure = rc
            return False
        if rc == Exit.OK or self._stopping or spec.terminated:
            spec.finished = True
            if rc == Exit.OK:
                if spec.kind == StepKind.LEARNER and self._progress is not None:
                    self._progress.finish()  # its last steps first; no progress line after "learner finished"
                logger.info("%s finished", spec.name)
            elif self._stopping or spec.terminated:  # stopped by the runner or the user: not a crash
                logger.info("%s stopped", spec.name)
            else:
                logger.info("%s exited with %d", spec.name, rc)
            return True
        if rc == Exit.STORAGE_UNAVAILABLE:
            return self._restart_after_outage(spec, now)
        spec.restarts += 1
        if spec.restarts > self.cfg.max_restarts:
            last = self.failure_reason(spec.name)
            logger.error("%s failed %d times (last exit %d%s); stopping the job; see %s", spec.name, spec.restarts,
                         rc, f": {last}" if last else "", self.log_location(spec.name))  # fmt: skip
            return False
        delay = backoff_delay(self.cfg.restart_backoff_s, self.cfg.restart_backoff_max_s, spec.restarts - 1)
        logger.warning(
            "%s exited with %d (log: %s); restart %d/%d in %.1f s",
            spec.name,
            rc,
            self.log_location(spec.name),
            spec.restarts,
            self.cfg.max_restarts,
            delay,
        )
        spec.process = None
        spec.next_start = now + delay
        return True

    def _restart_after_outage(self, spec: StepSpec, now: float) -> bool:
        """A step exited because its run root's storage could not be reached: schedule a restart with backoff
        (not counted against max_restarts); False once the outage has lasted STORAGE_OUTAGE_S."""
        since, restarts = self._outage.get(spec.name, (now, 0))
        if now - since > STORAGE_OUTAGE_S:
            logger.error("%s could not reach the run root's storage for %.0f s (STORAGE_OUTAGE_S); stopping the "
                         "job; see %s", spec.name, now - since, self.log_location(spec.name))  # fmt: skip
            return False
        self._outage[spec.name] = (since, restarts + 1)
        delay = backoff_delay(self.cfg.restart_backoff_s, self.cfg.restart_backoff_max_s, restarts)
        logger.warning("%s exited with %d: storage unavailable (log: %s); restart in %.1f s (outage for %.0f s, "
                       "given up after %.0f s)", spec.name, Exit.STORAGE_UNAVAILABLE, self.log_location(spec.name),
                       delay, now - since, STORAGE_OUTAGE_S)  # fmt: skip
        spec.process = None
        spec.next_start = now + delay
        return True

    @staticmethod
    def _unless_storage_unavailable(fn: Callable[[], Any]) -> None:
        """Run one of the runner's own reads of the run root; an outage only skips it (the steps retry)."""
        try:
            fn()
        except StorageUnavailableError as e:
            logger.warning("%s", e)

    def _stop_producers(self) -> None:
        """Training is over: let the evaluator finish the last policies, stop the rollout workers and the maker."""
        for spec in self.steps:
            if spec.kind in (StepKind.ROLLOUT, StepKind.BATCHMAKER):
                spec.terminated = True
                if spec.process is not None:
                    spec.process.terminate()

    def _stop_all(self) -> None:
        live = [s for s in self.steps if s.process is not None and s.process.poll() is None]
        for s in live:
            s.process.terminate()  # type: ignore[union-attr]
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(s.process.poll() is None for s in live):  # type: ignore[union-attr]
            time.sleep(0.2)
        for s in live:
            if s.process.poll() is None:  # type: ignore[union-attr]
                logger.warning("%s did not stop in %.0f s; killing it", s.name, STOP_GRACE_S)
                s.process.kill()  # type: ignore[union-attr]
        deadline = time.monotonic() + 5.0  # a step's poll() after its exit completes (uploads) its log
        while time.monotonic() < deadline and any(s.process.poll() is None for s in live):  # type: ignore[union-attr]
            time.sleep(0.1)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if not self._stopping:
            self._stop_signal = signum
        self._stopping = True


class _Collections:
    """With `retention.enabled`: one garbage collection in a background thread each time `gc_every_slots` new
    batch slots are committed, and a last one when the job ends (`pipeline.retention`)."""

    def __init__(self, store: RunStore, retention: Any) -> None:
        self._store = store
        self._retention = retention
        self._done_slot = 0
        self._last_check = 0.0
        self._thread: threading.Thread | None = None

    def tick(self) -> None:
        now = time.monotonic()
        if not self._retention.enabled or now - self._last_check < 2.0:
            return
        self._last_check = now
        if self._thread is not None and self._thread.is_alive():
            return
        slot = run_state.last_committed_slot(self._store)
        if slot >= self._done_slot + self._retention.gc_every_slots:
            self._done_slot = slot
            self._thread = threading.Thread(target=self._collect, name="rlpipe-gc", daemon=True)
            self._thread.start()

    def final(self) -> None:
        if self._retention.enabled:
            self.wait()
            self._collect()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _collect(self) -> None:
        from pipeline.retention import collect

        try:
            result = collect(self._store, self._retention, holder=f"gc@{socket.gethostname()}-{os.getpid()}")
            logger.info(
                "garbage collection: %d files, %d folders deleted", result.deleted_files, result.deleted_folders
            )
        except Exception:  # a failed collection deletes nothing more; the next one retries
            logger.exception("garbage collection failed")


CONFIG_ERROR_MARKERS = ("error: invalid config:", "ConfigError")
"""What marks a log line as a config error's one line (`steps.cli.run_command` prints the first; a traceback's last
line names the second)."""
REASON_PREFIX = "error: "
"""How `steps.cli.report` starts the one line of an expected failure (`error: <label>: <message>`)."""


def config_reason(log_text: str) -> str | None:
    """The last line of `log_text` that carries a config error, from its message on (see CONFIG_ERROR_MARKERS)."""
    for line in reversed(log_text.splitlines()):
        for marker in CONFIG_ERROR_MARKERS:
            at = line.find(marker)
            if at >= 0:
                text = line[at:].removeprefix("error: ").strip()
                return text or None
    return None


def failure_reason(log_text: str) -> str | None:
    """The last line of `log_text` that starts with `error: ` (a step's one-line report of an expected failure),
    without that prefix; else its last config-error line (`config_reason`)."""
    for line in reversed(log_text.splitlines()):
        if line.startswith(REASON_PREFIX) and line[len(REASON_PREFIX) :].strip():
            return line[len(REASON_PREFIX) :].strip()
    return config_reason(log_text)


def snapshot(store: RunStore) -> dict[str, Any]:
    """What a run root says about progress right now (see `pipeline.jobs.progress.RunProgress.snapshot`)."""
    return RunProgress(store).snapshot()
