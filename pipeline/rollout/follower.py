"""The rollout worker's policy follower: waits for the first committed policy, keeps the sampler on the newest one
(never an older one), falls back past damaged policies, runs the prefetch thread of partial rollouts, and warms up
sampler shapes while the worker is paused. The worker's loop (`pipeline.rollout.worker`) composes it with its
`Pacer` (`pipeline.rollout.pacer`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.config import RolloutStepConfig
from pipeline.jobs.step_logs import run_root_of, server_log
from pipeline.process.exits import DamagedInputError
from pipeline.process.watchdog import watchdog
from pipeline.store import layout, run_state
from pipeline.store.notify import Waker
from pipeline.store.poll import WaitTimeout, poll_until
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import MetricsWriter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicyRuntime:
    """What the worker asks of the JAX library, handed in by the rollout program
    (`policy.rollout_manager.policy_runtime(config, tokenizer)`), so this loop imports no JAX."""

    manages_weights: bool
    """The configured backend loads committed policies itself (a server): the worker never loads weights."""
    build_manager: Callable[[Any], Any]
    """model (None when the backend manages weights) -> the `RolloutManager` the worker samples with."""
    load_model: Callable[[RunStore, int], Any]
    """(store, committed policy step) -> its policy model."""
    publish_hf: Callable[[RunStore, int], Any]
    """(store, step) -> write `policies/step-S/hf/` when the backend's server needs it (a no-op otherwise)."""


class PolicyFollower:
    """Holds the `RolloutManager` and the policy step its weights are; moves it to each newer committed policy.

    `runtime` builds the manager and loads policy models; `manager` and `load_model(step)` (the policy model of a
    committed step) can be injected instead (tests). `stop_event` is the worker's: it ends a wait for the first
    policy and the prefetch thread. `waker` wakes a paused worker when a prefetched policy is staged.
    """

    def __init__(
        self,
        config: RolloutStepConfig,
        store: RunStore,
        *,
        stop_event: threading.Event,
        waker: Waker,
        metrics: MetricsWriter,
        runtime: PolicyRuntime | None = None,
        manager: Any = None,
        load_model: Callable[[int], Any] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self._stop = stop_event
        self._waker = waker
        self._runtime = runtime
        self._manager = manager
        self._load_model_fn = load_model
        self._server_log: Any = None  # a pipeline.jobs.step_logs.StepLog once a child server is attached
        self.current_step: int | None = None
        """The policy step the sampler's weights are (None before `start`)."""
        self.weight_load_s = 0.0
        """Seconds spent loading weights since the worker's last write record (it resets this)."""
        self._noticed_at: dict[int, float] = {}
        """policy step -> unix time this worker first saw it committed (recorded in its ready markers)."""
        self._damaged: dict[int, str] = {}
        """policy step -> why this worker set it aside (damaged on read; quarantined): never loaded again."""
        self._partial = bool(getattr(config.inference, "partial_rollouts", False))
        """Partial rollouts: a prefetch thread loads new policies and stages them into the running sampler."""
        self._staged: int | None = None
        """The newest policy step handed to the sampler (partial rollouts)."""
        self._prefetch: threading.Thread | None = None
        self._prefetch_error: BaseException | None = None

    # -- reading the run root ----------------------------------------------------------------------

    def latest_policy(self) -> int | None:
        """The newest committed policy this worker has not set aside as damaged (None: none yet)."""
        if not self._damaged:
            return run_state.latest_policy_step(self.store)
        for s in reversed(run_state.step_folders(self.store, layout.POLICIES)):
            if s not in self._damaged and self.store.exists(layout.policy_marker(s)):
                return s
        return None

    def noticed_at(self, step: int) -> float | None:
        """Unix time this worker first saw policy `step` committed (None: never noticed)."""
        return self._noticed_at.get(step)

    def _set_aside(self, step: int, error: DamagedInputError) -> None:
        """Quarantine damaged policy `step`'s file with the reason; this worker never loads it again."""
        self._damaged[step] = str(error)
        if not self.store.is_quarantined(error.path):
            self.store.quarantine(error.path, error.reason)

    def _newest_intact(self, step: int, load: Callable[[int], Any], floor: int | None = None) -> tuple[int, Any]:
        """`(s, load(s))` for the newest policy `s <= step` that loads, setting aside (quarantining) each damaged
        one on the way, one warning line each (the documented recovery, as the learner's checkpoint fallback).

        `(-1, None)` when every intact policy is `<= floor` (the worker keeps the one it holds); the last
        `DamagedInputError` (exit 7) when no intact policy is left at all.
        """
        while True:
            try:
                return step, load(step)
            except DamagedInputError as e:
                self._set_aside(step, e)
                older = self.latest_policy()
                if older is None or older >= step:
                    raise
                keep = floor is not None and older <= floor
                logger.warning(
                    "policy %d is damaged and set aside (%s); %s",
                    step,
                    e,
                    f"keeping policy {floor}" if keep else f"falling back to policy {older}",
                )
                if keep:
                    return -1, None
                step = older

    # -- loading policies ----------------------------------------------------------------------------

    def _load_model(self, step: int) -> Any:
        if self._load_model_fn is not None:
            return self._load_model_fn(step)
        return self._require_runtime().load_model(self.store, step)

    def _require_runtime(self) -> PolicyRuntime:
        if self._runtime is None:
            raise RuntimeError("RolloutWorker needs a PolicyRuntime (or an injected manager and load_model)")
        return self._runtime

    def wait_for_policy(self) -> int:
        """Block until a committed policy exists; return the newest step.

        Raises `WaitTimeout` naming `policies/step-00000000/COMMITTED` after `wait_for_policy_timeout_s`, or
        when the worker is stopped while waiting (`RolloutWorker.run` then stops cleanly).
        """

        def check_stop() -> None:
            if self._stop.is_set():
                raise WaitTimeout("stopped while waiting for the first policy")

        c = self.config  # not follow mode (a scheduled job): a short wait (see `RolloutWorker.run`)
        wait_s, setting = (
            (c.wait_for_policy_timeout_s, "wait_for_policy_timeout_s")
            if c.follow or c.wait_for_policy_timeout_s <= c.polling.bounded_wait_s
            else (c.polling.bounded_wait_s, "polling.bounded_wait_s")
        )

        step, _ = poll_until(
            self.latest_policy,
            timeout_s=wait_s,
            what=f"{self.store.full_path(layout.policy_marker(0))} (or any policies/step-*/COMMITTED)",
            interval_s=self.config.polling.interval_s,
            setting=setting,
            on_wait=check_stop,
            waker=self._waker,
        )
        self._noticed_at.setdefault(step, time.time())
        return step

    def _load_step(self, step: int) -> Any:
        t0 = time.monotonic()
        with watchdog(f"weight load (policy {step})", self.config.weight_load_timeout_s):
            model = self._load_model(step)
        self.weight_load_s += time.monotonic() - t0
        logger.info("loaded policy %d in %.2fs", step, time.monotonic() - t0)
        return model

    def _serve_step(self, step: int) -> None:
        """Tell a weight-managing server to load committed policy `step` (HF folder first when it needs one)."""
        with watchdog(f"server load (policy {step})", self.config.weight_load_timeout_s):
            if self._runtime is not None:
                self._runtime.publish_hf(self.store, step)
            self.weight_load_s += self.manager.load_policy(step)

    @property
    def manager(self) -> Any:
        """The RolloutManager (built by `start` from the config and the newest policy, unless injected)."""
        if self._manager is None:
            raise RuntimeError("manager not started: call start() first")
        return self._manager

    def start(self) -> None:
        """Wait for a policy, load it and build the manager (unless one was injected)."""
        if self._manager is not None and self._manager.external_weights and not self._manager.manages_weights:
            return
        step = self.wait_for_policy()
        model: Any = None
        managed = self._require_runtime().manages_weights if self._manager is None else None
        if self._manager is None:
            model = None
            if not managed:
                step, model = self._newest_intact(step, self._load_step)
            self._manager = self._require_runtime().build_manager(model)
        if self._manager.manages_weights:
            if self._server_log is None:
                self._server_log = server_log(self.store, self.config.worker_id)
            log = self._server_log  # written locally, kept (uploaded) at its location: errors name the latter
            self._manager.attach_run(run_root_of(self.store), str(log.local_path), log.location)
            step, _ = self._newest_intact(step, self._serve_step)
        elif managed is None:
            step, model = self._newest_intact(step, self._load_step)
            self._manager.update_model(model)
        self.current_step = step
        if self._partial and model is not None:  # the sampler learns which policy its weights are
            self._manager.stage_model(model, step)
            self._staged = step
        self.metrics.log({"event": "weights", "from_step": None, "policy_step": step})

    def sync(self) -> bool:
        """Load the newest committed policy if it is newer than the one held (never older). True if changed.

        Partial rollouts: the prefetch thread loads it (`_prefetch_loop`); this adopts the newest one it staged."""
        if self._partial:
            return self._adopt_staged()
        managed = self._manager is not None and self._manager.manages_weights
        if self._manager is not None and self._manager.external_weights and not managed:
            return False
        latest = self.latest_policy()
        if latest is None or (self.current_step is not None and latest <= self.current_step):
            if latest is not None and self.current_step is not None and latest < self.current_step:
                logger.warning(
                    "newest committed policy %d is older than held policy %d; keeping %d",
                    latest,
                    self.current_step,
                    self.current_step,
                )
            return False
        self._noticed_at.setdefault(latest, time.time())
        if managed:
            latest, _ = self._newest_intact(latest, self._serve_step, floor=self.current_step)
        else:
            latest, model = self._newest_intact(latest, self._load_step, floor=self.current_step)
        if latest < 0:  # the newer policies are damaged: keep the one held
            return False
        if not managed:
            t0 = time.monotonic()
            with watchdog(f"model update (policy {latest})", self.config.weight_load_timeout_s):
                self.manager.update_model(model)
            self.weight_load_s += time.monotonic() - t0
        self._adopt(latest)
        return True

    def _adopt(self, step: int) -> None:
        """Hold `step` from now on and log the `weights` event."""
        old, self.current_step = self.current_step, step
        self.metrics.log({"event": "weights", "from_step": old, "policy_step": step})
        self.metrics.flush()  # once per policy: the previous policy's writes reach trackers by the next learner step

    def policy_step(self) -> int:
        """The policy step the next rollouts are sampled with: the held one, or the one an external server reports."""
        if self.manager.external_weights and not self.manager.manages_weights:
            step = self.manager.served_policy_step()
            if step is None:
                raise RuntimeError(
                    "the openai backend's server does not report its policy step (header X-Policy-Step or a "
                    "model name ending in step-<N>); rollouts cannot be tagged"
                )
            return step
        assert self.current_step is not None
        return self.current_step

    # -- partial rollouts: the prefetch thread ---------------------------------------------------------

    def _prefetch_loop(self) -> None:
        """Until stopped: load each newer committed policy (setting damaged ones aside, as `sync`) and stage it
        into the sampler, which swaps it in between decode steps of the running call; an error stops the loop and
        is raised by the main loop (`_adopt_staged`)."""
        try:
            while not self._stop.is_set():
                latest = self.latest_policy()
                if latest is not None and (self._staged is None or latest > self._staged):
                    self._noticed_at.setdefault(latest, time.time())
                    step, model = self._newest_intact(latest, self._load_step, floor=self._staged)
                    if step >= 0:
                        self.manager.stage_model(model, step)
                        self._staged = step
                        self._waker.poke()  # a paused main loop adopts it now
                self._stop.wait(self.config.polling.interval_s)
        except BaseException as e:  # raised on the main thread
            self._prefetch_error = e
            self._waker.poke()

    def _adopt_staged(self) -> bool:
        """The main loop's view of the prefetch thread: raise its error, else take the newest staged policy as the
        held one (pacing, metrics). True if it changed."""
        if self._prefetch_error is not None:
            raise self._prefetch_error
        staged = self._staged
        if staged is None or (self.current_step is not None and staged <= self.current_step):
            return False
        self._adopt(staged)
        return True

    def start_prefetch(self) -> None:
        """Partial rollouts with a started manager: start the prefetch thread (once)."""
        if self._partial and self._prefetch is None and self._manager is not None:
            self._prefetch = threading.Thread(target=self._prefetch_loop, name="policy-prefetch", daemon=True)
            self._prefetch.start()

    def stop_prefetch(self) -> None:
        """End the prefetch thread, if one runs, after its current load (sets the worker's stop event)."""
        if self._prefetch is not None:
            self._stop.set()
            self._prefetch.join(timeout=self.config.weight_load_timeout_s)

    # -- while paused, and at the end ------------------------------------------------------------------

    def warm_up(self) -> bool:
        """While paused: have the sampler compile one shape a later file is likely to need (`RolloutManager.warm_up`:
        a prompt bucket of the lessons' prompts not yet run for a batch shape used, likely to be drawn among the
        prompts still to sample: `draws_left`), so that the compile does not land inside a later
        generation, which the learner may be waiting for; True if it did (seconds of work), False when nothing is
        left (cheap)."""
        warm = getattr(self._manager, "warm_up", None) if self._manager is not None else None
        return bool(warm(self.draws_left())) if warm is not None else False

    def draws_left(self) -> float | None:
        """At most how many more prompts this worker samples (None: no bound known): a following worker's run ends
        at learner step `train.num_train_steps`, so it samples at most the rows of the steps left after the policy it
        holds, `train.batch_size` each, in groups of the smallest `n_generations_per_prompt` of its lessons (all of
        them, should no other worker share them)."""
        c = self.config
        if not c.follow or self.current_step is None or not c.curriculum.lessons:
            return None
        group = min(c.curriculum.sampling_for(lesson).n_generations_per_prompt for lesson in c.curriculum.lessons)
        steps_left = max(0, c.train.num_train_steps - self.current_step)
        return steps_left * c.train.batch_size / max(1, group)

    def shutdown(self) -> None:
        """Release the manager's backend."""
        if self._manager is not None:
            self._manager.shutdown()
        if self._server_log is not None:  # after the server stopped: its last lines are in the final upload
            self._server_log.close()
