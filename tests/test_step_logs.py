"""Step logs under the run root (local and remote roots) and the waits that say what they wait for."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pipeline.jobs.step_logs import StepLog, log_target
from pipeline.store import layout
from pipeline.store.poll import WaitTimeout, poll_until
from pipeline.store.storage import RunStore


def test_a_long_wait_says_what_it_waits_for(caplog: pytest.LogCaptureFixture) -> None:
    """poll_until logs the awaited thing about every log_every_s while it waits, and nothing once it is over."""
    started: list[float] = []

    def ready() -> bool | None:
        started.append(time.monotonic())  # the clock starts at poll_until's first look, not before the call
        return time.monotonic() - started[0] > 0.55 or None

    with caplog.at_level(logging.INFO, logger="pipeline.store.poll"):
        value, waited = poll_until(
            ready, timeout_s=5, what="the thing X", interval_s=0.01, setting="x_timeout_s", log_every_s=0.1
        )
    assert value is True and waited >= 0.55
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline.store.poll"]
    # one line per 0.1 s at most; a loaded machine that pauses this process may leave out some
    assert 2 <= len(lines) <= waited / 0.1 + 1, (waited, lines)
    assert all("the thing X" in ln and "x_timeout_s=5" in ln for ln in lines), lines
    caplog.clear()
    with (
        caplog.at_level(logging.INFO, logger="pipeline.store.poll"),
        pytest.raises(WaitTimeout, match=r"x_timeout_s=0\.2"),
    ):
        poll_until(lambda: None, timeout_s=0.2, what="Y", interval_s=0.01, setting="x_timeout_s", log_every_s=None)
    assert not [r for r in caplog.records if r.name == "pipeline.store.poll"]


def test_local_step_log_is_the_file_under_the_run_root(tmp_path: Path) -> None:
    target = log_target(str(tmp_path / "run"), None, "learner")
    log = StepLog(target)
    with log.open() as f:
        subprocess.run([sys.executable, "-c", "print('hello from the step')"], stdout=f, check=True)
    log.close()
    path = Path(target.location)
    assert path == tmp_path / "run" / "logs" / "learner" / f"{target.attempt}.log"
    assert path.read_text() == "hello from the step\n"


def test_remote_step_log_is_uploaded_while_it_grows_and_at_the_end() -> None:
    """On a non-local root the log object exists at once, holds the output within a few upload periods while
    the step runs, and all of it after close(); two starts of a step are two attempts."""
    root = f"memory://logs-{uuid.uuid4().hex[:8]}/run"
    store = RunStore(root)
    target = log_target(root, None, "rollout-w0")
    log = StepLog(target, upload_every_s=0.05)
    assert store.get(target.rel) == b""
    with log.open() as f:
        f.write(b"line 1\n")
        f.flush()
        deadline = time.monotonic() + 5
        while store.get(target.rel) != b"line 1\n" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.get(target.rel) == b"line 1\n"
        f.write(b"line 2\n")
    log.close()
    assert store.get(target.rel) == b"line 1\nline 2\n"
    assert target.location == f"{root}/{layout.step_log('rollout-w0', target.attempt)}"
    again = log_target(root, None, "rollout-w0")
    StepLog(again).close()
    assert again.attempt != target.attempt
    assert sorted(store.list("logs/rollout-w0")) == sorted(
        [layout.step_log("rollout-w0", a) for a in (target.attempt, again.attempt)]
    )


def test_a_child_server_logs_beside_its_step_and_reaches_a_remote_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """`logs/<step>/<attempt>.server.log`: the step and attempt the job runner gave the worker, else
    `rollout-<worker id>` and a fresh attempt; on a remote root it is uploaded like a step log."""
    from pipeline.jobs.step_logs import server_log

    root = f"memory://server-logs-{uuid.uuid4().hex[:8]}/run"
    store = RunStore(root)
    monkeypatch.setenv("RLPIPE_STEP", "rollout-w3")
    monkeypatch.setenv("RLPIPE_ATTEMPT", "20260101T000000Z-0123abcd")
    log = server_log(store, "w3")
    with open(log.local_path, "ab") as f:  # what the server child writes
        f.write(b"server says hi\n")
    log.close()
    assert store.get("logs/rollout-w3/20260101T000000Z-0123abcd.server.log") == b"server says hi\n"
    monkeypatch.delenv("RLPIPE_STEP")
    monkeypatch.delenv("RLPIPE_ATTEMPT")
    alone = server_log(store, "w9")
    alone.close()
    (path,) = store.list("logs/rollout-w9")
    assert path.endswith(".server.log") and alone.target.attempt.endswith(".server")
