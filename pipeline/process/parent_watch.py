"""A process started by a supervisor ends when that supervisor is gone: no orphaned step keeps running.

The job runner (and its fork server) marks every step process it starts with `PARENT_ENV` (`starter_env()`:
its own process id). A step process that finds the mark at its start (`end_with_starter()`, called by
`steps/__init__.py` and by the fork server's `become_step`) removes it from its environment (its own children never
inherit it) and from then on ends once that process is no longer its parent:

- on Linux, `prctl(PR_SET_PDEATHSIG, SIGTERM)`: the kernel sends SIGTERM the moment the parent goes (a SIGKILLed
  runner included), and the step ends as when the runner itself stops it (its clean stop, else SIGTERM's default
  action: 143). The death signal follows the parent *thread*, so the mark says whether the process was started
  from its starter's main thread (`<pid>`), else (`<pid>:poll`) no death signal is set and only the watch below
  acts; a process forked by the fork server is reparented to the runner's main thread (`steps.forkserver`);
- the parent may die before `prctl`: `getppid()` is checked after it;
- everywhere, a watch thread polls `getppid()` every `POLL_S`: once the parent is gone it writes one line to
  stderr (the step's log), sends SIGTERM where no death signal was set, and ends the process with `os._exit(143)`
  if it is still running `GRACE_S` later (a step that does not stop on SIGTERM: the runner's own grace, then its
  SIGKILL).

Nothing is lost by such an end: commits are create-if-absent and a step may die at any instant (the crash suites);
the run's next job resumes from what was committed. A process started without the mark (a step run from a shell
or cron: `rlpipe learn …`) is never tied to its parent: it outlives the shell that started it. A mark whose
process is alive but is not this process's parent was inherited by mistake (through a program that does not
consume it) and is ignored.

A server a step starts as a child (`policy.inference.server.ServerProcess`: its own session, so that stopping it
stops what it started) is tied to the step by `tied_command()`: this file, run by path, becomes the server's program
(the same pid) and leaves a watcher process beside it that stops the server's process group once the step is no
longer the server's parent (a SIGKILLed step included): SIGTERM, then SIGKILL `GRACE_S` later. Any command works
(vLLM, SGLang, rlpipe's own servers), and the watcher follows the step process, not the thread that started the
server. Linux only (it reads `/proc`); elsewhere the server is started untied.

Standard library only: the verifiers harness worker (`pipeline/environments/harness_worker.py`), which runs on
another interpreter, loads this file by path for its own parent watch.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import NoReturn

PARENT_ENV = "RLPIPE_PARENT"
"""`<pid>` or `<pid>:poll`: set by a supervisor in the environment of each process it starts (`starter_env()`)."""
POLL_S = 1.0
"""How often the watch thread checks that the parent is still there."""
GRACE_S = 20.0
"""After its parent is gone, how long a process may take to stop on SIGTERM before it ends at once (the job
runner's own grace before its SIGKILL, `pipeline.jobs.launchers.base.STOP_GRACE_S`)."""
TERMINATED = 143
"""The exit code of a process ended this way: 128 + SIGTERM (`pipeline.process.exits.Exit.TERMINATED`; a literal
here, as this file is loaded by path on other interpreters)."""
PR_SET_PDEATHSIG = 1
TIED_ARGV_ENV = "RLPIPE_TIED_ARGV"
"""The tied program's command line (JSON), passed in the environment so that the watcher's own command line does not
name the server's program (a search of the process table for the server finds the server alone)."""


def starter_env() -> dict[str, str]:
    """The environment entry that ties a process this process starts now to this process's life (see the module
    docstring): `<pid>`, or `<pid>:poll` when called from a thread other than the main thread (a death signal
    would follow that thread, not the process)."""
    main = threading.current_thread() is threading.main_thread()
    return {PARENT_ENV: f"{os.getpid()}" if main else f"{os.getpid()}:poll"}


def set_death_signal(signum: int) -> bool:
    """Ask the kernel to send `signum` to this process when its parent thread ends (Linux); False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]  # the field after the command name, which may hold ")"
    except (OSError, IndexError):  # no /proc (not Linux), or it ended meanwhile: what kill() said
        return True
    return state not in (b"Z", b"X")


def _write_line(line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())


def stop_orphan(parent: int, *, signalled: bool) -> None:
    """What a process does once its parent `parent` is gone: one line on stderr, SIGTERM to itself unless the
    kernel sent it already (`signalled`), then `os._exit(TERMINATED)` if it is still running `GRACE_S` later.
    Called from the watch thread (or at the start, before anything ran)."""
    _write_line(f"error: terminated: the process that started this one (pid {parent}) is gone; stopping")
    if not signalled:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    _write_line(f"error: terminated: still running {GRACE_S:.0f} s after SIGTERM; exiting at once")
    os._exit(TERMINATED)


def watch_parent(parent: int, on_gone: Callable[[int], None], poll_s: float = POLL_S) -> threading.Thread:
    """Start a daemon thread that calls `on_gone(parent)` once `parent` is no longer this process's parent."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        on_gone(parent)

    thread = threading.Thread(target=watch, name="rlpipe-parent-watch", daemon=True)
    thread.start()
    return thread


def end_with_parent(
    parent: int,
    *,
    death_signal: bool = True,
    watch: bool = True,
    on_gone: Callable[[int], None] | None = None,
) -> bool:
    """From now on, end this process once `parent` is no longer its parent: the kernel's death signal (SIGTERM)
    when `death_signal`, a watch thread when `watch`; `on_gone(parent)` (default `stop_orphan`) runs at once if the
    parent is gone already. Returns whether the death signal was set."""
    signalled = death_signal and set_death_signal(signal.SIGTERM)
    # the parent may have died before the death signal was set: then nothing sent it, and the line comes first
    gone = os.getppid() != parent
    if on_gone is None:

        def on_gone(pid: int) -> None:
            stop_orphan(pid, signalled=signalled and not gone)

    if gone:
        on_gone(parent)
        return signalled
    if watch:
        watch_parent(parent, on_gone)
    return signalled


def end_with_starter(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Take `PARENT_ENV` out of `environ`; if it was set (this process was started by a job runner or its fork
    server), end this process with that process (`end_with_parent`). Returns whether it is now tied to it."""
    mark = environ.pop(PARENT_ENV, None)
    if not mark:
        return False
    pid_text, _, mode = mark.partition(":")
    try:
        parent = int(pid_text)
    except ValueError:
        return False
    if os.getppid() != parent and _alive(parent):  # inherited through a process that did not take it out
        return False
    end_with_parent(parent, death_signal=mode != "poll")
    return True


def tied_command(argv: list[str], env: MutableMapping[str, str]) -> list[str]:
    """The command line that runs `argv` tied to this process (see the module docstring), `env` (the child's
    environment) given what it needs; `argv` itself where the tie cannot work (no `/proc`)."""
    if not os.path.isdir(f"/proc/{os.getpid()}"):
        return argv
    env[TIED_ARGV_ENV] = json.dumps(argv)
    return [sys.executable, "-I", os.path.abspath(__file__), "exec-tied", str(os.getpid())]


def parent_of(pid: int) -> int | None:
    """The parent of live process `pid` (from /proc), None once it has ended (a zombie included) or without /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold ")"
    except (OSError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[1])


def _watch_tied(program: int, parent: int) -> NoReturn:
    """The watcher: once `program` is no longer `parent`'s child, stop `program`'s process group (SIGTERM, SIGKILL
    `GRACE_S` later); exit once `program` has ended."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the group's stop is the program's, not ours
        signal.signal(signum, signal.SIG_IGN)
    while (now := parent_of(program)) == parent:
        time.sleep(POLL_S)
    if now is not None:
        _write_line(f"error: terminated: the process that started this server (pid {parent}) is gone; stopping it")
        with contextlib.suppress(OSError):
            os.killpg(os.getpgid(program), signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while parent_of(program) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        if parent_of(program) is not None:
            _write_line(f"error: terminated: the server is still running {GRACE_S:.0f} s after SIGTERM; killing it")
            with contextlib.suppress(OSError):
                os.killpg(os.getpgid(program), signal.SIGKILL)
    os._exit(0)


def exec_tied(parent: int) -> NoReturn:
    """Become the program of `TIED_ARGV_ENV` (this pid), a watcher (`_watch_tied`) beside it; exit 143 with one line
    if `parent` is gone already, 127 if the program cannot be run."""
    argv = json.loads(os.environ.pop(TIED_ARGV_ENV))
    if os.getppid() != parent:
        _write_line(f"error: terminated: the process that started this server (pid {parent}) is gone; not starting")
        os._exit(TERMINATED)
    program = os.getpid()
    first = os.fork()
    if first == 0:  # the watcher is forked twice, so that nobody has to reap it (its parent exits at once)
        if os.fork() == 0:
            _watch_tied(program, parent)
        os._exit(0)
    os.waitpid(first, 0)
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        _write_line(f"error: cannot run the server's program {argv[0]!r}: {e.strerror or e}")
        os._exit(127)


if __name__ == "__main__" and sys.argv[1:2] == ["exec-tied"]:
    exec_tied(int(sys.argv[2]))
