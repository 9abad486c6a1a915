"""The local backend's fork server: imports the step programs once, then starts each step process by forking.

`python -m steps.forkserver --fd N --preload steps.learn,steps.rollout,…` is started by the job runner
(`pipeline.jobs.launchers.forkserver.ForkServer`; `backend.fork_server: true`, the default) with one end of a Unix
`SOCK_SEQPACKET` socket pair as fd N. It imports the preloaded modules and the modules each one's `main` imports
(its `HEAVY_MODULES`: JAX, haliax, levanter, transformers: ~4–5 s of CPU that every step process would otherwise
pay at each start and restart), answers `{"ready": true}`, then serves one request per message until the runner
closes its end:

    request  {"module": "steps.learn", "argv": [...], "env": {...}, "cwd": "..."} + two file descriptors:
             the step's log (stdout and stderr) and the read end of a "go" pipe held by the runner
    reply    {"pid": N} or {"error": "why"}

The step process is a grandchild: an intermediate fork forks it and exits at once, so it is reparented to the
runner (which marks itself a child subreaper around the request) and the runner waits for it and gets its exit
status exactly as for a process it started itself. The new process waits for one byte on the go pipe before it
does anything: if the runner never sends it (the fork server died before replying, the runner gave up), it
reads EOF and exits without running the step, so no step ever runs unsupervised.

In the step process: a new session, stdout and stderr on the log, the request's working directory, environment
(`os.environ` replaced, the step-process defaults of `steps` applied as for `python -m steps.<name>`), default
signal handlers, the process title `<python> -m <module> <argv>`, and the module run as `__main__`.

Forking is safe here because nothing in this process has started a thread or a JAX backend: JAX's backend (and
its thread pools, XLA flags, device count) starts in the step process, after the fork. The server checks this
before every fork and refuses (the runner then starts steps with a fresh interpreter) if an import broke it.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import threading
from typing import Any

MAX_MESSAGE = 1 << 20


def fork_hazard() -> str | None:
    """Why forking this process now would be unsafe (a thread or a JAX backend already started), else None."""
    if threading.active_count() != 1:
        return f"{threading.active_count()} threads are running: {[t.name for t in threading.enumerate()]}"
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        if getattr(xla_bridge, "_backends", None):
            return "a JAX backend was started while importing"
    return None


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def _fork_step(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> dict[str, Any] | None:
    """Fork the step process for `request`; in the step process returns the request (to run), in this server
    sends the reply and returns None."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid_r, pid_w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the intermediate: fork the step process, report its pid, exit (reparenting it)
        os.close(pid_r)
        try:
            step = os.fork()
        except OSError:
            os._exit(1)
        if step == 0:
            os.close(pid_w)
            sock.close()
            return request
        os.write(pid_w, str(step).encode())
        os._exit(0)
    os.close(pid_w)
    with os.fdopen(pid_r, "rb") as f:
        raw = f.read()
    os.waitpid(middle, 0)  # the intermediate has exited: the step process now belongs to the runner
    for fd in fds:
        os.close(fd)
    _send(sock, {"pid": int(raw)} if raw else {"error": "fork failed"})
    return None


def import_step(name: str) -> None:
    """Import step module `name` and the modules its `main` imports (its `HEAVY_MODULES`: JAX, levanter, the model),
    which a step module leaves out of its own imports so that its config is checked before they load
    (`steps.cli.step_main`): a step forked from here finds them loaded."""
    module = importlib.import_module(name)
    for heavy in getattr(module, "HEAVY_MODULES", ()):
        importlib.import_module(heavy)


def serve(sock: socket.socket, preload: list[str]) -> dict[str, Any] | None:
    """Preload, then fork one step per request until the runner closes the socket (returns None). In a step
    process it returns that step's request, with fds `log` and `go` added."""
    error = None
    for module in preload:
        try:
            import_step(module)
        except Exception as e:  # the runner falls back to plain processes, whose logs will show the same error
            error = f"importing {module}: {type(e).__name__}: {e}"
            break
    # Objects that exist now are never collected: the collector would otherwise walk (and so write to) every
    # page of them in each step process, copying memory that the step processes share with this one.
    gc.freeze()
    _send(sock, {"error": error} if error else {"ready": True})
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
        except (ConnectionError, OSError):
            return None
        if not data:
            for fd in fds:
                os.close(fd)
            return None
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            _send(sock, {"error": f"expected 2 file descriptors, got {len(fds)}"})
            continue
        request = json.loads(data)
        hazard = fork_hazard()
        if hazard is None:
            try:
                import_step(request["module"])
            except Exception as e:
                hazard = f"importing {request['module']}: {type(e).__name__}: {e}"
            else:
                hazard = fork_hazard()
        if hazard is not None:
            for fd in fds:
                os.close(fd)
            _send(sock, {"error": hazard})
            continue
        child = _fork_step(sock, request, fds)
        if child is not None:
            child["log_fd"], child["go_fd"] = fds
            return child


def _prepare_title() -> None:
    """Let setproctitle find this process's argv memory now, while the environment is still the one the
    process started with (it finds that memory through the environment's)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.getproctitle()


def _set_title(title: str) -> None:
    try:
        import setproctitle
    except ImportError:  # the process keeps the server's command line; nothing else depends on it
        return
    setproctitle.setproctitle(title)


def become_step(request: dict[str, Any]) -> None:
    """Turn this freshly forked process into the step process of `request` and run its module (never returns
    normally: the module's exit, via SystemExit, ends the process)."""
    go = os.read(request["go_fd"], 1)
    if go != b"g":  # the runner is not going to supervise this process: run nothing
        os._exit(0)
    os.close(request["go_fd"])
    os.setsid()
    log_fd = request["log_fd"]
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    from steps import step_process_defaults

    step_process_defaults()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # the runner is this process's parent now (it confirmed so before the go): end with it, as a fresh step does
    from pipeline.process.parent_watch import end_with_starter

    end_with_starter()
    module, argv = request["module"], list(request["argv"])
    command = [sys.executable, "-m", module, *argv]
    _set_title(" ".join(command))
    sys.argv = [module, *argv]
    if isinstance(getattr(sys, "orig_argv", None), list):
        sys.orig_argv[:] = command  # what tools (and a profiler's exit record) read as this process's command
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.exit(0)


def end_with_runner(mark: str) -> None:
    """End this server when the runner that started it is gone (`mark`: `<pid>`, or `<pid>:poll` from a runner's
    other thread, or empty). Its socket's EOF ends it once it serves; the kernel's death signal (SIGTERM, whose
    default action ends this process) also ends it while it imports. No watch thread: it would make forking unsafe
    (`fork_hazard`); a step it forks does not inherit the death signal and sets its own (`become_step`)."""
    pid, _, mode = mark.partition(":")
    if pid and mode != "poll":
        from pipeline.process.parent_watch import end_with_parent

        end_with_parent(int(pid), watch=False, on_gone=lambda _: os._exit(0))


def main(argv: list[str] | None = None) -> int:
    """Serve fork requests on the socket passed as `--fd` (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m steps.forkserver", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True, help="this end of the runner's socket pair")
    parser.add_argument("--preload", default="", help="comma-separated modules to import before serving")
    parser.add_argument("--parent", default="", help="the runner's mark (pipeline.process.parent_watch.PARENT_ENV)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner stops us by closing the socket
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a step forked but not yet running dies silently, as the server
    end_with_runner(args.parent)
    _prepare_title()
    sock = socket.socket(fileno=args.fd)
    request = serve(sock, [m for m in args.preload.split(",") if m])
    if request is None:
        return 0
    become_step(request)
    return 0


if __name__ == "__main__":
    sys.exit(main())
