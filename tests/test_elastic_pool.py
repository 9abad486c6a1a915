"""The elastic rollout pool (`rollout_pool:`, `pipeline.jobs.pool`): a real job whose runner adds rollout workers
while the learner waits for batches and removes them while the workers are paused by pacing, each decision
recorded under `pool/` in the run root, the run's exactly-once invariants intact (tests/invariants.py: every
committed rollout row of every worker, removed ones included, used, dropped with a reason or still usable); the
signal rules on their own; a pool config with min > max refused with one line before anything starts; the Ray
launcher starting and stopping a rollout worker the way the pool adds and removes one."""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from jobs import ROOT, check_finished_run, job_config, step_module

from pipeline.config.pacing import RolloutPoolConfig
from pipeline.jobs.pool import PoolSignals, decide, read_pool_records
from pipeline.process.exits import Exit
from pipeline.store import layout
from pipeline.store.storage import RunStore

STEPS = 30
POOL = {
    "rollout_pool.enabled": "true",
    "rollout_pool.min_workers": "1",
    "rollout_pool.max_workers": "3",
    "rollout_pool.scale_up_learner_wait": "0.2",
    "rollout_pool.scale_down_paused": "0.25",
    "rollout_pool.scale_down_waste": "100",  # only the pacing signal removes workers in this test
    # the time an added worker has to start and commit before the next decision (the default is 30 s): at 4 s a
    # loaded machine's slow learner left the new worker paused behind a full backlog, and the pool removed it
    "rollout_pool.cooldown_s": "15",
    "rollout_pool.window_s": "10",
}


def test_decide_follows_the_signals() -> None:
    """Up on a waiting learner (not while paused or wasteful), down on paused workers (not while the learner waits)
    or on waste, always within min..max; too few records decide nothing."""
    cfg = RolloutPoolConfig(enabled=True, min_workers=1, max_workers=3, scale_up_learner_wait=0.3,
                            scale_down_paused=0.5, scale_down_waste=0.5)  # fmt: skip
    waits = PoolSignals(learner_wait=0.6, paused=0.1, waste=0.1)
    assert decide(cfg, 1, waits).delta == +1  # type: ignore[union-attr]
    assert decide(cfg, 3, waits) is None  # at max_workers
    assert decide(cfg, 2, PoolSignals(0.6, 0.7, None)) is None  # conflicting signals: keep the pool
    paused = PoolSignals(learner_wait=0.05, paused=0.8, waste=None)
    assert decide(cfg, 2, paused).delta == -1  # type: ignore[union-attr]
    assert decide(cfg, 1, paused) is None  # at min_workers
    for learner_wait in (0.0, 0.9):  # rows dropped (a saturated lesson): more workers would only drop more
        wasteful = decide(cfg, 2, PoolSignals(learner_wait, 0.0, 0.9))
        assert wasteful is not None and wasteful.delta == -1 and "waste 0.90" in wasteful.reason
    assert decide(cfg, 2, PoolSignals(None, None, None)) is None


def test_pause_records_count_only_inside_the_window(tmp_path: Path) -> None:
    """A pause record covers the `paused_s` before its time: a worker that was paused long before the window (the
    last change) counts only the part inside it; learner idle is wait / (wait + train) over steps after the first."""
    from pipeline.jobs.pool import PoolSignalReader
    from pipeline.process.step_kind import StepKind
    from pipeline.telemetry.metrics import MetricsWriter

    store = RunStore(str(tmp_path / "run"))
    worker = MetricsWriter(store, StepKind.ROLLOUT, "worker0", flush_every=1)
    worker.log({"time": 1005.0, "event": "pause", "paused_s": 60.0})  # paused since 945: 5 s inside the window
    worker.log({"time": 1008.0, "event": "pause", "paused_s": 2.0})  # wholly inside
    worker.log({"time": 990.0, "event": "pause", "paused_s": 5.0})  # before the window: forgotten
    learner = MetricsWriter(store, StepKind.LEARNER, "learner", flush_every=1)
    for step, wait in ((1, 50.0), (2, 3.0), (3, 1.0)):  # the first step (start-up) is left out
        learner.log({"time": 1000.0 + step, "step": step, "wait_s": wait, "train_s": 1.0})
    signals = PoolSignalReader(store).read(since=1000.0, workers=2, now=1010.0)
    assert signals.paused == pytest.approx((5.0 + 2.0) / (10.0 * 2))
    assert signals.learner_wait == pytest.approx(4.0 / 6.0)
    assert signals.waste is None  # no BatchMaker records


def test_min_above_max_is_refused_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m steps.run` (its `cli`, in this process) refuses the pool before anything starts: exit 2, one
    line naming the field."""
    from steps.run import cli

    cfg = job_config(tmp_path, str(tmp_path / "run"))
    rc = cli(["--config_path", str(cfg), "--rollout_pool.enabled", "true", "--rollout_pool.min_workers", "3",
              "--rollout_pool.max_workers", "2"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == Exit.CONFIG, err[-2000:]
    errors = [line for line in err.splitlines() if "rollout_pool.max_workers" in line]
    assert len(errors) == 1 and "min_workers (3)" in errors[0], err[-2000:]
    assert not (tmp_path / "run" / layout.RUN_CONFIG).exists()  # refused before anything started


def _step_process(job: subprocess.Popen[str], module: str, config_name: str | None = None) -> psutil.Process | None:
    """The job's child process running `module` (with `config_name` in its command line, when given)."""
    for child in psutil.Process(job.pid).children():
        try:
            words = " ".join(child.cmdline())
            if step_module(child.cmdline()) == module and (config_name is None or config_name in words):
                return child
        except psutil.Error:
            pass
    return None


def _pool_events(run_root: Path) -> list[str]:
    return [r["event"] for r in read_pool_records(RunStore(str(run_root)))]


@pytest.mark.slow
def test_pool_scales_up_and_down_during_a_job(tmp_path: Path) -> None:
    """One worker at the start. Phase 1: worker0 is slowed down (SIGSTOP for 0.9 s of every second) until the pool
    adds a worker, so the learner waits for its batches; then worker0 is held until the added worker has committed a
    rollout file. Phase 2: the learner is held (SIGSTOP) until the pool removes a worker, so every worker pauses
    (ahead of the learner, or waiting for a newer policy). Then the job runs to its end."""
    run_root = tmp_path / "run"
    cfg = job_config(tmp_path, str(run_root), None, **{"num_rollout_workers": "1", "train.num_train_steps": str(STEPS),
                                                 "evaluator": "false", **POOL})  # fmt: skip
    job = subprocess.Popen([sys.executable, "-m", "steps.run", "--config_path", str(cfg)], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    held: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while (worker0 := _step_process(job, "steps.rollout", "worker0.yaml")) is None or not (
            run_root / layout.batch_log_entry(2)
        ).exists():  # every step has started (compiled) and trained
            assert job.poll() is None and time.monotonic() < deadline, "the job committed no second batch"
            time.sleep(0.05)
        while "up" not in _pool_events(run_root):  # phase 1: a slow worker
            assert job.poll() is None and time.monotonic() < deadline, "the pool added no worker"
            # stopped 90% of the time: on a loaded machine the learner is slow too, and at 70% it kept up
            worker0.send_signal(signal.SIGSTOP)
            held = [worker0]
            time.sleep(0.9)
            worker0.send_signal(signal.SIGCONT)
            held = []
            time.sleep(0.1)
        added = next(r["step"] for r in read_pool_records(RunStore(str(run_root))) if r["event"] == "up")
        # worker0 held until the added worker has committed a file: the learner then cannot finish the run on
        # worker0's rows alone while the added worker is still starting (imports, compile: slow on a loaded machine)
        worker0.send_signal(signal.SIGSTOP)
        held = [worker0]
        while not list((run_root / layout.ROLLOUTS).glob(f"step-*/{added.removeprefix('rollout-')}.*")):
            assert job.poll() is None and time.monotonic() < deadline, f"{added} committed no rollout file"
            time.sleep(0.1)
        worker0.send_signal(signal.SIGCONT)
        held = []
        learner = _step_process(job, "steps.learn")
        assert learner is not None
        learner.send_signal(signal.SIGSTOP)  # phase 2: a learner that does not consume
        held = [learner]
        while "down" not in _pool_events(run_root):
            assert job.poll() is None and time.monotonic() < deadline, "the pool removed no worker"
            time.sleep(0.2)
        learner.send_signal(signal.SIGCONT)
        held = []
        out, err = job.communicate(timeout=300)
    finally:
        for p in held:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass  # gone: the failure being raised says why
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-3000:] + err[-3000:]
    store = RunStore(str(run_root))
    check_finished_run(store, num_steps=STEPS, max_lag=1, evaluated=False)  # exactly-once (I1-I4), no row lost

    records = read_pool_records(store)
    events = [r["event"] for r in records]
    assert events[0] == "start" and records[0]["workers"] == 1 and events[-1] == "end", records
    ups = [r for r in records if r["event"] == "up"]
    downs = [r for r in records if r["event"] == "down"]
    assert ups and downs, (events, err[-4000:])
    # each decision was taken on the signal its rule names, and the pool stayed within its bounds
    assert all(r["learner_wait"] >= 0.2 and (r["paused"] or 0) < 0.25 for r in ups), ups
    assert all(r["paused"] >= 0.25 and (r["learner_wait"] or 0) < 0.2 for r in downs), downs
    sizes = [r["workers"] for r in records if r["event"] in ("start", "up", "down")]
    assert all(1 <= n <= 3 for n in sizes), records
    assert all(abs(b - a) == 1 for a, b in itertools.pairwise(sizes)), sizes  # one worker per change
    assert f"rollout pool: added {ups[0]['step']} -> 2 workers" in err, err[-3000:]

    # each added worker got a fresh id; a removed one stopped cleanly (SIGTERM, exit 0), its committed files kept
    names = [r["step"] for r in ups]
    assert len(set(names)) == len(names) and "rollout-worker0" not in names, names
    for name in {r["step"] for r in downs}:
        log = store.get(store.list(f"{layout.LOGS}/{name}")[-1]).decode()
        assert "stopped (" in log, log[-2000:]
        assert f"{name} left the rollout pool (exit 0)" in err, err[-3000:]
    ready = {p.name.split(".")[0] for p in (run_root / layout.ROLLOUTS).glob(f"step-*/*{layout.READY_SUFFIX}")}
    assert names[0].removeprefix("rollout-") in ready, ready  # the first added worker produced
    assert "killing it" not in err


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one Ray cluster at a time: two starting together on 2 cores took minutes
def test_ray_launcher_starts_and_stops_a_rollout_worker(tmp_path: Path) -> None:
    """What the pool does on a Ray backend: `RayLauncher.prepare` with the pool's headroom checks the cluster for
    max_workers, `start` runs a rollout worker in an actor, `terminate` (SIGTERM) stops it and frees the actor. (The
    run root has no policy: the worker waits for one, so its exit code is not asserted; the local job test checks
    a removed worker's clean exit.)"""
    import draccus

    from pipeline.config import RLJobConfig
    from pipeline.jobs.job import RLJob
    from pipeline.jobs.launchers.ray import RayLauncher
    from pipeline.jobs.runner import JobRunner
    from pipeline.jobs.step_logs import log_target

    ray = pytest.importorskip("ray")
    cfg_path = job_config(tmp_path, str(tmp_path / "run"), None, **{"num_rollout_workers": "1", **POOL})
    cfg = draccus.parse(RLJobConfig, config_path=str(cfg_path), args=[])
    runner = JobRunner(RLJob(draccus.decode(RLJobConfig, {**draccus.encode(cfg), "backend": {"type": "ray"}})))
    assert isinstance(runner.launcher, RayLauncher)
    headroom = runner._pool_headroom()
    assert [s.name for s in headroom] == ["rollout-worker1", "rollout-worker2"]
    try:
        runner.launcher.prepare(runner.steps + headroom)
        spec = runner.job.rollout_config(7)
        assert spec.worker_id == "worker7"
        step = next(s for s in runner.steps if s.name == "rollout-worker0")
        proc = runner.launcher.start(step, log_target(str(tmp_path / "run"), {}, step.name))
        time.sleep(3.0)  # running (it waits for a first policy)
        assert proc.poll() is None
        proc.terminate()
        # SIGTERM stops the worker after its current phase: on a loaded CI machine its start-up (imports, model
        # build, sampler compile) can itself take a minute before it reaches the wait it leaves at once
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is not None, "the rollout worker's actor did not stop on SIGTERM"
        while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
            time.sleep(0.2)  # the actor is killed asynchronously
        assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"], "the actor was not freed"
    finally:
        ray.shutdown()
