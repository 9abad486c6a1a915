"""Replay of a job whose learner ran as two processes (`learner.num_processes: 2`, 2 simulated CPU devices each,
`jax.distributed` over gloo): `make replay` starts the recorded two processes itself and gives the committed
policy bit for bit; a batch slot whose contents were changed (and its log entry re-signed, so that it verifies)
makes replay exit 10 (`Exit.REPLAY_MISMATCH`) naming each differing tensor and its first differing element, and
the first one in its one `error: replay mismatch: …` line.

One job (3 slots, a checkpoint at every slot) serves both tests; each replays slot 3 from checkpoint 2.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import ROOT, TEST_XLA_FLAGS, job_config, run_job, simulated_devices, tamper_batch
from makefile import make_env, recipe_command

from pipeline.process.exits import LABELS, Exit
from pipeline.store import layout
from pipeline.store.storage import RunStore

pytest.importorskip("jax")

STEPS = 3


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run root of a finished job whose learner was a group of two processes × 2 devices."""
    tmp = tmp_path_factory.mktemp("replay2")
    run_root = tmp / "run"
    overrides = {
        "train.num_train_steps": str(STEPS),
        "learner.num_processes": "2",
        "evaluator": "false",
        "num_rollout_workers": "1",
        "cadence.checkpoint_interval": "1",
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLA_FLAGS", simulated_devices(2))
        mp.setenv("PYTHONHASHSEED", "0")
        job = run_job(job_config(tmp, str(run_root), None, **overrides))
    assert job.returncode == 0, job.stderr[-3000:]
    marker = json.loads((run_root / layout.checkpoint_marker(2)).read_text())
    assert sorted(marker["files"]) == ["p0", "p1"], marker["files"]  # both learner processes wrote checkpoint 2
    return run_root


def _replay_env() -> dict[str, str]:
    """The environment `make replay` gets: one device and no group variables (replay makes the rest itself)."""
    env = {**make_env(), "XLA_FLAGS": TEST_XLA_FLAGS, "PYTHONPATH": str(ROOT)}
    for name in ("RLPIPE_COORDINATOR", "RLPIPE_NUM_PROCESSES", "RLPIPE_PROCESS_ID"):
        env.pop(name, None)
    return env


@pytest.mark.slow
def test_make_replay_of_a_two_process_run_is_bitwise(two_process_run: Path, tmp_path: Path) -> None:
    cmd = recipe_command("replay", RUN=str(two_process_run), FROM="2", TO="3", ARGS=f"--scratch {tmp_path / 's'}")
    proc = subprocess.run(cmd, cwd=ROOT, env=_replay_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "replaying as 2 processes (2 processes × 2 devices (mesh fsdp=4))" in proc.stdout
    assert "replayed slots 3..3 from checkpoint 2 on 2 processes" in proc.stdout
    assert "bitwise equal" in proc.stdout
    for i in range(2):  # both replay processes joined one jax.distributed group on the recorded mesh
        assert f"jax.distributed: process {i} of 2" in proc.stderr
    assert proc.stderr.count("learner mesh: data=1 fsdp=4 model=1 over 4 devices") == 2


@pytest.mark.slow
def test_replay_of_a_tampered_batch_names_tensor_and_element(two_process_run: Path, tmp_path: Path) -> None:
    run_root = tmp_path / "run"
    shutil.copytree(two_process_run, run_root)
    tamper_batch(RunStore(str(run_root)), 3)
    cmd = [
        sys.executable,
        "-m",
        "steps.replay",
        "--store.run_root",
        str(run_root),
        "--from_step",
        "2",
        "--to_step",
        "3",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=_replay_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == Exit.REPLAY_MISMATCH, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "NOT equal to the run's committed policy 3" in proc.stdout
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

    from steps.replay import wait_group

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
