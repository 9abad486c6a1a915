"""Which exits of a step the job runner restarts: a refused configuration (exit 2) never; a step that could not
reach its run root's storage (exit 75) with backoff, not counted against `max_restarts`, until the outage has
lasted `STORAGE_OUTAGE_S`.

The steps are real processes of a test backend (a registered `JobBackendConfig`, the documented extension
point) whose launcher runs, at each start of a step, a process that exits with the next code of that step's
script.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import draccus
import pytest

from pipeline.config import JobBackendConfig, RLJobConfig
from pipeline.jobs import runner as runner_mod
from pipeline.jobs.job import RLJob
from pipeline.jobs.launchers.base import StepSpec
from pipeline.jobs.runner import JobRunner
from pipeline.jobs.step_logs import LogTarget
from pipeline.process.exits import Exit
from pipeline.process.step_kind import StepKind

ROOT = Path(__file__).resolve().parents[1]
SCRIPT: dict[str, list[int | None]] = {}
"""Step kind -> exit codes of its next starts (the last one repeats); None: the start runs until it is stopped."""
LOG_TEXT: dict[str, str] = {}
"""Step kind -> what each start of it writes into its log before exiting."""


@JobBackendConfig.register_subclass("scripted-test")
@dataclasses.dataclass(frozen=True)
class ScriptedBackendConfig(JobBackendConfig):
    launcher: ClassVar[str] = f"{__name__}:ScriptedLauncher"


class ScriptedLauncher:
    def __init__(self, config: ScriptedBackendConfig) -> None:
        del config

    def prepare(self, steps: Sequence[StepSpec]) -> None:
        pass

    def start(self, spec: StepSpec, log: LogTarget) -> subprocess.Popen[bytes]:
        codes = SCRIPT[spec.kind]
        code = codes.pop(0) if len(codes) > 1 else codes[0]
        if spec.kind in LOG_TEXT:
            path = Path(log.location)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(LOG_TEXT[spec.kind])
        program = "import time; time.sleep(120)" if code is None else f"import sys; sys.exit({code})"
        return subprocess.Popen([sys.executable, "-c", program])


def run_scripted(
    tmp_path: Path, script: dict[str, list[int | None]], log_text: dict[str, str] | None = None
) -> JobRunner:
    SCRIPT.clear()
    LOG_TEXT.clear()
    LOG_TEXT.update(log_text or {})
    SCRIPT.update({StepKind.BATCHMAKER: [0], StepKind.ROLLOUT: [0], StepKind.EVALUATE: [0], **script})
    cfg = draccus.parse(RLJobConfig, config_path=str(ROOT / "configs/test_cats.yaml"), args=[])
    cfg = dataclasses.replace(
        cfg,
        store=dataclasses.replace(cfg.store, run_root=str(tmp_path / "run")),
        backend=ScriptedBackendConfig(),
        max_restarts=0,
        restart_backoff_s=0.05,
    )
    runner = JobRunner(RLJob(cfg))
    runner.returncode = runner.run()  # type: ignore[attr-defined]
    return runner


def learner(runner: JobRunner) -> StepSpec:
    return next(s for s in runner.steps if s.kind == StepKind.LEARNER)


def test_storage_unavailable_steps_are_restarted_outside_max_restarts(tmp_path: Path) -> None:
    unavailable = Exit.STORAGE_UNAVAILABLE
    runner = run_scripted(tmp_path, {"learner": [unavailable, unavailable, unavailable, Exit.OK]})
    assert runner.returncode == Exit.OK  # type: ignore[attr-defined]
    assert learner(runner).exit_codes == [unavailable, unavailable, unavailable, Exit.OK]
    assert learner(runner).restarts == 0  # max_restarts 0 and still restarted


def test_a_refused_config_is_never_restarted(tmp_path: Path) -> None:
    runner = run_scripted(tmp_path, {"learner": [Exit.CONFIG, Exit.OK]})
    assert runner.returncode == Exit.CONFIG  # type: ignore[attr-defined]
    assert learner(runner).exit_codes == [Exit.CONFIG]


def test_a_refused_config_stops_the_job_at_once_printing_its_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reason = "curriculum.lessons.qa.env.env_args.path='/no/such.jsonl': no such file"
    log = f"2025 INFO steps.rollout: starting\nerror: invalid config: {reason}\n"
    with caplog.at_level("ERROR", logger="pipeline.jobs.runner"):
        # the learner runs until stopped: a learner done at once would end the job before the rollout's exit is read
        runner = run_scripted(tmp_path, {"rollout": [Exit.CONFIG, Exit.OK], "learner": [None]}, {"rollout": log})
    assert runner.returncode == Exit.CONFIG  # type: ignore[attr-defined]
    rollout = next(s for s in runner.steps if s.kind == StepKind.ROLLOUT)
    assert rollout.exit_codes == [Exit.CONFIG] and rollout.restarts == 0
    (line,) = [r.getMessage() for r in caplog.records if "refused its configuration" in r.getMessage()]
    assert reason in line and "not restarted" in line and runner.log_location(rollout.name) in line


def test_config_reason_is_the_last_config_error_line() -> None:
    assert runner_mod.config_reason("a\nerror: invalid config: x=1: bad\nb\n") == "invalid config: x=1: bad"
    tail = "Traceback ...\npipeline.config.base.ConfigError: y=2: worse\n"
    assert runner_mod.config_reason(tail) == "ConfigError: y=2: worse"
    assert runner_mod.config_reason("nothing here\n") is None


def test_a_crash_counts_against_max_restarts(tmp_path: Path) -> None:
    runner = run_scripted(tmp_path, {"learner": [Exit.FAILED, Exit.OK]})
    assert runner.returncode == Exit.FAILED  # type: ignore[attr-defined]
    assert learner(runner).exit_codes == [Exit.FAILED]


def test_an_outage_longer_than_the_bound_stops_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_mod, "STORAGE_OUTAGE_S", 1.0)
    runner = run_scripted(tmp_path, {"learner": [Exit.STORAGE_UNAVAILABLE]})
    assert runner.returncode == Exit.FAILED  # type: ignore[attr-defined]
    codes = learner(runner).exit_codes
    assert len(codes) >= 3 and set(codes) == {Exit.STORAGE_UNAVAILABLE}


def test_local_step_processes_share_the_accelerators(monkeypatch: pytest.MonkeyPatch) -> None:
    """JAX must not reserve most of a GPU in the first step process of a job (the others would run out of
    memory): local step processes get XLA_PYTHON_CLIENT_PREALLOCATE=false unless the user set it."""
    from pipeline.jobs.launchers.local import child_env

    spec, log = StepSpec("learner", StepKind.LEARNER, "cfg.yaml"), LogTarget("/tmp/run", None, "learner", "a1")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    env = child_env(spec, log)
    assert (env["XLA_PYTHON_CLIENT_PREALLOCATE"], env["RLPIPE_STEP"], env["RLPIPE_ATTEMPT"]) == (
        "false",
        "learner",
        "a1",
    )
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    assert child_env(spec, log)["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
