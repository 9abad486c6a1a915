"""What the job runner needs of a backend: a `Launcher` that starts a step and gives back a `StepProcess`.

A backend is a registered config class (`pipeline.config.backend.JobBackendConfig`) whose `launcher` names
"module:Class"; the class is built with that config. Every backend runs the same step program
(`python -m <module> --config_path <yaml>`, the step config as YAML) and reports its exit code.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from typing import Protocol

from pipeline.config import JobBackendConfig
from pipeline.jobs.step_logs import LogTarget
from pipeline.process.step_kind import StepKind

STOP_GRACE_S = 20.0
"""How long a step may take to exit after SIGTERM before it is killed."""


class StepProcess(Protocol):
    """A running step: local process or Ray task."""

    def poll(self) -> int | None:
        """The exit code once the step has ended, else None."""
        ...

    def terminate(self) -> None:
        """Ask the step to stop (it commits nothing half-done)."""
        ...

    def kill(self) -> None:
        """Stop the step at once."""
        ...

    @property
    def pid(self) -> int | None:
        """The local process id, if the step is a local process."""
        ...


class StepGroup:
    """One step run as N cooperating members (a multi-process learner under `jax.distributed`), on any backend.

    The group has ended when every member has; its exit code is the first non-zero one. When one member fails the
    others are killed at once (they would block in a collective), so the supervisor restarts the whole group. A
    backend's group adds what its members need once the group has ended (`_ended`)."""

    def __init__(self, members: Sequence[StepProcess]) -> None:
        self._members = list(members)

    def poll(self) -> int | None:
        """None while any member runs and none has failed; else the group's exit code."""
        codes = [m.poll() for m in self._members]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            for m in self._members:
                m.kill()
            self._ended(killed=True)
            return failed[0]
        if any(c is None for c in codes):
            return None
        self._ended(killed=False)
        return 0

    def _ended(self, *, killed: bool) -> None:
        """Called once `poll` finds the group ended (`killed`: after a failure killed the others)."""

    def terminate(self) -> None:
        """Ask every member to stop (SIGTERM to its step program)."""
        for m in self._members:
            m.terminate()

    def kill(self) -> None:
        """Stop every member at once."""
        for m in self._members:
            m.kill()


@dataclasses.dataclass
class StepSpec:
    """One supervised step of the job."""

    name: str
    """Its name in the job (`logs/<name>/`): its kind's `job_name`, `rollout-<worker_id>` for a rollout worker."""
    kind: StepKind
    config_path: str
    restarts: int = 0
    process: StepProcess | None = None
    next_start: float = 0.0
    finished: bool = False
    terminated: bool = False
    exit_codes: list[int] = dataclasses.field(default_factory=list)
    processes: int = 1
    """Cooperating processes of this step (the learner under jax.distributed); backends start them together."""

    @property
    def module(self) -> str:
        """The step program (`python -m <module>`)."""
        return self.kind.module


class Launcher(Protocol):
    """Starts steps on one backend."""

    def prepare(self, steps: Sequence[StepSpec]) -> None:
        """Before any step starts: connect to the backend and refuse (ConfigError) what it cannot run at once."""
        ...

    def start(self, spec: StepSpec, log: LogTarget) -> StepProcess:
        """Start `spec`'s program with its config; its stdout and stderr go to `log` (under the run root)."""
        ...

    def close(self) -> None:
        """The job has ended (every step stopped): release what `prepare` set up."""
        ...


def make_launcher(backend: JobBackendConfig) -> Launcher:
    """The launcher of a backend config (its class names it as `launcher = "module:Class"`)."""
    module_name, _, cls_name = type(backend).launcher.partition(":")
    launcher: Launcher = getattr(importlib.import_module(module_name), cls_name)(backend)
    return launcher
