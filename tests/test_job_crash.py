"""End-to-end crash suite: SIGKILL random steps of a running job >= 20 times; the runner restarts them;
nothing committed is lost, and replaying the committed batches reproduces the final parameters."""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from jobs import check_finished_run, job_config, policy_arrays

from pipeline.store.storage import RunStore

ROOT = Path(__file__).resolve().parents[1]
# Long enough that >= 20 kills land before the job can finish on a fast machine (10 steps once ended after 9 kills
# in 23 s, at one kill every 0.5-2 s); kills stop at MAX_KILLS, so the remaining steps run undisturbed.
STEPS = 14
MIN_KILLS = 20
MAX_KILLS = 22
KILL_GAP_S = (0.3, 1.2)
"""Seconds between two kills, drawn uniformly: 20 kills take ~15 s. A restarted step is often killed again while it
starts (import, JAX, resume), which is a random point like any other and wastes less of the machine than a kill
of a step that had warmed up: this and the shorter job (20 steps and 24 kills at one every 0.5-2 s before) are
what the test spends."""


@pytest.mark.slow
def test_crash_suite_sigkill_random_steps(tmp_path: Path) -> None:
    """SIGKILL random steps >= MIN_KILLS times while the job runs; the runner restarts them; nothing is lost."""
    run_root = tmp_path / "run"
    cfg = job_config(
        tmp_path,
        str(run_root),
        **{
            "train.num_train_steps": str(STEPS),
            "max_restarts": "40",
            "restart_backoff_s": "0.2",
            "cadence.checkpoint_interval": "1",
        },
    )
    runner = subprocess.Popen(
        [sys.executable, "-m", "steps.run", "--config_path", str(cfg)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    rng = random.Random(1234)
    kills = 0
    deadline = time.monotonic() + 900
    try:
        while runner.poll() is None and time.monotonic() < deadline:
            time.sleep(rng.uniform(*KILL_GAP_S))
            children = [c for c in psutil.Process(runner.pid).children(recursive=False) if c.is_running()]
            if not children or kills >= MAX_KILLS:
                continue
            victim = rng.choice(children)
            try:
                victim.send_signal(signal.SIGKILL)
                kills += 1
            except psutil.NoSuchProcess:
                pass
        out, _ = runner.communicate(timeout=600)
    finally:
        if runner.poll() is None:
            runner.kill()
    assert kills >= MIN_KILLS, f"only {kills} kills happened before the job ended"
    assert runner.returncode == 0, out[-4000:]
    store = RunStore(str(run_root))
    check_finished_run(store, num_steps=STEPS, max_lag=1)

    # Replay: a fresh learner trained on the committed batches reproduces the final parameters.
    replay_root = tmp_path / "replay"
    shutil.copytree(run_root / "batches", replay_root / "batches")
    shutil.copy(run_root / "run.json", replay_root / "run.json")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "steps.run",
            "step",
            "learn",
            "--config_path",
            str(cfg),
            "--store.run_root",
            str(replay_root),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a = policy_arrays(RunStore(str(run_root)), STEPS)
    b = policy_arrays(RunStore(str(replay_root)), STEPS)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
