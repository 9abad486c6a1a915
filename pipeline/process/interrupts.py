"""A program stopped by SIGINT (Ctrl-C) or SIGTERM (a scheduler's or a container's stop) ends with one line on
stderr and exit code 128 + the signal (130, 143), never a traceback.

Three stages of a program's life, one rule each:

- from its start until it runs its own code (`python -m steps.<name>` while its modules import, `rlpipe` while it
  dispatches): `exit_at_once_on_signals()`: the line, then `os._exit(128 + signal)` (nothing was started);
- while it runs (`steps.cli.run_command`, `python -m pipeline.report`): `stop_signals()`: SIGINT raises
  KeyboardInterrupt as Python's default does (`finally` blocks run: a child server is stopped, a lease released),
  which the program catches at its top and ends with `interrupted()`: the line, exit 130 (a Ctrl-C that lands in
  code whose exceptions Python only reports, a garbage-collection callback such as JAX's, is delivered again
  once that code returned, instead of "Exception ignored" and a program that goes on); SIGTERM prints the line
  and ends the process at once with 143, as SIGTERM's default action ends it (with 143 and no line). A step with a
  clean stop of its own installs its own handlers inside (the BatchMaker, a rollout worker, `steps.serve`: exit 0).
- under the job runner (`RLPIPE_STEP` set), SIGTERM is the runner's way to stop a step: it keeps its default action
  there (the runner logs `<step> stopped` itself).

The line is `error: interrupted: stopped by SIGINT (Ctrl-C)` / `error: terminated: stopped by SIGTERM`: the label of
the code in the one table (`pipeline.process.exits.LABELS`). `rlpipe` ends a program stopped by a signal with
`end_process`: its line is out and its `finally` blocks ran, and the interpreter's teardown and the libraries'
exit functions (JAX's, equinox's), which can crash while JAX's threads still hold the interrupted work, are
skipped; a program that ended on its own ignores a signal that lands after its code is decided
(`ignore_stop_signals`), so it exits with that code.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any, NoReturn

from pipeline.process.exits import LABELS

REDELIVER_S = 0.05
"""How long after a Ctrl-C swallowed by a garbage-collection callback it is delivered again (`stop_signals`)."""
STEP_ENV = "RLPIPE_STEP"
"""Set by the job runner in every step process it starts (`pipeline.jobs.step_logs`)."""


def exit_code(signum: int) -> int:
    """128 + `signum`: what a shell reports for a process that ended on that signal (130 SIGINT, 143 SIGTERM)."""
    return 128 + int(signum)


def stop_line(signum: int) -> str:
    """The one line a program stopped by `signum` prints."""
    code = exit_code(signum)
    how = " (Ctrl-C)" if signum == signal.SIGINT else ""
    return f"error: {LABELS.get(code, 'interrupted')}: stopped by {signal.Signals(signum).name}{how}"


def write_line(line: str) -> None:
    """`line` on stderr with one write(2) (safe inside a signal handler; a stderr that refuses it is ignored)."""
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())


def _exit_at_once(signum: int, frame: FrameType | None) -> None:
    write_line(stop_line(signum))
    os._exit(exit_code(signum))


def under_job_runner() -> bool:
    """Whether this process is a step the job runner started (it stops its steps with SIGTERM)."""
    return bool(os.environ.get(STEP_ENV))


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def exit_at_once_on_signals() -> None:
    """SIGINT and SIGTERM end this process at once with the line and 128 + the signal (see the module docstring);
    SIGTERM under the job runner keeps its default action."""
    if not _in_main_thread():
        return
    signal.signal(signal.SIGINT, _exit_at_once)
    if not under_job_runner():
        signal.signal(signal.SIGTERM, _exit_at_once)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """While the program runs: SIGINT raises KeyboardInterrupt (end it with `interrupted()`); SIGTERM prints the line
    and exits 143 at once (its default action under the job runner). The previous handlers come back after."""
    if not _in_main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous_hook = sys.unraisablehook
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL if under_job_runner() else _exit_at_once)

    def unraisable(info: Any) -> None:
        # Ctrl-C landed in code whose exceptions Python cannot raise (a garbage-collection callback, such as JAX's,
        # a __del__): instead of "Exception ignored … KeyboardInterrupt" and a program that goes on, the signal is
        # delivered again a moment later, once that code has returned (not from here: it would land in this hook)
        if isinstance(info.exc_value, KeyboardInterrupt):
            main = threading.main_thread().ident  # a signal to the main thread also ends a wait it is blocked in
            again = threading.Timer(REDELIVER_S, signal.pthread_kill, args=(main, signal.SIGINT))
            again.daemon = True
            again.start()
        else:
            previous_hook(info)

    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def interrupted(signum: int = signal.SIGINT) -> int:
    """End a program that caught KeyboardInterrupt: the line, and its exit code (130). A second Ctrl-C from here on
    ends the process at once (with the line again) instead of a traceback from the shutdown."""
    if _in_main_thread():
        signal.signal(signal.SIGINT, _exit_at_once)
    write_line(stop_line(signum))
    return exit_code(signum)


def end_process(code: int) -> NoReturn:
    """End this program's process now with `code`, after what it wrote is flushed, its logging handlers closed and
    the children of `multiprocessing` ended, but without the interpreter's teardown and without the other atexit
    functions. For a program stopped by a signal: finalizing JAX/XLA objects while their threads still hold the
    interrupted work (a compile, a running computation) can crash the process after its line was printed (SIGSEGV,
    exit -11 instead of 130), and the libraries' exit functions do exactly that: JAX's destroy its backend clients,
    collect XLA's garbage and wait for pending effects, equinox replaces JAX's token wait by its own copy, and
    pybind11's and pyarrow's release native objects. Skipping them loses nothing: rlpipe registers none, every commit
    is atomic against a SIGKILL at any point, and the interrupted program's `finally` blocks have run."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    atexit._clear()
    mp = sys.modules.get("multiprocessing.util")
    with contextlib.suppress(Exception):
        if mp is not None:
            mp._exit_function()  # terminates daemonic children, joins the others: what Python's own exit does
    os._exit(code)


def ignore_stop_signals() -> None:
    """From here on SIGINT and SIGTERM are ignored: for a program whose work is over and whose exit code is decided.
    Python's teardown puts back the default action of any signal with a Python handler, so a Ctrl-C landing in it
    would end the process by the signal (exit -2, no line) instead of the code the program already has."""
    if _in_main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
