"""The tool-use recipe's calculator task as a verifiers taskset with an MCP toolset
(configs/tool_calculator_verifiers.yaml): the problems, tool and reward of
`pipeline.environments.chat_calculator.ChatCalculatorEnv`, played by verifiers' own rollout loop.

- Problems: those of `ChatCalculatorEnv(n_terms=…, max_operand=…, seed=…, n_eval=…)`. `split="eval"`: its fixed
  held-out list (`eval_problems`, 256 by default), in order; `split="train"`: `n` problems drawn by its training
  draw (`problems(n, default_rng(train_seed), "train")`), which skips the held-out ones, so no evaluated problem is
  trained on. A task's id is its expression.
- Prompt: the class's first message, `"What is EXPR? Use the calculator tool."`, as the only user message, no
  system prompt.
- Tool: `calculator(expression)`, a `vf.Toolset` verifiers serves as an MCP server (started as
  `python -m verifiers_calculator`, so this module runs it as `__main__`). `TOOL_PREFIX = None` keeps the tool's
  name unqualified (`calculator`, not `<server>_calculator`), the name the SFT transcripts call and the chat template
  lists. It answers like the class's tool: the value by `calculator.safe_eval` as `format_value` writes it, or
  `error: WHY` for a malformed expression.
- Reward `correct`: 1.0 iff the final answer of the last reply (`calculator.final_answer`: the number after
  "Answer:", else the last number) equals the expression's value (the class's rule). Metric `tool_use`: the class's
  per-turn metrics (`turns`, `tool_calls`, `tool_errors`, `parse_failure`, `ended_at_turn<k>`, `reward_at_turn<k>`),
  which VerifiersEnv reports as `env/<name>_mean`.

With the built-in tokenizers' chat template the first prompt is token for token the class's (and the SFT
transcripts'): `<bos>system\\nTools: calculator<eos><bos>user\\nWhat is EXPR? Use the calculator tool.<eos>
<bos>assistant\\n` (the template lists only tool names; the tool's description and schema are the class's too).
"""

# no `from __future__ import annotations`: MCP builds the tool's schema from its real parameter annotations
from collections.abc import Iterable
from typing import Annotated

import numpy as np
import verifiers.v1 as vf
from pydantic import Field

from pipeline.environments.calculator import ToolError, final_answer, format_value, safe_eval
from pipeline.environments.chat_calculator import CALCULATOR_TOOL, ChatCalculatorEnv

__all__ = ["Calculator", "CalculatorTaskset", "load_environment"]

_SCHEMA = CALCULATOR_TOOL["function"]


class Calculator(vf.Toolset[vf.ToolsetConfig]):
    """The class env's calculator as an MCP tool server."""

    TOOL_PREFIX = None  # tool names unqualified: `calculator`, as ChatCalculatorEnv offers it

    @vf.tool
    async def calculator(
        self,
        expression: Annotated[str, Field(description=_SCHEMA["parameters"]["properties"]["expression"]["description"])],
    ) -> str:
        """Evaluate an arithmetic expression (+ - * / and parentheses) exactly."""
        try:
            return format_value(safe_eval(expression))
        except ToolError as e:
            return f"error: {e}"


class CalculatorData(vf.TaskData):
    expression: str = ""


class CalculatorTask(vf.Task[CalculatorData, vf.State, vf.TaskConfig]):
    def solved(self, trace: vf.Trace) -> bool:
        """Whether the last reply's final answer equals the expression's value."""
        answer = final_answer(trace.last_reply)
        return answer is not None and answer == safe_eval(self.data.expression)

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        """1.0 iff the last reply's final answer equals the expression's value."""
        return 1.0 if self.solved(trace) else 0.0

    @vf.metric
    async def tool_use(self, trace: vf.Trace) -> dict[str, float]:
        """The class env's per-episode metrics: `turns` (model calls), `tool_calls`, `tool_errors` (results that are
        errors), `parse_failure` (no final answer), and `ended_at_turn<k>` / `reward_at_turn<k>` for k up to the
        episode's turns (VerifiersEnv averages each over the episodes, 0 where an episode has none)."""
        turns = trace.num_turns
        errors = sum(1 for m in trace.tool_messages if str(m.content).lower().startswith("error"))
        out = {
            "turns": float(turns),
            "tool_calls": float(len(trace.tool_messages)),
            "tool_errors": float(errors),
            "parse_failure": float(final_answer(trace.last_reply) is None),
        }
        reward = 1.0 if self.solved(trace) else 0.0
        for k in range(1, turns + 1):
            out[f"ended_at_turn{k}"] = float(k == turns)
            out[f"reward_at_turn{k}"] = reward if k == turns else 0.0
        return out


class CalculatorTaskset(vf.Taskset[CalculatorTask, vf.TasksetConfig]):
    def __init__(self, config: vf.TasksetConfig, env: ChatCalculatorEnv, problems: list[str]) -> None:
        super().__init__(config)
        self.env = env
        self.problems = problems

    @classmethod
    def toolsets(cls, config: vf.TasksetConfig) -> list[vf.Toolset]:
        """One shared calculator server for every task."""
        return [Calculator(vf.ToolsetConfig())]

    def load(self) -> Iterable[CalculatorTask]:
        for expr in self.problems:
            (first,) = self.env.first_messages(expr)  # the class's conversation start: one user message
            yield CalculatorTask(CalculatorData(id=expr, prompt=str(first["content"]), expression=expr))


def load_environment(
    split: str = "train", n: int = 10_000, *, n_terms: int = 2, max_operand: int = 999, seed: int = 0,
    n_eval: int = 256, train_seed: int = 2,
) -> vf.Taskset:  # fmt: skip
    """The calculator taskset of a split (module docstring): the held-out problems of
    `ChatCalculatorEnv(n_terms=…, max_operand=…, seed=…, n_eval=…)` (`eval`), or `n` of its training draws from
    `default_rng(train_seed)` (`train`). Raises ValueError for another split."""
    env = ChatCalculatorEnv(max_turns=2, n_terms=n_terms, max_operand=max_operand, seed=seed, n_eval=n_eval)
    if split == "eval":
        problems = list(env.eval_problems)
    elif split == "train":
        problems = env.problems(n, np.random.default_rng(train_seed), "train")
    else:
        raise ValueError(f"split={split!r}: must be 'train' or 'eval'")
    return CalculatorTaskset(vf.TasksetConfig(), env, problems)


if __name__ == "__main__":  # verifiers starts the toolset's MCP server as `python -m verifiers_calculator`
    Calculator.run()
