"""Fast step starts for the local backend: a fork server that has imported the step programs once.

A step process spends ~4–5 s of CPU importing JAX, haliax, levanter and transformers before it does any work,
at every start and every restart. With `backend.fork_server: true` (the default) the job runner starts one
`python -m steps.forkserver` that imports the job's step programs once, and each step process is forked from it
instead (~0.05 s). Nothing in that server has started a thread or a JAX backend, so every step process starts
its own JAX backend with its own environment (XLA flags, device count, `jax.distributed`) as a fresh
interpreter would. The step process is still the runner's own child (the runner is a child subreaper while the
server forks it), so exit codes, signals and logs work exactly as for `subprocess.Popen`.

Where the server cannot be used (not Linux, the server failed to start or to import a step, a step's
environment differs from the server's beyond the `RLPIPE_*` variables the launcher sets per step) the launcher starts a
fresh interpreter for that step, as with `fork_server: false`, and logs why once.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.process.parent_watch import PARENT_ENV, starter_env

logger = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
READY_TIMEOUT_S = 180.0
"""How long the server may take to import the step programs (a loaded machine) before steps start without it."""
MAX_SERVER_STARTS = 4
"""A server that died (killed, out of memory) is replaced at the next step start, this many starts in all."""
REPLY_TIMEOUT_S = 60.0
"""How long one fork request may take (it imports the step's module first if it was not preloaded)."""
RUN_TIME_ENV = (
    "RLPIPE_STEP",
    "RLPIPE_ATTEMPT",
    "RLPIPE_COORDINATOR",
    "RLPIPE_NUM_PROCESSES",
    "RLPIPE_PROCESS_ID",
    "PYTEST_CURRENT_TEST",
    PARENT_ENV,
)
"""Environment variables that differ from one step process to the next and are read at run time only (never
while importing), so a step whose environment differs from the server's in these alone can be forked."""


def _set_subreaper(on: bool) -> bool:
    """Make this process a child subreaper (Linux): orphaned descendants become its children. False if not."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def base_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without `RUN_TIME_ENV`: what must equal the server's environment to fork a step."""
    return {k: v for k, v in env.items() if k not in RUN_TIME_ENV}


class ForkedProcess:
    """A step process started by the fork server: the subset of `subprocess.Popen` the launcher uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal) once the process has ended, else None."""
        if self.returncode is None:
            self._wait(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to end (`subprocess.TimeoutExpired` after `timeout` s); its exit code."""
        if timeout is None:
            while self.returncode is None:
                self._wait(0)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def _wait(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped elsewhere: the status is lost; count it as a crash
            self.returncode = -int(signal.SIGKILL)
            return
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)

    def send_signal(self, sig: int) -> None:
        """Send `sig` if the process has not been reaped."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL the process if it still runs."""
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The runner's side of one `python -m steps.forkserver` (see the module docstring)."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str]) -> None:
        self.preload = list(preload)
        self.env = base_env(env)
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.disabled: str | None = None
        """Why steps no longer start through the server (None while they do)."""
        self._ready = False
        self.starts = 0

    def start(self) -> None:
        """Start the server (it imports in the background; the first `spawn` waits for it)."""
        self.starts += 1
        self._ready = False
        if not _set_subreaper(False):
            self._disable("this platform has no child subreaper (Linux only)")
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "steps.forkserver",
                    "--fd",
                    str(theirs.fileno()),
                    "--preload",
                    ",".join(self.preload),
                    "--parent",  # it ends with this process (pipeline.process.parent_watch)
                    starter_env()[PARENT_ENV],
                ],
                pass_fds=[theirs.fileno()],
                env=dict(self.env),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches the runner, which closes the socket
            )
        except OSError as e:
            ours.close()
            self._disable(f"could not start it: {e}")
            return
        finally:
            theirs.close()
        self._sock = ours

    def _disable(self, why: str) -> None:
        if self.disabled is None:
            logger.warning("fork server: %s; steps start as fresh interpreters", why)
        self.disabled = why
        self.close()

    def _receive(self, timeout: float) -> dict[str, Any] | None:
        assert self._sock is not None
        deadline = time.monotonic() + timeout
        while True:
            self._sock.settimeout(min(1.0, max(0.01, deadline - time.monotonic())))
            try:
                data = self._sock.recv(1 << 16)
            except TimeoutError:
                if self._proc is not None and self._proc.poll() is not None:
                    return None
                if time.monotonic() >= deadline:
                    return None
                continue
            except OSError:
                return None
            return json.loads(data) if data else None

    def wait_ready(self) -> bool:
        """Wait until the server has imported its modules; False if it will not be used."""
        if self.disabled is not None or self._sock is None:
            return False
        if self._ready:
            return True
        started = time.monotonic()
        reply = self._receive(READY_TIMEOUT_S)
        if reply is None or not reply.get("ready"):
            why = (reply or {}).get("error") or f"no answer within {READY_TIMEOUT_S:.0f} s or it exited"
            self._disable(f"not ready ({why})")
            return False
        logger.info("fork server ready in %.1f s (preloaded %s)", time.monotonic() - started, ", ".join(self.preload))
        self._ready = True
        return True

    def spawn(self, module: str, argv: Sequence[str], env: Mapping[str, str], log_fd: int) -> ForkedProcess | None:
        """Start `python -m module argv` with `env`, stdout and stderr on `log_fd`, in a new session, as a child
        of this process; None (nothing started) when the server cannot start it."""
        if self.disabled is not None or self._sock is None:
            return None
        if self._proc is not None and (rc := self._proc.poll()) is not None:
            if self.starts >= MAX_SERVER_STARTS:
                self._disable(f"it exited with {rc}, {self.starts} starts in all")
                return None
            logger.warning("fork server exited with %s; starting a new one", rc)
            self.close()
            self.start()
            if self._sock is None:
                return None
        if base_env(env) != self.env:
            logger.debug("fork server: %s has another environment; a fresh interpreter starts it", module)
            return None
        if not self.wait_ready():
            return None
        go_r, go_w = os.pipe()
        try:
            request = {"module": module, "argv": list(argv), "env": dict(env), "cwd": os.getcwd()}
            if not _set_subreaper(True):
                self._disable("could not become a child subreaper")
                return None
            try:
                socket.send_fds(self._sock, [json.dumps(request).encode()], [log_fd, go_r])
                reply = self._receive(REPLY_TIMEOUT_S)
            except OSError as e:
                reply = {"error": f"{type(e).__name__}: {e}"}
            finally:
                _set_subreaper(False)
            if reply is None or "pid" not in reply:
                if self._proc is not None and self._proc.poll() is not None and reply is None:
                    return None  # it died meanwhile: replaced at the next start
                self._disable(f"could not start {module} ({(reply or {}).get('error') or 'no answer'})")
                return None  # closing go_w makes a process it may have forked exit at once
            proc = ForkedProcess(int(reply["pid"]))
            try:
                os.waitpid(proc.pid, os.WNOHANG)
            except ChildProcessError:  # not reparented to us: we could not supervise it; it exits on EOF
                self._disable("the forked step is not this process's child")
                return None
            os.write(go_w, b"g")
            return proc
        finally:
            os.close(go_r)
            os.close(go_w)

    def close(self) -> None:
        """Stop the server (step processes it started keep running)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
