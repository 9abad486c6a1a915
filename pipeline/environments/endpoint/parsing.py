"""Request parsing and validation for the generate endpoint's routes: every field a client sends is checked here,
and a wrong one is refused with a 400 naming it (`errors.bad`; `prefix` says where a field sits, e.g.
`sampling_params.`). Pure functions of the request (and the served tokenizer where a prompt is encoded or
rendered): no server, no sampler.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.environments.base import effective_stop_tokens, encode_prompt
from pipeline.environments.endpoint.errors import EndpointError, bad
from pipeline.environments.generation import NO_CONTROLS, SamplingControls

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """The sampling settings common to every route: choices per prompt, temperature, top-p/top-k/min-p, seed."""

    n: int = 1
    temperature: float = 1.0
    controls: SamplingControls = NO_CONTROLS
    seed: int | None = None


def json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object (400 on `body` otherwise)."""
    try:
        request = json.loads(body or b"null")
    except ValueError as e:
        raise bad("body", f"is not JSON ({e})") from None
    if not isinstance(request, dict):
        raise bad("body", "must be a JSON object")
    return request


def token_ids(value: Any, name: str) -> list[int]:
    """A non-empty list of integer token ids."""
    if not isinstance(value, list) or not value:
        raise bad(name, "must be a non-empty list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad(name, "must be a list of integers")
    return [int(t) for t in value]


def number(req: Mapping[str, Any], name: str, prefix: str, default: float, *, low: float) -> float:
    """`req[name]`, a finite number >= `low` (`default` when absent or null)."""
    v = req.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < low:
        raise bad(f"{prefix}{name}", f"must be a number >= {low}, got {v!r}")
    return float(v)


def integer(req: Mapping[str, Any], name: str, prefix: str, default: int, *, low: int) -> int:
    """`req[name]`, an integer >= `low` (`default` when absent or null; a boolean is refused)."""
    v = req.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise bad(f"{prefix}{name}", f"must be an integer >= {low}, got {v!r}")
    return int(v)


def flag(req: Mapping[str, Any], name: str) -> bool:
    """`req[name]`, a boolean (False when absent or null)."""
    v = req.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(name, f"must be a boolean, got {v!r}")
    return v


def messages(value: Any) -> list[dict[str, Any]]:
    """Chat messages: a non-empty list of objects with a known role; content a string, null, or a list of text
    parts (joined into one string)."""
    if not isinstance(value, list) or not value:
        raise bad("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"must be system, user, assistant or tool, got {role!r}")
        msg = dict(m)
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for k, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content[{k}]", "only text parts are supported")
                texts.append(part["text"])
            msg["content"] = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise bad(f"messages[{i}].content", "must be a string, a list of text parts or null")
        out.append(msg)
    return out


def sampling_settings(req: Mapping[str, Any], prefix: str = "") -> SamplingSettings:
    """The settings every route shares (`n`, `temperature`, `top_p`, `top_k` (-1 or 0: off), `min_p`, `seed`)."""
    n = integer(req, "n", prefix, 1, low=1)
    temperature = number(req, "temperature", prefix, 1.0, low=0.0)
    top_p = number(req, "top_p", prefix, 1.0, low=0.0)
    top_k = integer(req, "top_k", prefix, 0, low=-1)
    min_p = number(req, "min_p", prefix, 0.0, low=0.0)
    try:
        controls = SamplingControls(top_p=top_p, top_k=max(top_k, 0), min_p=min_p)
    except ValueError as e:
        raise bad(f"{prefix}top_p/top_k/min_p", str(e)) from None
    seed = req.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad(f"{prefix}seed", "must be an integer")
    return SamplingSettings(n, temperature, controls, seed)


def stop_tokens(req: Mapping[str, Any], tokenizer: Any, prefix: str = "") -> list[int]:
    """vLLM's rule: generation stops at EOS (unless `ignore_eos`) and at every `stop_token_ids` id. Stop strings
    are refused: honouring them would mean cutting sampled tokens by their text."""
    stop = req.get("stop")
    if stop not in (None, [], ""):
        raise bad(f"{prefix}stop", "stop strings are not supported; use stop_token_ids")
    ids = req.get("stop_token_ids")
    if ids is None:
        ids = []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad(f"{prefix}stop_token_ids", "must be a list of integers")
    ignore_eos = req.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad(f"{prefix}ignore_eos", "must be a boolean")
    base = set() if ignore_eos else effective_stop_tokens(tokenizer, None)
    return sorted(base | {int(t) for t in ids})


def max_new_tokens(req: Mapping[str, Any], prefix: str = "", *names: str) -> int | None:
    """The first of `names` (default `max_tokens`) the request sets, an integer >= 1; None when none is set."""
    for name in names or ("max_tokens",):
        if req.get(name) is not None:
            return integer(req, name, prefix, 1, low=1)
    return None


def completion_prompt(tokenizer: Any, prompt: Any, add_special: bool) -> list[int]:
    """A completions prompt as ids: a string encoded once (BOS as in training unless `add_special` is False), a
    list of ids as given, a batch of one as its one prompt."""
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt, add_bos=add_special)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return completion_prompt(tokenizer, prompt[0], add_special)  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return token_ids(prompt, "prompt")
    raise bad("prompt", "must be a string or a list of token ids (one prompt per request)")


def chat_prompt(tokenizer: Any, req: Mapping[str, Any]) -> list[int]:
    """A chat request's `messages` (and `tools`) rendered by the tokenizer's chat template (400 on `messages` when
    the tokenizer has none or cannot render them)."""
    from pipeline.environments.tokenizer import has_chat_template, render_chat

    msgs = messages(req.get("messages"))
    tools = req.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise bad("tools", "must be a list of objects")
    if not has_chat_template(tokenizer):
        raise bad("messages", "the served tokenizer has no chat template; use /v1/completions")
    try:
        return render_chat(tokenizer, msgs, tools or None)
    except Exception as e:
        raise bad("messages", f"the chat template cannot render them: {type(e).__name__}: {e}") from None


def vocab_size(tokenizer: Any) -> int | None:
    """`len(tokenizer)`, or None for a tokenizer without a length."""
    try:
        return len(tokenizer)
    except TypeError:
        return None


def check_prompt(prompt: Sequence[int], *, max_seq_len: int, tokenizer: Any, param: str = "prompt") -> list[int]:
    """The prompt's ids, refused (400 on `param`) when empty, when `max_seq_len` leaves no room to generate after
    it, or when an id is outside the tokenizer's vocabulary."""
    ids = [int(t) for t in prompt]
    if not ids:
        raise bad(param, "is empty")
    if len(ids) >= max_seq_len:
        raise EndpointError(
            400,
            f"{param}: the prompt has {len(ids)} tokens, but max_seq_len={max_seq_len} leaves no room to "
            f"generate (at most {max_seq_len - 1} prompt tokens)",
            param,
        )
    vocab = vocab_size(tokenizer)
    if vocab is not None and (out := [t for t in ids if not 0 <= t < vocab]):
        raise bad(param, f"token id {out[0]} is outside the vocabulary [0, {vocab})")
    return ids
