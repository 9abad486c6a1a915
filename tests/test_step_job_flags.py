"""`python -m steps.run step NAME` with a flag of a job field the step's config does not have (a lesson field for
`step learn`): it overrides the job config, so an unknown lesson id is one line naming the known ids (exit 2,
nothing created) instead of draccus's `unrecognized arguments`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipeline.jobs.job import RLJob
from pipeline.process.exits import Exit
from pipeline.process.step_kind import StepKind
from steps.run import parse_job, split_step_args

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/test_cats.yaml"


def test_step_learn_with_an_unknown_lesson_id_names_the_known_ids(tmp_path: Path) -> None:
    run_root = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable, "-m", "steps.run", "step", "learn", "--config_path", CONFIG, "--run_root", str(run_root),
            "--max_steps", "1", "--curriculum.lessons.dogs.chat", "true",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == Exit.CONFIG, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "curriculum.lessons.dogs.chat" in lines[0] and "known ids: cats" in lines[0], lines[0]
    assert "unrecognized" not in lines[0]
    assert not run_root.exists()  # refused before anything was written


def test_job_fields_a_step_lacks_go_to_the_job_config() -> None:
    job = RLJob(parse_job(["--config_path", str(ROOT / CONFIG)]))
    args = [
        "--max_steps",
        "1",
        "--curriculum.lessons.cats.chat",
        "true",
        "--train.seq_len=32",
        "--pacing.max_steps_ahead=2",
    ]
    to_job, to_step = split_step_args(job, StepKind.LEARNER, args)
    assert to_job == ["--curriculum.lessons.cats.chat", "true", "--pacing.max_steps_ahead=2"]
    assert to_step == ["--max_steps", "1", "--train.seq_len=32"]
    # the rollout worker's config has a curriculum of its own: the lesson flag stays a step override
    to_job, to_step = split_step_args(job, StepKind.ROLLOUT, ["--curriculum.lessons.cats.chat", "true"])
    assert to_job == [] and to_step == ["--curriculum.lessons.cats.chat", "true"]
    # and the job parsed with the learner's job flags has the lesson field set
    assert (
        RLJob(parse_job(["--config_path", str(ROOT / CONFIG), *split_step_args(job, StepKind.LEARNER, args)[0]]))
        .config.curriculum.lessons["cats"]
        .chat
    )
