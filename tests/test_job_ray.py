"""The Ray backend runs the same step programs as Ray tasks on a local Ray cluster started by the test, and
restarts a step whose program was killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from jobs import ROOT, check_finished_run, job_config, run_job, step_module
from test_job_e2e import check_step_logs

from pipeline.process.exits import Exit
from pipeline.store import layout
from pipeline.store.storage import RunStore


def _descendant(job: subprocess.Popen[str], module: str, step: str | None = None) -> psutil.Process | None:
    """The process of the job's step program running `module` (the runner's descendant: under the Ray backend a
    child of a Ray worker of the local cluster the runner started), of step `step` (its `RLPIPE_STEP`) when given."""
    for p in psutil.Process(job.pid).children(recursive=True):
        try:
            if step_module(p.cmdline()) == module and (step is None or p.environ().get("RLPIPE_STEP") == step):
                return p
        except psutil.Error:
            pass
    return None


def _until(cond: Callable[[], Any], what: str, job: subprocess.Popen[str], timeout_s: float = 300) -> Any:
    """Poll `cond` until it is truthy (its value), failing if the job ends or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert job.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.1)
    return value


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one Ray cluster at a time: two starting together on 2 cores took minutes
def test_ray_backend_runs_the_same_steps(tmp_path: Path, gcs_endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole job as Ray tasks, its run root on gs:// (the GCS emulator): every step task reads and writes the
    bucket through the job's storage options, step logs included, and nothing is written locally. Its output,
    piped here (not a terminal), carries no ANSI colour codes.

    A step killed with SIGKILL is restarted: once a rollout worker has committed a rollout file, its program is
    SIGKILLed; the runner restarts it (a new program, a second log) and the job completes with the run's
    exactly-once invariants (`check_finished_run`). The learner is held (SIGSTOP) from the commit of policy 0
    until the restarted program runs, so the job cannot reach its end before the kill and the restart. The step
    programs run at the job runner's niceness (Ray's workers default to 15)."""
    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)  # the launcher's own default, not this environment's
    run_root = f"gs://{gcs_endpoint.bucket}/ray-{os.getpid()}"
    cfg = job_config(
        tmp_path,
        run_root,
        gcs_endpoint.storage_options,
        **{"backend.type": "ray", "train.num_train_steps": "3", "curriculum.eval_frequency": "3"},
    )
    store = RunStore(run_root, gcs_endpoint.storage_options)
    out_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    held: psutil.Process | None = None
    with out_path.open("w") as out, err_path.open("w") as err:
        job = subprocess.Popen([sys.executable, "-m", "steps.run", "--config_path", str(cfg)], cwd=ROOT,
                               stdout=out, stderr=err, text=True)  # fmt: skip
        try:
            # a Ray cluster's start and its actors' first imports (no fork server) took 4.5 min once under twice
            # CI's load beside another Ray test (now in one xdist group with it): a generous bound for this wait
            learner = _until(lambda: store.exists(layout.policy_marker(0)) and _descendant(job, "steps.learn"),
                             "learner holding policy 0", job, timeout_s=600)  # fmt: skip
            learner.send_signal(signal.SIGSTOP)
            held = learner
            # the step programs run at the runner's niceness, not Ray's worker default of 15 (beside other work
            # on the host they got a fraction of its CPU: 7x this test's time on a loaded 2-core VM)
            assert learner.nice() == psutil.Process(job.pid).nice(), (learner.nice(), psutil.Process(job.pid).nice())
            # and end with their actor's process, started from one of its threads (pipeline.process.parent_watch)
            assert learner.environ().get("RLPIPE_PARENT") == f"{learner.ppid()}:poll", learner.environ()
            assert not store.exists(layout.LEARNER_DONE), "the job ended before the learner was held"

            def committed() -> list[str]:
                return [f for f in store.list(layout.rollout_step_dir(0)) if f.endswith(layout.READY_SUFFIX)]

            # the victim is the first worker to commit: with the learner held, one worker may fill the pacing
            # window before the other has started (a loaded machine), and the other then rightly waits
            first = _until(committed, "a rollout file committed", job)[0]
            victim = "rollout-" + first.rsplit("/", 1)[-1].split(".", 1)[0]
            assert victim in ("rollout-worker0", "rollout-worker1"), first
            worker = _until(lambda: _descendant(job, "steps.rollout", victim), f"{victim}'s program", job)
            worker.send_signal(signal.SIGKILL)
            _until(lambda: (p := _descendant(job, "steps.rollout", victim)) is not None and p.pid != worker.pid,
                   f"restarted program of {victim}", job)  # fmt: skip
            learner.send_signal(signal.SIGCONT)
            held = None
            job.wait(timeout=600)
        finally:
            if held is not None:
                try:
                    held.send_signal(signal.SIGCONT)
                except psutil.Error:
                    pass  # gone: the failure being raised says why
            if job.poll() is None:  # a failure above: the runner stops its steps and its Ray cluster on SIGTERM
                job.terminate()
                try:
                    job.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    job.kill()
                    job.wait()
    stdout, stderr = out_path.read_text(), err_path.read_text()
    assert job.returncode == 0, stdout[-3000:] + stderr[-3000:]
    check_finished_run(store, num_steps=3, max_lag=1)
    check_step_logs(store, stderr, 3, restarted={victim: 1})
    assert not (tmp_path / "run").exists()
    # the kill is the one failure of the job, restarted once: the runner's record of it
    exits = [ln for ln in (stdout + stderr).splitlines() if "exited with" in ln]
    assert len(exits) == 1 and f"{victim} exited with -{int(signal.SIGKILL)} " in exits[0], exits
    assert "restart 1/" in exits[0], exits
    # the step output also reaches the driver (Ray's log_to_driver), and stopping the producers at the end is
    # a clean stop, not a failure
    assert "[learner] " in stdout and "trained slot 3 " in stdout, stdout[-3000:]
    output = stdout + stderr
    assert "TaskCancelledError" not in output and "Traceback" not in output, output[-3000:]
    assert "\x1b[" not in output, [ln for ln in output.splitlines() if "\x1b[" in ln][:5]
    for log in store.list("logs/learner") + store.list("logs/batches"):
        assert b"\x1b[" not in store.get(log), log


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one Ray cluster at a time: two starting together on 2 cores took minutes
def test_ray_backend_refuses_resources_the_cluster_cannot_hold(tmp_path: Path) -> None:
    """A step asking for a GPU on a CPU-only local cluster would wait forever: refused, naming `resources`, before
    a local cluster is started for nothing (Ray's own GPU detection, as its node start counts them)."""
    cfg = job_config(tmp_path, str(tmp_path / "run"), **{"backend.type": "ray", "backend.resources.learner_gpus": "1"})
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_OVERRIDE_RESOURCES")}
    proc = run_job(cfg, timeout=300, env={**env, "CUDA_VISIBLE_DEVICES": ""})  # no GPU, also on a host with one
    assert proc.returncode == Exit.CONFIG, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resources=" in proc.stderr and " and 0 GPUs;" in proc.stderr, proc.stderr[-3000:]
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "rollouts").exists()


def test_a_local_clusters_gpus_are_rays_own_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPUs counted before a local cluster starts are what Ray's node start would count: the visible devices
    cap the detected ones; a user's `RAY_OVERRIDE_RESOURCES` leaves the count to the cluster."""
    from ray._private import accelerators

    from pipeline.jobs.launchers.ray import local_gpus

    manager = accelerators.get_accelerator_manager_for_resource("GPU")
    detected = manager.get_current_node_num_accelerators() if manager is not None else 0
    monkeypatch.delenv("RAY_OVERRIDE_RESOURCES", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert local_gpus() == detected
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_gpus() == 0
    monkeypatch.setenv("RAY_OVERRIDE_RESOURCES", '{"GPU": 4}')
    assert local_gpus() is None


def test_a_local_cluster_that_does_not_start_is_started_again_then_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray waits a fixed 30 s for its node to register, which two suites side by side on 2 cores exceeded once: the
    start is tried `RAY_START_TRIES` times, each failed start's processes stopped, then one line (RayStartError, an
    expected failure). Ray's start is replaced here by one that starts a process and fails as Ray's does."""
    import ray

    from pipeline.jobs.launchers import ray as launcher
    from steps.cli import expected_failure

    started: list[subprocess.Popen[bytes]] = []

    def failing_init(**kwargs: Any) -> None:
        assert kwargs["_system_config"] == {"worker_niceness": os.getpriority(os.PRIO_PROCESS, 0)}
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        raise Exception(  # Ray's own words (ray/_private/node.py)
            "The current node timed out during startup. This could happen because some of the raylet failed to "
            "startup or the GCS has become overloaded."
        )

    monkeypatch.setattr(ray, "init", failing_init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(launcher.RayStartError) as refused:
        launcher.init_ray(None, 1.0, 0.0)
    assert len(started) == launcher.RAY_START_TRIES
    assert all(p.wait(timeout=30) == -signal.SIGKILL for p in started)  # each failed start's processes stopped
    assert expected_failure(refused.value) == (Exit.FAILED, str(refused.value))
    assert "backend.type=ray" in str(refused.value) and "\n" not in str(refused.value)
