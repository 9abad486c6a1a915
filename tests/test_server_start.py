"""The `server` backend's start-up, without a real server: `{python}` and PATH give the child this environment's
Python; a server that exits before it is ready on its first start is a config error (`ServerStartError`, exit 2,
not restarted) naming the server log and its last error line; a restarted one that does is a `ServerLoadError`."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import ConfigError, ServerInferenceConfig
from pipeline.environments.tokenizer import load_tokenizer
from policy.inference import make_backend
from policy.inference.adapters import ServerLoadError
from policy.inference.server import ServerBackend, ServerProcess, ServerStartError, last_error_line

PROBE = (
    "import shutil, sys; print('exe', sys.executable); print('which', shutil.which('python')); "
    "print('ModuleNotFoundError: No module named levanter_probe'); sys.exit(3)"
)


def _backend(tmp_path: Path, command: str) -> tuple[ServerBackend, Path]:
    config = ServerInferenceConfig(command=command, port=0, startup_timeout_s=30, max_restarts=2)
    backend = make_backend(config, None, load_tokenizer("builtin:tiny"), 48)
    assert isinstance(backend, ServerBackend)
    log = tmp_path / "w.server.log"
    backend.attach(str(tmp_path), "{}", str(log))
    return backend, log


def test_python_placeholder_and_path_give_this_environments_python(tmp_path: Path) -> None:
    backend, log = _backend(tmp_path, f"{{python}} -c {shlex.quote(PROBE)}")
    try:
        with pytest.raises(ServerStartError) as ei:
            backend.load_policy(0)
    finally:
        backend.shutdown()
    text = log.read_text()
    assert f"exe {sys.executable}" in text
    assert f"which {os.path.join(os.path.dirname(sys.executable), 'python')}" in text
    # one line: the field, the exit, the log's path and its last error line
    message = str(ei.value)
    assert isinstance(ei.value, ConfigError) and isinstance(ei.value, ServerLoadError)
    assert ei.value.field == "inference.command" and "\n" not in message
    assert "exited with 3 before it was ready" in message and str(log) in message
    assert message.endswith("ModuleNotFoundError: No module named levanter_probe")


def test_plain_python_in_the_command_is_this_environments(tmp_path: Path) -> None:
    backend, log = _backend(tmp_path, f"python -c {shlex.quote(PROBE)}")
    try:
        with pytest.raises(ServerStartError):
            backend.load_policy(0)
    finally:
        backend.shutdown()
    assert f"exe {os.path.join(os.path.dirname(sys.executable), 'python')}" in log.read_text()


def test_a_restarted_server_that_dies_starting_is_a_load_error(tmp_path: Path) -> None:
    backend, _ = _backend(tmp_path, f"{{python}} -c {shlex.quote(PROBE)}")
    try:
        with pytest.raises(ServerStartError):
            backend.load_policy(0)
        with pytest.raises(ServerLoadError) as ei:  # the second start: not a config error
            backend.load_policy(0)
    finally:
        backend.shutdown()
    assert not isinstance(ei.value, ConfigError)


def test_last_error_line(tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    assert last_error_line(str(log)) is None
    log.write_text("starting\nValueError: bad\nshutting down\n")
    assert last_error_line(str(log)) == "ValueError: bad"
    log.write_text("just\nlines\n")
    assert last_error_line(str(log)) == "lines"


def test_a_server_program_that_does_not_exist_is_a_start_error(tmp_path: Path) -> None:
    """A command whose program is missing is the same one-line start error as a program that exits (127), not an
    exception out of the step."""
    backend, _ = _backend(tmp_path, f"{tmp_path / 'no-such-server'} --port {{port}}")
    try:
        with pytest.raises(ServerStartError) as ei:
            backend.load_policy(0)
    finally:
        backend.shutdown()
    message = str(ei.value)
    assert "exited with 127 before it was ready" in message and "\n" not in message
    assert message.endswith(
        f"cannot run the server's program {str(tmp_path / 'no-such-server')!r}: No such file or directory"
    )


def test_a_child_server_is_tied_to_the_process_that_started_it() -> None:
    """The server's pid is the program's, and a watcher of this process stands beside it in its process group (it
    stops the server once this process is gone: `test_orphaned_steps`); a stopped server leaves no watcher."""
    import psutil

    server = ServerProcess([sys.executable, "-c", "import time; time.sleep(120)"])
    server.start()

    def watchers() -> list[psutil.Process]:  # this server's (other tests of this process start servers too)
        found = []
        for p in psutil.process_iter(["cmdline"]):
            if (p.info["cmdline"] or [])[-2:] == ["exec-tied", str(os.getpid())]:
                with contextlib.suppress(OSError):
                    if os.getpgid(p.pid) == server.pid:
                        found.append(p)
        return found

    try:
        deadline = time.monotonic() + 60
        while not (found := watchers()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(found) == 1
        program = psutil.Process(server.pid)
        while program.cmdline()[-1] != "import time; time.sleep(120)" and time.monotonic() < deadline:
            time.sleep(0.05)  # the tie forks its watcher, then becomes the program
        assert program.cmdline()[-1] == "import time; time.sleep(120)"
    finally:
        server.stop()
    deadline = time.monotonic() + 10
    while watchers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not watchers()
