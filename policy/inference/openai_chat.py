"""The chat client of the openai / server backends: `POST /v1/chat/completions` with tools, token ids and logprobs.

Used by `OpenAIBackend.chat(ChatRequest)` (`pipeline.environments.chat`): one request per conversation (`n = 1`).

Request (vLLM's OpenAI-compatible server, pinned 0.10.x; reference:
https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html#chat-api and the request fields of
`vllm/entrypoints/openai/protocol.py` `ChatCompletionRequest`): `messages`, `tools` + `tool_choice: "auto"` when
tools are offered, `temperature`, `max_tokens`, `seed`, `logprobs: true`, and vLLM's extensions
`return_token_ids: true` (the response then carries `prompt_token_ids` and each choice's `token_ids`; vLLM >=
0.10.2), `return_tokens_as_token_ids: true` (logprob entries named `token_id:<id>`), `stop_token_ids`,
`skip_special_tokens: false`, `include_stop_str_in_output: true`; top-p / top-k / min-p as `top_p`, `top_k`,
`min_p` (also SGLang's names: https://docs.sglang.ai/backend/openai_api_completions.html). The server must run
with a tool parser for the model (vLLM `--enable-auto-tool-choice --tool-call-parser hermes`; SGLang
`--tool-call-parser qwen25`).

Response, per choice: `message` (`content`, `tool_calls` with `function.arguments` a JSON string),
`finish_reason` ("stop", "length", "tool_calls"), `logprobs.content[i] = {"token", "logprob", ...}`.

Exactness, never re-tokenising sampled text:
- completion ids: the choice's `token_ids`; else the `token_id:<id>` names of `logprobs.content`; else logprob
  token strings that are vocabulary entries (exact lookup; anything else raises `OpenAIResponseError`);
  logprobs: `logprobs.content[i].logprob`, one per id (fewer raises).
- prompt ids: the response's (or choice's) `prompt_token_ids`; else, for servers that do not return them (vLLM
  before `return_token_ids` existed, the pinned 0.10.1.1 included, and servers without the extension), the
  conversation rendered with the local tokenizer's chat template — accepted only when its length equals the
  server's `usage.prompt_tokens` (otherwise, or without a local chat template, `OpenAIResponseError`).
- the output is cut after the first stop token (kept); finish "stop" when cut or the server said "stop" /
  "tool_calls", else "length".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pipeline.environments.base import Completion
from pipeline.environments.chat import ChatRequest, ChatTurn, assistant_message
from policy.inference.base import NO_CONTROLS, PromptTooLongError, SamplingControls, truncate_at_stop


def chat_body(
    model: str,
    messages: Sequence[Any],
    request: ChatRequest,
    stops: list[int],
    seed: int,
    controls: SamplingControls = NO_CONTROLS,
) -> dict[str, Any]:
    """The JSON body of one `/v1/chat/completions` request (see the module docstring)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [dict(m) for m in messages],
        "n": 1,
        "temperature": request.temperature,
        "max_tokens": request.max_tokens,
        "seed": seed,
        "logprobs": True,
        "stream": False,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "stop_token_ids": stops,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    if request.tools:
        body["tools"] = [dict(t) for t in request.tools]
        body["tool_choice"] = "auto"
    if not controls.is_default:
        body.update(top_p=controls.top_p, top_k=controls.top_k or -1, min_p=controls.min_p)
    return body


def chat_budget(tokenizer: Any, max_seq_len: int | None, k: int, conv: Any, request: ChatRequest) -> ChatRequest:
    """`request` with `max_tokens` cut to `max_seq_len - len(prompt)`, the prompt length estimated with the local
    chat template (when there is one and `max_seq_len` is set); PromptTooLongError (conversation `k`) when nothing
    fits."""
    if max_seq_len is None or not getattr(tokenizer, "chat_template", None):
        return request
    from pipeline.environments.tokenizer import render_chat

    tools = [dict(t) for t in request.tools] if request.tools else None
    n = len(render_chat(tokenizer, [dict(m) for m in conv], tools))
    if n >= max_seq_len:
        raise PromptTooLongError(k, n, max_seq_len)
    budget = min(request.max_tokens, max_seq_len - n)
    return request if budget == request.max_tokens else dataclasses.replace(request, max_tokens=budget)


def chat_prompt_ids(
    payload: dict[str, Any], choice: dict[str, Any], messages: Sequence[Any], request: ChatRequest, tokenizer: Any
) -> list[int] | str:
    """The prompt ids the server conditioned on, or a string saying why they cannot be known exactly."""
    got = payload.get("prompt_token_ids")
    if got is None:
        got = choice.get("prompt_token_ids")
    if got is not None:
        return [int(t) for t in got]
    counted = (payload.get("usage") or {}).get("prompt_tokens")
    if counted is None or not getattr(tokenizer, "chat_template", None):
        return "the server returned no prompt_token_ids (vLLM >= 0.10.2 with return_token_ids does)"
    from pipeline.environments.tokenizer import render_chat

    tools = [dict(t) for t in request.tools] if request.tools else None
    local = render_chat(tokenizer, [dict(m) for m in messages], tools)
    if len(local) != int(counted):
        return (
            f"the server returned no prompt_token_ids and counted {counted} prompt tokens, but the local chat "
            f"template renders {len(local)}"
        )
    return local


def chat_completion(
    choice: dict[str, Any], token_ids: list[int], max_tokens: int, stops: list[int]
) -> Completion | str:
    """The `Completion` of one chat choice whose sampled ids are `token_ids`, or a string saying what is wrong."""
    content = (choice.get("logprobs") or {}).get("content")
    if content is None or len(content) < len(token_ids) or any(c.get("logprob") is None for c in content):
        return f"{len(token_ids)} tokens but {None if content is None else len(content)} logprobs"
    logprobs = [float(c["logprob"]) for c in content[: len(token_ids)]]
    ids, logprobs, stopped = truncate_at_stop(token_ids, logprobs, stops)
    if not ids:
        return "no tokens came back"
    server_reason = str(choice.get("finish_reason") or "")
    if stopped or server_reason in ("stop", "tool_calls"):
        reason = "stop"
    elif server_reason == "length" or len(ids) >= max_tokens:
        reason = "length"
    else:
        return f"unexpected finish_reason {server_reason!r}"
    return Completion(tokens=ids, logprobs=logprobs, finish_reason=reason)


def chat_message(choice: dict[str, Any]) -> dict[str, Any]:
    """The assistant message of a choice, as an environment appends it to its conversation."""
    msg = choice.get("message") or {}
    calls = []
    for c in msg.get("tool_calls") or []:
        fn = c.get("function") or {}
        calls.append(
            {
                "id": str(c.get("id", "")),
                "type": "function",
                "function": {"name": str(fn.get("name", "")), "arguments": str(fn.get("arguments", "{}"))},
            }
        )
    return assistant_message(str(msg.get("content") or ""), calls)


def chat_turn(prompt: list[int], completion: Completion, choice: dict[str, Any]) -> ChatTurn:
    """The `ChatTurn` of one parsed choice."""
    return ChatTurn(prompt_tokens=prompt, completion=completion, message=chat_message(choice))
