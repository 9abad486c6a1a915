"""Command-line overrides as docs/guides/configuration.md documents them (pipeline/config/overrides.py, applied by
steps/cli.py's parse for every step program and `steps.run`): switching a choice (`--loss.type gspo`) starts from
the new type's defaults, with the file's other fields named in one log line; a lesson's fields can be set with
`--curriculum.lessons.<id>.<field> value`. Parsed through the real parse functions with the shipped configs; no job
runs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shipped import JOB_CONFIGS, without_init_policy

from pipeline.config import (
    CISPOLossConfig,
    GSPOLossConfig,
    LevanterInferenceConfig,
    PPOClipLossConfig,
    RLJobConfig,
    RLOOLossConfig,
)
from pipeline.jobs.job import RLJob
from pipeline.process.exits import Exit
from pipeline.process.step_kind import StepKind
from steps.cli import UsageError, parse_config
from steps.run import parse_args, parse_job, step_config

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = JOB_CONFIGS
TEST_CATS = str(ROOT / "configs/test_cats.yaml")


def job(*args: str, config: str = TEST_CATS) -> RLJobConfig:
    return parse_config(RLJobConfig, ["--config_path", str(ROOT / config), *args])


@pytest.mark.parametrize("config", SHIPPED)
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--loss.type", "ppo"), PPOClipLossConfig()),
        (("--loss.type", "gspo", "--loss.aggregation", "sequence"), GSPOLossConfig()),
        (("--loss.type", "gspo"), GSPOLossConfig()),
        (("--loss.type", "cispo"), CISPOLossConfig()),
    ],
)
def test_a_loss_switch_starts_from_the_new_types_defaults(config: str, args: tuple[str, ...], expected: object) -> None:
    parsed = job(*args, config=config)
    assert parsed.loss == expected
    RLJob(without_init_policy(parsed))  # the whole-job validation accepts it too


def test_flags_after_a_switch_apply_on_top_of_its_defaults() -> None:
    loss = job("--loss.type", "gspo", "--loss.clip_low", "0.001").loss
    assert loss == GSPOLossConfig(clip_low=0.001)
    assert job("--loss.clip_low", "0.1", "--loss.type=cispo").loss == CISPOLossConfig(clip_low=0.1)


def test_the_file_values_set_aside_are_named_in_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="rlpipe.config"):
        job("--loss.type", "ppo")
    notes = [r.getMessage() for r in caplog.records if r.name == "rlpipe.config"]
    assert len(notes) == 1, notes
    assert "loss.clip_low=0.2" in notes[0] and "loss.clip_high=0.28" in notes[0], notes
    assert "dropped" in notes[0] and "rloo" in notes[0], notes
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlpipe.config"):
        job("--loss.type", "gspo", "--loss.clip_high", "0.001")
    (note,) = [r.getMessage() for r in caplog.records if r.name == "rlpipe.config"]
    assert "loss.clip_low (file 0.2 -> 0.0003)" in note and "clip_high" not in note, note  # the flag sets it


def test_an_override_that_keeps_the_type_keeps_the_file_values(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="rlpipe.config"):
        assert job("--loss.kl_coef", "0.1").loss == RLOOLossConfig(kl_coef=0.1, clip_low=0.2, clip_high=0.28)
        assert job("--loss.type", "rloo", "--loss.clip_high", "0.3").loss == RLOOLossConfig(clip_high=0.3)
    assert not [r for r in caplog.records if r.name == "rlpipe.config"]


def test_every_choice_switches_the_same_way() -> None:
    parsed = job("--inference.type", "levanter", "--tracker.type", "json", "--backend.type", "ray")
    assert parsed.inference == LevanterInferenceConfig()  # test_cats.yaml's max_seqs 64 is also the default
    assert type(parsed.tracker).__name__ == "JsonTrackerConfig"
    assert type(parsed.backend).__name__ == "RayBackendConfig"


def test_a_step_level_switch_through_steps_run() -> None:
    invocation = parse_args(["step", "learn", "--config_path", TEST_CATS, "--loss.type", "ppo"])
    assert invocation.step is StepKind.LEARNER
    config = step_config(RLJob(parse_job(invocation.job_args)), StepKind.LEARNER, invocation.step_args)
    assert config.loss == PPOClipLossConfig()


def test_lesson_overrides_change_exactly_that_field() -> None:
    base = job()
    parsed = job("--curriculum.lessons.cats.chat", "true")
    assert parsed.curriculum.lessons["cats"].chat is True
    assert parsed.curriculum.lessons["cats"] == base.curriculum.lessons["cats"].__class__(
        **{**vars(base.curriculum.lessons["cats"]), "chat": True}
    )
    assert {k: v for k, v in vars(parsed).items() if k != "curriculum"} == {
        k: v for k, v in vars(base).items() if k != "curriculum"
    }
    # an unset per-lesson sampling starts from the curriculum's default: one flag changes one value
    sampled = job("--curriculum.lessons.cats.sampling_params.n_prompts", "8").curriculum
    assert sampled.lessons["cats"].sampling_params == base.curriculum.default_sampling.__class__(
        **{**vars(base.curriculum.default_sampling), "n_prompts": 8}
    )
    evaluated = job("--curriculum.lessons.cats.eval_sampling_params.max_tokens=8").curriculum
    assert evaluated.lessons["cats"].eval_sampling_params == base.curriculum.eval_sampling.__class__(
        **{**vars(base.curriculum.eval_sampling), "max_tokens": 8}
    )


def test_lesson_overrides_of_a_curriculum_with_several_lessons() -> None:
    config = "configs/arithmetic_curriculum.yaml"
    base = job(config=config).curriculum.lessons
    parsed = job("--curriculum.lessons.addition_easy.stop_threshold", "0.5", config=config).curriculum.lessons
    assert parsed["addition_easy"].stop_threshold == 0.5
    assert {k: v for k, v in parsed.items() if k != "addition_easy"} == {
        k: v for k, v in base.items() if k != "addition_easy"
    }


def test_an_unknown_lesson_id_is_a_usage_error_naming_the_known_ids() -> None:
    with pytest.raises(UsageError, match=r"curriculum\.lessons\.nope\.chat.*known ids: cats"):
        job("--curriculum.lessons.nope.chat", "true")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("step", [("step", "learn"), ("step", "rollout"), ()])
def test_an_unknown_lesson_id_fails_fast_in_one_line(tmp_path: Path, step: tuple[str, ...]) -> None:
    root = tmp_path / "run"
    proc = run(
        "steps.run", *step, "--config_path", "configs/test_cats.yaml", "--run_root", str(root),
        "--curriculum.lessons.nope.chat", "true",
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == Exit.CONFIG, proc.stderr[-3000:]
    assert len(lines) == 1 and "curriculum.lessons.nope.chat" in lines[0], proc.stderr[-3000:]
    if step != ("step", "learn"):  # the learner's config has no curriculum: the flag is not one of its flags
        assert "known ids: cats" in lines[0], lines
    assert not root.exists()


GUIDE = ROOT / "docs/guides/configuration.md"


def guide_examples() -> list[list[str]]:
    """The guide's `python -m steps.run …` example lines of its override sections (fenced command blocks, each also
    run as written by tests/test_guide_commands.py)."""
    text = GUIDE.read_text().split("### Switching a choice", 1)[1].split("## Step flags", 1)[0]
    return [ln.split()[3:] for ln in text.splitlines() if ln.startswith("python -m steps.run ")]


@pytest.mark.parametrize("argv", guide_examples(), ids=" ".join)
def test_the_guides_examples_parse_as_written(argv: list[str]) -> None:
    invocation = parse_args(argv)
    RLJob(parse_job(invocation.job_args))


def test_the_guide_has_examples() -> None:
    assert len(guide_examples()) >= 2


@pytest.mark.parametrize("step", [StepKind.ROLLOUT, StepKind.EVALUATE, StepKind.BATCHMAKER])
def test_steps_that_hold_the_curriculum_take_lesson_flags(step: StepKind) -> None:
    config = step_config(RLJob(job()), step, ["--curriculum.lessons.cats.chat", "true"])
    assert config.curriculum.lessons["cats"].chat is True
