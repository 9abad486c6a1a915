"""Every step program's command line (steps/cli.py): a bad config is ONE stderr line naming the field and the value,
with exit code 2 and no traceback, before anything is written; the programs run as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.process.exits import Exit

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs/test_cats.yaml")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def assert_refused(proc: subprocess.CompletedProcess[str], *needles: str, alone: bool = True) -> None:
    """Exit code 2, no traceback, one error line naming `needles`; with `alone`, nothing else on stderr (the config
    never parsed); else the error is the last line (the program logged its config, then refused it)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == Exit.CONFIG, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [ln for ln in lines if "error" in ln.lower()] == lines[-1:], proc.stderr[-3000:]
    assert len(lines) == 1 or not alone, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])


def test_out_of_range_value_is_one_line_naming_field_and_value(tmp_path: Path) -> None:
    assert_refused(run("steps.learn", "--store.run_root", str(tmp_path / "run"), "--train.max_lag", "-1"),
                   "train.max_lag", "-1")  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_missing_config_file_is_one_line_naming_the_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-config.yaml")
    assert_refused(run("steps.learn", "--config_path", missing), missing)


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("steps.make_batches", "--train.batch_size", "0"), ("train.batch_size", "0")),
        (("steps.evaluate", "--train.max_lag", "1"), ("unrecognized arguments", "--train.max_lag")),
        (("steps.learn", "--tracker.type", "mlflow"), ("tracker.type", "mlflow")),
        (("steps.learn", "--train.max_lag", "many"), ("train.max_lag", "many")),
    ],
)
def test_step_programs_refuse_bad_values_in_one_line(args: tuple[str, ...], needles: tuple[str, ...]) -> None:
    assert_refused(run(*args), *needles)


def test_export_without_run_json_names_the_run_root(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    assert_refused(run("steps.export", "--store.run_root", root, "--step", "0"), "store.run_root", root, "run.json",
                   alone=False)  # fmt: skip


def test_job_runner_refuses_in_one_line_before_writing_anything(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert_refused(run("steps.run", "--config_path", CONFIG, "--run_root", str(root), "--train.max_lag", "-1"),
                   "train.max_lag", "-1")  # fmt: skip
    step_args = ["step", "learn", "--config_path", CONFIG, "--run_root", str(root), "--cadence.policy_interval", "0"]
    assert_refused(run("steps.run", *step_args), "cadence.policy_interval", "0")
    assert not root.exists()
