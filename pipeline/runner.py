"""The job runner: starts the learner, the BatchMaker, N rollout workers and the evaluator as
separate processes (local backend) or Ray tasks (ray backend), restarts a crashed one with
bounded exponential backoff, shows live progress, and stops everything cleanly when the learner
reaches `num_train_steps` or on Ctrl-C.

Every step is the same program either way: `python -m steps.<module> --config_path <yaml>`,
with the step config written as YAML (no pickle). The run root is the only channel between
steps, so a restart of any step is safe at any instant.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import draccus

from pipeline import layout
from pipeline.config import ConfigError
from pipeline.job import RLJob, check_run_config

logger = logging.getLogger(__name__)

MODULES = {
    "learner": "steps.learn",
    "batches": "steps.make_batches",
    "rollout": "steps.rollout",
    "evaluate": "steps.evaluate",
}
STOP_GRACE_S = 20.0
EVALUATOR_DRAIN_S = 300.0


class StepProcess(Protocol):
    """A running step: local process or Ray task."""

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    @property
    def pid(self) -> int | None: ...


@dataclasses.dataclass
class StepSpec:
    """One supervised step of the job."""

    name: str
    kind: str
    config_path: str
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    restarts: int = 0
    process: StepProcess | None = None
    next_start: float = 0.0
    finished: bool = False
    terminated: bool = False
    exit_codes: list[int] = dataclasses.field(default_factory=list)

    @property
    def module(self) -> str:
        return MODULES[self.kind]


class LocalProcess:
    """A step as a local child process, output appended to a log file."""

    def __init__(self, module: str, config_path: str, log_path: Path, env: dict[str, str]) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 — lives as long as the process
        self._proc = subprocess.Popen(
            [sys.executable, "-m", module, "--config_path", config_path],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ctrl-C in the terminal reaches the runner only; it stops children itself
        )

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def poll(self) -> int | None:
        rc = self._proc.poll()
        if rc is not None and not self._log.closed:
            self._log.close()
        return rc

    def terminate(self) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()


class RayProcess:
    """A step as a Ray task that runs the step program with the resources asked for."""

    def __init__(self, module: str, config_yaml: str, num_cpus: float, num_gpus: float, env: dict[str, str]) -> None:
        import ray

        self._ray = ray
        self._ref = _ray_run_step.options(num_cpus=num_cpus, num_gpus=num_gpus).remote(module, config_yaml, env)
        self._rc: int | None = None

    @property
    def pid(self) -> int | None:
        return None

    def poll(self) -> int | None:
        if self._rc is not None:
            return self._rc
        ready, _ = self._ray.wait([self._ref], timeout=0)
        if ready:
            try:
                self._rc = int(self._ray.get(self._ref))
            except Exception as e:
                logger.warning("ray task for %s failed: %s", self._ref, e)
                self._rc = 1
        return self._rc

    def terminate(self) -> None:
        if self._rc is None:
            self._ray.cancel(self._ref, force=False)

    def kill(self) -> None:
        if self._rc is None:
            self._ray.cancel(self._ref, force=True)


def _ray_run_step_impl(module: str, config_yaml: str, env: dict[str, str]) -> int:
    """Body of the Ray task: write the config locally and run the step program to completion."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "step.yaml")
        Path(path).write_text(config_yaml)
        proc = subprocess.Popen([sys.executable, "-m", module, "--config_path", path], env={**os.environ, **env})
        try:
            return proc.wait()
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()


_ray_run_step: Any = None


def _init_ray(address: str | None, need_cpus: float, need_gpus: float) -> None:
    """Connect to (or start) Ray and make sure every step can run at once.

    The steps of a job depend on each other (the learner waits for rollouts), so a cluster that can hold only
    some of them deadlocks silently; refuse that up front, naming the resources asked for. A local cluster
    started here gets at least as many logical CPUs as the steps ask for (they are processes, not cores).
    """
    global _ray_run_step
    import ray

    if not ray.is_initialized():
        kwargs: dict[str, Any] = {}
        if address is None and not os.environ.get("RAY_ADDRESS"):
            kwargs["num_cpus"] = max(os.cpu_count() or 1, math.ceil(need_cpus))
        ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True, **kwargs)
    total = ray.cluster_resources()
    have_cpus, have_gpus = float(total.get("CPU", 0.0)), float(total.get("GPU", 0.0))
    if have_cpus + 1e-9 < need_cpus or have_gpus + 1e-9 < need_gpus:
        raise ConfigError(
            "resources",
            {"cpus": need_cpus, "gpus": need_gpus},
            f"the steps ask for {need_cpus:g} CPUs and {need_gpus:g} GPUs together, but the Ray cluster at "
            f"{address or 'local'} has {have_cpus:g} CPUs and {have_gpus:g} GPUs; every step must run at once "
            "(lower resources.*_cpus / *_gpus or add nodes)",
        )
    if _ray_run_step is None:
        _ray_run_step = ray.remote(max_retries=0)(_ray_run_step_impl)


class JobRunner:
    """Supervises the steps of one RLJob until the learner finishes, a step exhausts its restarts,
    or the user interrupts. Returns 0 on success."""

    def __init__(self, job: RLJob, *, on_progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        from pipeline.storage import RunStore

        self.job = job
        self.cfg = job.config
        self.store = RunStore(self.cfg.store.run_root, self.cfg.store.storage_options)
        self._stopping = False
        self._on_progress = on_progress
        self._tmp = tempfile.TemporaryDirectory(prefix="rlpipe-job-")
        root = self.cfg.store.run_root
        local_root = root if "://" not in root or root.startswith("file://") else None
        base = Path(local_root.removeprefix("file://")) if local_root else Path(self._tmp.name)
        self.log_dir = base / "logs"
        self.steps = self._build_specs()

    # phases ----------------------------------------------------------------------------
    def run(self) -> int:
        """Check run.json, start every step, supervise, stop cleanly."""
        check_run_config(self.store, self.cfg)
        if self.store.exists(layout.STOP_FILE):
            logger.warning("removing a stale %s left by an earlier run", layout.STOP_FILE)
            self.store.delete(layout.STOP_FILE)
        if self.cfg.backend == "ray":
            _init_ray(
                self.cfg.ray_address,
                sum(s.num_cpus for s in self.steps),
                sum(s.num_gpus for s in self.steps),
            )
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        signal.signal(signal.SIGTERM, self._on_sigint)
        try:
            return self._supervise()
        finally:
            self._stop_all()
            signal.signal(signal.SIGINT, previous)
            logger.info("logs of every step are under %s", self.log_dir)

    def _build_specs(self) -> list[StepSpec]:
        configs = self.job.to_worker_configs()
        # The BatchMaker's lease is held under a name of this runner's: when the runner restarts its crashed
        # maker (it has seen it exit), the new one takes the lease over instead of waiting out lease_ttl_s. A
        # second runner on the same run root has another name and is refused as before.
        configs["batches"] = dataclasses.replace(
            configs["batches"], holder_id=f"batches@{socket.gethostname()}-{os.getpid()}", lease_take_over_own=True
        )
        r = self.cfg.resources
        specs = [
            StepSpec(
                "learner", "learner", self._write_config("learner", configs["learner"]), r.learner_cpus, r.learner_gpus
            ),
            StepSpec("batches", "batches", self._write_config("batches", configs["batches"]), r.batches_cpus),
        ]
        for rc in configs["rollout"]:
            specs.append(
                StepSpec(
                    f"rollout-{rc.worker_id}",
                    "rollout",
                    self._write_config(rc.worker_id, rc),
                    r.rollout_cpus,
                    r.rollout_gpus,
                )
            )
        if self.cfg.evaluator:
            specs.append(
                StepSpec(
                    "evaluate",
                    "evaluate",
                    self._write_config("evaluate", configs["evaluate"]),
                    r.evaluate_cpus,
                    r.evaluate_gpus,
                )
            )
        return specs

    def _write_config(self, name: str, cfg: Any) -> str:
        path = Path(self._tmp.name) / f"{name}.yaml"
        path.write_text(str(draccus.dump(cfg)))
        return str(path)

    def _start(self, spec: StepSpec) -> None:
        env = {**os.environ, "RLPIPE_STEP": spec.name}
        if self.cfg.backend == "ray":
            spec.process = RayProcess(
                spec.module,
                Path(spec.config_path).read_text(),
                spec.num_cpus,
                spec.num_gpus,
                {"RLPIPE_STEP": spec.name},
            )
        else:
            spec.process = LocalProcess(spec.module, spec.config_path, self.log_dir / f"{spec.name}.log", env)
        logger.info("started %s (%s) pid=%s", spec.name, spec.module, spec.process.pid)

    def _supervise(self) -> int:
        for spec in self.steps:
            self._start(spec)
        progress = _Progress(self.store, self.cfg.train.num_train_steps, self._on_progress)
        learner = self.steps[0]
        drain_deadline: float | None = None
        try:
            while True:
                now = time.monotonic()
                for spec in self.steps:
                    if spec.finished or spec.process is None:
                        if (
                            not spec.finished
                            and spec.process is None
                            and now >= spec.next_start
                            and not self._stopping
                            and not spec.terminated
                        ):
                            self._start(spec)
                        continue
                    rc = spec.process.poll()
                    if rc is None:
                        continue
                    spec.exit_codes.append(rc)
                    if rc == 0 or self._stopping or spec.terminated:
                        spec.finished = True
                        logger.info("%s exited with %d", spec.name, rc)
                        continue
                    spec.restarts += 1
                    if spec.restarts > self.cfg.max_restarts:
                        logger.error(
                            "%s failed %d times (last exit %d); stopping the job; see %s",
                            spec.name,
                            spec.restarts,
                            rc,
                            self.log_dir / f"{spec.name}.log",
                        )
                        return 1
                    delay = min(30.0, self.cfg.restart_backoff_s * 2 ** (spec.restarts - 1))
                    logger.warning(
                        "%s exited with %d; restart %d/%d in %.1f s",
                        spec.name,
                        rc,
                        spec.restarts,
                        self.cfg.max_restarts,
                        delay,
                    )
                    spec.process = None
                    spec.next_start = now + delay
                progress.update()
                if self._stopping:
                    logger.info("interrupted: stopping every step")
                    return 130
                if learner.finished and drain_deadline is None:
                    # Training is over: let the evaluator finish the last policies, stop the producers.
                    drain_deadline = now + EVALUATOR_DRAIN_S
                    for spec in self.steps:
                        if spec.kind in ("rollout", "batches"):
                            spec.terminated = True
                            if spec.process is not None:
                                spec.process.terminate()
                if drain_deadline is not None and (
                    all(s.finished or s.process is None for s in self.steps) or now > drain_deadline
                ):
                    return 0
                time.sleep(0.25)
        finally:
            progress.close()

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

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self._stopping = True

    def child_pids(self) -> dict[str, int]:
        """Live local child pids by step name (for tests and operators)."""
        return {
            s.name: s.process.pid
            for s in self.steps
            if s.process is not None and s.process.pid is not None and s.process.poll() is None
        }


class _Progress:
    """Live progress line: learner step, batch slot, reward, staleness, throughput."""

    def __init__(self, store: Any, total: int, callback: Callable[[dict[str, Any]], None] | None) -> None:
        from tqdm import tqdm

        self._store = store
        self._bar = tqdm(total=total, desc="learner", unit="step", dynamic_ncols=True, disable=None)
        self._last = 0.0
        self._callback = callback
        self._metrics_cache: dict[str, list[dict[str, Any]]] = {}

    def update(self) -> None:
        now = time.monotonic()
        if now - self._last < 2.0:
            return
        self._last = now
        info = snapshot(self._store)
        self._bar.n = info.get("policy_step", 0)
        self._bar.set_postfix(
            {k: info[k] for k in ("batch_slot", "reward", "staleness", "rollouts_per_s") if k in info}, refresh=True
        )
        if self._callback:
            self._callback(info)

    def close(self) -> None:
        self._bar.close()


def snapshot(store: Any) -> dict[str, Any]:
    """What a run root says about progress right now (cheap: listings plus the newest metrics)."""
    from pipeline.metrics import read_metrics

    info: dict[str, Any] = {}
    steps = [layout.parse_step(p) for p in store.list(layout.POLICIES) if p.endswith(layout.COMMIT_MARKER)]
    info["policy_step"] = max(steps, default=0)
    slots = [layout.parse_step(p) for p in store.list(layout.BATCH_LOG) if p.endswith(".json")]
    info["batch_slot"] = max(slots, default=0)
    bm = read_metrics(store, "batchmaker")
    if bm:
        last = bm[-1]
        if "mean_reward" in last:
            info["reward"] = round(float(last["mean_reward"]), 3)
        if "staleness_mean" in last:
            info["staleness"] = round(float(last["staleness_mean"]), 2)
    ro = read_metrics(store, "rollout")
    if ro and "rollouts_per_s" in ro[-1]:
        info["rollouts_per_s"] = round(sum(float(r.get("rollouts_per_s", 0)) for r in ro[-4:]) / min(4, len(ro)), 1)
    return info
