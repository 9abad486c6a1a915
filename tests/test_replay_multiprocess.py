"""Replay of a job whose learner ran as two processes (`learner.num_processes: 2`, 2 simulated CPU devices each,
`jax.distributed` over gloo): `make replay` starts the recorded two processes itself and gives the committed
policy bit for bit; a batch slot whose contents were changed (and its log entry re-signed, so that it verifies)
makes replay exit 10 (`Exit.REPLAY_MISMATCH`) naming each differing tensor and its first differing element, and
the first one in its one `error: replay mismatch: …` line.

The run both tests replay is the session's `learner_group_crash_run` (tests/conftest.py): the job of
tests/test_job_crash_learner_group.py, whose two-process learner group was SIGKILLed at random points and resumed
(a checkpoint at every slot, the newest two kept); each test replays its last slot from the checkpoint before it.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import test_job_crash_learner_group as crash_group  # its importorskip("jax") is this module's too
from jobs import ROOT, TEST_XLA_FLAGS, tamper_batch
from makefile import make_env, recipe_command

from pipeline.process.exits import LABELS, Exit
from pipeline.store import layout
from pipeline.store.storage import RunStore

pytest.importorskip("jax")

STEPS = crash_group.STEPS
"""The crashed job's learner steps: both tests replay slot STEPS from checkpoint STEPS - 1."""


@pytest.fixture(scope="module")
def two_process_run(learner_group_crash_run: crash_group.CrashedGroupRun) -> Path:
    """The run root of a finished job whose learner was a group of two processes × 2 devices (read only)."""
    run_root = learner_group_crash_run.root
    marker = json.loads((run_root / layout.checkpoint_marker(STEPS - 1)).read_text())
    assert sorted(marker["files"]) == ["p0", "p1"], marker["files"]  # both learner processes wrote the checkpoint
    return run_root


def _replay_env() -> dict[str, str]:
    """The environment `make replay` gets: one device and no group variables (replay makes the rest itself)."""
    env = {**make_env(), "XLA_FLAGS": TEST_XLA_FLAGS, "PYTHONPATH": str(ROOT)}
    for name in ("RLPIPE_COORDINATOR", "RLPIPE_NUM_PROCESSES", "RLPIPE_PROCESS_ID"):
        env.pop(name, None)
    return env


@pytest.mark.slow
def test_make_replay_of_a_two_process_run_is_bitwise(two_process_run: Path, tmp_path: Path) -> None:
    cmd = recipe_command("replay", RUN=str(two_process_run), FROM=str(STEPS - 1), TO=str(STEPS),
                         ARGS=f"--scratch {tmp_path / 's'}")  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=_replay_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "replaying as 2 processes (2 processes × 2 devices (mesh fsdp=4))" in proc.stdout
    assert f"replayed slots {STEPS}..{STEPS} from checkpoint {STEPS - 1} on 2 processes" in proc.stdout
    assert "bitwise equal" in proc.stdout
    for i in range(2):  # both replay processes joined one jax.distributed group on the recorded mesh
        assert f"jax.distributed: process {i} of 2" in proc.stderr
    assert proc.stderr.count("learner mesh: data=1 fsdp=4 model=1 over 4 devices") == 2


@pytest.mark.slow
def test_replay_of_a_tampered_batch_names_tensor_and_element(two_process_run: Path, tmp_path: Path) -> None:
    run_root = tmp_path / "run"
    shutil.copytree(two_process_run, run_root)
    tamper_batch(RunStore(str(run_root)), STEPS)
    cmd = [
        sys.executable,
        "-m",
        "steps.replay",
        "--store.run_root",
        str(run_root),
        "--from_step",
        str(STEPS - 1),
        "--to_step",
        str(STEPS),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=_replay_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == Exit.REPLAY_MISMATCH, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"NOT equal to the run's committed policy {STEPS}" in proc.stdout
    lines = re.findall(r"^  (\.\S.*?): max abs difference (\S+); first at \[(\d+(?:, \d+)*)\]", proc.stdout, re.M)
    assert lines, proc.stdout[-2000:]
    assert all(float(diff) > 0 for _, diff, _ in lines)
    assert "replay process" not in proc.stderr  # a difference, not a failed process
    # one line, from process 0 alone, naming the first differing tensor; no traceback
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {LABELS[Exit.REPLAY_MISMATCH]}: "), proc.stderr[-3000:]
    assert f"first {lines[0][0]}: max abs difference" in errors[0], (errors, lines[0])
    assert "Traceback" not in proc.stderr


def test_a_failing_replay_process_stops_the_group_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Process 1 of a group ends with exit code 3 while process 0 still runs (it would wait for process 1 in a
    collective): the group's wait returns at once with that code and one stderr line naming process 1."""
    import time

    from policy.replay import wait_group

    procs = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
        subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"]),
    ]
    try:
        t0 = time.monotonic()
        assert wait_group(procs) == 3
        assert time.monotonic() - t0 < 30
    finally:
        for p in procs:
            p.kill()
            p.wait()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["replay process 1 of 2 failed (exit code 3); the other processes were stopped"]


@pytest.mark.slow
def test_a_sigkilled_replay_leaves_none_of_its_processes(two_process_run: Path, tmp_path: Path) -> None:
    """The group's processes end with the replay that started them: SIGKILLed once both run, none is left waiting
    for the other in a collective."""
    import time

    import psutil
    from jobs import step_module

    cmd = [sys.executable, "-m", "steps.replay", "--store.run_root", str(two_process_run), "--from_step",
           str(STEPS - 1), "--to_step", str(STEPS), "--scratch", str(tmp_path / "s")]  # fmt: skip
    replay = subprocess.Popen(cmd, cwd=ROOT, env=_replay_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    group: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while len(group) < 2 and replay.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            with contextlib.suppress(psutil.Error):
                group = [p for p in psutil.Process(replay.pid).children() if step_module(p.cmdline()) == "steps.replay"]
        assert len(group) == 2, f"the replay's two processes did not start (exit code {replay.poll()})"
        replay.kill()
        replay.wait()

        def running(p: psutil.Process) -> bool:
            with contextlib.suppress(psutil.Error):
                return p.status() != psutil.STATUS_ZOMBIE
            return False

        deadline = time.monotonic() + 30
        while (alive := [p.pid for p in group if running(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, f"replay processes {alive} outlived the SIGKILLed replay"
    finally:
        if replay.poll() is None:
            replay.kill()
            replay.wait()
        for p in group:
            with contextlib.suppress(psutil.Error):
                p.kill()
