"""The Ray backend: every step as a Ray task that runs the step program with the resources asked for."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError, RayBackendConfig
from pipeline.runners.base import STOP_GRACE_S, StepProcess, StepSpec

logger = logging.getLogger(__name__)


class RayProcess:
    """A step as a Ray task that runs the step program with the resources asked for."""

    def __init__(
        self,
        module: str,
        config_yaml: str,
        num_cpus: float,
        num_gpus: float,
        env: dict[str, str],
        resources: dict[str, float] | None = None,
    ) -> None:
        import ray

        self._ray = ray
        options = _remote_run_step().options(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {})
        self._ref = options.remote(module, config_yaml, env)
        self._rc: int | None = None

    @property
    def pid(self) -> int | None:
        """None: the process runs on a Ray worker."""
        return None

    def poll(self) -> int | None:
        """The task's exit code once it has ended (1 if the task itself failed), else None."""
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
        """Cancel the task (its step program gets SIGTERM)."""
        if self._rc is None:
            self._ray.cancel(self._ref, force=False)

    def kill(self) -> None:
        """Cancel the task by force."""
        if self._rc is None:
            self._ray.cancel(self._ref, force=True)


def _run_step(module: str, config_yaml: str, env: dict[str, str]) -> int:
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


_remote: Any = None


def _remote_run_step() -> Any:
    """`_run_step` as a Ray remote function (made once, after Ray is initialised)."""
    global _remote
    if _remote is None:
        import ray

        _remote = ray.remote(max_retries=0)(_run_step)
    return _remote


def init_ray(address: str | None, need_cpus: float, need_gpus: float) -> None:
    """Connect to (or start) Ray and make sure every step can run at once.

    The steps of a job depend on each other (the learner waits for rollouts), so a cluster that can hold only
    some of them deadlocks silently; refuse that up front (ConfigError naming `backend.resources`). A local
    cluster started here gets at least as many logical CPUs as the steps ask for (they are processes, not cores).
    """
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
            "backend.resources",
            {"cpus": need_cpus, "gpus": need_gpus},
            f"the steps ask for {need_cpus:g} CPUs and {need_gpus:g} GPUs together, but the Ray cluster at "
            f"{address or 'local'} has {have_cpus:g} CPUs and {have_gpus:g} GPUs; every step must run at once "
            "(lower backend.resources.*_cpus / *_gpus or add nodes)",
        )


class RayLauncher:
    """Starts steps as Ray tasks with the per-step resources of the backend config."""

    def __init__(self, config: RayBackendConfig) -> None:
        self.config = config

    def prepare(self, steps: Sequence[StepSpec]) -> None:
        """Connect to the cluster and refuse resources it cannot hold for every step at once."""
        res = [self.config.resources.for_kind(s.kind) for s in steps]
        init_ray(self.config.address, sum(c for c, _ in res), sum(g for _, g in res))

    def start(self, spec: StepSpec, log_path: Path) -> StepProcess:
        """Start the step's program as a Ray task (its output stays in Ray's worker logs)."""
        cpus, gpus = self.config.resources.for_kind(spec.kind)
        config_yaml = Path(spec.config_path).read_text()
        node = self.config.resources.node_resources(spec.kind)
        return RayProcess(spec.module, config_yaml, cpus, gpus, {"RLPIPE_STEP": spec.name}, node)
