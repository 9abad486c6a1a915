"""Experiment trackers (levanter's) for the learner's per-step metrics, one builder per registered config class.

A new tracker is one registered `TrackerConfig` subclass (pipeline/config/steps.py) plus one function here:

    @register_tracker(MyTrackerConfig)
    def _my_tracker(config: MyTrackerConfig, run: TrackerRun) -> Tracker: ...

`make_tracker(config, run_root)` returns the levanter tracker (None for `type: none`); `make_run_tracker(config,
store)` wraps it as the run's one tracker run: the learner owns it and forwards every step's metrics records from
the run root to it (`RunTracker`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pipeline.config import (
    ConfigError,
    JsonTrackerConfig,
    NoTrackerConfig,
    TensorboardTrackerConfig,
    TrackerConfig,
    WandbTrackerConfig,
)
from pipeline.process.step_kind import StepKind
from pipeline.store.poll import WaitTimeout, poll_until
from pipeline.store.urls import is_local, split_location

if TYPE_CHECKING:
    from pipeline.store.storage import RunStore

Tracker = Any
"""A `levanter.tracker.Tracker`: `log(metrics, step=)`, `finish()`."""
T = TypeVar("T", bound=TrackerConfig)
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrackerRun:
    """What every tracker is told about the run: its name and the default local folder for its files."""

    name: str
    """`tracker.name`, else the run root's last path component."""
    default_logdir: str
    """`<run root>/trackers` for a local run root, else ./trackers (absolute)."""


TRACKERS: dict[type[TrackerConfig], Callable[[Any, TrackerRun], Tracker | None]] = {}
"""Config class -> builder (exact class match)."""


def register_tracker(config_class: type[T]) -> Callable[[Callable[[T, TrackerRun], Tracker | None]], Any]:
    """Decorator: the builder of the trackers configured by `config_class`."""

    def register(builder: Callable[[T, TrackerRun], Tracker | None]) -> Callable[[T, TrackerRun], Tracker | None]:
        TRACKERS[config_class] = builder
        return builder

    return register


def tracker_run(config: TrackerConfig, run_root: str) -> TrackerRun:
    """The run's tracker name and default folder (see TrackerRun)."""
    local = split_location(run_root)[1] if is_local(run_root) else None
    logdir = os.path.join(local, "trackers") if local else os.path.abspath("trackers")
    return TrackerRun(name=config.name or run_root.rstrip("/").rsplit("/", 1)[-1] or "rlpipe", default_logdir=logdir)


def tracker_type(config: TrackerConfig) -> str:
    """The registered name of `config`'s class (`tracker.type`)."""
    return TrackerConfig.get_choice_name(type(config))


def make_tracker(config: TrackerConfig, run_root: str) -> Tracker | None:
    """The levanter tracker `config` asks for (None for 'none'), initialised with the run's name.

    Raises ConfigError naming `tracker.type` when no builder is registered or the tracker's package is missing.
    """
    try:
        builder = TRACKERS[type(config)]
    except KeyError:
        raise ConfigError("tracker.type", type(config).__name__, "has no registered tracker builder") from None
    try:
        return builder(config, tracker_run(config, run_root))
    except ImportError as e:
        raise ConfigError("tracker.type", tracker_type(config), f"needs a package that is not installed ({e})") from e


@register_tracker(NoTrackerConfig)
def _no_tracker(config: NoTrackerConfig, run: TrackerRun) -> None:
    return None


@register_tracker(JsonTrackerConfig)
def _json_tracker(config: JsonTrackerConfig, run: TrackerRun) -> Tracker:
    from levanter.tracker.json_logger import JsonLoggerConfig

    return JsonLoggerConfig().init(run.name)


@register_tracker(TensorboardTrackerConfig)
def _tensorboard_tracker(config: TensorboardTrackerConfig, run: TrackerRun) -> Tracker:
    import tensorboardX  # noqa: F401  (levanter imports it only inside init: fail here, by name)
    from levanter.tracker.tensorboard import TensorboardConfig

    logdir = config.logdir or run.default_logdir
    os.makedirs(logdir, exist_ok=True)
    return TensorboardConfig(logdir=logdir).init(run.name)


@register_tracker(WandbTrackerConfig)
def _wandb_tracker(config: WandbTrackerConfig, run: TrackerRun) -> Tracker:
    import wandb  # noqa: F401
    from levanter.tracker.wandb import WandbConfig

    logdir = config.logdir or run.default_logdir
    os.makedirs(logdir, exist_ok=True)
    if config.logdir or "WANDB_DIR" not in os.environ:  # an explicit logdir wins over the environment
        os.environ["WANDB_DIR"] = logdir
    os.environ.setdefault("WANDB_SILENT", "true")
    return _WandbRun(
        WandbConfig(project=config.project, name=run.name, mode=config.mode, save_code=False).init(run.name)
    )


class _WandbRun:
    """levanter's wandb tracker whose `finish()` returns only once the run's files are written (offline) or sent.

    `wandb.Run.finish()` returns while wandb's service process may still be writing the run file (seen under load:
    the offline `.wandb` file held only its header when `finish()` returned); `wandb.teardown()` waits for it."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tracker, name)

    def finish(self) -> None:
        import wandb

        self.tracker.finish()
        wandb.teardown()


FORWARD_EVERY_S = 2.0
"""How often the other steps' metrics records are read from the run root for the tracker."""
FORWARDED_KINDS = (StepKind.BATCHMAKER, StepKind.ROLLOUT, StepKind.EVALUATE)


class RunTracker:
    """The run's one tracker run, owned by the learner: its own records (`learner/<key>`) and, forwarded from
    the run root's metrics records, every other step's (`batches/<key>` per batch slot, `rollout/<key>`
    summed or averaged over the writes since the previous learner step, `rollout/rows_per_s` over the wall time
    since the tracker started, `eval/<lesson>/<key>` per evaluated policy, at the learner step it arrives).
    Same interface as a levanter tracker (`log(metrics, step=)`, `finish()`).

    A background thread reads the records (`pipeline.telemetry.metrics.MetricsTail`), so the learner's step never
    waits on storage; they are logged from the learner's thread at its next step, at step max(record's step, the last
    step logged) so that every tracker sees non-decreasing steps. `finish()` forwards what is committed by then.
    """

    def __init__(
        self,
        tracker: Tracker,
        store: RunStore,
        *,
        forward_every_s: float = FORWARD_EVERY_S,
        fresh: bool = False,
    ) -> None:
        """`fresh`: the learner starts the run (no step trained yet), so every record of the run root is forwarded,
        including those committed before the tracker opened (a short run's workers may have written all their files
        by then); otherwise only records from now on: a restarted learner opens a new tracker run and does not replay
        what the previous one already logged."""
        import threading

        from pipeline.telemetry.metrics import MetricsTail

        self.tracker = tracker
        opened = time.time()
        self._tail = MetricsTail(store, FORWARDED_KINDS, since=None if fresh else opened)
        self._tail_lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self._pending_lock = threading.Lock()
        self._step = 0
        self._evaluated: set[tuple[int, str]] = set()
        """(policy step, lesson) of every evaluation forwarded so far."""
        self._rollout_rows = 0.0
        self._rows_since = opened
        """The start of `rollout/rows_per_s`: the tracker's opening, or the earliest write forwarded if older."""
        self._stop = threading.Event()
        self._every = forward_every_s
        self._thread = threading.Thread(target=self._collect_loop, name="tracker-forward", daemon=True)
        self._thread.start()

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        """Log `metrics` (already prefixed) at `step`, then the other steps' records collected since."""
        self._step = max(self._step, step)
        self.tracker.log(metrics, step=self._step)
        self._forward()

    def await_evaluations(
        self, policy_step: int, lessons: Iterable[str], timeout_s: float, poll_s: float = 1.0
    ) -> bool:
        """Keep forwarding records until the evaluations of every lesson in `lessons` of policy `policy_step` have
        been logged, or `timeout_s` passed (`pipeline.store.poll.poll_until`; the timeout is logged naming the
        evaluations still missing); True when they all were."""
        wanted = {(policy_step, lesson) for lesson in lessons}

        def all_logged() -> bool:
            self._collect()
            self._forward()
            return wanted <= self._evaluated

        def what() -> str:
            missing = sorted(lesson for step, lesson in wanted - self._evaluated)
            return f"the evaluations of policy {policy_step} (lessons {', '.join(missing)}) in metrics/evaluate/"

        try:
            poll_until(all_logged, timeout_s=timeout_s, what=what, interval_s=poll_s, log=logger)
        except WaitTimeout as e:  # the caller says what it means (the tracker closes without them)
            logger.info("%s", e)
            return False
        return True

    def finish(self) -> None:
        """Forward the records committed by now, then finish the tracker run."""
        self._stop.set()
        self._thread.join()
        self._collect()
        self._forward()
        self.tracker.finish()

    def _collect_loop(self) -> None:
        while not self._stop.wait(self._every):
            self._collect()

    def _collect(self) -> None:
        try:
            with self._tail_lock:
                records = self._tail.new_records()
        except Exception as e:  # storage hiccup: the next round reads the same files again
            logger.warning("could not read metrics records for the tracker: %s", e)
            return
        with self._pending_lock:
            self._pending.extend(records)

    def _forward(self) -> None:
        with self._pending_lock:
            records, self._pending = self._pending, []
        # a worker's writes only: its `stop` record repeats the rows of every write (records without an event are
        # writes of older workers)
        rollouts = [
            r
            for r in records
            if r.get("kind") == StepKind.ROLLOUT and r.get("event", "write") == "write" and "rows" in r
        ]
        for rec in records:
            kind = rec.get("kind")
            if kind == StepKind.BATCHMAKER:
                self._log_at(_prefixed("batches", rec, skip=("slot",)), int(rec.get("slot", 0)))
            elif kind == StepKind.EVALUATE and not rec.get("external"):
                lesson = str(rec.get("lesson_id", "eval"))
                self._log_at(_prefixed(f"eval/{lesson}", rec, skip=("lesson_id", "external")), self._step)
                if isinstance(rec.get("policy_step"), int):
                    self._evaluated.add((int(rec["policy_step"]), lesson))
        if rollouts:
            self._rollout_rows += sum(float(r["rows"]) for r in rollouts)
            self._rows_since = min(self._rows_since, *(float(r.get("time", self._rows_since)) for r in rollouts))
            summary = rollout_summary(rollouts)
            summary["rollout/rows_per_s"] = self._rollout_rows / max(time.time() - self._rows_since, 1e-9)
            self._log_at(summary, self._step)

    def _log_at(self, metrics: dict[str, Any], step: int) -> None:
        self._step = max(self._step, step)
        self.tracker.log(metrics, step=self._step)


def _prefixed(prefix: str, rec: dict[str, Any], *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """`prefix/key` for every numeric field of a metrics record but its bookkeeping (time, kind, worker)."""
    drop = {"time", "kind", "worker", *skip}
    return {
        f"{prefix}/{k}": v for k, v in rec.items() if k not in drop and isinstance(v, int | float) and v is not True
    }


def rollout_summary(records: list[dict[str, Any]]) -> dict[str, float]:
    """The rollout workers' writes since the previous forward, as one set of `rollout/...` metrics: rows, tokens
    and failures summed, reward, truncation rate and policy lag averaged over rows."""
    out = {
        "rollout/rows": sum(float(r.get("rows", 0)) for r in records),
        "rollout/tokens": sum(float(r.get("tokens", 0)) for r in records),
        "rollout/failures": sum(float(r.get("failures", 0)) for r in records),
    }
    for key in ("mean_reward", "policy_lag", "truncation_rate"):
        weighted = [(float(r[key]), float(r.get("rows", 1))) for r in records if key in r]
        if weighted and sum(w for _, w in weighted) > 0:
            out[f"rollout/{key}"] = sum(v * w for v, w in weighted) / sum(w for _, w in weighted)
    return out


def make_run_tracker(
    config: TrackerConfig, run_root: str, store: RunStore, *, fresh: bool = False
) -> RunTracker | None:
    """The run's tracker (`make_tracker`) with the other steps' metrics forwarded from `store` (the run root's
    RunStore; all of them when the learner starts the run, `fresh`, else from now on); None for `type: none`."""
    tracker = make_tracker(config, run_root)
    return None if tracker is None else RunTracker(tracker, store, fresh=fresh)
