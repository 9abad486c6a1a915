"""The local backend: every step as a child process of the job runner, output in its log under the run root."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from pipeline.config import LocalBackendConfig
from pipeline.jobs.launchers.base import StepGroup, StepProcess, StepSpec
from pipeline.jobs.launchers.forkserver import ForkedProcess, ForkServer
from pipeline.jobs.step_logs import LogTarget, StepLog
from pipeline.process.parent_watch import starter_env
from pipeline.process.ports import ReservedPort, reserve_port


class LocalProcess:
    """A step as a local child process, stdout and stderr appended to its `StepLog`: forked by `fork_server`
    when one is given and can, else a fresh `python -m <module>`."""

    def __init__(
        self, module: str, config_path: str, log: LogTarget, env: dict[str, str], fork_server: ForkServer | None = None
    ) -> None:
        self._log = StepLog(log)
        self._file = self._log.open()
        env = {**env, **starter_env()}  # the step ends when this runner is gone (pipeline.process.parent_watch)
        argv = ["--config_path", config_path]
        forked = fork_server.spawn(module, argv, env, self._file.fileno()) if fork_server is not None else None
        self._proc: subprocess.Popen[bytes] | ForkedProcess = forked or subprocess.Popen(
            [sys.executable, "-m", module, *argv],
            stdout=self._file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ctrl-C in the terminal reaches the runner only; it stops children itself
        )
        self.forked = forked is not None
        """Whether the fork server started this process."""

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


SHARED_DEVICE_DEFAULTS = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
"""Environment defaults of every local step process (a value already in the environment wins): the job's JAX
processes share this machine's accelerators, and JAX's default of reserving 75% of a GPU's memory in the first
process would leave the others out of memory."""


def shared_env() -> dict[str, str]:
    """What every local step process's environment starts from: this one's, `SHARED_DEVICE_DEFAULTS` where unset."""
    return {**SHARED_DEVICE_DEFAULTS, **os.environ}


def child_env(spec: StepSpec, log: LogTarget) -> dict[str, str]:
    """The environment of a local step process: `shared_env()` plus `RLPIPE_STEP` / `RLPIPE_ATTEMPT` (the step's
    name and its log's attempt id; a child server logs beside it)."""
    return {**shared_env(), "RLPIPE_STEP": spec.name, "RLPIPE_ATTEMPT": log.attempt}


class LocalLauncher:
    """Starts steps as local child processes (no resources: the steps share this machine); with
    `fork_server` (the default), forked from a server that has imported the step programs once
    (`pipeline.jobs.launchers.forkserver`)."""

    def __init__(self, config: LocalBackendConfig) -> None:
        self.config = config
        self.fork_server: ForkServer | None = None

    def prepare(self, steps: Sequence[StepSpec]) -> None:
        """Start the fork server (it imports the job's step programs while the runner goes on)."""
        if self.config.fork_server and self.fork_server is None:
            self.fork_server = ForkServer(sorted({s.module for s in steps}), shared_env())
            self.fork_server.start()

    def start(self, spec: StepSpec, log: LogTarget) -> StepProcess:
        """Start the step's program as a child process, `RLPIPE_STEP` and `RLPIPE_ATTEMPT` set to the step's name
        and its log's attempt id (a child server logs beside it); a learner of `processes` > 1: that many
        processes, see `ProcessGroup`."""
        if spec.processes > 1:
            return start_group(spec, log, spec.processes, self.fork_server)
        return LocalProcess(spec.module, spec.config_path, log, child_env(spec, log), self.fork_server)

    def close(self) -> None:
        """Stop the fork server (the steps it started are the runner's to stop)."""
        if self.fork_server is not None:
            self.fork_server.close()
            self.fork_server = None


class ProcessGroup(StepGroup):
    """One step run as N cooperating local processes (the group contract: `StepGroup`).

    Process i gets `RLPIPE_COORDINATOR`, `RLPIPE_NUM_PROCESSES`, `RLPIPE_PROCESS_ID`; logs go to
    `logs/<step>/<attempt>.p<i>.log`. The coordinator's port is reserved by the runner
    (`pipeline.process.ports.reserve_port`) until the group has ended: no other program can bind it meanwhile,
    while process 0's coordinator (gRPC, SO_REUSEPORT) can."""

    def __init__(self, procs: list[LocalProcess], port: ReservedPort | None = None) -> None:
        super().__init__(procs)
        self._procs = procs
        self._port = port

    @property
    def pid(self) -> int | None:
        """Process 0's id."""
        return self._procs[0].pid

    @property
    def forked(self) -> bool:
        """Whether the fork server started every process of the group."""
        return all(p.forked for p in self._procs)

    @property
    def members(self) -> list[LocalProcess]:
        """The processes, in process-id order."""
        return list(self._procs)

    def _ended(self, *, killed: bool) -> None:
        """Reap the killed processes (their logs then complete) and release the coordinator's port."""
        if killed:
            for p in self._procs:
                p._proc.wait()
                p.poll()
        if self._port is not None:
            self._port.close()


def start_group(spec: StepSpec, log: LogTarget, processes: int, fork_server: ForkServer | None = None) -> StepProcess:
    """Start `processes` copies of the step's program wired to one coordinator on loopback, on a port reserved
    for the group's lifetime (see `ProcessGroup`)."""
    port = reserve_port()
    procs: list[LocalProcess] = []
    try:
        for i in range(processes):
            env = {
                **child_env(spec, log),
                "RLPIPE_COORDINATOR": port.address,
                "RLPIPE_NUM_PROCESSES": str(processes),
                "RLPIPE_PROCESS_ID": str(i),
            }
            target = log if i == 0 else dataclasses.replace(log, attempt=f"{log.attempt}.p{i}")
            procs.append(LocalProcess(spec.module, spec.config_path, target, env, fork_server))
    except BaseException:
        for p in procs:
            p.kill()
        port.close()
        raise
    return ProcessGroup(procs, port)
