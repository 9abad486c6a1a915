"""A warm, bounded pool of harness processes for `VerifiersEnv`: verifiers' chat program (the `null`/`bash`
harnesses' program) runs in long-lived processes (`pipeline/environments/harness_worker.py`), one episode at a
time each, instead of one new Python process per episode.

A fresh process pays the program's imports (openai, mcp, httpx: about a CPU second, more on a loaded machine) on
every episode; a pool process pays them once. `PooledRuntime` is verifiers' subprocess runtime with one change:
its main program, when it is the chat program, runs in a pool process (every other command, a tool server, a
harness with another program runs exactly as verifiers runs it). Parent and pool processes talk JSON lines over
the process's stdin/stdout (`harness_worker`'s protocol); nothing else crosses.

The pool promises:
- bounded: at most `size` processes at once, so at most `size` episodes run their program at once (the others wait
  for a free process); processes start when an episode needs one and none is idle, and stay warm for the next;
- reuse: a process runs episode after episode, and is replaced after `max_episodes` of them (0: never);
- a process that dies mid-episode fails that episode with the reason (its exit status or signal, in the program
  result verifiers turns into the trace's `HarnessError`) and is discarded: the next episode starts a new one; an
  episode cancelled mid-run (verifiers' rollout timeout) kills its process (its whole process group) the same way;
- `close()` ends every process (stdin closed, then SIGKILL of the group after `CLOSE_GRACE_S`) and waits for them;
  a process whose parent disappears ends itself (its watchdog), so none outlives the environment.

Most episodes need no separate program at all: `InProcessChatProgram` runs the same chat program (its bundled
source, loaded once as a module) in the environment's own event loop, as verifiers' `Harness.launch` allows ("a
harness may run its loop in-process ... as long as every model call goes through `endpoint` + `secret`"). It takes
an episode whose program has no local tools (`--bash`, `--edit`, `--search`: they act on the program's working
directory and environment) and no harness environment variables; `PooledRuntime` gives every other one to the
pool. Its model calls still go over HTTP to verifiers' interception server, so the trace records exactly what a
separate program would have made it record.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import runpy
import signal
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verifiers.v1.runtimes import ProgramResult, SubprocessConfig
from verifiers.v1.runtimes.subprocess import SubprocessRuntime

logger = logging.getLogger(__name__)

WORKER = str(Path(__file__).with_name("harness_worker.py"))
"""The pool process's program (standard library only), run by path with the chat program's interpreter."""

START_TIMEOUT_S = 120.0
"""How long a new pool process may take to load the program (a loaded 2-core machine is slow)."""

CLOSE_GRACE_S = 5.0
"""How long `close()` waits for processes to end on their own (stdin closed) before killing them."""

READ_LIMIT = 1 << 24
"""Longest protocol line read from a pool process (bytes); the worker bounds each output to its tail."""

ACTIVATE_MARK = "uv-script"
"""argv[3] of verifiers' activation wrapper (`sh -c <export VIRTUAL_ENV ...; exec "$@"> uv-script <venv> <python>
<script> <args>`, `Runtime.prepare_uv_script`)."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


@dataclass(eq=False)  # identity: a process is kept in a set
class _Proc:
    """One pool process."""

    proc: asyncio.subprocess.Process
    program: tuple[str, str]
    episodes: int = 0
    next_id: int = 0

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None


@dataclass
class PoolStats:
    """What the pool did so far (for tests and metrics)."""

    starts: int = 0
    """Processes started."""
    episodes: int = 0
    """Programs run."""
    deaths: int = 0
    """Processes that died (or were killed) mid-episode."""
    pids: list[int] = field(default_factory=list)
    """The pid of every process started, in order."""


class HarnessPool:
    """A bounded pool of warm harness processes (see the module docstring); use from one event loop."""

    def __init__(self, size: int, max_episodes: int = 0) -> None:
        if size < 1:
            raise ValueError(f"size={size}: must be >= 1")
        if max_episodes < 0:
            raise ValueError(f"max_episodes={max_episodes}: must be >= 0")
        self.size = size
        self.max_episodes = max_episodes
        self.stats = PoolStats()
        self._idle: list[_Proc] = []
        self._all: set[_Proc] = set()
        self._slots: asyncio.Semaphore | None = None
        self._closed = False

    def live_pids(self) -> list[int]:
        """The pids of the pool's processes that have not ended."""
        return [p.proc.pid for p in self._all if p.alive]

    async def run(self, interpreter: str, program: str, args: list[str], env: dict[str, str], cwd: str) -> Any:
        """Run `program` (a script with an async `main()`) once with `args`, environment `env` (the whole process
        environment) and working directory `cwd` in a pool process; returns verifiers' `ProgramResult`. A process
        that dies meanwhile gives a result with a nonzero exit code and the reason on stderr."""
        if self._closed:
            raise RuntimeError("the harness pool is closed")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.size)
        async with self._slots:
            worker = await self._acquire((interpreter, program))
            try:
                result = await self._request(worker, args, env, cwd)
            except BaseException:  # cancelled mid-episode (a rollout timeout): the program cannot be stopped inside
                await self._discard(worker)
                raise
            if worker.alive and not self._closed and (not self.max_episodes or worker.episodes < self.max_episodes):
                self._idle.append(worker)
            else:
                await self._discard(worker)
            return result

    async def _acquire(self, program: tuple[str, str]) -> _Proc:
        while self._idle:
            worker = self._idle.pop()
            if worker.alive and worker.program == program:
                return worker
            await self._discard(worker)  # died while idle, or another program's: a slot for a new one
        return await self._start(program)

    async def _start(self, program: tuple[str, str]) -> _Proc:
        interpreter, script = program
        proc = await asyncio.create_subprocess_exec(
            interpreter,
            WORKER,
            script,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=READ_LIMIT,
            start_new_session=True,  # its own process group: killing it reaps whatever the program started
        )
        worker = _Proc(proc, program)
        self._all.add(worker)
        self.stats.starts += 1
        self.stats.pids.append(proc.pid)
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
            hello = json.loads(line) if line else {}
        except BaseException:
            await self._discard(worker)
            raise
        if not hello.get("ready"):
            await self._discard(worker)
            why = hello.get("error") or f"it ended ({_describe_exit(proc.returncode)}) before loading"
            raise RuntimeError(f"harness pool process for {script}: {why}")
        logger.debug("harness pool: started pid %d (%d started so far)", proc.pid, self.stats.starts)
        return worker

    async def _request(self, worker: _Proc, args: list[str], env: dict[str, str], cwd: str) -> Any:
        proc = worker.proc
        assert proc.stdin is not None and proc.stdout is not None
        worker.next_id += 1
        worker.episodes += 1
        self.stats.episodes += 1
        request = {"id": worker.next_id, "args": args, "env": env, "cwd": cwd}
        line = b""
        with contextlib.suppress(ConnectionError):
            proc.stdin.write((json.dumps(request) + "\n").encode())
            await proc.stdin.drain()
            line = await proc.stdout.readline()
        if line:
            reply = json.loads(line)
            if reply.get("id") == worker.next_id:
                return ProgramResult(
                    exit_code=int(reply["exit_code"]), stdout=str(reply["stdout"]), stderr=str(reply["stderr"])
                )
        # No answer: the process died mid-episode (or answered out of turn): this episode fails, the process goes.
        self.stats.deaths += 1
        await self._discard(worker)
        why = f"the harness pool process (pid {proc.pid}) died mid-episode: {_describe_exit(proc.returncode)}"
        logger.warning("%s; it is replaced", why)
        return ProgramResult(exit_code=proc.returncode or 1, stdout="", stderr=why)

    async def _discard(self, worker: _Proc) -> None:
        """Kill the process's group (if it still runs) and reap it."""
        self._all.discard(worker)
        if worker.alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await worker.proc.wait()

    async def close(self) -> None:
        """End every pool process and wait for them: stdin closed (a process then exits), SIGKILL to the group of
        any still running after `CLOSE_GRACE_S`. Idempotent."""
        self._closed = True
        workers = list(self._all)
        self._idle.clear()
        for w in workers:
            if w.proc.stdin is not None:
                with contextlib.suppress(Exception):
                    w.proc.stdin.close()
        if workers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(w.proc.wait() for w in workers), return_exceptions=True), CLOSE_GRACE_S
                )
        for w in workers:
            await self._discard(w)


def chat_program_call(argv: list[str], script: str) -> tuple[str, list[str], str | None] | None:
    """(interpreter, program arguments, virtual environment or None) when `argv` runs the prepared script `script`
    directly (`<python> <script> <args>`) or through verifiers' activation wrapper (which names the virtual
    environment it activates), else None."""
    if len(argv) >= 7 and argv[:2] == ["sh", "-c"] and argv[3] == ACTIVATE_MARK and argv[6] == script:
        return argv[5], argv[7:], argv[4]
    if len(argv) >= 2 and argv[1] == script:
        return argv[0], argv[2:], None
    return None


def program_env(env: dict[str, str], venv: str | None) -> dict[str, str]:
    """`env` (a whole process environment) plus what verifiers' activation wrapper exports for `venv`."""
    if venv is None:
        return env
    home = env.get("HOME", "")
    return {
        **env,
        "VIRTUAL_ENV": venv,
        "PATH": f"{venv}/bin:{home}/.local/bin:{env.get('PATH', '')}",
        "UV_INSTALL_DIR": f"{home}/.local/bin",
        "UV_RUN_RECURSION_DEPTH": "1",
    }


LOCAL_TOOL_FLAGS = ("--bash", "--edit", "--search")
"""Chat program options whose tools act on the program's own process (working directory, environment)."""

INITIAL_MESSAGES_FLAG = "--initial-messages-file="
"""The chat program option naming a file (relative to its working directory) it reads and deletes."""


class _ParserBuilt(Exception):
    """Raised instead of parsing, carrying the program's argument parser (see `_program_parser`)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser built")
        self.parser = parser


def _program_parser(program: dict[str, Any]) -> argparse.ArgumentParser:
    """The argument parser the program's `parse_args()` builds (it builds one per call, about a third of a run's
    CPU here), taken at the moment it would parse `sys.argv`."""

    class Capture(argparse.ArgumentParser):
        def parse_args(self, *args: Any, **kwargs: Any) -> Any:
            raise _ParserBuilt(self)

    shim = types.SimpleNamespace(ArgumentParser=Capture, Namespace=argparse.Namespace)
    build = types.FunctionType(program["parse_args"].__code__, {**program, "argparse": shim}, "parse_args")
    try:
        build()
    except _ParserBuilt as built:
        built.parser.__class__ = argparse.ArgumentParser  # parses as argparse does from now on
        return built.parser
    raise RuntimeError("the chat program's parse_args did not parse")


class InProcessChatProgram:
    """verifiers' chat program (`script`, the prepared bundled program) run as a coroutine of the calling event
    loop, one call per episode, any number at once (see the module docstring).

    Loaded on first use: the script is executed once as a module (its `__main__` entry point inert), and one SSL
    context is built from the same CA bundle (`certifi`) the program verifies with; each run calls the program's
    own `main()` with its arguments parsed by its own parser (built once), its OpenAI client built on that shared
    context (the program builds a new one, re-reading the bundle, per run) and closed when the run ends."""

    def __init__(self, script: str) -> None:
        self.script = script
        self.runs = 0
        """Programs run so far."""
        self._program: dict[str, Any] | None = None
        self._parser: argparse.ArgumentParser | None = None
        self._ssl: Any = None

    @staticmethod
    def can_run(args: list[str], env: dict[str, str]) -> bool:
        """Whether a run with program arguments `args` and harness environment `env` needs no process of its own:
        no local tools and no environment variables to set."""
        return not env and not any(a.split("=", 1)[0] in LOCAL_TOOL_FLAGS for a in args)

    def _load(self) -> dict[str, Any]:
        if self._program is None:
            import httpx

            program = runpy.run_path(self.script, run_name="rlpipe_harness_program")
            self._ssl = httpx.create_ssl_context(verify=program["certifi"].where())
            self._parser = _program_parser(program)
            self._program = program
        return self._program

    async def run(self, args: list[str], workdir: str) -> Any:
        """Run the program once with `args`, relative paths resolved against `workdir`; returns verifiers'
        `ProgramResult`: exit code 0 when `main` returns, the code of a `SystemExit`, 1 when it raises (the
        traceback, or a `SystemExit`'s cause, on stderr, as the interpreter would print it)."""
        program = self._load()
        self.runs += 1
        args = [
            f"{INITIAL_MESSAGES_FLAG}{os.path.join(workdir, a[len(INITIAL_MESSAGES_FLAG) :])}"
            if a.startswith(INITIAL_MESSAGES_FLAG)
            else a
            for a in args
        ]
        clients: list[Any] = []

        def open_client(**kwargs: Any) -> Any:
            client = program["AsyncOpenAI"](**kwargs)
            clients.append(client)
            return client

        def http_client(**kwargs: Any) -> Any:
            return program["DefaultAsyncHttpxClient"](**{**kwargs, "verify": self._ssl})

        try:
            assert self._parser is not None
            parsed = self._parser.parse_args(args)
            scope = {**program, "parse_args": lambda: parsed, "AsyncOpenAI": open_client}
            scope["DefaultAsyncHttpxClient"] = http_client
            main = types.FunctionType(program["main"].__code__, scope, "main")
            await main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            cause = e.__cause__
            err = "".join(traceback.format_exception(cause)) if cause is not None else ""
            if e.code is not None and not isinstance(e.code, int):  # printed by the interpreter, as the worker does
                err += f"{e.code}\n"
            return ProgramResult(exit_code=code, stdout="", stderr=err)
        except Exception as e:  # the program failed: reported as the interpreter would, not raised
            return ProgramResult(exit_code=1, stdout="", stderr="".join(traceback.format_exception(e)))
        finally:
            for client in clients:
                with contextlib.suppress(Exception):
                    await client.close()
        return ProgramResult(exit_code=0, stdout="", stderr="")


class PooledRuntime(SubprocessRuntime):
    """verifiers' subprocess runtime whose main program, when it is `script` (the prepared chat program), runs in
    this process (`in_process`, when it can run the episode) or else in `pool` (see the module docstring);
    everything else runs as in `SubprocessRuntime`."""

    def __init__(
        self,
        pool: HarnessPool | None,
        script: str,
        name: str | None = None,
        in_process: InProcessChatProgram | None = None,
    ) -> None:
        super().__init__(SubprocessConfig(), name)
        self._pool = pool
        self._script = script
        self._in_process = in_process

    async def run_program(self, argv: list[str], env: dict[str, str]) -> Any:
        """The chat program in this process or a pool process (with the environment and working directory a fresh
        process of `SubprocessRuntime.run` would get); any other program as `SubprocessRuntime` runs it."""
        call = chat_program_call(argv, self._script)
        if call is None or self.workdir is None:
            return await super().run_program(argv, env)
        interpreter, args, venv = call
        if self._in_process is not None and self._in_process.can_run(args, env):
            return await self._in_process.run(args, str(self.workdir))
        if self._pool is None:
            return await super().run_program(argv, env)
        full_env = {k: v for k, v in os.environ.items() if "API_KEY" not in k.upper()}
        full_env.update(self.process_env(env))
        return await self._pool.run(interpreter, self._script, args, program_env(full_env, venv), str(self.workdir))
