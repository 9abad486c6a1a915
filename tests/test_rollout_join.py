"""`make rollout` joining a running job: a second rollout worker process started against the run root of a running
job (the command `make rollout` runs, `python -m steps.run step rollout --config_path … --run_root …`) commits
rollout files under its own worker id, nothing of the job is restarted, and the job finishes normally."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import ROOT, check_finished_run, job_config

from pipeline import layout
from pipeline.storage import RunStore

STEPS = 12


def ready_files(run_root: Path, worker: str) -> list[Path]:
    return sorted((run_root / layout.ROLLOUTS).glob(f"step-*/{worker}.*{layout.READY_SUFFIX}"))


@pytest.mark.slow
def test_a_rollout_worker_joins_a_running_job(tmp_path: Path) -> None:
    run_root = tmp_path / "run"
    cfg = job_config(tmp_path, str(run_root), **{"num_rollout_workers": "1", "train.num_train_steps": str(STEPS)})
    job = subprocess.Popen([sys.executable, "-m", "steps.run", "--config_path", str(cfg)], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    joiner: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + 300
        while not (run_root / layout.RUN_CONFIG).exists():  # the job is running: its runner wrote run.json
            assert job.poll() is None, job.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the job wrote no run.json in 300 s"
            time.sleep(0.2)
        assert not (run_root / layout.LEARNER_DONE).exists()
        joiner = subprocess.Popen(
            [sys.executable, "-m", "steps.run", "step", "rollout", "--config_path", str(cfg), "--run_root",
             str(run_root), "--worker_id", "joiner"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        out, err = job.communicate(timeout=600)
        assert job.returncode == 0, out[-3000:] + err[-3000:]
        j_out, j_err = joiner.communicate(timeout=120)  # it stops on its own once the last policy is published
        assert joiner.returncode == 0, j_out[-3000:] + j_err[-3000:]
    finally:
        for p in (job, joiner):
            if p is not None and p.poll() is None:
                p.kill()
    joined = ready_files(run_root, "joiner")
    assert joined, "the joining worker committed no rollout file:\n" + j_err[-3000:]
    assert all((run_root / layout.data_of_marker(str(p.relative_to(run_root)))).exists() for p in joined)
    store = RunStore(str(run_root))
    check_finished_run(store, num_steps=STEPS, max_lag=1)
    for name in ("learner", "batches", "rollout-worker0", "evaluate"):  # one attempt each: nothing restarted
        assert len(store.list(f"{layout.LOGS}/{name}")) == 1, (name, store.list(f"{layout.LOGS}/{name}"))
    assert "restart" not in err.lower(), err[-3000:]
