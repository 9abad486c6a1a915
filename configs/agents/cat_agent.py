"""An OpenAI-speaking agent for the `agent` environment (configs/agent_example.yaml): it asks the served policy, through
the real `openai` SDK, to talk about cats, and prints its result as one JSON line.

The environment runs it once per episode with the task as JSON on stdin and `OPENAI_BASE_URL` / `OPENAI_API_KEY`
set (any OpenAI program works the same way). A task's `turns` (default 1) is how many user turns it plays: each
later turn sends the conversation so far plus "More." (those inserted tokens are trained with loss mask 0).

Reward: `cats` (how often the replies say "cat", at most 4, over 4) plus 0.1 x `brief` (1 - the replies' length
over 64 characters), each recorded as its own reward component.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from openai import OpenAI


def play(task: dict[str, Any], client: OpenAI) -> dict[str, Any]:
    """Play one episode of `task` against the endpoint `client` talks to; return the result object."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": str(task["prompt"])}]
    replies = []
    for turn in range(int(task.get("turns", 1))):
        if turn:
            messages.append({"role": "user", "content": "More."})
        reply = client.chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]
        text = reply.choices[0].message.content or ""
        replies.append(text)
        messages.append({"role": "assistant", "content": text})
    said = " ".join(replies)
    cats = min(said.lower().count("cat"), 4) / 4
    brief = max(0.0, 1.0 - len(said) / 64)
    return {
        "reward": cats + 0.1 * brief,
        "reward_components": {"cats": cats, "brief": brief},
        "answer": said,
    }


def run(task: dict[str, Any], *, base_url: str, api_key: str) -> dict[str, Any]:
    """The entry-point form (`entry_point: cat_agent:run`): the same episode, called in a thread."""
    return play(task, OpenAI(base_url=base_url, api_key=api_key, max_retries=0))


if __name__ == "__main__":
    # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment, as for any OpenAI program.
    print(json.dumps(play(json.load(sys.stdin), OpenAI(max_retries=0))))
