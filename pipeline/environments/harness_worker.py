"""One warm harness process of `pipeline.environments.harness_pool`: loads verifiers' chat program once, then runs
it once per request, each time as `python <program> <args>` would, without a new interpreter.

    <python> harness_worker.py <program.py>

The program (verifiers' bundled chat program, whose `async def main()` reads `sys.argv`) is executed as a module
named `rlpipe_harness_program` (its `if __name__ == "__main__"` entry point stays inert), which imports its
packages (openai, mcp, httpx: most of a fresh start's CPU) once. Standard library only: it runs on whatever
interpreter verifiers prepared for the program.

Protocol: JSON lines, nothing else. On the protocol channel (the process's original stdout; stray writes to file
descriptor 1 go to stderr instead) it first writes `{"ready": true, "pid": ...}` once the program is loaded (or
`{"ready": false, "error": ...}` and exits 1). Then, for each line on stdin, `{"id", "args", "env", "cwd"}`, it
sets the process environment to `env` (the whole environment, as a fresh process would get it), changes to `cwd`,
runs `asyncio.run(main())` with `sys.argv = [program, *args]` and `sys.stdout`/`sys.stderr` captured, and answers
`{"id", "exit_code", "stdout", "stderr"}`: exit code 0 when `main` returns, the code of a `SystemExit`, 1 with the
traceback on stderr when it raises (as the interpreter would). Each output keeps its last `OUTPUT_TAIL`
characters (verifiers reads only the tail of a failed program's output). One request at a time; stdin closing,
or the parent process going away, ends the process.
"""

from __future__ import annotations

import os
import sys

# Run by path, Python puts this file's folder first on sys.path; its modules' names (base, chat, agent, ...) must
# not shadow what the program imports.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import asyncio
import importlib.util
import io
import json
import runpy
import traceback
from typing import Any

OUTPUT_TAIL = 64_000
"""Characters of each of stdout and stderr sent back per episode (the tail)."""

PARENT_WATCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "process", "parent_watch.py")
"""rlpipe's one parent watch (standard library only), loaded by path: this interpreter may not have rlpipe."""


def _watch_parent(parent: int) -> None:
    """Exit the process (code 1) once its parent is gone (re-parented), even mid-episode: no orphans."""
    spec = importlib.util.spec_from_file_location("rlpipe_parent_watch", PARENT_WATCH)
    assert spec is not None and spec.loader is not None, PARENT_WATCH
    parent_watch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parent_watch)
    parent_watch.watch_parent(parent, lambda _: os._exit(1))


def run_one(main: Any, program: str, request: dict[str, Any]) -> dict[str, Any]:
    """Run the program's `main` once for `request`; returns the reply (never raises)."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr, sys.argv
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in request.get("env", {}).items()})
    code = 0
    try:
        os.chdir(request.get("cwd") or "/")
        sys.stdout, sys.stderr, sys.argv = out, err, [program, *request.get("args", [])]
        asyncio.run(main())
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=err)
    except BaseException:  # the program failed: reported as the interpreter would, not raised
        traceback.print_exc(file=err)
        code = 1
    finally:
        sys.stdout, sys.stderr, sys.argv = saved
    return {
        "id": request.get("id"),
        "exit_code": code,
        "stdout": out.getvalue()[-OUTPUT_TAIL:],
        "stderr": err.getvalue()[-OUTPUT_TAIL:],
    }


def main() -> int:
    """Load the program named on the command line, then serve requests until stdin closes."""
    program = sys.argv[1]
    channel = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # the program's (or a child's) writes to fd 1 must not corrupt the protocol
    sys.stdout = sys.stderr
    _watch_parent(os.getppid())

    def send(obj: dict[str, Any]) -> None:
        channel.write(json.dumps(obj) + "\n")
        channel.flush()

    try:
        entry = runpy.run_path(program, run_name="rlpipe_harness_program")["main"]
    except BaseException as e:  # reported to the parent, then this process ends
        send({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    send({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if line.strip():
            send(run_one(entry, program, json.loads(line)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
