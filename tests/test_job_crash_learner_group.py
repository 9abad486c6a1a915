"""Crash test of a job whose learner is a group of two processes: SIGKILL one of them at random points (>= 10).

The job (`python -m steps.run`, local backend) runs the learner as TWO `steps.learn` processes × 2 simulated CPU
devices each under `jax.distributed` (gloo; `learner.num_processes: 2`), the BatchMaker and a rollout worker.
Each kill lands in a random attempt of the group at a random point: during start-up (import, `jax.distributed`,
resume), the instant the first shard file of the attempt's next checkpoint lands (before or after the other
process's shard and the COMMITTED marker), or right after a trained slot. The local backend then kills the
group's other process (it would block in a collective) and the job runner restarts both.

Checks: the job ends with exit 0 and its run root passes the run audit; every attempt of the group resumed, on
both processes, from the newest committed checkpoint at its start (so a checkpoint folder that a kill left
without COMMITTED was never loaded); the lineage of checkpoint markers covers batch slots 1..N exactly once;
the final policy equals, bitwise, the one an uninterrupted run of the same two-process learner group trains on
the job's committed batches in a fresh run root (same mesh over the same devices: the same XLA programs).

The job runs once per test session (`crashed_group_run`, the `learner_group_crash_run` fixture of
tests/conftest.py): tests/test_replay_multiprocess.py replays its last slot as two processes.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import draccus
import numpy as np
import psutil
import pytest
from invariants import check_checkpoint_lineage, half_written_checkpoints
from jobs import ROOT, check_finished_run, job_config, policy_arrays, simulated_devices, step_module

from pipeline.config import LocalBackendConfig, RLJobConfig, StoreConfig
from pipeline.jobs.job import RLJob
from pipeline.jobs.launchers.base import StepSpec
from pipeline.jobs.launchers.local import LocalLauncher
from pipeline.jobs.step_logs import log_target
from pipeline.process.step_kind import StepKind
from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas.records import CommitMarker

pytest.importorskip("jax")

STEPS = 8
"""Learner steps of the job. Kills that train no slot (start-up points) are the only ones drawn once 4 or fewer
slots are left, so the first ~4 slots take the checkpoint and trained-slot kills and the job cannot end before
every kill has landed; 12 steps (before) only added slots to the last attempt and to the reference group."""
MIN_KILLS = 10
START_UP = (None, b"rlpipe.cli: config", b"jax.distributed: process", b"learner mesh", b"learner at step")
"""Start-up points to kill at, by the line the attempt's process 0 has logged (None: as soon as both run)."""


@pytest.fixture
def group_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process of the job (and of the reference group) sees 2 simulated CPU devices."""
    monkeypatch.setenv("XLA_FLAGS", simulated_devices(2))
    monkeypatch.setenv("PYTHONHASHSEED", "0")


def _config(tmp_path: Path, run_root: Path) -> Path:
    return job_config(
        tmp_path,
        str(run_root),
        **{
            "train.num_train_steps": str(STEPS),
            "learner.num_processes": "2",
            "evaluator": "false",
            "num_rollout_workers": "1",
            "cadence.checkpoint_interval": "1",
            "max_restarts": "40",
            "restart_backoff_s": "0.05",
            "restart_backoff_max_s": "0.2",
        },
    )


def _learner_group(runner: subprocess.Popen[str], seen: set[int]) -> tuple[list[psutil.Process], str] | None:
    """Both processes of a learner attempt not seen before, process 0 first, and the attempt's id; else None.

    A process's attempt and index are read from the learner log it writes to (`<attempt>.log` for process 0,
    `<attempt>.p1.log` for process 1): its environment cannot tell, since a process forked by the job's fork
    server shows the server's environment in /proc."""
    try:
        procs = [
            p
            for p in psutil.Process(runner.pid).children()
            if step_module(p.cmdline()) == "steps.learn" and p.pid not in seen and p.status() != psutil.STATUS_ZOMBIE
        ]
        if len(procs) != 2:
            return None
        logs = [sorted({Path(f.path).name for f in p.open_files() if "/logs/learner/" in f.path}) for p in procs]
    except psutil.Error:  # one ended while we looked
        return None
    if any(len(names) != 1 for names in logs):
        return None
    order = sorted(range(2), key=lambda i: logs[i][0].endswith(".p1.log"))
    attempt = logs[order[0]][0].removesuffix(".log")
    if logs[order[1]][0] != f"{attempt}.p1.log":
        return None
    return [procs[i] for i in order], attempt


def _newest_checkpoint(store: RunStore) -> int | None:
    from pipeline.store.run_state import committed_steps

    return (committed_steps(store, layout.CHECKPOINTS) or [None])[-1]


def _logs(store: RunStore, attempt: str) -> list[Path]:
    return [Path(store.full_path(layout.step_log("learner", a))) for a in (attempt, f"{attempt}.p1")]


def _until(group: list[psutil.Process], ready: object, period: float) -> None:
    """Poll `ready()` every `period` s until it is true or a process of the group has ended."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in group):
        if ready():  # type: ignore[operator]
            return
        time.sleep(period)


def _kill_point(rng: random.Random, store: RunStore, group: list[psutil.Process], log: Path, newest: int | None) -> str:
    """Wait for a random point of this attempt; returns its name. A start-up point trains no slot, so once few
    slots are left only those are drawn: the job cannot end before every kill has landed."""

    def logged(needle: bytes, count: int = 1) -> object:
        return lambda: log.exists() and log.read_bytes().count(needle) >= count

    mode = rng.random()
    if mode < 0.3 or STEPS - (newest or 0) <= 4:
        needle = rng.choice(START_UP)
        if needle is not None:
            _until(group, logged(needle), 0.005)
        return f"start-up:{needle.decode() if needle else 'at once'}"
    k = rng.randint(1, 2)  # the attempt's first or second checkpoint / trained slot
    if mode < 0.55:  # the instant this attempt's first shard file of that checkpoint lands
        folder = Path(store.full_path(layout.checkpoint_dir((newest or 0) + k)))
        old = set(os.listdir(folder)) if folder.is_dir() else set()  # left by a killed attempt

        def landed() -> bool:
            return folder.is_dir() and any(n.startswith("shard-") and n not in old for n in os.listdir(folder))

        _until(group, landed, 0.001)
        return f"first shard of checkpoint {(newest or 0) + k}"
    _until(group, logged(b"trained slot", k), 0.005)
    time.sleep(rng.uniform(0.0, 0.2))
    return f"after trained slot {(newest or 0) + k}"


def _reference_group(tmp_path: Path, config_path: Path, run_root: Path) -> RunStore:
    """The same learner group, uninterrupted, on copies of the job's committed batches in a fresh run root."""
    ref_root = tmp_path / "ref"
    for folder in (layout.BATCH_LOG, layout.BATCH_DATA):
        shutil.copytree(run_root / folder, ref_root / folder)
    job = RLJob(draccus.parse(RLJobConfig, config_path=str(config_path), args=[]), check_environments=False)
    learner = job.to_worker_configs()["learner"]
    learner = dataclasses.replace(learner, store=StoreConfig(run_root=str(ref_root)))
    learner_path = tmp_path / "ref-learner.yaml"
    learner_path.write_text(draccus.dump(learner))
    spec = StepSpec("learner", StepKind.LEARNER, str(learner_path), processes=learner.distributed.num_processes)
    group = LocalLauncher(LocalBackendConfig()).start(spec, log_target(str(ref_root), None, "learner"))
    deadline = time.monotonic() + 600
    while (rc := group.poll()) is None:
        assert time.monotonic() < deadline, "the reference learner group did not finish"
        time.sleep(0.05)
    assert rc == 0, f"the reference learner group failed (rc={rc}); logs under {ref_root / layout.LOGS}"
    return RunStore(str(ref_root))


def _check_resumes(store: RunStore, attempts: list[tuple[str, int | None, list[str]]]) -> list[int | None]:
    """Every attempt resumed, on both processes, from the newest checkpoint committed at its start, never from a
    folder without COMMITTED; returns the resume points."""
    for attempt, newest, half_written in attempts:
        for path in _logs(store, attempt):
            text = path.read_text(errors="replace")
            if m := re.search(r"resuming from checkpoint (\d+)", text):
                assert int(m.group(1)) == newest, f"{path.name} resumed from {m.group(1)}; newest was {newest}"
                assert layout.checkpoint_dir(int(m.group(1))) not in half_written
            elif "no checkpoint: initialising" in text:
                assert newest is None, f"{path.name} re-initialised although checkpoint {newest} was committed"
            else:  # killed before it chose
                assert "learner at step" not in text, path.name
    return [newest for _, newest, _ in attempts]


@dataclasses.dataclass(frozen=True)
class CrashedGroupRun:
    """A finished job whose two-process learner group was SIGKILLed at random points (`crashed_group_run`)."""

    root: Path
    config: Path
    kills: int
    points: list[str]
    attempts: list[tuple[str, int | None, list[str]]]
    """(attempt id, newest committed checkpoint and half-written checkpoint folders at its start), in order"""
    crash_s: float
    total_s: float


def crashed_group_run(tmp_path: Path) -> CrashedGroupRun:
    """The job of `_config` run by `python -m steps.run` under `tmp_path`, one process of its learner group
    SIGKILLed at a random point of each attempt until MIN_KILLS kills landed, then run to its end. Its processes
    see 2 simulated CPU devices each. Asserts the job ended with exit 0.

    The session fixture `learner_group_crash_run` (tests/conftest.py) runs it once for this test and for
    tests/test_replay_multiprocess.py (a two-process run to replay): one job, many assertions on what it left."""
    t0 = time.monotonic()
    run_root = tmp_path / "run"
    store = RunStore(str(run_root))
    config_path = _config(tmp_path, run_root)
    runner_log = tmp_path / "runner.log"  # a file, not a pipe: nobody reads while the kills go on
    rng = random.Random(2468)
    kills, seen, points = 0, set(), []
    attempts: list[tuple[str, int | None, list[str]]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLA_FLAGS", simulated_devices(2))
        mp.setenv("PYTHONHASHSEED", "0")
        runner = subprocess.Popen(
            [sys.executable, "-m", "steps.run", "--config_path", str(config_path)],
            cwd=ROOT,
            stdout=runner_log.open("w"),
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        while runner.poll() is None and kills < MIN_KILLS:
            found = _learner_group(runner, seen)
            if found is None:
                time.sleep(0.005)
                continue
            group, attempt = found
            seen.update(p.pid for p in group)
            newest = _newest_checkpoint(store)  # the previous attempt has ended: both its processes are reaped
            attempts.append((attempt, newest, half_written_checkpoints(store)))
            points.append(_kill_point(rng, store, group, _logs(store, attempt)[0], newest))
            victim = group[rng.randrange(2)]
            try:
                victim.send_signal(signal.SIGKILL)
                kills += 1
            except psutil.NoSuchProcess:  # the attempt ended on its own first
                points[-1] += " (ended first)"
            psutil.wait_procs(group, timeout=60)  # the runner kills the other one and reaps both
        crash_s = time.monotonic() - t0
        while runner.poll() is None and time.monotonic() - t0 < 900:  # the last attempt, undisturbed
            if (found := _learner_group(runner, seen)) is not None:
                seen.update(p.pid for p in found[0])
                attempts.append((found[1], _newest_checkpoint(store), half_written_checkpoints(store)))
            time.sleep(0.05)
        runner.wait(timeout=60)
    finally:
        if runner.poll() is None:
            runner.kill()
    assert runner.returncode == 0, runner_log.read_text()[-4000:]
    return CrashedGroupRun(run_root, config_path, kills, points, attempts, crash_s, time.monotonic() - t0)


@pytest.mark.slow
def test_sigkill_one_learner_process_job_restarts_group(
    learner_group_crash_run: CrashedGroupRun, tmp_path: Path, group_env: None
) -> None:
    run = learner_group_crash_run
    run_root, kills, points, attempts = run.root, run.kills, run.points, run.attempts
    store = RunStore(str(run_root))
    assert kills >= MIN_KILLS, f"only {kills} kills before the job ended; points: {points}"
    check_finished_run(store, num_steps=STEPS, max_lag=1, evaluated=False)

    resumed = _check_resumes(store, attempts)
    started = {p.name.removesuffix(".log") for p in (run_root / layout.LOGS / "learner").glob("*.log")}
    assert {a for a, _, _ in attempts} == {a for a in started if not a.endswith(".p1")}, "an attempt went unobserved"
    chain = check_checkpoint_lineage(store, STEPS)
    for step in chain:  # each written by both processes, in the sharded format
        rec = CommitMarker.from_json(store.get(layout.checkpoint_marker(step)), path=layout.checkpoint_marker(step))
        assert rec.format == "rlpipe-sharded-safetensors-v2" and sorted(rec.files) == ["p0", "p1"], rec

    ref = _reference_group(tmp_path, run.config, run_root)
    a, b = policy_arrays(store, STEPS), policy_arrays(ref, STEPS)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    half = {f for _, _, h in attempts for f in h}
    print(
        f"job with a two-process learner: {kills} kills at {points}; attempts resumed from {resumed}; lineage "
        f"{chain}; half-written checkpoint folders left by kills (never loaded) {sorted(half)}; "
        f"{run.crash_s:.0f} s under kills, {run.total_s:.0f} s for the job"
    )
