"""The `server` backend's start-up, without a real server: `{python}` and PATH give the child this environment's
Python; a server that exits before it is ready on its first start is a config error (`ServerStartError`, exit 2,
not restarted) naming the server log and its last error line; a restarted one that does is a `ServerLoadError`."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest

from pipeline.config import ConfigError, ServerInferenceConfig
from pipeline.environments.tokenizer import load_tokenizer
from policy.inference import make_backend
from policy.inference.adapters import ServerLoadError
from policy.inference.server import ServerBackend, ServerStartError, last_error_line

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
