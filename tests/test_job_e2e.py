"""End to end: the whole job (learner, BatchMaker, 2 rollout workers, evaluator) as real processes
through the job runner, on a local run root and on the GCS emulator."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from jobs import check_finished_run, job_config, run_job

from pipeline.storage import RunStore


@pytest.mark.slow
def test_job_runs_end_to_end_on_local_run_root(tmp_path: Path) -> None:
    run_root = tmp_path / "run"
    proc = run_job(job_config(tmp_path, str(run_root)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_finished_run(RunStore(str(run_root)), num_steps=6, max_lag=1)


@pytest.mark.slow
def test_job_runs_with_run_root_on_gcs_emulator(tmp_path: Path, gcs_endpoint) -> None:
    run_root = f"gs://{gcs_endpoint.bucket}/e2e-{os.getpid()}"
    cfg = job_config(
        tmp_path,
        run_root,
        gcs_endpoint.storage_options,
        **{"train.num_train_steps": "3", "curriculum.eval_frequency": "3"},
    )
    proc = run_job(cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_finished_run(RunStore(run_root, gcs_endpoint.storage_options), num_steps=3, max_lag=1)
