"""The tool-use recipe's calculator task as a verifiers environment (configs/envs/verifiers_calculator.py, run by
configs/tool_calculator_verifiers.yaml): its episodes, played by verifiers' own rollout loop (chat program, training
client, the MCP calculator server) against the real generate endpoint, are token for token the episodes
`ChatCalculatorEnv` plays and the SFT transcripts teach, so the recipe's SFT policy transfers to it."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest
from jobs import ROOT

from pipeline.environments.base import SampleSpec
from pipeline.environments.calculator import final_answer, format_value, safe_eval
from pipeline.environments.chat_calculator import CALCULATOR_TOOL, ChatCalculatorEnv
from pipeline.environments.scripted import ScriptedContext
from pipeline.environments.tokenizer import load_tokenizer, render_chat
from pipeline.environments.verifiers_env import VerifiersEnv

CALC = "configs/envs/verifiers_calculator.py:load_environment"
PROBLEMS = {"n_terms": 2, "max_operand": 999, "seed": 0, "n_eval": 256}
"""configs/tool_calculator.yaml's problems (and configs/tool_calculator_verifiers.yaml's)."""


@pytest.fixture(scope="module")
def taskset_module() -> Iterator[ModuleType]:
    sys.path.insert(0, str(ROOT / "configs/envs"))
    try:
        import verifiers_calculator

        yield verifiers_calculator
    finally:
        sys.path.remove(str(ROOT / "configs/envs"))


def _script(prompt: str) -> str:
    """Call the calculator with the question's expression; then answer with the tool's result, except for a
    product, answered wrong."""
    expr = re.search(r"What is (\S+)\? Use the calculator tool\.", prompt)
    assert expr is not None, prompt
    result = re.search(r"<bos>tool\n(.*?)<eos>", prompt)
    if result is None:
        return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr.group(1)}"}}}}</tool_call>'
    return "Answer: 7" if "*" in expr.group(1) else f"Answer: {result.group(1)}"


def test_splits_prompt_and_tool_are_the_class_envs(taskset_module: ModuleType) -> None:
    from mcp.server.mcpserver import MCPServer

    cls = ChatCalculatorEnv(max_turns=2, **PROBLEMS)
    held_out = [t.data for t in taskset_module.load_environment("eval", **PROBLEMS).load()]
    train = [t.data for t in taskset_module.load_environment("train", n=2000, **PROBLEMS).load()]
    assert [d.id for d in held_out] == cls.eval_problems and len(train) == 2000
    assert not {d.id for d in train} & set(cls.eval_problems)  # no evaluated problem is trained on
    for d in (held_out[0], train[0]):
        assert [{"role": "user", "content": d.prompt}] == cls.first_messages(d.expression)

    server = MCPServer("calculator")
    tool = taskset_module.Calculator(taskset_module.vf.ToolsetConfig())
    tool.register(server)
    (listed,) = asyncio.run(server.list_tools())
    want = CALCULATOR_TOOL["function"]
    assert (listed.name, listed.description) == (want["name"], want["description"])
    assert listed.input_schema["properties"]["expression"]["description"] == "e.g. 12*(3+4)"
    assert listed.input_schema["required"] == ["expression"]
    assert asyncio.run(tool.calculator("(2+3)*4/8")) == "2.5"
    assert asyncio.run(tool.calculator("5/0")) == "error: division by zero"


def test_episodes_are_the_class_envs_and_the_sft_transcripts() -> None:
    tok = load_tokenizer("builtin:bpe")
    spec = SampleSpec(n_examples=3, n_generations=2, temperature=1.0, max_tokens=32, stop_tokens=None, mode="eval")
    env = VerifiersEnv(env=CALC, env_kwargs={"split": "train", "n": 8, **PROBLEMS}, eval_env=CALC,
                       eval_env_kwargs={"split": "eval", **PROBLEMS}, max_turns=2, max_seq_len=128)  # fmt: skip
    try:
        res = env.sample(ScriptedContext(tok, _script, logprob=-0.5), spec, np.random.default_rng(0))
    finally:
        env.close()
    ref = ChatCalculatorEnv(max_turns=2, **PROBLEMS).sample(
        ScriptedContext(tok, _script, logprob=-0.5), spec, np.random.default_rng(0)
    )
    assert not res.failures and not ref.failures
    assert [g.rollouts[0].example_id for g in res.groups] == ["504*895", "860+697", "581*317"]
    for group, ref_group in zip(res.groups, ref.groups, strict=True):
        expr = group.rollouts[0].example_id
        value = format_value(safe_eval(expr))
        sft_prompt = render_chat(tok, [{"role": "user", "content": f"What is {expr}? Use the calculator tool."}],
                                 tools=[CALCULATOR_TOOL])  # fmt: skip
        assert len(group.rollouts) == 2  # one row per episode: the second call continues the first's tokens
        for row, want in zip(group.rollouts, ref_group.rollouts, strict=True):
            assert row.prompt_tokens == want.prompt_tokens == sft_prompt
            assert row.response_tokens == want.response_tokens
            assert row.response_loss_mask == want.response_loss_mask
            assert row.response_logprobs == want.response_logprobs
            # the tool's result, rendered between the two sampled turns: mask 0, logprob 0
            n1 = row.response_loss_mask.index(0)
            n_tool = row.response_loss_mask[n1:].index(1)
            assert tok.decode(row.response_tokens[n1 : n1 + n_tool]) == f"<bos>tool\n{value}<eos><bos>assistant\n"
            assert set(row.response_logprobs[n1 : n1 + n_tool]) == {0.0}
            right = final_answer(tok.decode(row.response_tokens[n1 + n_tool :])) == safe_eval(expr)
            assert row.episode_reward == want.episode_reward == float(right) == float("*" not in expr)
            assert row.reward_components == {"correct": row.episode_reward}
    assert res.metrics["reward/correct"] == pytest.approx(1 / 3)
    assert res.metrics["turns_mean"] == 2.0 and res.metrics["tool_calls_mean"] == 1.0
    assert res.metrics["tool_errors_mean"] == 0.0 and res.metrics["ended_at_turn2_mean"] == 1.0
