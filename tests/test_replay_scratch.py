"""`make replay` without `--scratch` trains into a temporary folder it names at the start and removes at the end;
`--keep_scratch true` keeps it (with the replayed policy in it). The kept replay is of a copy of the run with a
tampered batch slot: replay exits 10 (`Exit.REPLAY_MISMATCH`, not 1: a bug) with one line naming the first
differing tensor, and keeps its scratch folder all the same."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import FinishedJob, tamper_batch

from pipeline.process.exits import LABELS, Exit
from pipeline.store import layout
from pipeline.store.storage import RunStore

ROOT = Path(__file__).resolve().parents[1]


def _replay(
    run_root: Path, tmpdir: Path, *args: str, code: int = Exit.OK
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`python -m steps.replay` of slots 5..6 with TMPDIR set to `tmpdir`, exit code `code` (OK: "bitwise equal");
    the scratch folder it printed."""
    proc = subprocess.run(
        [sys.executable, "-m", "steps.replay", "--store.run_root", str(run_root), "--from_step", "4", *args],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmpdir)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("bitwise equal" in proc.stdout) == (code == Exit.OK), proc.stdout
    m = re.search(r"^scratch run root: (\S+)", proc.stdout, re.M)
    assert m is not None, proc.stdout
    return proc, Path(m.group(1).removeprefix("file://"))


@pytest.mark.slow
def test_replay_removes_its_scratch_folder_unless_kept(default_job: FinishedJob, tmp_path: Path) -> None:
    removed_tmp, kept_tmp = tmp_path / "tmp-removed", tmp_path / "tmp-kept"
    removed_tmp.mkdir()
    kept_tmp.mkdir()

    proc, scratch = _replay(default_job.root, removed_tmp)
    assert scratch.parent == removed_tmp, scratch  # a new temporary folder, named at the start
    assert "removed at the end" in proc.stdout
    assert not scratch.exists() and os.listdir(removed_tmp) == [], os.listdir(removed_tmp)
    assert "(removed)" in proc.stdout, proc.stdout

    tampered = tmp_path / "tampered"
    shutil.copytree(default_job.root, tampered)
    tamper_batch(RunStore(str(tampered)), 6)
    proc, scratch = _replay(tampered, kept_tmp, "--keep_scratch", "true", code=Exit.REPLAY_MISMATCH)
    assert scratch.parent == kept_tmp, scratch
    assert "removed at the end" not in proc.stdout and "(removed)" not in proc.stdout, proc.stdout
    assert (scratch / layout.policy_marker(6)).exists(), sorted(p.name for p in scratch.rglob("*"))
    # every differing tensor listed on stdout; one stderr line naming the first of them, no traceback
    assert "NOT equal to the run's committed policy 6" in proc.stdout, proc.stdout[-3000:]
    first = re.search(r"^  (.+?): max abs difference ", proc.stdout, re.M)
    assert first is not None, proc.stdout[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert errors == [ln for ln in errors if ln.startswith(f"error: {LABELS[Exit.REPLAY_MISMATCH]}: ")], errors
    assert len(errors) == 1 and f"first {first.group(1)}: max abs difference" in errors[0], errors
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
