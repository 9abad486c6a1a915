"""The Ray backend runs the same step programs as Ray tasks on a local Ray cluster started by the test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from jobs import check_finished_run, job_config, run_job
from test_job_e2e import check_step_logs

from pipeline.process.exits import Exit
from pipeline.store.storage import RunStore


@pytest.mark.slow
def test_ray_backend_runs_the_same_steps(tmp_path: Path, gcs_endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole job as Ray tasks, its run root on gs:// (the GCS emulator): every step task reads and writes the
    bucket through the job's storage options, step logs included, and nothing is written locally. Its output,
    piped here (not a terminal), carries no ANSI colour codes."""
    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)  # the launcher's own default, not this environment's
    run_root = f"gs://{gcs_endpoint.bucket}/ray-{os.getpid()}"
    cfg = job_config(
        tmp_path,
        run_root,
        gcs_endpoint.storage_options,
        **{"backend.type": "ray", "train.num_train_steps": "3", "curriculum.eval_frequency": "3"},
    )
    proc = run_job(cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    store = RunStore(run_root, gcs_endpoint.storage_options)
    check_finished_run(store, num_steps=3, max_lag=1)
    check_step_logs(store, proc.stderr, 3)
    assert not (tmp_path / "run").exists()
    # the step output also reaches the driver (Ray's log_to_driver), and stopping the producers at the end is
    # a clean stop, not a failure
    assert "[learner] " in proc.stdout and "trained slot 3 " in proc.stdout, proc.stdout[-3000:]
    output = proc.stdout + proc.stderr
    assert "TaskCancelledError" not in output and "Traceback" not in output, output[-3000:]
    assert "exited with" not in output, [ln for ln in output.splitlines() if "exited with" in ln]
    assert "\x1b[" not in output, [ln for ln in output.splitlines() if "\x1b[" in ln][:5]
    for log in store.list("logs/learner") + store.list("logs/batches"):
        assert b"\x1b[" not in store.get(log), log


@pytest.mark.slow
def test_ray_backend_refuses_resources_the_cluster_cannot_hold(tmp_path: Path) -> None:
    """A step asking for a GPU on a CPU-only local cluster would wait forever: refused, naming `resources`."""
    cfg = job_config(tmp_path, str(tmp_path / "run"), **{"backend.type": "ray", "backend.resources.learner_gpus": "1"})
    proc = run_job(cfg, timeout=300)
    assert proc.returncode == Exit.CONFIG, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resources=" in proc.stderr and "GPUs" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "rollouts").exists()
