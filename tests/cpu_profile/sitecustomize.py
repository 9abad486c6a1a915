"""Opt-in CPU accounting of every Python process of a test run (not used by `make test`).

With this folder on PYTHONPATH and RLPIPE_PROF_LOG=FILE set, every Python process started with that environment
appends one JSON line to FILE when it exits normally (a SIGKILLed process writes nothing): its command line, wall
seconds since the process started, CPU seconds (user + system, its own and of its waited-for children), the CPU
seconds spent before `steps.cli.run_program` was entered (imports and start-up of a step program), and from JAX's
monitoring events the seconds spent tracing, lowering and compiling and the persistent compilation cache's hits
and misses. `python tests/cpu_profile/report.py FILE` sums them per program and per test file.

    RLPIPE_PROF_LOG=/tmp/prof.log PYTHONPATH=tests/cpu_profile \\
        .venv/bin/pytest -q -n 2 --dist loadgroup -p cpu_plugin tests
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import signal
import sys
import time
from types import ModuleType
from typing import Any

_LOG = os.environ.get("RLPIPE_PROF_LOG")


def _process_start() -> float:
    """The wall-clock time this process started (from /proc), else now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


_T0 = _process_start()
_RECORD: dict[str, Any] = {
    "argv": list(getattr(sys, "orig_argv", sys.argv)),
    "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
    "pre_main_cpu": None,
    "compile_s": 0.0,
    "trace_s": 0.0,
    "lower_s": 0.0,
    "hits": 0,
    "misses": 0,
}


def _on_duration(event: str, seconds: float, **_: Any) -> None:
    for suffix, key in (
        ("backend_compile_duration", "compile_s"),
        ("jaxpr_trace_duration", "trace_s"),
        ("jaxpr_to_mlir_module_duration", "lower_s"),
    ):
        if event.endswith(suffix):
            _RECORD[key] += seconds


def _on_event(event: str, **_: Any) -> None:
    if event.endswith("cache_hits"):
        _RECORD["hits"] += 1
    elif event.endswith("cache_misses"):
        _RECORD["misses"] += 1


def _after_import(name: str, module: ModuleType) -> None:
    if name == "jax._src.monitoring":
        module.register_event_duration_secs_listener(_on_duration)
        module.register_event_listener(_on_event)
    elif name == "steps.cli":
        run_program = module.run_program

        def timed_run_program(*args: Any, **kwargs: Any) -> Any:
            _RECORD["pre_main_cpu"] = _cpu()
            return run_program(*args, **kwargs)

        module.run_program = timed_run_program


class _Hook(importlib.abc.MetaPathFinder):
    """Calls `_after_import` once each watched module has executed."""

    WATCHED = ("jax._src.monitoring", "steps.cli")

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in self.WATCHED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _after_import(name, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _write() -> None:
    if _RECORD.get("written"):
        return
    _RECORD["written"] = True
    t = os.times()
    _RECORD.update(wall=time.time() - _T0, cpu=_cpu(), children_cpu=t.children_user + t.children_system)
    _RECORD["argv"] = list(getattr(sys, "orig_argv", sys.argv))  # a forked step process rewrites it
    _RECORD["test"] = _RECORD["test"] or os.environ.get("PYTEST_CURRENT_TEST", "")
    try:
        with open(str(_LOG), "a") as f:
            f.write(json.dumps(_RECORD) + "\n")
    except OSError:
        pass


def _on_sigterm(signum: int, _frame: Any) -> None:
    _write()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _after_fork() -> None:
    """A process forked by the fork server (or an intermediate): its own clock, counters and command line."""
    global _T0
    _T0 = time.time()
    _RECORD.update(compile_s=0.0, trace_s=0.0, lower_s=0.0, hits=0, misses=0, pre_main_cpu=None)
    _RECORD["test"] = ""


if _LOG:
    os.register_at_fork(after_in_child=_after_fork)
    sys.meta_path.insert(0, _Hook())
    atexit.register(_write)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
