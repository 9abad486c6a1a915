"""Opt-in pytest plugin (`-p cpu_plugin` with tests/cpu_profile on PYTHONPATH and RLPIPE_PROF_LOG=FILE): one JSON
line per test in FILE.tests with its wall seconds and the CPU seconds of the pytest process and of its
waited-for child processes (with theirs) while the test (fixtures included) ran."""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator

import pytest


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    own, children, start = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.time()
    yield
    log = os.environ.get("RLPIPE_PROF_LOG")
    if log:
        record = {
            "test": item.nodeid,
            "wall": time.time() - start,
            "self_cpu": _cpu(resource.RUSAGE_SELF) - own,
            "child_cpu": _cpu(resource.RUSAGE_CHILDREN) - children,
            "worker": os.environ.get("PYTEST_XDIST_WORKER"),
        }
        with open(f"{log}.tests", "a") as f:
            f.write(json.dumps(record) + "\n")
