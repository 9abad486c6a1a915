"""End to end: the whole job (learner, BatchMaker, 2 rollout workers, evaluator) as real processes
through the job runner, on a local run root and on the GCS emulator."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from jobs import FinishedJob, check_finished_run, job_config, run_job

from pipeline.store import layout
from pipeline.store.storage import RunStore

STEP_NAMES = ("learner", "batches", "rollout-worker0", "rollout-worker1", "evaluate")


def check_step_logs(store: RunStore, output: str, num_steps: int, restarted: dict[str, int] | None = None) -> None:
    """Every step's output is under the run root as logs/<step>/<attempt>.log (one per start: a step restarted
    n times, `restarted[step]`, has n + 1), at the location the runner printed when it started the step; the
    learner's log holds its last step."""
    for name in STEP_NAMES:
        logs = store.list(f"{layout.LOGS}/{name}")
        assert len(logs) == 1 + (restarted or {}).get(name, 0), (name, logs)
        for log in logs:
            location = store.full_path(log) if store.is_local else f"{store.protocol}://{store.full_path(log)}"
            assert f"log: {location}" in output, location
    assert f"trained slot {num_steps} " in store.get(store.list(f"{layout.LOGS}/learner")[0]).decode()


def check_progress_lines(output: str, num_steps: int) -> None:
    """Without a terminal: a line at once, then exactly one progress line per learner step."""
    assert "job started:" in output
    steps = [int(m) for m in re.findall(rf"runner: learner step (\d+)/{num_steps} \(", output)]
    assert steps == list(range(1, num_steps + 1)), steps


@pytest.mark.slow
def test_job_runs_end_to_end_on_local_run_root(default_job: FinishedJob) -> None:
    """The test job as configs/test_cats.yaml has it (the session's `default_job`, run by `python -m steps.run`)."""
    store = RunStore(str(default_job.root))
    check_finished_run(store, num_steps=6, max_lag=1)
    check_step_logs(store, default_job.proc.stderr, 6)
    check_progress_lines(default_job.proc.stderr, 6)
    # the default local backend forked every step from its fork server (no silent fallback to fresh interpreters)
    forked = re.findall(r"started (\S+) \(steps\.\w+\) pid=\d+ \(forked\)", default_job.proc.stderr)
    assert sorted(forked) == sorted(STEP_NAMES), default_job.proc.stderr[-3000:]
    assert "fork server:" not in default_job.proc.stderr


@pytest.mark.slow
def test_job_runs_with_run_root_on_gcs_emulator(tmp_path: Path, gcs_endpoint) -> None:
    run_root = f"gs://{gcs_endpoint.bucket}/e2e-{os.getpid()}"
    cfg = job_config(
        tmp_path,
        run_root,
        gcs_endpoint.storage_options,
        # every step a fresh interpreter: the local backend's other way to start steps, end to end
        **{"train.num_train_steps": "3", "curriculum.eval_frequency": "3", "backend.fork_server": "false"},
    )
    proc = run_job(cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    store = RunStore(run_root, gcs_endpoint.storage_options)
    check_finished_run(store, num_steps=3, max_lag=1)
    check_step_logs(store, proc.stderr, 3)
    assert "(forked)" not in proc.stderr and "fork server" not in proc.stderr
    assert not (tmp_path / "run").exists()
