"""`make rollout` joining a running job: a second rollout worker process started against the run root of a running
job (the command `make rollout` runs, `python -m steps.run step rollout --config_path … --run_root …`) commits
rollout files under its own worker id, nothing of the job is restarted, and the job finishes normally."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from jobs import ROOT, check_finished_run, job_config, step_module

from pipeline.store import layout
from pipeline.store.storage import RunStore

STEPS = 12


def ready_files(run_root: Path, worker: str) -> list[Path]:
    return sorted((run_root / layout.ROLLOUTS).glob(f"step-*/{worker}.*{layout.READY_SUFFIX}"))


def _child(job: subprocess.Popen[str], module: str) -> psutil.Process | None:
    """The job's step process running `module`."""
    for child in psutil.Process(job.pid).children():
        try:
            if step_module(child.cmdline()) == module:
                return child
        except psutil.Error:
            pass
    return None


@pytest.mark.slow
def test_a_rollout_worker_joins_a_running_job(tmp_path: Path) -> None:
    """The job's learner is held (SIGSTOP) from its first published policy until the joiner has loaded a policy;
    then the job's own rollout worker is held until the joiner has committed a rollout file, so the learner needs
    the joiner's rows: the joiner, a fresh interpreter, joins while the job is running whatever the machine's load
    (the job, whose steps are forked, could otherwise train all its steps on its own worker's rows while the joiner
    is still compiling)."""
    run_root = tmp_path / "run"
    # room for a second worker: with pacing claims (the default) workers never generate past max_steps_ahead
    # batches together, so at the default of 1 the job's own worker, claiming first after each commit, would
    # leave a joiner nothing to do
    cfg = job_config(
        tmp_path,
        str(run_root),
        **{"num_rollout_workers": "1", "train.num_train_steps": str(STEPS), "pacing.max_steps_ahead": "3"},
    )
    job = subprocess.Popen([sys.executable, "-m", "steps.run", "--config_path", str(cfg)], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    joiner: subprocess.Popen[str] | None = None
    joiner_log = tmp_path / "joiner.log"
    held: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while (learner := _child(job, "steps.learn")) is None or not (run_root / layout.policy_marker(0)).exists():
            assert job.poll() is None, job.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the job published no policy in 300 s"
            time.sleep(0.05)
        learner.send_signal(signal.SIGSTOP)
        held = [learner]
        assert not (run_root / layout.LEARNER_DONE).exists()
        joiner = subprocess.Popen(
            [sys.executable, "-m", "steps.run", "step", "rollout", "--config_path", str(cfg), "--run_root",
             str(run_root), "--worker_id", "joiner"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=joiner_log.open("w"), text=True,
        )  # fmt: skip
        while "loaded policy" not in joiner_log.read_text():
            assert joiner.poll() is None, joiner_log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the joiner loaded no policy"
            time.sleep(0.05)
        worker0 = _child(job, "steps.rollout")
        assert worker0 is not None
        worker0.send_signal(signal.SIGSTOP)
        learner.send_signal(signal.SIGCONT)
        held = [worker0]
        while not ready_files(run_root, "joiner"):
            assert joiner.poll() is None, joiner_log.read_text()[-3000:]
            assert job.poll() is None and time.monotonic() < deadline, "the joiner committed no rollout file"
            time.sleep(0.05)
        worker0.send_signal(signal.SIGCONT)
        held = []
        out, err = job.communicate(timeout=600)
        assert job.returncode == 0, out[-3000:] + err[-3000:]
        joiner.wait(timeout=120)  # it stops on its own once the last policy is published
        assert joiner.returncode == 0, joiner_log.read_text()[-3000:]
    finally:
        for p in held:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass  # gone: the failure being raised says why
        for p in (job, joiner):
            if p is not None and p.poll() is None:
                p.kill()
    j_err = joiner_log.read_text()
    joined = ready_files(run_root, "joiner")
    assert joined, "the joining worker committed no rollout file:\n" + j_err[-3000:]
    assert all((run_root / layout.data_of_marker(str(p.relative_to(run_root)))).exists() for p in joined)
    store = RunStore(str(run_root))
    check_finished_run(store, num_steps=STEPS, max_lag=1)
    for name in ("learner", "batches", "rollout-worker0", "evaluate"):  # one attempt each: nothing restarted
        assert len(store.list(f"{layout.LOGS}/{name}")) == 1, (name, store.list(f"{layout.LOGS}/{name}"))
    assert "restart" not in err.lower(), err[-3000:]
