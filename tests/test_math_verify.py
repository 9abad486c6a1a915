"""`verifier: math_verify` for exact-answer lessons: equivalent answers score 1, others 0, in any thread."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from pipeline.environments.base import SampleSpec
from pipeline.environments.exact_answer import ExactAnswerEnv, math_verify_answer, math_verify_match
from pipeline.environments.scripted import ScriptedContext
from pipeline.environments.tokenizer import build_tiny_tokenizer

EQUIVALENT = [
    ("\\frac{1}{2}", "0.5"),
    ("0.5", "\\frac{1}{2}"),
    ("\\boxed{3}", "3"),
    ("The answer is $\\boxed{\\frac{2}{4}}$.", "\\frac{1}{2}"),
    ("so x = 0.50", "1/2"),
    ("$\\sqrt{4}$", "2"),
    ("<answer>7</answer>", "7"),
    ("3,000", "3000"),
]
DIFFERENT = [
    ("2", "3"),
    ("\\boxed{4}", "3"),
    ("\\frac{1}{3}", "0.5"),
    ("no answer here", "3"),
    ("", "1"),
]


@pytest.mark.parametrize(("response", "answer"), EQUIVALENT)
def test_equivalent_answers_score_one(response: str, answer: str) -> None:
    assert math_verify_match(response, answer) == 1.0


@pytest.mark.parametrize(("response", "answer"), DIFFERENT)
def test_different_answers_score_zero(response: str, answer: str) -> None:
    assert math_verify_match(response, answer) == 0.0


def test_works_outside_the_main_thread() -> None:
    # math-verify's own time limit (signal.alarm) raises ValueError off the main thread: it must be off there
    out: list[object] = []

    def run() -> None:
        try:
            out.append([math_verify_match(r, a) for r, a in EQUIVALENT[:3] + DIFFERENT[:2]])
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert out == [[1.0, 1.0, 1.0, 0.0, 0.0]]


def test_exact_answer_lesson_with_math_verify(tmp_path: Path) -> None:
    rows = [
        {"id": "half", "prompt": "1/2 as a decimal?", "answer": "0.5"},
        {"id": "three", "prompt": "1+2?", "answer": "3"},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = ExactAnswerEnv(str(path), verifier="math_verify")
    tok = build_tiny_tokenizer()
    script = {"1/2 as a decimal?": "\\frac{1}{2}", "1+2?": "\\boxed{4}"}
    ctx = ScriptedContext(tok, lambda p: next(v for k, v in script.items() if k in p))
    res = env.sample(ctx, SampleSpec(2, 1, 0.0, 16, None, "eval"), np.random.default_rng(0))
    got = {g.rollouts[0].example_id: g.rollouts[0] for g in res.groups}
    assert got["half"].episode_reward == 1.0 and got["three"].episode_reward == 0.0
    assert got["half"].ground_truth == "0.5" and got["three"].ground_truth == "3"
    assert got["three"].extracted_answer == math_verify_answer(got["three"].response_text) == "4"
    assert got["half"].response_text == "\\frac{1}{2}"
