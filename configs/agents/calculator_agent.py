"""The tool-use recipe's calculator task as an OpenAI-speaking agent (configs/tool_calculator_agent.yaml): it talks
to the served policy through the real `openai` SDK, offers the `calculator` function tool, runs the tool calls
itself, and reports reward 1 when the final answer is right.

An episode plays exactly what `pipeline.environments.chat_calculator.ChatCalculatorEnv` plays (the recipe's
`{max_turns: 2, n_terms: 2, max_operand: 999, seed: 0, n_eval: 256}`), reusing its code: the same first message
(`first_messages`), the same tool schema (`CALCULATOR_TOOL`), the same tool execution (`call_tool`: the value of
`expression` by `calculator.safe_eval`, or `error: WHY`), the same scoring (`calculator.final_answer` equal to the
expression's value). So the first prompt the endpoint renders is token for token the class environment's and the
SFT transcripts' (tests/test_tool_agent.py checks it), and the SFT policy of `runs/tool_calculator_sft` transfers.

1. Ask `What is EXPR? Use the calculator tool.` with `tools=[calculator]`.
2. A reply with tool calls (when turns remain) gets one `tool` message per call, then the next request.
3. A reply without tool calls (or the last allowed turn) ends the episode: reward 1.0 iff its `Answer: N` (else
   its last number) equals the value. A later turn refused with a 400 (its prompt would not fit the served
   `max_seq_len`) also ends it, with reward 0 (`context_overflow`).

Info (numbers, per episode): `turns`, `tool_calls`, `tool_errors`, `parse_failure`, `context_overflow`, and for
each turn k `ended_at_turn<k>` / `reward_at_turn<k>`, the class environment's per-turn metrics.

Tasks come from code (`train_tasks`, `eval_tasks`; the `agent` environment calls a `tasks: "file.py:function"`):
the held-out tasks are the class environment's 256 fixed evaluation problems, the training tasks distinct problems
drawn the way the class environment draws them (skipping the held-out ones).
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

import numpy as np
import openai
from openai import OpenAI

from pipeline.environments.calculator import final_answer, format_value, safe_eval
from pipeline.environments.chat_calculator import CALCULATOR_TOOL, ChatCalculatorEnv, call_tool

ENV_ARGS: dict[str, Any] = {"max_turns": 2, "n_terms": 2, "max_operand": 999, "seed": 0, "n_eval": 256}
"""The class environment's arguments in configs/tool_calculator.yaml: the same problems and held-out split."""
N_TRAIN = 4096
"""Distinct training problems (a 20-step run of 32 prompts draws 640)."""
TRAIN_SEED = 2


@functools.cache
def environment() -> ChatCalculatorEnv:
    """The class environment whose episodes this agent plays (for its problems, prompt and limits)."""
    return ChatCalculatorEnv(**ENV_ARGS)


def task(expr: str) -> dict[str, Any]:
    """The task object of one problem: its id is the expression (the class environment's example id)."""
    return {"id": expr, "expression": expr, "answer": format_value(safe_eval(expr))}


def eval_tasks() -> list[dict[str, Any]]:
    """The held-out tasks: the class environment's 256 fixed evaluation problems, in its order."""
    return [task(e) for e in environment().eval_problems]


@functools.cache
def _train_exprs() -> tuple[str, ...]:
    env = environment()
    rng = np.random.default_rng(TRAIN_SEED)
    seen: dict[str, None] = {}
    while len(seen) < N_TRAIN:
        for expr in env.problems(N_TRAIN, rng, "train"):  # skips the held-out problems
            seen.setdefault(expr, None)
    return tuple(list(seen)[:N_TRAIN])


def train_tasks() -> list[dict[str, Any]]:
    """`N_TRAIN` distinct training problems from `default_rng(TRAIN_SEED)`, none of them held out."""
    return [task(e) for e in _train_exprs()]


def play(task: dict[str, Any], client: OpenAI) -> dict[str, Any]:
    """Play one episode of `task` against the endpoint `client` talks to; return the result object."""
    env = environment()
    expr = str(task["expression"])
    messages: list[dict[str, Any]] = list(env.first_messages(expr))
    answer, turns, tool_calls, tool_errors, overflow = "", 0, 0, 0, 0
    for turn in range(1, env.max_turns + 1):
        try:
            reply = client.chat.completions.create(
                model="policy",
                messages=messages,  # type: ignore[arg-type]
                tools=[CALCULATOR_TOOL],  # type: ignore[list-item]
            )
        except openai.BadRequestError:
            if turn == 1:
                raise
            overflow = 1  # the conversation no longer fits the served max_seq_len: the episode ends unanswered
            break
        turns = turn
        msg = reply.choices[0].message
        calls = [c.model_dump() for c in msg.tool_calls or []]
        if not calls or turn == env.max_turns:
            answer = msg.content or ""
            break
        messages.append({"role": "assistant", "content": msg.content or "", "tool_calls": calls})
        for call in calls:
            content, erred = call_tool(call)
            tool_calls += 1
            tool_errors += int(erred)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
    got = final_answer(answer)
    reward = 1.0 if got is not None and got == safe_eval(expr) else 0.0
    info = {
        "turns": float(turns),
        "tool_calls": float(tool_calls),
        "tool_errors": float(tool_errors),
        "parse_failure": float(got is None),
        "context_overflow": float(overflow),
    }
    for k in range(1, env.max_turns + 1):
        info[f"ended_at_turn{k}"] = float(turns == k)
        info[f"reward_at_turn{k}"] = float(turns == k) * reward
    return {"reward": reward, "answer": answer, "info": info}


@functools.cache
def _client() -> OpenAI:
    # One client (and its HTTP connection pool) for every episode of this process: building an `OpenAI` client
    # costs about 25 ms of CPU (its SSL context), more than the rest of an episode's agent work.
    return OpenAI(base_url="http://127.0.0.1/v1", api_key="rlpipe", max_retries=0)


def run(task: dict[str, Any], *, base_url: str, api_key: str) -> dict[str, Any]:
    """The entry-point form (`entry_point: configs/agents/calculator_agent.py:run`), called in a thread: the
    shared client pointed at this episode's `base_url`."""
    return play(task, _client().with_options(base_url=base_url, api_key=api_key))


if __name__ == "__main__":
    # As a command (`command: "{python} configs/agents/calculator_agent.py"`): the task on stdin, OPENAI_BASE_URL
    # and OPENAI_API_KEY from the environment, the result as the last line of stdout.
    print(json.dumps(play(json.load(sys.stdin), OpenAI(max_retries=0))))
