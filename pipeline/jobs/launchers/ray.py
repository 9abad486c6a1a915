"""The Ray backend: every step as a Ray actor that runs the step program with the resources asked for; the
step's output goes to its log under the run root and, through Ray's `log_to_driver`, to the driver."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError, RayBackendConfig
from pipeline.jobs.launchers.base import STOP_GRACE_S, StepGroup, StepProcess, StepSpec
from pipeline.jobs.step_logs import LogTarget, StepLog, pump
from pipeline.process.exits import ExpectedFailure
from pipeline.process.parent_watch import parent_of, starter_env

logger = logging.getLogger(__name__)


class RayProcess:
    """A step as a Ray actor that runs the step program with the resources asked for.

    An actor rather than a task, so that stopping a step is a SIGTERM to its program (which exits cleanly,
    code 0) instead of a cancelled task: the exit code is the program's own on every backend.
    """

    def __init__(
        self,
        module: str,
        config_yaml: str,
        num_cpus: float,
        num_gpus: float,
        env: dict[str, str],
        log: LogTarget,
        resources: dict[str, float] | None = None,
        actor: Any = None,
    ) -> None:
        import ray

        self._ray = ray
        self._name = log.step
        self._actor = actor if actor is not None else new_actor(num_cpus, num_gpus, resources)
        self._ref = self._actor.run.remote(module, config_yaml, env, log)
        self._rc: int | None = None

    @property
    def pid(self) -> int | None:
        """None: the process runs on a Ray worker."""
        return None

    def poll(self) -> int | None:
        """The step program's exit code once it has ended (1 if its actor died), else None."""
        if self._rc is not None:
            return self._rc
        ready, _ = self._ray.wait([self._ref], timeout=0)
        if ready:
            try:
                self._rc = int(self._ray.get(self._ref))
            except self._ray.exceptions.RayError as e:  # the actor died (node lost, killed): a failed step
                logger.warning("the Ray actor of %s died: %s", self._name, str(e).splitlines()[0])
                self._rc = 1
            self._ray.kill(self._actor)  # frees its resources
        return self._rc

    def terminate(self) -> None:
        """SIGTERM the step program (it stops after its current phase)."""
        if self._rc is None:
            self._actor.stop.remote(signal.SIGTERM)

    def kill(self) -> None:
        """Kill the actor and its step program at once."""
        if self._rc is None:
            try:  # the program first: killing only the actor would orphan it
                self._ray.get(self._actor.stop.remote(signal.SIGKILL), timeout=5.0)
            except self._ray.exceptions.RayError as e:
                logger.warning("could not signal the step program of %s: %s", self._name, str(e).splitlines()[0])
            self._ray.kill(self._actor, no_restart=True)
            self._rc = -signal.SIGKILL


def new_actor(num_cpus: float, num_gpus: float, resources: dict[str, float] | None, spread: bool = False) -> Any:
    """A fresh `StepActor` holding these resources (`spread`: Ray's SPREAD strategy, one per node where it can)."""
    extra: dict[str, Any] = {"scheduling_strategy": "SPREAD"} if spread else {}
    return (
        _step_actor()
        .options(
            num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {}, max_concurrency=2, max_restarts=0, **extra
        )
        .remote()
    )


class RayProcessGroup(StepGroup):
    """One step run as N cooperating Ray actors (the group contract: `StepGroup`)."""

    def __init__(self, members: list[RayProcess]) -> None:
        super().__init__(members)
        self.members = members

    @property
    def pid(self) -> int | None:
        """None: the processes run on Ray workers."""
        return None


def start_ray_group(spec: StepSpec, log: LogTarget, config_yaml: str, cpus: float, gpus: float,
                    node: dict[str, float], base_env: dict[str, str]) -> RayProcessGroup:  # fmt: skip
    """`spec.processes` actors, one per node where the cluster has enough (SPREAD), each with the step's resources;
    member 0's node serves the `jax.distributed` coordinator on a port free there, and every member gets
    `RLPIPE_COORDINATOR`, `RLPIPE_NUM_PROCESSES`, `RLPIPE_PROCESS_ID` (logs: `<attempt>.p<i>.log` for i > 0)."""
    import ray

    actors = [new_actor(cpus, gpus, node, spread=True) for _ in range(spec.processes)]
    coordinator = ray.get(actors[0].coordinator_address.remote())
    members = []
    for i, actor in enumerate(actors):
        target = log if i == 0 else dataclasses.replace(log, attempt=f"{log.attempt}.p{i}")
        env = {
            **base_env,
            "RLPIPE_ATTEMPT": target.attempt,
            "RLPIPE_COORDINATOR": coordinator,
            "RLPIPE_NUM_PROCESSES": str(spec.processes),
            "RLPIPE_PROCESS_ID": str(i),
        }
        members.append(RayProcess(spec.module, config_yaml, cpus, gpus, env, target, node, actor=actor))
    logger.info("%s: %d processes, coordinator %s", spec.name, spec.processes, coordinator)
    return RayProcessGroup(members)


class StepActor:
    """Runs one step program on a Ray worker: `run` (to completion, output into the step's log under the run
    root and onto this worker's stdout, which Ray forwards to the driver) and `stop` (a signal to it)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._pending: int | None = None
        """A signal that arrived before the program started (delivered as soon as it starts)."""
        self._lock = threading.Lock()
        self._port: Any = None
        """The coordinator port this actor holds (`coordinator_address`), released when the actor ends."""

    def run(self, module: str, config_yaml: str, env: dict[str, str], log: LogTarget) -> int:
        """Write the config locally, run the step program, return its exit code."""
        step_log = StepLog(log)
        try:
            with tempfile.TemporaryDirectory() as d, step_log.open() as sink:
                path = os.path.join(d, "step.yaml")
                Path(path).write_text(config_yaml)
                with self._lock:  # `stop` may run (second thread) before the program exists: hand it on
                    self._proc = subprocess.Popen(
                        [sys.executable, "-m", module, "--config_path", path],
                        # the program ends with this actor's process (one Ray kills, or whose node is lost),
                        # never left running on the node (pipeline.process.parent_watch)
                        env={**os.environ, **env, **starter_env()},
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                    )
                    if self._pending is not None:
                        self._proc.send_signal(self._pending)
                assert self._proc.stdout is not None
                pump(self._proc.stdout, sink, echo_prefix=f"[{log.step}] ")
                return self._proc.wait()
        finally:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
            step_log.close()

    def coordinator_address(self) -> str:
        """host:port on this actor's node for a `jax.distributed` coordinator: a port this actor reserves
        (`pipeline.process.ports.reserve_port`) and holds for its own life, so no other program on the node can
        bind it while process 0's coordinator (gRPC, SO_REUSEPORT) can."""
        import ray

        from pipeline.process.ports import reserve_port

        if self._port is None:
            self._port = reserve_port()
        return f"{ray.util.get_node_ip_address()}:{self._port.port}"

    def stop(self, signum: int) -> None:
        """Send `signum` to the step program; one that has not started yet gets it as soon as it starts (a stop
        sent while the actor is still being placed is not lost)."""
        with self._lock:
            if self._proc is None:
                self._pending = signum
            elif self._proc.poll() is None:
                self._proc.send_signal(signum)


_actor_class: Any = None


def _step_actor() -> Any:
    """`StepActor` as a Ray actor class (made once, after Ray is initialised); two threads, so `stop` runs while
    `run` waits."""
    global _actor_class
    if _actor_class is None:
        import ray

        _actor_class = ray.remote(StepActor)
    return _actor_class


def init_ray(address: str | None, need_cpus: float, need_gpus: float) -> None:
    """Connect to (or start) Ray and make sure every step can run at once.

    The steps of a job depend on each other (the learner waits for rollouts), so a cluster that can hold only
    some of them deadlocks silently; refuse that up front (ConfigError naming `backend.resources`). A local
    cluster started here gets at least as many logical CPUs as the steps ask for (they are processes, not cores)
    and runs the step programs at the caller's niceness (Ray's default for its workers is 15).
    """
    # Every line of every step reaches the driver: Ray's default folds lines that differ only in numbers ("trained
    # slot 3" after "trained slot 2") into "[repeated Nx]". Read when ray is first imported; the environment wins.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray wraps each forwarded line in ANSI colour codes unless RAY_COLOR_PREFIX=0 (read as each line is
    # printed, to the driver's stdout or stderr): into a file or a pipe they are noise. The environment wins.
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    import ray

    if not ray.is_initialized():
        kwargs: dict[str, Any] = {}
        local = address is None and not os.environ.get("RAY_ADDRESS")  # a cluster started here, by ray.init
        if local:
            # A local cluster gets every CPU asked for (below) and the GPUs Ray detects on this host: a GPU ask it
            # cannot hold is refused before a cluster is started for nothing.
            gpus = local_gpus()
            if gpus is not None:
                refuse_unless_held(None, need_cpus, need_gpus, need_cpus, float(gpus))
            kwargs["num_cpus"] = max(os.cpu_count() or 1, math.ceil(need_cpus))
            # Ray starts its workers at niceness 15 (its `worker_niceness`), and a step program inherits its
            # actor's: beside any other work on the host the steps then got ~1/30 of a normal process's CPU share
            # (a test job took 7x its time on a loaded 2-core VM). A local cluster runs them as the local backend
            # does, at this process's own niceness; a cluster started elsewhere keeps its own setting.
            kwargs["_system_config"] = {"worker_niceness": os.getpriority(os.PRIO_PROCESS, 0)}
        start_ray(address, kwargs, tries=RAY_START_TRIES if local else 1)
    total = ray.cluster_resources()
    refuse_unless_held(address, need_cpus, need_gpus, float(total.get("CPU", 0.0)), float(total.get("GPU", 0.0)))


def refuse_unless_held(address: str | None, need_cpus: float, need_gpus: float, have_cpus: float,
                       have_gpus: float) -> None:  # fmt: skip
    """ConfigError naming `backend.resources` unless a cluster of `have_*` holds every step's ask at once."""
    if have_cpus + 1e-9 < need_cpus or have_gpus + 1e-9 < need_gpus:
        raise ConfigError(
            "backend.resources",
            {"cpus": need_cpus, "gpus": need_gpus},
            f"the steps ask for {need_cpus:g} CPUs and {need_gpus:g} GPUs together, but the Ray cluster at "
            f"{address or 'local'} has {have_cpus:g} CPUs and {have_gpus:g} GPUs; every step must run at once "
            "(lower backend.resources.*_cpus / *_gpus or add nodes)",
        )


def local_gpus() -> int | None:
    """The GPUs a Ray cluster started on this host would have, by Ray's own detection (its accelerator manager for
    `GPU`, capped by the visible devices); None where this Ray version's detection cannot be reached (the cluster's
    own count is then checked once it is up)."""
    if os.environ.get("RAY_OVERRIDE_RESOURCES"):  # the node's resources as the user set them: Ray's to count
        return None
    try:
        from ray._private import accelerators  # Ray's node start counts GPUs with it (resource_and_label_spec)

        manager = accelerators.get_accelerator_manager_for_resource("GPU")
        if manager is None:
            return 0
        count = int(manager.get_current_node_num_accelerators())
        visible = manager.get_current_process_visible_accelerator_ids()
        return count if visible is None else min(count, len(visible))
    except Exception:  # a private module: a Ray that moved it keeps the check after the start
        logger.debug("Ray's GPU detection is not reachable; the cluster's GPUs are checked once it is up",
                     exc_info=True)  # fmt: skip
        return None


RAY_START_TRIES = 3
"""Starts of a local Ray cluster before giving up: Ray waits a fixed 30 s for its node to register with its GCS
server, which a loaded machine can exceed (seen with two test suites side by side on 2 cores)."""


class RayStartError(ExpectedFailure):
    """A local Ray cluster did not start: one line naming the cause, exit 1."""


def start_ray(address: str | None, kwargs: dict[str, Any], tries: int) -> None:
    """`ray.init`; a local cluster whose node does not register within Ray's fixed 30 s is started again (up to
    `tries` starts), the processes of the failed start stopped first; RayStartError after the last."""
    import ray

    for attempt in range(1, tries + 1):
        before = _children()
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=True, ignore_reinit_error=True, **kwargs)
            return
        except Exception as e:  # Ray raises a bare Exception when its node does not register in time
            if "timed out during startup" not in str(e):
                raise
            for pid in _children() - before:  # the failed start's GCS server, raylet, monitors
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                ray.shutdown()
            if attempt == tries:
                raise RayStartError(
                    f"backend.type=ray: the local Ray cluster did not start in {tries} tries (its node did not "
                    f"register within Ray's 30 s each time: an overloaded machine?): {' '.join(str(e).split())}"
                ) from e
            logger.warning("the local Ray cluster did not start (try %d/%d): %s; starting it again", attempt, tries,
                           str(e).splitlines()[0])  # fmt: skip


def _children() -> set[int]:
    """The pids of this process's live children (from /proc; empty where there is none)."""
    me = os.getpid()
    try:
        names = os.listdir("/proc")
    except OSError:
        return set()
    return {int(n) for n in names if n.isdigit() and parent_of(int(n)) == me}


class RayLauncher:
    """Starts steps as Ray tasks with the per-step resources of the backend config."""

    def __init__(self, config: RayBackendConfig) -> None:
        self.config = config

    def prepare(self, steps: Sequence[StepSpec]) -> None:
        """Connect to the cluster and refuse resources it cannot hold for every step at once."""
        res = [
            (c * s.processes, g * s.processes)
            for s in steps
            for c, g in [self.config.resources.for_kind(s.kind.job_name)]
        ]
        init_ray(self.config.address, sum(c for c, _ in res), sum(g for _, g in res))

    def start(self, spec: StepSpec, log: LogTarget) -> StepProcess:
        """Start the step's program in a Ray actor (a learner of `processes` > 1: one actor per process, see
        `RayProcessGroup`); its output goes to `log` and to the driver."""
        cpus, gpus = self.config.resources.for_kind(spec.kind.job_name)
        config_yaml = Path(spec.config_path).read_text()
        node = self.config.resources.node_resources(spec.kind.job_name)
        env = {"RLPIPE_STEP": spec.name, "RLPIPE_ATTEMPT": log.attempt}
        if spec.processes > 1:
            return start_ray_group(spec, log, config_yaml, cpus, gpus, node, env)
        return RayProcess(spec.module, config_yaml, cpus, gpus, env, log, node)

    def close(self) -> None:
        """Nothing to release: the actors end with their steps, and the Ray connection with the driver."""
