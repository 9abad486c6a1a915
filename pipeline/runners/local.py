"""The local backend: every step as a child process of the job runner, output in its log under the run root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from pipeline.config import LocalBackendConfig
from pipeline.runners.base import StepProcess, StepSpec
from pipeline.step_logs import LogTarget, StepLog


class LocalProcess:
    """A step as a local child process, stdout and stderr appended to its `StepLog`."""

    def __init__(self, module: str, config_path: str, log: LogTarget, env: dict[str, str]) -> None:
        self._log = StepLog(log)
        self._file = self._log.open()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", module, "--config_path", config_path],
            stdout=self._file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ctrl-C in the terminal reaches the runner only; it stops children itself
        )

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        return self._proc.pid

    def poll(self) -> int | None:
        """The exit code once the child has ended (its log is then complete under the run root), else None."""
        rc = self._proc.poll()
        if rc is not None and not self._file.closed:
            self._file.close()
            self._log.close()
        return rc

    def terminate(self) -> None:
        """SIGTERM the child if it still runs."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the child if it still runs."""
        if self._proc.poll() is None:
            self._proc.kill()


class LocalLauncher:
    """Starts steps as local child processes (no resources: the steps share this machine)."""

    def __init__(self, config: LocalBackendConfig) -> None:
        self.config = config

    def prepare(self, steps: Sequence[StepSpec]) -> None:
        """Nothing to connect to."""

    def start(self, spec: StepSpec, log: LogTarget) -> StepProcess:
        """Start the step's program as a child process, `RLPIPE_STEP` set to the step's name."""
        env = {**os.environ, "RLPIPE_STEP": spec.name}
        return LocalProcess(spec.module, spec.config_path, log, env)
