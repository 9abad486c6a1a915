"""The tool-use recipe's calculator task as an OpenAI-speaking agent (configs/agents/calculator_agent.py, the
`agent` environment of configs/tool_calculator_agent.yaml) plays exactly the class environment's episode.

The endpoint, the `agent` environment and the agent (the real `openai` SDK) are real; the sampler is scripted
(`ScriptedContext`) to replay the SFT transcripts' assistant turns, or a wrong answer, or a malformed call. Checked:
an episode's row is token for token the SFT transcript and the class environment's rollout (first prompt included,
so the SFT policy transfers), one segment, the tool message and role headers masked 0, the reward the calculator's
truth; the held-out tasks are the class environment's 256 evaluation problems and the training tasks avoid them.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import yaml
from jobs import ROOT

from pipeline.environments.agent import AgentEnv, load_tasks
from pipeline.environments.base import SampleSpec
from pipeline.environments.chat_calculator import CALCULATOR_TOOL, ChatCalculatorEnv
from pipeline.environments.scripted import ScriptedContext
from pipeline.environments.tokenizer import load_tokenizer, render_chat
from pipeline.environments.tool_transcripts import transcript
from pipeline.sft_data import chat_example

AGENT = "configs/agents/calculator_agent.py"
CONFIG = yaml.safe_load((ROOT / "configs" / "tool_calculator_agent.yaml").read_text())
ENV_ARGS = CONFIG["curriculum"]["lessons"]["calc"]["env"]["env_args"]
CLASS_ARGS = yaml.safe_load((ROOT / "configs" / "tool_calculator.yaml").read_text())["curriculum"]["lessons"]["calc"][
    "env"
]["env_args"]


class Ctx(ScriptedContext):
    max_seq_len = 128
    policy_step = 0


def replay(env: ChatCalculatorEnv, *, answer_offset: int = 0, expression: str | None = None) -> Any:
    """A script playing the SFT transcript's assistant turns (the call with `expression` instead of the problem's
    when given; the answer off by `answer_offset`)."""

    def script(prompt_text: str) -> str:
        expr = prompt_text.split("What is ")[1].split("?")[0]
        if "<bos>tool\n" not in prompt_text:
            call = {"name": "calculator", "arguments": {"expression": expression or expr}}
            return f"<tool_call>{json.dumps(call)}</tool_call>"
        value = int(transcript(env, expr)[-1]["content"].split()[-1])
        return f"Answer: {value + answer_offset}"

    return script


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("builtin:bpe")


def test_tasks_are_the_class_environments_problems() -> None:
    env = ChatCalculatorEnv(**CLASS_ARGS)
    held_out = load_tasks(ENV_ARGS["eval_tasks"], "eval_tasks")
    train = load_tasks(ENV_ARGS["tasks"], "tasks")
    assert [t.task_id for t in held_out] == env.eval_problems and len(held_out) == 256
    assert len(train) == 4096 and not {t.task_id for t in train} & set(env.eval_problems)
    assert [t.task_id for t in load_tasks(ENV_ARGS["tasks"])] == [t.task_id for t in train]  # deterministic
    assert held_out[0].data == {"id": env.eval_problems[0], "expression": env.eval_problems[0],
                                "answer": str(eval(env.eval_problems[0]))}  # fmt: skip
    with pytest.raises(ValueError, match="has no function"):
        load_tasks(f"{AGENT}:no_such_tasks")


def test_agent_episode_is_the_class_environments_and_the_sft_transcripts(tok: Any) -> None:
    env = ChatCalculatorEnv(**CLASS_ARGS)
    n = 4
    agent = AgentEnv(tasks=ENV_ARGS["tasks"], eval_tasks=ENV_ARGS["eval_tasks"], entry_point=ENV_ARGS["entry_point"])
    eval_spec = SampleSpec(n, 1, 0.0, 32, None, "eval")
    got = agent.sample(Ctx(tok, replay(env)), eval_spec, np.random.default_rng(0))
    ref = env.sample(Ctx(tok, replay(env)), eval_spec, np.random.default_rng(0))
    assert not got.failures and not ref.failures
    for g, r in zip(got.groups, ref.groups, strict=True):
        (row,), (cls,) = g.rollouts, r.rollouts  # one segment: the second prompt extends the first turn's ids
        expr = row.example_id
        assert expr == cls.example_id and row.segment_index == 0
        assert row.prompt_tokens == render_chat(tok, env.first_messages(expr), [CALCULATOR_TOOL]) == cls.prompt_tokens
        sft = chat_example(tok, transcript(env, expr), [CALCULATOR_TOOL])
        assert row.prompt_tokens + row.response_tokens == sft.tokens == cls.prompt_tokens + cls.response_tokens
        assert row.response_loss_mask == sft.loss_mask[len(row.prompt_tokens) :] == cls.response_loss_mask
        tool = tok.decode([t for t, m in zip(row.response_tokens, row.response_loss_mask, strict=True) if not m])
        assert str(transcript(env, expr)[2]["content"]) in tool  # the tool's result is what the mask hides
        assert row.episode_reward == 1.0 == cls.episode_reward and row.ground_truth == row.extracted_answer[8:]
    for key in ("turns_mean", "tool_calls_mean", "ended_at_turn2_mean", "reward_at_turn2_mean", "success_rate"):
        assert got.metrics[key] == ref.metrics[key] == (2.0 if key == "turns_mean" else 1.0), key
    assert got.metrics["tool_errors_total"] == 0 and got.metrics["segments_mean"] == 1.0

    wrong = agent.sample(Ctx(tok, replay(env, answer_offset=1)), eval_spec, np.random.default_rng(0))
    assert not wrong.failures and {r.episode_reward for g in wrong.groups for r in g.rollouts} == {0.0}
    bad = agent.sample(Ctx(tok, replay(env, expression="1+")), SampleSpec(2, 2, 1.0, 32, None, "train"),
                       np.random.default_rng(0))  # fmt: skip
    assert not bad.failures and len(bad.groups) == 2
    assert bad.metrics["tool_errors_mean"] == 1.0 and bad.metrics["tool_calls_mean"] == 1.0
    assert bad.metrics["mean_reward"] == 1.0  # the reward is the truth's, not the tool's: the answer is still right
    row = bad.groups[0].rollouts[0]
    tool = tok.decode([t for t, m in zip(row.response_tokens, row.response_loss_mask, strict=True) if not m])
    assert "<bos>tool\nerror: " in tool
    assert all(r.example_id not in set(env.eval_problems) for g in bad.groups for r in g.rollouts)
