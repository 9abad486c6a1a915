"""The "An rlpipe Environment class" example of docs/guides/bring-your-environment.md works as written: its Python
block, saved as `my_envs.py`, is the class its YAML block names, and a sample scores right and wrong answers."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import yaml

from pipeline.config.curriculum import EnvConfig
from pipeline.environments.base import SampleSpec
from pipeline.environments.loading import load_environment
from pipeline.environments.scripted import ScriptedContext
from pipeline.environments.tokenizer import load_tokenizer

GUIDE = Path(__file__).resolve().parents[1] / "docs/guides/bring-your-environment.md"


def _block(text: str, lang: str, after: str) -> str:
    section = text[text.index(after) :]
    match = re.search(rf"```{lang}\n(.*?)```", section, re.S)
    assert match, f"no {lang} block after {after!r}"
    return match.group(1)


def test_the_guides_environment_class_samples_and_scores(tmp_path: Path, monkeypatch) -> None:
    text = GUIDE.read_text(encoding="utf-8")
    (tmp_path / "my_envs.py").write_text(_block(text, "python", "## An rlpipe Environment class"), encoding="utf-8")
    lesson = yaml.safe_load(_block(text, "yaml", "## An rlpipe Environment class"))["curriculum"]["lessons"]
    [(lesson_id, spec)] = lesson.items()
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment(EnvConfig(**spec["env"]))

    def answer(prompt: str) -> str:  # right for even inputs, wrong for odd ones
        x = int(re.search(r"double (\d+)", prompt).group(1))  # type: ignore[union-attr]
        return f" {2 * x if x % 2 == 0 else 2 * x + 1}"

    tok = load_tokenizer("builtin:tiny")
    spec_ = SampleSpec(n_examples=6, n_generations=2, temperature=1.0, max_tokens=8, stop_tokens=None, mode="train")
    result = env.sample(ScriptedContext(tok, answer), spec_, np.random.default_rng(0))
    assert not result.failures and len(result.groups) == 6
    for group in result.groups:
        for r in group.rollouts:
            x = int(r.example_id.split("-")[1])
            assert x >= 1000  # train problems are offset from eval ones
            assert r.episode_reward == float(x % 2 == 0), (r.example_id, r.response_text)
            assert r.extracted_answer == r.response_text.strip().split(" ")[0]
            assert r.ground_truth == str(2 * x)
    assert lesson_id == "doubling"
    sys.modules.pop("my_envs", None)
