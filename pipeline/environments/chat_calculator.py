"""A chat environment with a calculator function tool: multi-turn exchanges of an instruct model with tool calls.

Episode (at most `max_turns` assistant turns, each at most `max_tokens` new tokens), through
`pipeline.environments.chat.chat_turns` (a server's `/v1/chat/completions`, or the tokenizer's chat template
locally):
1. The conversation starts with one user message (`"What is EXPR? Use the calculator tool."` by default); the
   tool `calculator(expression: string)` is offered with every request.
2. An assistant turn with tool calls, when turns remain, gets one `role: tool` message per call (in order, with its
   `tool_call_id`): the value of `expression` by `calculator.safe_eval` (`+ - * /`, parentheses, numbers), or
   `error: WHY` (bad JSON arguments, unknown tool, malformed expression; counted in `tool_errors`).
3. A turn without tool calls (or the last allowed turn) ends the episode. Reward 1.0 iff the final answer of
   its content (`calculator.final_answer`: the number after "Answer:", else the last number) equals the value.

The rollout is the conversation's `ChatTranscript`: the first turn's prompt ids as the prompt; every sampled token
with its logprob and loss mask 1; the tokens later prompts add (tool results, role headers) with logprob 0.0 and
loss mask 0; the reward on the last sampled token. Rendered locally, each later turn's prompt continues the
transcript's own ids (`ChatRequest.prefixes`); a turn whose prompt does not extend the transcript (a server's
re-rendering), or a failed request, fails the example (an `ExampleFailure` with the reason). Prompts are always
chat-rendered (by the server, or by the tokenizer's chat template): give its lesson `chat: true` so that a
tokenizer without a chat template is refused at start-up rather than failing every example.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from pipeline.environments.base import (
    Environment,
    EnvRollout,
    ExampleFailure,
    InferenceContext,
    SampleResult,
    SampleSpec,
    check_mode,
    draw_seed,
)
from pipeline.environments.calculator import (
    ArithmeticProblems,
    ToolError,
    answer_rollout,
    format_value,
    safe_eval,
)
from pipeline.environments.chat import ChatRequest, ChatTranscript, ChatTurn, Message, chat_turns
from pipeline.environments.turns import play_turns

TOOL_NAME = "calculator"
CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression (+ - * / and parentheses) exactly.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
            "required": ["expression"],
        },
    },
}
"""The tool schema offered with every request (OpenAI function-tool format)."""


def call_tool(call: Message) -> tuple[str, bool]:
    """The tool message content for one OpenAI tool call, and whether it erred."""
    fn = call.get("function") or {}
    if fn.get("name") != TOOL_NAME:
        return f"error: unknown tool {fn.get('name')!r}", True
    try:
        args = json.loads(fn.get("arguments") or "{}")
        expr = args["expression"]
        if not isinstance(expr, str):
            raise TypeError("expression must be a string")
        return format_value(safe_eval(expr)), False
    except (ValueError, KeyError, TypeError, ToolError) as e:
        return f"error: {e}", True


@dataclass
class _Conversation:
    example: int
    messages: list[Message]
    transcript: ChatTranscript = field(default_factory=ChatTranscript)
    answer: str = ""
    finish_reason: str = "length"
    tool_calls: int = 0
    tool_errors: int = 0
    done: bool = False


class ChatCalculatorEnv(ArithmeticProblems, Environment):
    """Arithmetic problems for an instruct model with a calculator tool (see the module docstring).

    Problems: `n_terms` integer operands in [1, max_operand] joined by random `+ - *` (train: drawn with the
    call's rng; eval: a fixed list of `n_eval` problems from `default_rng([seed, 3])`). Metrics add `turns`,
    `tool_calls`, `tool_errors`, `parse_failure`, and for each turn k `ended_at_turn<k>` (the episode ended at
    turn k) and `reward_at_turn<k>` (its reward if so, else 0), each as `_mean` and `_total`.
    """

    name = "chat_calculator"

    def __init__(
        self,
        max_turns: int = 3,
        n_terms: int = 3,
        max_operand: int = 99,
        seed: int = 0,
        *,
        prompt_template: str = "What is {expr}? Use the calculator tool.",
        system_prompt: str | None = None,
        n_eval: int = 256,
    ) -> None:
        self._init_problems(max_turns, n_terms, max_operand, [seed, 3], n_eval)
        self.prompt_template = prompt_template
        self.system_prompt = system_prompt

    def first_messages(self, expr: str) -> list[Message]:
        """The conversation an episode starts from."""
        msgs: list[Message] = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*msgs, {"role": "user", "content": self.prompt_template.format(expr=expr)}]

    def sample(self, ctx: InferenceContext, spec: SampleSpec, rng: np.random.Generator) -> SampleResult:
        check_mode(spec.mode)
        exprs = self.problems(spec.n_examples, rng, spec.mode)
        convs = [
            _Conversation(i, self.first_messages(e)) for i, e in enumerate(exprs) for _ in range(spec.n_generations)
        ]
        failures: list[ExampleFailure] = []

        def generate(turn: int, active: list[_Conversation]) -> list[ChatTurn]:
            request = ChatRequest(
                [c.messages for c in active],
                [CALCULATOR_TOOL],
                spec.temperature,
                spec.max_tokens,
                draw_seed(rng),
                spec.stop_tokens,
                # Local rendering continues each transcript on the ids the model sampled: re-rendering a sampled
                # turn from its parsed message gave other ids (a non-canonical split such as "-" "-" for "--",
                # text after a tool call moved before it, escaped non-ASCII arguments) and failed the example.
                prefixes=[
                    c.transcript.prompt_tokens + c.transcript.tokens if c.transcript.turns else None for c in active
                ],
            )
            return chat_turns(ctx, request)

        def advance(conv: _Conversation, turn: ChatTurn, last: bool) -> None:
            self._advance(conv, turn, last_turn=last)

        failed = play_turns(self.name, convs, exprs, self.max_turns, generate, advance, failures)
        return self.answer_result(exprs, convs, failed, failures, rng, spec.n_examples, self._rollout)

    def _advance(self, conv: _Conversation, turn: ChatTurn, *, last_turn: bool) -> None:
        """Add one assistant turn; run its tool calls (when turns remain) or end the episode."""
        conv.transcript.add(turn)
        msg = turn.message
        calls = msg.get("tool_calls") or []
        if not calls or last_turn:
            conv.answer = str(msg.get("content") or "")
            conv.finish_reason = turn.completion.finish_reason
            conv.done = True
            return
        conv.messages.append(msg)
        for call in calls:
            content, erred = call_tool(call)
            conv.tool_calls += 1
            conv.tool_errors += int(erred)
            conv.messages.append({"role": "tool", "tool_call_id": str(call.get("id", "")), "content": content})

    def _rollout(self, expr: str, target: Fraction, conv: _Conversation) -> EnvRollout:
        tr = conv.transcript
        rollout = answer_rollout(
            self.name,
            expr,
            target,
            conv.answer,
            prompt=tr.prompt_tokens,
            tokens=tr.tokens,
            logprobs=tr.logprobs,
            mask=tr.mask,
            finish_reason=conv.finish_reason,
            info={
                "turns": float(tr.turns),
                "tool_calls": float(conv.tool_calls),
                "tool_errors": float(conv.tool_errors),
            },
        )
        # Per-turn outcome: the episode ended at turn k (1..max_turns) with this reward, so the summary's
        # `reward_at_turn<k>_total / ended_at_turn<k>_total` is the mean reward of the episodes that ended there.
        for k in range(1, self.max_turns + 1):
            ended = float(tr.turns == k)
            rollout.info[f"ended_at_turn{k}"] = ended
            rollout.info[f"reward_at_turn{k}"] = ended * rollout.episode_reward
        return rollout
