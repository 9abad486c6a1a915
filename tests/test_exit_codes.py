"""One error shape everywhere: every step program ends an expected failure with one stderr line
`error: <label>: <what>` and its code from the one table (`pipeline.process.exits`, docs/reference/exit-codes.md),
and the same condition gives the same code and line through every entry point (`python -m steps.<module>`,
`python -m steps.run step <name>`, `python -m steps.run` for the job where the condition applies).

The subprocess tests run the real programs on real run roots; the conditions are real (a lease held by a live
process that renews it, a regular file as run root, a bad flag) or made through the documented fault-injection
hook (`RLPIPE_INJECT_STORAGE_FAULT`, `pipeline.store.faults`: the tests run as root, so `chmod a-w` would not make
a run root read-only).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import sys
from pathlib import Path

import draccus
import pytest

from pipeline.config import ConfigError, RLJobConfig
from pipeline.jobs.job import RLJob
from pipeline.jobs.step_logs import read_reason, reason_path
from pipeline.process.exits import (
    LABELS,
    DamagedInputError,
    Exit,
    LearningCheckError,
    NoProgressError,
    ReplayMismatchError,
    StorageFaultError,
)
from pipeline.process.step_kind import StepKind
from pipeline.store.committed import StorageUnavailableError
from pipeline.store.faults import FAULT_INJECTION_ENV
from pipeline.store.lease import Lease, LeaseHeldError, LeaseLostError
from pipeline.store.poll import WaitTimeout
from pipeline.store.storage import RunStore
from steps.cli import run_command

ROOT = Path(__file__).resolve().parents[1]
TEST_CONFIG = ROOT / "configs/test_cats.yaml"


# ---------------------------------------------------------------------------------------------- the table, in process
def _boom(error: BaseException) -> int:
    raise error


def _wrapped(inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as e:
            raise RuntimeError("a step's thread failed") from e
    except RuntimeError as outer:
        return outer


CASES = [
    (DamagedInputError("batches/data/step-1-x.parquet", "sha256 differs from its log entry"), Exit.DAMAGED_INPUT),
    (StorageFaultError("/r/policies/step-1/x", "No space left on device (ENOSPC)"), Exit.STORAGE_FAULT),
    (NoProgressError("lesson 'cats': nothing generated"), Exit.NO_PROGRESS),
    (ReplayMismatchError("policy 6 differs in 3 tensors; first .w: max abs difference 1e-3"), Exit.REPLAY_MISMATCH),
    (LearningCheckError("end reward 0.086 < 3 x start reward 0.086"), Exit.LEARNING_CHECK),
    (LeaseHeldError("maker-A", 12.0, "batchmaker", 3), Exit.LEASE_HELD),
    (LeaseLostError("lease 'batchmaker' epoch 3 lost"), Exit.LEASE_LOST),
    (WaitTimeout("waited 3.0s (> train.max_batch_latency_s=3) for x"), Exit.TIMEOUT),
    (StorageUnavailableError("gs://b/run", "connection refused"), Exit.STORAGE_UNAVAILABLE),
    (OSError(errno.ENOSPC, "No space left on device", "/r/batches/data/x.parquet"), Exit.STORAGE_FAULT),
    (OSError(errno.EROFS, "Read-only file system", "/r/rollouts/step-0/w.parquet"), Exit.STORAGE_FAULT),
    (ConfigError("max_rollouts", -5, "must be >= 1 or null"), Exit.CONFIG),
]


@pytest.mark.parametrize("wrap", [False, True], ids=["raised", "as-cause"])
@pytest.mark.parametrize(("error", "code"), CASES, ids=[type(e).__name__ + str(int(c)) for e, c in CASES])
def test_every_expected_failure_is_one_line_and_its_code(
    error: BaseException, code: Exit, wrap: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    raised = _wrapped(error) if wrap else error
    assert run_command(lambda args: raised, _boom, []) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {LABELS[code]}: "), err
    assert "Traceback" not in err[0]
    if isinstance(error, OSError) and error.filename:
        assert str(error.filename) in err[0]  # names the path


def test_the_documented_table_is_the_table() -> None:
    """docs/reference/exit-codes.md lists every code of `Exit` with its label (`LABELS`; code 0 has none), one row
    each, and no other: a code added to one and not the other fails here, and so does a reused code (1 for a
    check that failed: it means a bug)."""
    import re

    text = (ROOT / "docs/reference/exit-codes.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+?) \|", text, re.M)
    documented = [(int(code), label.strip()) for code, label in rows]
    assert len({code for code, _ in documented}) == len(documented), documented
    assert dict(documented) == {int(c): LABELS.get(c, "—") for c in Exit}, documented
    assert len(set(LABELS.values())) == len(LABELS)  # one meaning per code


def test_a_bug_is_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(KeyError):
        run_command(lambda args: KeyError("x"), _boom, [])
    with pytest.raises(OSError):  # an OSError that is not a storage fault is a bug too
        run_command(lambda args: OSError(errno.EBADF, "Bad file descriptor", "/x"), _boom, [])


def test_under_the_job_runner_the_line_is_also_kept_off_the_run_root(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The job runner reads it when the step log could not be written (a full run root)."""
    monkeypatch.setenv("RLPIPE_STEP", "learner")
    monkeypatch.setenv("RLPIPE_ATTEMPT", "20250101T000000Z-abcdef12")
    error = StorageFaultError("/r/policies/step-00000003/model.safetensors", "No space left on device (ENOSPC)")
    assert run_command(lambda args: error, _boom, []) == Exit.STORAGE_FAULT
    printed = capsys.readouterr().err.strip()
    from pipeline.jobs.step_logs import LogTarget

    target = LogTarget("/r", None, "learner", "20250101T000000Z-abcdef12")
    assert os.path.exists(reason_path("learner", "20250101T000000Z-abcdef12"))
    assert f"error: {read_reason(target)}" == printed
    assert read_reason(target) is None  # consumed


# ---------------------------------------------------------------------------------------------- real programs
def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one `error: …` line of a finished program (exactly one, no traceback)."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def _step_config_yaml(tmp_path: Path, root: Path, step: StepKind) -> Path:
    """The config the job gives `step` on `root` (as the job runner writes it), for `python -m <step module>`."""
    cfg = draccus.parse(RLJobConfig, config_path=str(TEST_CONFIG), args=[])
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, run_root=str(root)))
    config = RLJob(cfg).to_worker_configs()[step.job_name]
    path = tmp_path / f"{step.job_name}.yaml"
    path.write_text(str(draccus.dump(config[0] if isinstance(config, list) else config)))
    return path


def _job_step(root: Path, name: str, *flags: str) -> list[str]:
    return ["steps.run", "step", name, "--config_path", str(TEST_CONFIG), "--run_root", str(root), *flags]


def test_a_held_lease_is_the_same_code_and_line_through_every_entry_point(tmp_path: Path, held_lease: Path) -> None:
    root = held_lease
    via_run = _run(_job_step(root, "batches", "--max_batches", "1"))
    assert via_run.returncode == Exit.LEASE_HELD, via_run.stderr[-3000:]
    config = _step_config_yaml(tmp_path, root, StepKind.BATCHMAKER)
    via_module = _run(["steps.make_batches", "--config_path", str(config)])
    assert via_module.returncode == Exit.LEASE_HELD, via_module.stderr[-3000:]
    for proc in (via_run, via_module):
        line = _error_line(proc)
        assert line.startswith("error: lease held: lease 'batchmaker'") and "'maker-A'" in line


def test_a_held_gc_lease_is_exit_lease_held(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert _run(_job_step(root, "batches", "--max_batches", "1", "--polling.bounded_wait_s", "0.5")).returncode == 0
    lease = Lease(RunStore(str(root)), "gc", "gc-other", ttl_s=120.0)
    lease.acquire()
    try:
        proc = _run(["steps.gc", "--store.run_root", str(root)])
    finally:
        lease.release()
    assert proc.returncode == Exit.LEASE_HELD, proc.stderr[-3000:]
    assert "'gc-other'" in _error_line(proc)


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--max_rollouts", "-5"], "max_rollouts=-5"),
        (["--max_seconds", "0"], "max_seconds=0"),
        (["--curriculum.lessons.cats.env.env_class", "no.such.Env"], "curriculum.lessons.cats.env.env_class"),
    ],
    ids=["negative-max_rollouts", "zero-max_seconds", "unknown-env-class"],
)
def test_a_meaningless_rollout_config_is_exit_2_through_every_entry_point(
    tmp_path: Path, flags: list[str], field: str
) -> None:
    root = tmp_path / "run"
    config = _step_config_yaml(tmp_path, root, StepKind.ROLLOUT)
    lines = []
    for args in (_job_step(root, "rollout", *flags), ["steps.rollout", "--config_path", str(config), *flags]):
        proc = _run(args)
        assert proc.returncode == Exit.CONFIG, proc.stderr[-3000:]
        line = _error_line(proc)
        assert line.startswith("error: invalid config: ") and field in line
        lines.append(line)
    assert lines[0] == lines[1]
    assert not (root / "rollouts").exists()  # refused before anything started


def test_a_run_root_that_is_a_file_is_exit_2_through_every_entry_point(tmp_path: Path) -> None:
    """Found before anything starts (the run root field names a file): a config error, not a storage fault."""
    root = tmp_path / "run"
    root.write_text("not a folder")
    config = _step_config_yaml(tmp_path, root, StepKind.BATCHMAKER)
    runs = [
        _run(_job_step(root, "batches", "--max_batches", "1")),
        _run(["steps.make_batches", "--config_path", str(config)]),
        _run(["steps.run", "--config_path", str(TEST_CONFIG), "--run_root", str(root)]),
    ]
    for proc in runs:
        assert proc.returncode == Exit.CONFIG, proc.stderr[-3000:]
        assert _error_line(proc) == f"error: invalid config: store.run_root={str(root)!r}: is a file, not a folder"
    assert root.read_text() == "not a folder"


def test_a_read_only_run_root_is_exit_8_through_every_entry_point(tmp_path: Path) -> None:
    """The tests run as root (`chmod a-w` does not stop root's writes), so EROFS comes from the fault hook, which
    fails the real write path of the real program."""
    root = tmp_path / "run"
    ok = _run(_job_step(root, "batches", "--max_batches", "1", "--polling.bounded_wait_s", "0.5"))
    assert ok.returncode == 0, ok.stderr[-3000:]  # run.json exists: only the storage refuses from now on
    env = {FAULT_INJECTION_ENV: "EROFS:"}
    config = _step_config_yaml(tmp_path, root, StepKind.BATCHMAKER)
    via_module = ["steps.make_batches", "--config_path", str(config)]
    for args in (_job_step(root, "batches", "--max_batches", "1"), via_module):
        proc = _run(args, env)
        assert proc.returncode == Exit.STORAGE_FAULT, proc.stderr[-3000:]
        line = _error_line(proc)
        assert line.startswith(f"error: storage fault: {root}/") and "Read-only file system" in line, line
        assert "(EROFS)" in line


def test_a_learner_whose_batch_never_comes_is_exit_4_through_every_entry_point(tmp_path: Path) -> None:
    root = tmp_path / "run"
    flags = ["--cadence.batch_wait_timeout_s", "1"]
    via_run = _run(_job_step(root, "learn", *flags))
    config = _step_config_yaml(tmp_path, root, StepKind.LEARNER)
    via_module = _run(["steps.learn", "--config_path", str(config), *flags])
    for proc in (via_run, via_module):
        assert proc.returncode == Exit.TIMEOUT, proc.stderr[-3000:]
        line = _error_line(proc)
        assert line.startswith("error: timed out: waited ") and "cadence.batch_wait_timeout_s=1" in line
        assert line.endswith(f"{root}/batches/log/step-00000001.json")


@pytest.mark.parametrize("case", ["not a run", "unknown flag"])
def test_the_report_refuses_in_one_line_with_exit_2(tmp_path: Path, case: str) -> None:
    """`python -m pipeline.report` on a folder that holds no run, or with an unknown flag (argparse's error): one
    line `error: invalid config: …` naming the cause, exit 2, no traceback, nothing written (a run root that does
    not exist: tests/test_run_safety.py)."""
    root = tmp_path / "not-a-run"
    root.mkdir()
    args = [str(root)] if case == "not a run" else [str(root), "--outt", "x"]
    proc = _run(["pipeline.report", *args])
    assert proc.returncode == Exit.CONFIG, proc.stderr[-3000:]
    line = _error_line(proc)
    assert line.startswith(f"error: {LABELS[Exit.CONFIG]}: "), line
    assert (str(root) if case == "not a run" else "--outt") in line, line
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert list(root.iterdir()) == []
