"""A user's broken environment is refused at start in one line (exit 2, never restarted): an environment that cannot
load, a lesson whose reference answers the model cannot produce (characters outside the tokenizer's vocabulary), a
lesson no row of which fits `train.seq_len`. (Broken rewards at run time: tests/test_rollout_manager.py; reasoning-gym
answers longer than `max_tokens` or that extract nothing: tests/test_reasoning_gym_env.py.)"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import (
    ConfigError,
    CurriculumConfig,
    EnvConfig,
    EvaluateStepConfig,
    LessonConfig,
    ModelSpec,
    RolloutStepConfig,
    SamplingParams,
    StoreConfig,
    TrainParams,
)
from pipeline.environments.base import encode_prompt
from pipeline.environments.start_checks import check_evaluate_step, check_lessons
from pipeline.environments.tokenizer import load_tokenizer
from pipeline.process.exits import Exit

ROOT = Path(__file__).resolve().parents[1]

USER_ENV = '''
from pipeline.environments.cats import CatsEnv


def load_environment(dataset):
    raise FileNotFoundError(f"dataset {dataset!r} not found")


class DatasetEnv(CatsEnv):
    """A user's environment whose constructor loads a dataset that is not there."""

    def __init__(self, dataset="gsm9k"):
        super().__init__()
        self.data = load_environment(dataset)
'''


def test_an_environment_that_cannot_load_is_one_line_exit_2_before_jax(tmp_path: Path) -> None:
    """The rollout step program builds each lesson's environment while it checks its config: a constructor that
    raises is one line naming the lesson and the cause, exit 2 (never restarted), before JAX is imported; the
    evaluator's check refuses it the same way."""
    (tmp_path / "user_dataset_env.py").write_text(USER_ENV)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "steps.rollout", "--store.run_root", str(tmp_path / "run"),
         "--curriculum.lessons.cats.env.env_class", "user_dataset_env.DatasetEnv"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == Exit.CONFIG, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:") and " INFO " not in ln]
    assert lines == [
        "error: invalid config: curriculum.lessons.cats.env='user_dataset_env.DatasetEnv': lesson 'cats': the "
        "environment cannot be loaded: constructor failed: FileNotFoundError: dataset 'gsm9k' not found"
    ], proc.stderr[-2000:]
    assert "| jax\n" not in proc.stderr and not (tmp_path / "run").exists()

    sys.path.insert(0, str(tmp_path))
    try:
        lessons = {"mine": LessonConfig("mine", env=EnvConfig("user_dataset_env.DatasetEnv", {"dataset": "x"}))}
        with pytest.raises(ConfigError, match=r"curriculum\.lessons\.mine\.env=.*lesson 'mine'.*dataset 'x'"):
            check_evaluate_step(EvaluateStepConfig(curriculum=CurriculumConfig(lessons=lessons)))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("user_dataset_env", None)


def _worker(tmp_path: Path, env: EnvConfig, *, max_tokens: int = 8, seq_len: int = 64) -> RolloutStepConfig:
    return RolloutStepConfig(
        store=StoreConfig(run_root=str(tmp_path / "run")),
        model=ModelSpec(max_seq_len=128),
        train=TrainParams(seq_len=seq_len, overlong="drop"),
        curriculum=CurriculumConfig(
            lessons={"mine": LessonConfig("mine", env=env)},
            default_sampling=SamplingParams(max_tokens=max_tokens),
        ),
    )


def _exact(tmp_path: Path, rows: list[dict]) -> EnvConfig:
    path = tmp_path / f"rows{len(list(tmp_path.glob('rows*')))}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return EnvConfig("pipeline.environments.exact_answer.ExactAnswerEnv", {"path": str(path)})


def test_answers_outside_the_vocabulary_and_rows_longer_than_seq_len_are_refused_at_start(tmp_path: Path) -> None:
    """On the examples the prompt check draws: reference answers the tokenizer cannot write (here `café` in the
    built-in ASCII vocabulary) refuse the lesson naming `model.tokenizer`; prompts that fit the model but whose rows
    never fit `train.seq_len` refuse it naming `train.seq_len` and the lengths; one answer that can be produced is
    enough."""
    tok = load_tokenizer("builtin:tiny")
    unknown = _exact(tmp_path, [{"id": f"q{i}", "prompt": f"Say it {i}", "answer": "café"} for i in range(3)])
    with pytest.raises(ConfigError) as e:
        check_lessons(_worker(tmp_path, unknown), tok)
    assert e.value.field == "model.tokenizer"
    assert "lesson 'mine': none of the 16 reference answers drawn can be produced" in str(e.value)
    assert "characters 'é' are not in the vocabulary" in str(e.value)

    long_prompt = "Say it " * 12  # fits the 128-token model, not a 16-token row
    rows = _exact(tmp_path, [{"id": "q", "prompt": long_prompt, "answer": "cat"}])
    with pytest.raises(ConfigError) as e:
        check_lessons(_worker(tmp_path, rows, max_tokens=4, seq_len=16), tok)
    assert e.value.field == "train.seq_len" and e.value.value == 16
    n = len(encode_prompt(tok, long_prompt))
    assert 16 < n < 64 and f"lesson 'mine': no row fits: the 16 prompts drawn have {n}..{n} tokens" in str(e.value)
    assert f"(prompt + reference answer: {n + 1}..{n + 1}; train.overlong=drop)" in str(e.value)

    mixed = [{"id": "a", "prompt": "Say cat", "answer": "cat"}, {"id": "b", "prompt": "x", "answer": "é"}]
    some = _exact(tmp_path, mixed)
    check_lessons(_worker(tmp_path, some), tok)  # a mix: what can be produced trains (a warning names the rest)


def test_the_job_start_check_refuses_the_same_without_transformers(tmp_path: Path) -> None:
    """`check_lessons` on each built-in through transformers and through `BuiltinTokenizer` (what the job start's
    `check_prompts` uses for a built-in without chat lessons): the same prompt lengths when the lesson passes, the
    same field, value and message when it is refused (an answer outside the vocabulary, a row longer than
    `train.seq_len`, no prompt under `max_seq_len`, answers over `max_tokens`)."""
    from pipeline.environments.tokenizer import BuiltinTokenizer

    def outcome(config: RolloutStepConfig, tok: object) -> object:
        try:
            return check_lessons(config, tok)
        except ConfigError as e:
            return (e.field, e.value, str(e))

    rows = [{"id": f"q{i}", "prompt": f"Say it {i} ×", "answer": a} for i, a in enumerate(["cat", "café", "12"])]
    configs = [
        _worker(tmp_path, _exact(tmp_path, rows)),  # passes (on tiny: a warning for café)
        _worker(tmp_path, _exact(tmp_path, [{**r, "answer": "café"} for r in rows])),  # outside the tiny vocabulary
        _worker(tmp_path, _exact(tmp_path, [{**r, "prompt": "Say it " * 12} for r in rows]), seq_len=16),
        dataclasses.replace(_worker(tmp_path, _exact(tmp_path, rows)), model=ModelSpec(max_seq_len=4)),
        _worker(tmp_path, _exact(tmp_path, [{**r, "answer": "a long answer, " * 4} for r in rows]), max_tokens=3),
    ]
    refused = {"builtin:tiny": 0, "builtin:bpe": 0}
    for spec in refused:
        hf, lite = load_tokenizer(spec), BuiltinTokenizer(spec)
        for config in configs:
            want = outcome(config, hf)
            assert outcome(config, lite) == want, spec
            refused[spec] += isinstance(want, tuple)
    assert refused == {"builtin:tiny": 4, "builtin:bpe": 3}  # the BPE writes café
