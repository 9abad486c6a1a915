"""A whole job driven from a terminal (a pseudo-terminal): the progress bar reaches the final step, every
step's output is under the run root, the tracker receives every step's metrics, and start-up is quiet."""

from __future__ import annotations

import fcntl
import glob
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from jobs import ROOT, job_config

from pipeline.store import layout
from pipeline.store.storage import RunStore

STEPS = 4
NOISE = ("Disabling PyTorch", "transition_steps", "our own retried write", "Traceback")


@dataclass
class TtyJob:
    run_root: Path
    returncode: int
    screen: str


def run_on_a_terminal(config: Path, timeout: float = 600) -> tuple[int, str]:
    """Run the job with stdin, stdout and stderr on a pseudo-terminal; return (exit code, all it wrote)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen(
        [sys.executable, "-m", "steps.run", "--config_path", str(config)],
        cwd=ROOT,
        stdin=slave,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed: the job exited
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    else:
        proc.kill()
    os.close(master)
    return proc.wait(timeout=60), out.decode(errors="replace")


@pytest.fixture(scope="module")
def tty_job(tmp_path_factory: pytest.TempPathFactory) -> TtyJob:
    tmp = tmp_path_factory.mktemp("tty")
    run_root = tmp / "run"
    cfg = job_config(
        tmp,
        str(run_root),
        **{"train.num_train_steps": str(STEPS), "curriculum.eval_frequency": "2", "tracker.type": "tensorboard"},
    )
    rc, screen = run_on_a_terminal(cfg)
    return TtyJob(run_root, rc, screen)


@pytest.mark.slow
def test_progress_bar_reaches_the_final_step(tty_job: TtyJob) -> None:
    assert tty_job.returncode == 0, tty_job.screen[-3000:]
    bars = re.findall(r"learner:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)", tty_job.screen)
    assert bars, tty_job.screen[-3000:]
    assert bars[-1] == (str(STEPS), str(STEPS)), bars[-5:]
    assert "rollout_rows_per_s=" in tty_job.screen and "reward=" in tty_job.screen
    # on a terminal the bar replaces the per-step lines
    assert "learner step 1/" not in tty_job.screen


@pytest.mark.slow
def test_every_step_logs_under_the_run_root(tty_job: TtyJob) -> None:
    store = RunStore(str(tty_job.run_root))
    names = {"learner", "batches", "rollout-worker0", "rollout-worker1", "evaluate"}
    assert set(store.list(layout.LOGS)) >= {f"{layout.LOGS}/{n}" for n in names}
    for name in names:
        (path,) = store.list(f"{layout.LOGS}/{name}")
        assert re.fullmatch(rf"logs/{name}/\d{{8}}T\d{{6}}Z-[0-9a-f]{{8}}\.log", path), path
        assert str(tty_job.run_root / path) in tty_job.screen  # the runner named it when it started the step
    learner_log = store.get(store.list("logs/learner")[0]).decode()
    assert f"trained slot {STEPS} " in learner_log
    for path in store.list(layout.LOGS):
        text = store.get(store.list(path)[0]).decode()
        assert not [n for n in NOISE if n in text], (path, [n for n in NOISE if n in text])
    assert not [n for n in NOISE if n in tty_job.screen]


@pytest.mark.slow
def test_tracker_holds_every_steps_metrics(tty_job: TtyJob) -> None:
    """One tracker run (one event file) holds the learner's loss, the batches' reward and staleness, the
    rollout throughput and the evaluations."""
    from test_trackers import tfevents_scalars

    files = glob.glob(str(tty_job.run_root / "trackers" / "run" / "events.out.tfevents.*"))
    assert len(files) == 1, files
    scalars = tfevents_scalars(files[0])
    assert sorted(scalars["learner/loss"]) == list(range(1, STEPS + 1))
    for key in ("batches/mean_reward", "batches/staleness_mean", "rollout/rows_per_s", "eval/cats/mean_reward"):
        assert scalars.get(key), (key, sorted(scalars))
    assert all(0 <= v <= 1 for v in scalars["batches/staleness_mean"].values())  # max_lag 1
    assert all(v > 0 for v in scalars["rollout/rows_per_s"].values())
    # the final policy's evaluation ends after the learner's last step: the tracker run waited for it
    assert float(STEPS) in scalars["eval/cats/policy_step"].values(), scalars["eval/cats/policy_step"]
