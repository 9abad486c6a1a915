"""A bounded rollout worker (a scheduled job's `step rollout --follow false`, as docs/guides/gcs-and-ray.md writes
it) on a run with no policy yet waits at most `polling.bounded_wait_s`, then exits 0 with one line saying what is
missing: no traceback, no wait of `wait_for_policy_timeout_s` (600 s), nothing written under rollouts/."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from pipeline.store import layout

ROOT = Path(__file__).resolve().parents[1]


def test_bounded_rollout_worker_without_a_policy_exits_0_with_one_line(tmp_path: Path) -> None:
    run_root = tmp_path / "run"
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable, "-m", "steps.run", "step", "rollout", "--config_path", "configs/test_cats.yaml",
            "--run_root", str(run_root), "--worker_id", "job1", "--follow", "false", "--max_rollouts", "64",
            "--polling.bounded_wait_s", "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    wall = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "WaitTimeout" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "no committed policy yet" in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "polling.bounded_wait_s=1" in lines[0] and str(run_root / layout.policy_marker(0)) in lines[0], lines[0]
    assert "0 rows" in lines[0], lines[0]
    assert not [p for p in (run_root / layout.ROLLOUTS).rglob("*") if p.is_file()]  # nothing sampled, nothing written
    assert wall < 60, f"took {wall:.0f} s (waited longer than polling.bounded_wait_s?)"
