"""Scheduled-job behaviour of the BatchMaker: a stop by SIGTERM releases its lease (the next `batches` starts at
once), and a lease left by a killed maker is waited for (at most its ttl), with one line, not a traceback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from test_make_batches import REPO, publish_policy, step_args

from pipeline.process.exits import Exit
from pipeline.store.storage import RunStore


def _start(root: Path, holder: str, ttl_s: float) -> subprocess.Popen[str]:
    args = step_args(root, follow=True, holder_id=holder, lease_ttl_s=ttl_s, **{"train.max_batch_latency_s": 120})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _holds_lease(store: RunStore, holder: str) -> bool:
    """True once `holder` has claimed an epoch of the BatchMaker's lease (its claim record names it)."""
    claims = [p for p in store.list("leases/batchmaker") if re.search(r"epoch-\d{8}\.json$", p)]
    return any(store.get_json(p).get("holder") == holder for p in claims)


def _wait_for_lease(store: RunStore, proc: subprocess.Popen[str], holder: str) -> None:
    """Wait until `proc` (holder `holder`) holds the lease: the folder may already hold earlier holders' records,
    so its own claim is what is waited for (a loaded machine can take many seconds to start a step)."""
    deadline = time.time() + 120
    while not _holds_lease(store, holder) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None and _holds_lease(store, holder)


def _bounded(root: Path, holder: str) -> subprocess.CompletedProcess[str]:
    args = step_args(root, max_batches=1, holder_id=holder, **{"polling.bounded_wait_s": 1})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_sigterm_releases_the_lease_and_a_killed_holders_lease_is_taken_over(tmp_path: Path) -> None:
    root = tmp_path / "run"
    store = RunStore(str(root))
    publish_policy(store, 0)
    ttl = 6.0
    first = _start(root, "maker-A", ttl)
    _wait_for_lease(store, first, "maker-A")
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0
    assert any(p.endswith(".released.json") for p in store.list("leases/batchmaker"))
    r = _bounded(root, "maker-B")  # starts at once: no lease wait
    assert r.returncode == 0, r.stderr
    assert "waiting up to that long for it to lapse" not in r.stderr and "Traceback" not in r.stderr

    killed = _start(root, "maker-C", ttl)
    _wait_for_lease(store, killed, "maker-C")  # its claim (host, pid) is written
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    t0 = time.monotonic()
    r = _bounded(root, "maker-D")
    # its claim names this host and a process that no longer runs: taken over at once (no wait for the lapse)
    assert r.returncode == 0, r.stderr
    assert "'maker-C'" in r.stderr and "is dead; taking over at once" in r.stderr
    assert "waiting up to that long for it to lapse" not in r.stderr
    assert "Traceback" not in r.stderr and r.returncode != Exit.LEASE_HELD
    assert time.monotonic() - t0 < ttl + 30
