"""The local backend's fork server (`pipeline.jobs.launchers.forkserver`, `steps.forkserver`) with real processes.

A step process forked by the server must be indistinguishable, to the runner and to the step, from a fresh
`python -m <module>`: the runner's own child (exit codes and signals through `waitpid`), its own session,
argv, working directory, environment and log, its own JAX backend started after the fork (the device count of
its XLA flags), the modules its `main` imports (`HEAVY_MODULES`) already loaded, its command line in `ps`; a server
that dies is replaced; a step whose environment differs is left to a fresh interpreter; a process forked for a
runner that never confirms runs nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from jobs import simulated_devices, step_module

from pipeline.jobs.launchers.forkserver import ForkedProcess, ForkServer

pytest.importorskip("jax")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def server_env() -> dict[str, str]:
    """This process's environment with tests/ importable and 3 simulated CPU devices for JAX."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "XLA_FLAGS": simulated_devices(3),
        "JAX_PLATFORMS": "cpu",
    }


@pytest.fixture
def server() -> Iterator[ForkServer]:
    fs = ForkServer(["forkserver_probe"], server_env())
    fs.start()
    try:
        yield fs
    finally:
        fs.close()


def spawn(fs: ForkServer, log: Path, *argv: str, **env: str) -> ForkedProcess:
    with open(log, "ab") as f:
        proc = fs.spawn("forkserver_probe", list(argv), {**server_env(), "RLPIPE_STEP": "probe", **env}, f.fileno())
    assert proc is not None, fs.disabled
    return proc


def wait(proc: ForkedProcess, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while (rc := proc.poll()) is None:
        assert time.monotonic() < deadline, "the forked process did not end"
        time.sleep(0.02)
    return rc


def test_a_forked_step_is_our_child_with_its_own_argv_env_log_session_and_jax(
    server: ForkServer, tmp_path: Path
) -> None:
    log = tmp_path / "probe.log"
    proc = spawn(server, log, "--exit", "7")
    assert wait(proc) == 7
    lines = log.read_text().splitlines()
    seen = json.loads(lines[0])
    assert seen["argv"] == ["--exit", "7"] and seen["name"] == "__main__"
    assert seen["ppid"] == os.getpid()  # reparented to the runner, which reaped it with waitpid above
    assert seen["sid"] == seen["pid"] == proc.pid  # a session of its own
    assert seen["cwd"] == os.getcwd()
    assert seen["step"] == "probe"  # the request's environment, not the server's
    assert seen["devices"] == 3  # JAX's backend started after the fork, from XLA_FLAGS
    assert seen["heavy_preloaded"]  # the server imported the module's HEAVY_MODULES before forking
    assert "probe stderr line" in lines  # stderr on the same log


def test_signals_reach_the_step_and_its_status_comes_back(server: ForkServer, tmp_path: Path) -> None:
    proc = spawn(server, tmp_path / "a.log", "--sleep", "60")
    deadline = time.monotonic() + 60
    while step_module(psutil.Process(proc.pid).cmdline()) == "steps.forkserver":  # until it has its own title
        assert time.monotonic() < deadline
        time.sleep(0.02)
    title = " ".join(psutil.Process(proc.pid).cmdline()).split()
    assert title == [sys.executable, "-m", "forkserver_probe", "--sleep", "60"]  # what ps shows
    proc.send_signal(signal.SIGTERM)
    assert wait(proc) == -signal.SIGTERM
    other = spawn(server, tmp_path / "b.log", "--sleep", "60")
    other.kill()
    assert wait(other) == -signal.SIGKILL


def test_a_killed_server_is_replaced_and_its_steps_go_on(server: ForkServer, tmp_path: Path) -> None:
    running = spawn(server, tmp_path / "a.log", "--sleep", "3", "--exit", "5")
    first = server._proc
    assert first is not None
    first.kill()
    first.wait()
    again = spawn(server, tmp_path / "b.log", "--exit", "4")
    assert server._proc is not None and server._proc.pid != first.pid and server.starts == 2
    assert wait(again) == 4
    assert wait(running) == 5  # started by the dead server, still supervised by us


def test_a_step_with_another_environment_is_left_to_a_fresh_interpreter(server: ForkServer, tmp_path: Path) -> None:
    with open(tmp_path / "a.log", "ab") as f:
        env = {**server_env(), "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
        assert server.spawn("forkserver_probe", [], env, f.fileno()) is None
    assert server.disabled is None  # the next matching step is forked again
    assert wait(spawn(server, tmp_path / "b.log")) == 0


def test_a_forked_process_without_the_go_runs_nothing(tmp_path: Path) -> None:
    """The server's own protocol: a process forked for a runner that never confirms exits without running."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server = subprocess.Popen(
        [sys.executable, "-m", "steps.forkserver", "--fd", str(theirs.fileno()), "--preload", "forkserver_probe"],
        pass_fds=[theirs.fileno()],
        env=server_env(),
        cwd=ROOT,
    )
    theirs.close()
    try:
        assert json.loads(ours.recv(1 << 16)) == {"ready": True}
        marker = tmp_path / "ran"
        go_r, go_w = os.pipe()
        with open(tmp_path / "probe.log", "ab") as log:
            request = {"module": "forkserver_probe", "argv": ["--marker", str(marker)], "env": server_env(),
                       "cwd": str(ROOT)}  # fmt: skip
            socket.send_fds(ours, [json.dumps(request).encode()], [log.fileno(), go_r])
        pid = json.loads(ours.recv(1 << 16))["pid"]
        os.close(go_r)
        os.close(go_w)  # no "go": EOF
        deadline = time.monotonic() + 30
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the unconfirmed process did not exit"
            time.sleep(0.02)
        assert not marker.exists()
    finally:
        ours.close()
        server.wait(timeout=30)
    assert server.returncode == 0  # the runner's end closed: the server exits
