"""Generated tool-using transcripts for the SFT warm start of `chat_calculator` (the tool-use recipe).

A transcript is the conversation a perfect agent has with `ChatCalculatorEnv`: the environment's own first
messages (`first_messages`), one assistant turn calling `calculator` with the problem's expression, the tool's
result as the environment returns it (`call_tool`), then `Answer: VALUE`. Rendered by the tokenizer's chat template
with the calculator offered (`pipeline.sft_data.chat_example`), these are exactly the token sequences of an RL
episode that succeeds in two turns, so SFT teaches the format and the copying and RL starts from a policy that
speaks the protocol.

Problems are drawn like the environment's training draws (`ArithmeticProblems._problem`) from their own seeded
generator; any that is one of the environment's held-out evaluation problems is skipped, so no evaluated problem
is ever trained on. Everything is a function of the arguments: the same arguments write the same bytes.

    .venv/bin/python -m pipeline.environments.tool_transcripts --out configs/tool_calculator_sft.jsonl
    .venv/bin/python -m pipeline.environments.tool_transcripts --out configs/tool_calculator_sft.jsonl --check
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.environments.chat import Message, assistant_message
from pipeline.environments.chat_calculator import CALCULATOR_TOOL, TOOL_NAME, ChatCalculatorEnv, call_tool

DEFAULTS: dict[str, int] = {"n": 400, "seed": 1, "n_terms": 2, "max_operand": 999, "env_seed": 0, "n_eval": 256}
"""The arguments that wrote configs/tool_calculator_sft.jsonl (the environment's: configs/tool_calculator.yaml)."""


def transcript(env: ChatCalculatorEnv, expr: str) -> list[Message]:
    """The two-turn conversation that solves `expr` with one calculator call (module docstring)."""
    call: Message = {
        "id": "call_0_0",
        "type": "function",
        "function": {"name": TOOL_NAME, "arguments": json.dumps({"expression": expr})},
    }
    result, erred = call_tool(call)
    if erred:
        raise ValueError(f"{expr!r}: the calculator refused it ({result})")
    return [
        *env.first_messages(expr),
        assistant_message("", [call]),
        {"role": "tool", "tool_call_id": call["id"], "content": result},
        assistant_message(f"Answer: {result}", []),
    ]


def transcripts(
    n: int, seed: int, *, n_terms: int, max_operand: int, env_seed: int, n_eval: int
) -> list[list[Message]]:
    """`n` transcripts of distinct problems drawn from `default_rng(seed)`, none of them one of the held-out
    evaluation problems of `ChatCalculatorEnv(n_terms=…, max_operand=…, seed=env_seed, n_eval=…)`."""
    env = ChatCalculatorEnv(max_turns=2, n_terms=n_terms, max_operand=max_operand, seed=env_seed, n_eval=n_eval)
    held_out = set(env.eval_problems)
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    out: list[list[Message]] = []
    while len(out) < n:
        expr = env._problem(rng)
        if expr in held_out or expr in seen:
            continue
        seen.add(expr)
        out.append(transcript(env, expr))
    return out


def render(records: Sequence[list[Message]]) -> str:
    """The jsonl text of the SFT files source: one `{"messages": [...], "tools": [the calculator]}` per line (the
    tools offered, so the chat template renders the prompt the environment's episodes start from)."""
    return "".join(json.dumps({"messages": m, "tools": [CALCULATOR_TOOL]}, sort_keys=True) + "\n" for m in records)


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or with --check compare) the transcripts file; exit 1 when --check finds it differs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--check", action="store_true", help="exit 1 unless --out holds exactly these transcripts")
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key}", type=int, default=value)
    args: Any = parser.parse_args(argv)
    text = render(
        transcripts(
            args.n,
            args.seed,
            n_terms=args.n_terms,
            max_operand=args.max_operand,
            env_seed=args.env_seed,
            n_eval=args.n_eval,
        )
    )
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'current' if same else 'differs from what the generator writes'}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"{args.out}: {args.n} transcripts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
