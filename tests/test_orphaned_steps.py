"""A step process started by a job runner (or its fork server) ends when the runner is gone
(`pipeline.process.parent_watch`); a process started without the runner's mark outlives its parent.

- a real job (`python -m steps.run`) SIGKILLed while its steps run: every step process and the fork server are gone
  within a deadline, with the fork server (its steps forked, mid-run: a rollout is committed) and without it (fresh
  interpreters, killed as they start: the parent may die before the step sets its death signal); what the run
  committed passes the run audit;
- small processes (no JAX) for the rest of the contract: the death signal and the `getppid()` re-check, the watch
  thread of a process started from another thread (no death signal there), a process without the mark, and a mark
  inherited by mistake, which must not end a process whose starter is alive; the verifiers harness worker's watch,
  the same module loaded by path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest
from invariants import audit_run
from jobs import ROOT, job_config, step_module

from pipeline.process.parent_watch import PARENT_ENV
from pipeline.store import layout
from pipeline.store.committed import TMP_PREFIX
from pipeline.store.storage import RunStore

GONE_WITHIN_S = 30.0
"""How long the orphaned processes may take to end (a death signal is immediate; the watch polls every second)."""
STEP_MODULES = {"steps.learn", "steps.make_batches", "steps.rollout", "steps.evaluate"}


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(procs: list[psutil.Process], within: float = GONE_WITHIN_S) -> list[psutil.Process]:
    """Wait until none of `procs` runs; those still running at the deadline."""
    deadline = time.monotonic() + within
    while (left := [p for p in procs if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _descendants(pid: int) -> dict[int, psutil.Process]:
    try:
        return {p.pid: p for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return {}


def _modules(procs: dict[int, psutil.Process]) -> set[str]:
    found = set()
    for p in procs.values():
        try:
            found.add(step_module(p.cmdline()) or "")
        except psutil.NoSuchProcess:
            pass
    return found


def _rollouts_written(run_root: Path) -> bool:
    return any(not p.name.startswith(TMP_PREFIX) for p in (run_root / layout.ROLLOUTS).rglob("*.parquet"))


@pytest.mark.parametrize("fork_server", [True, False], ids=["forked", "fresh"])
def test_steps_of_a_sigkilled_job_runner_end(tmp_path: Path, fork_server: bool) -> None:
    run_root = tmp_path / "run"
    # a run far longer than the test: a step that ends did so because its runner is gone, not because the run ended
    overrides = {"backend.fork_server": str(fork_server).lower(), "train.num_train_steps": "1000"}
    config = job_config(tmp_path, str(run_root), **overrides)
    log = tmp_path / "job.log"
    store = RunStore(str(run_root))
    wanted = STEP_MODULES | ({"steps.forkserver"} if fork_server else set())
    with log.open("ab") as out:
        runner = subprocess.Popen([sys.executable, "-m", "steps.run", "--config_path", str(config)], cwd=ROOT,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and runner.poll() is None:
            seen.update(_descendants(runner.pid))
            if wanted <= _modules(seen) and (not fork_server or _rollouts_written(run_root)):
                break  # forked: mid-run (a worker has committed rollouts); fresh: as the steps start
            time.sleep(0.05)
        assert runner.poll() is None, log.read_text()[-3000:]
        assert wanted <= _modules(seen), (_modules(seen), log.read_text()[-3000:])
        seen.update(_descendants(runner.pid))
        runner.kill()
        runner.wait()
        left = _wait_gone(list(seen.values()))
        assert not left, [(p.pid, p.cmdline()) for p in left if _alive(p)]
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        for p in seen.values():  # the test's own processes only, and only after a failure
            if _alive(p):
                p.kill()
    audit = audit_run(store, max_samples_per_rollout=1, max_lag=1)
    assert not audit.problems, audit.problems


CHILD = """
import sys, time
from pipeline.process.parent_watch import end_with_starter
tied = end_with_starter()
print("tied" if tied else "free", flush=True)
time.sleep(300)
"""
"""A child that ends with its starter if it carries the mark, then sleeps."""

STARTER = """
import os, subprocess, sys, threading
from pipeline.process.parent_watch import starter_env
child, in_thread, mark = sys.argv[1], sys.argv[2] == "thread", sys.argv[3]
started = []

def start():
    env = dict(os.environ)
    if mark == "mark":
        env.update(starter_env())
    started.append(subprocess.Popen([sys.executable, "-c", child], env=env, stdout=sys.stdout))

if in_thread:
    t = threading.Thread(target=start)
    t.start()
    t.join()  # the thread that started the child is gone: its death signal would have fired now
else:
    start()
print(started[0].pid, flush=True)
sys.stdin.read()
"""
"""A starter (the job runner's role) that starts CHILD from its main thread or from a thread that then ends, with
or without the mark, prints the child's pid, and waits to be killed."""


def _start_pair(mode: str, mark: str) -> tuple[subprocess.Popen[str], psutil.Process, str]:
    """A STARTER and its CHILD; returns the starter, the child and what the child said ("tied" / "free")."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    starter = subprocess.Popen([sys.executable, "-c", STARTER, CHILD, mode, mark], cwd=ROOT, env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert starter.stdout is not None
    said = {starter.stdout.readline().strip(), starter.stdout.readline().strip()}
    (pid,) = [int(s) for s in said if s.isdigit()]
    (word,) = said - {str(pid)}
    return starter, psutil.Process(pid), word


def _kill_then_wait_for_its_child(parent: subprocess.Popen[str], child: psutil.Process) -> None:
    """SIGKILL `parent`; `child` must end within 10 s (it is killed here if it does not)."""
    try:
        parent.kill()
        parent.wait()
        assert not _wait_gone([child], within=10.0), f"pid {child.pid} outlived its parent"
    finally:
        if _alive(child):
            child.kill()


@pytest.mark.parametrize("mode", ["main", "thread"])
def test_a_marked_child_ends_with_its_starter_even_after_the_starting_thread_ended(mode: str) -> None:
    """From the main thread: the death signal; from a thread that ended before the starter dies: no death signal
    was set (it would have fired when that thread ended), the watch thread ends the child."""
    starter, child, word = _start_pair(mode, "mark")
    assert word == "tied"
    assert _alive(child), "a child started from a thread that ended must outlive that thread"
    _kill_then_wait_for_its_child(starter, child)


def test_a_child_without_the_mark_outlives_its_starter() -> None:
    """A step run from a shell or cron has no mark: its parent's end (the shell's) does not end it."""
    starter, child, word = _start_pair("main", "none")
    try:
        assert word == "free"
        starter.kill()
        starter.wait()
        assert _wait_gone([child], within=1.5) == [child], "an unmarked child ended with its parent"
    finally:
        child.kill()


def test_a_mark_inherited_from_a_live_process_is_ignored_and_one_whose_process_died_ends_the_child() -> None:
    """A mark whose process lives but is not the parent came through a program that did not take it out: ignored.
    A mark whose process is gone means the parent died before the child could check: it stops at once (143)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = "from pipeline.process.parent_watch import end_with_starter; print(end_with_starter(), flush=True)"
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        inherited = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                   timeout=60, env={**env, PARENT_ENV: str(other.pid)})  # fmt: skip
    finally:
        other.kill()
        other.wait()
    assert (inherited.returncode, inherited.stdout.strip()) == (0, "False"), inherited.stderr

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={**env, PARENT_ENV: str(dead.pid)})  # fmt: skip
    assert orphan.returncode == -signal.SIGTERM, (orphan.returncode, orphan.stderr)
    assert f"error: terminated: the process that started this one (pid {dead.pid}) is gone" in orphan.stderr


HARNESS_PROGRAM = "async def main():\n    pass\n"


def test_the_harness_worker_ends_with_its_parent(tmp_path: Path) -> None:
    """The verifiers harness worker runs the same watch, loaded by path (it runs on another interpreter)."""
    program = tmp_path / "program.py"
    program.write_text(HARNESS_PROGRAM)
    worker = ROOT / "pipeline/environments/harness_worker.py"
    middle_code = textwrap.dedent(f"""
        import subprocess, sys
        w = subprocess.Popen([sys.executable, {str(worker)!r}, {str(program)!r}], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        print(w.pid, w.stdout.readline().strip(), flush=True)
        sys.stdin.read()
    """)
    middle = subprocess.Popen([sys.executable, "-c", middle_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    assert middle.stdout is not None
    pid, ready = middle.stdout.readline().split(maxsplit=1)
    worker_proc = psutil.Process(int(pid))
    assert '"ready": true' in ready
    _kill_then_wait_for_its_child(middle, worker_proc)


SERVER_STARTER = """
import os, subprocess, sys, threading
from pipeline.process.parent_watch import tied_command
program, log = sys.argv[1:3]
started = []

def start():  # as a rollout worker starts its child server: its own session, tied to this process
    env = dict(os.environ)
    with open(log, "ab") as out:
        started.append(subprocess.Popen(tied_command([sys.executable, "-c", program], env), env=env, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True))

t = threading.Thread(target=start)
t.start()
t.join()  # started from a thread that has ended: the tie follows the process, not the thread
print(started[0].pid, flush=True)
sys.stdin.read()
"""
"""A step stand-in that starts a server program tied to itself (`tied_command`), prints the server's pid and waits
to be killed."""

SERVER_PROGRAM = "import os, time; print('server', os.getpid(), flush=True); time.sleep(300)"


def _tied_server(tmp_path: Path, program: str) -> tuple[subprocess.Popen[str], psutil.Process, Path, str]:
    """Starts the stand-in with `program`, whose command line carries a mark no other process has (tests run side by
    side, and other tests' processes run the same program text); returns the mark last."""
    mark = f"tied-server-{uuid.uuid4().hex}"
    program = f"{program}  # {mark}"
    log = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    starter = subprocess.Popen([sys.executable, "-c", SERVER_STARTER, program, str(log)], cwd=ROOT, env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert starter.stdout is not None
    server = psutil.Process(int(starter.stdout.readline()))
    deadline = time.monotonic() + 60  # until the program runs (the tie forks its watcher, then becomes it)
    while f"server {server.pid}" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    return starter, server, log, mark


def _watchers(starter_pid: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "exec-tied" in cmd and cmd[-1] == str(starter_pid):
            found.append(p)
    return found


def test_a_tied_server_ends_with_its_sigkilled_starter(tmp_path: Path) -> None:
    """A child server of a step that is SIGKILLed would hold its port, memory and accelerator forever: tied, it is
    stopped within the deadline, with one line in its log. Its pid is the server program's own (what the step
    tracks and stops), and no process but the server names the server's command."""
    starter, server, log, mark = _tied_server(tmp_path, SERVER_PROGRAM)
    try:
        assert f"server {server.pid}" in log.read_text()  # the pid the starter holds is the program itself
        naming = sorted(p.pid for p in psutil.process_iter(["cmdline"]) if mark in " ".join(p.info["cmdline"] or []))
        # the stand-in was given the program on its command line; the watcher was not
        assert naming == sorted([starter.pid, server.pid]), naming
        assert len(_watchers(starter.pid)) == 1
        _kill_then_wait_for_its_child(starter, server)
        assert "error: terminated: the process that started this server" in log.read_text()
        assert not _wait_gone(_watchers(starter.pid), within=10.0)
    finally:
        if starter.poll() is None:
            starter.kill()
        if _alive(server):
            server.kill()


def test_a_tied_server_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    """A server that does not stop on SIGTERM (a hung shutdown) is SIGKILLed `GRACE_S` after its starter is gone."""
    from pipeline.process.parent_watch import GRACE_S

    program = "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + SERVER_PROGRAM
    starter, server, log, _ = _tied_server(tmp_path, program)
    try:
        starter.kill()
        starter.wait()
        assert _wait_gone([server], within=5.0) == [server], "a server that ignores SIGTERM ended before the grace"
        assert not _wait_gone([server], within=GRACE_S + 10.0), "the server outlived the grace"
        assert f"the server is still running {GRACE_S:.0f} s after SIGTERM; killing it" in log.read_text()
    finally:
        if starter.poll() is None:
            starter.kill()
        if _alive(server):
            server.kill()


def test_a_tied_program_that_cannot_run_is_one_line_and_127(tmp_path: Path) -> None:
    """A server command whose program does not exist ends as a program that exited before it was ready (the step's
    one-line start error), never as a traceback in the step."""
    from pipeline.process.parent_watch import tied_command

    env = dict(os.environ)
    argv = tied_command([str(tmp_path / "no-such-server"), "--port", "0"], env)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, start_new_session=True)
    assert done.returncode == 127, done
    assert done.stderr.strip() == (
        f"error: cannot run the server's program {str(tmp_path / 'no-such-server')!r}: No such file or directory"
    )
