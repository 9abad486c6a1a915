"""A whole job driven from a terminal (a pseudo-terminal): the progress bar reaches the final step, every
step's output is under the run root, the tracker receives every step's metrics, and start-up is quiet. And the
progress computation itself, from run roots written with the real metrics writer: each step's own values, the
rollout rate over a real window, nothing after the learner finished, and the job's closing summary."""

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
from jobs import ROOT, FinishedJob, job_config
from log_entries import put_log_entry

from pipeline.jobs.progress import ROWS_WINDOW_S, JobProgress, RunProgress, summary_lines
from pipeline.process.step_kind import StepKind
from pipeline.store import layout
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import MetricsWriter

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


def _records(store: RunStore, kind: StepKind, *records: dict[str, object]) -> None:
    """Commit `records` as one metrics file of step kind `kind` (each record's own `time` kept when given)."""
    writer = MetricsWriter(store, kind, kind.job_name)
    for rec in records:
        writer.log(rec)
    writer.flush()


def test_rollout_rows_per_s_counts_the_last_window(local_store: RunStore) -> None:
    """Rows committed in the last ROWS_WINDOW_S seconds over that window; older writes and summaries not."""
    now = time.time()
    _records(
        local_store,
        StepKind.ROLLOUT,
        {"event": "write", "rows": 600, "rollout_committed_at": now - ROWS_WINDOW_S - 20},
        {"event": "write", "rows": 30, "rollout_committed_at": now - 10},
        {"event": "write", "rows": 30, "rollout_committed_at": now - 5},
        {"event": "stop", "rows": 660},  # the worker's total: not rows written again
    )
    progress = RunProgress(local_store, t0=now - 200)
    assert progress.snapshot()["rollout_rows_per_s"] == round(60 / ROWS_WINDOW_S, 1)
    # a job younger than the window: rows over the time since it started
    assert RunProgress(local_store, t0=now - 15).snapshot()["rollout_rows_per_s"] == round(60 / 15, 1)


def test_each_step_line_has_its_own_values_and_none_follow_the_finish(
    local_store: RunStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Two steps committed between two reads: two lines, each with its own batch's reward; the "now" values
    (batch slot, rollout rate) on the newest only. After `finish()` (the learner finished) nothing is printed."""
    caplog.set_level("INFO", logger="pipeline.jobs.runner")
    progress = JobProgress(local_store, 3, terminal=False)
    for slot in (1, 2):
        put_log_entry(local_store, slot)
    _records(local_store, StepKind.BATCHMAKER, {"slot": 1, "mean_reward": 0.1, "staleness_mean": 0.0},
             {"slot": 2, "mean_reward": 0.5, "staleness_mean": 1.0})  # fmt: skip
    _records(local_store, StepKind.LEARNER, {"step": 1, "loss": 0.25}, {"step": 2, "loss": 0.5})
    progress.update(force=True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("learner step")]
    assert len(lines) == 2, lines
    assert lines[0].startswith("learner step 1/3 (") and "reward=0.1 " in lines[0] and "loss=0.25" in lines[0]
    assert "rollout_rows_per_s" not in lines[0] and "batch_slot" not in lines[0]
    assert lines[1].startswith("learner step 2/3 (") and "batch_slot=2 reward=0.5 staleness=1.0" in lines[1]
    assert "rollout_rows_per_s=0.0" in lines[1]
    progress.update(force=True)  # nothing new: no line
    progress.finish()
    _records(local_store, StepKind.LEARNER, {"step": 3, "loss": 0.1})
    progress.update(force=True)
    progress.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("learner step")]
    assert len(lines) == 2, lines


def test_a_committed_steps_line_waits_for_its_own_records(
    local_store: RunStore, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Policy 1 committed before the learner's and the BatchMaker's records of step 1 are in: no line yet; once
    they are, the line carries step 1's loss and reward. Policy 2 whose records never come: its line comes after
    STEP_RECORDS_WAIT_S without numbers (the display never stalls); policy 3 committed as the learner finishes:
    `finish()` prints its line at once."""
    import pipeline.jobs.progress as progress_module

    caplog.set_level("INFO", logger="pipeline.jobs.runner")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("learner step")]

    progress = JobProgress(local_store, 3, terminal=False)
    local_store.put_unique(layout.policy_marker(1), b"{}")
    progress.update(force=True)
    assert lines() == []  # committed, but its own numbers are not in yet
    _records(local_store, StepKind.LEARNER, {"step": 1, "loss": 0.25})
    progress.update(force=True)
    assert lines() == []  # its batch's record is not in yet either
    put_log_entry(local_store, 1)
    _records(local_store, StepKind.BATCHMAKER, {"slot": 1, "mean_reward": 0.75, "staleness_mean": 0.0})
    progress.update(force=True)
    (line,) = lines()
    assert line.startswith("learner step 1/3 (") and "reward=0.75 staleness=0.0 loss=0.25" in line, line

    local_store.put_unique(layout.policy_marker(2), b"{}")
    progress.update(force=True)
    assert len(lines()) == 1
    monkeypatch.setattr(progress_module, "STEP_RECORDS_WAIT_S", 0.0)  # as if it had waited the whole bound
    progress.update(force=True)
    assert len(lines()) == 2 and lines()[1].startswith("learner step 2/3 (") and "loss=" not in lines()[1]

    monkeypatch.setattr(progress_module, "STEP_RECORDS_WAIT_S", 3600.0)
    local_store.put_unique(layout.policy_marker(3), b"{}")
    _records(local_store, StepKind.LEARNER, {"step": 3, "loss": 0.125})
    progress.finish()
    assert len(lines()) == 3 and lines()[2].startswith("learner step 3/3 (") and "loss=0.125" in lines()[2]
    progress.close()
    assert len(lines()) == 3


def test_a_resumed_job_shows_only_the_steps_it_commits(local_store: RunStore, caplog: pytest.LogCaptureFixture) -> None:
    """A job started on a run whose learner already committed 40 steps (a rerun; its learner may re-train them from
    step 0 without a checkpoint): one "resuming" line, no line for steps 1..40, then one line per new step."""
    _records(local_store, StepKind.LEARNER, *({"step": s, "loss": 0.5} for s in range(1, 41)))
    caplog.set_level("INFO", logger="pipeline.jobs.runner")
    progress = JobProgress(local_store, 50, terminal=False)
    progress.update(force=True)
    _records(local_store, StepKind.LEARNER, *({"step": s, "loss": 0.5} for s in range(1, 42)))  # re-trained, then 41
    progress.update(force=True)
    progress.close()
    messages = [r.getMessage() for r in caplog.records]
    assert "resuming: learner step 40/50 was committed before this job started" in messages
    steps = [m.split()[2] for m in messages if m.startswith("learner step")]
    assert steps == ["41/50"], steps


def test_summary_names_rewards_the_last_evaluation_and_the_report(local_store: RunStore) -> None:
    _records(local_store, StepKind.BATCHMAKER, {"slot": 2, "mean_reward": 0.75}, {"slot": 1, "mean_reward": 0.125})
    _records(local_store, StepKind.EVALUATE,
             {"policy_step": 0, "lesson_id": "cats", "mean_reward": 0.1, "success_rate": 0.0},
             {"policy_step": 2, "lesson_id": "cats", "mean_reward": 0.9, "success_rate": 0.5})  # fmt: skip
    lines = summary_lines(local_store, "runs/my run")
    assert lines == [
        "batch reward: 0.125 (slot 1) -> 0.750 (slot 2)",
        "last evaluation (policy 2): cats reward 0.900 success 0.500",
        "report: make report RUN='runs/my run'",
    ]


@pytest.mark.slow
def test_finished_job_ends_with_its_summary_and_no_exit_codes(default_job: FinishedJob) -> None:
    """The runner's output of a normal end: the producers it stopped read "stopped", not as a crash's exit code;
    no progress line after "learner finished"; the summary and the report command close it."""
    err = default_job.proc.stderr
    assert "exit -15" not in err and "exit 130" not in err and "stopped (exit" not in err
    assert re.search(r"runner: rollout-worker0 (stopped|finished)$", err, re.M), err[-3000:]
    # one line per learner step, in order, each with that step's own loss and batch reward
    lines = re.findall(r"runner: learner step (\d+)/6 \(\d+s\) (.*)$", err, re.M)
    assert [int(s) for s, _ in lines] == list(range(1, 7)), lines
    assert all("reward=" in text and "loss=" in text for _, text in lines), lines
    after = err[err.index("learner finished") :]
    assert "runner: learner step" not in after
    assert "batch reward: " in after and "last evaluation (policy 6): " in after
    assert f"report: make report RUN={default_job.root}" in after
