"""Chat turns with tool calls, for multi-turn environments of instruct models.

An environment holding OpenAI-style conversations (`{"role": "user" | "assistant" | "tool" | "system", ...}`)
asks for the next assistant turn of each with `chat_turns(ctx, ChatRequest(...))`:

- a context whose backend speaks `/v1/chat/completions` (`policy.inference.openai.OpenAIBackend.chat`) answers it
  itself (`ctx.chat`): the server renders the conversation and parses tool calls, and returns the exact prompt
  ids it conditioned on, the sampled ids and their logprobs;
- any other context (in-process backends, `ScriptedContext`) gets the same from `local_chat`: the conversation
  is rendered with the tokenizer's chat template (`pipeline.environments.tokenizer.render_chat`), sampled with
  `ctx.generate`, and tool calls are parsed from `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks of the sampled text (the built-in tokenizer's template format, also Hermes/Qwen's). A request that
  carries a conversation's transcript so far (`ChatRequest.prefixes`) is continued on those exact ids
  (`continue_transcript`): only the messages after its last assistant turn are rendered, so the model's own
  sampled ids are never re-tokenised (a turn sampled as ids the tokenizer would not produce for its text, or
  with text the template would place elsewhere, re-renders to other ids). A request's conversations are rendered
  together (`chat_prompts`: one batched template call per generation-prompt flag, one tokenizer call for the
  distinct texts), each to the ids it gets alone.

Each `ChatTurn` carries `prompt_tokens` (the whole rendered conversation), the `Completion` (sampled ids, logprobs,
finish reason; a stop token is kept) and the assistant `message` (`content`, and `tool_calls` as OpenAI's
`[{"id", "type": "function", "function": {"name", "arguments": JSON string}}]`).

`ChatTranscript` turns the turns of one conversation into one rollout: the first turn's prompt is the rollout
prompt; each later turn's prompt must start with everything before it (prompt + earlier tokens) — the tokens it
adds (tool results, the template's role headers) go into the response with logprob 0.0 and loss mask 0, and the
sampled tokens with their logprobs and mask 1. A later prompt that does not extend the transcript (a server whose
chat template re-renders earlier turns differently from how they were sampled) raises `TranscriptMismatch`:
nothing is ever re-tokenised to paper over it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.environments.base import Completion, check_completions, effective_stop_tokens
from pipeline.environments.generation import NO_CONTROLS, GenerationRequest, SamplingControls, check_budget

Message = dict[str, Any]

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """The next assistant turn of each conversation (one sample each), with `tools` (OpenAI function schemas,
    `[{"type": "function", "function": {"name", "description", "parameters"}}]`) offered to the model.
    `stop_tokens=None`: the tokenizer's EOS. `prefixes`: for each conversation, its transcript so far (the previous
    turn's prompt ids, sampled ids and inserted ids; None or empty for a first turn), which local rendering
    continues instead of re-rendering the sampled turns (`continue_transcript`); a server renders the whole
    conversation itself. Raises ValueError for `max_tokens < 1`, `temperature < 0`, or `prefixes` of another
    length than `conversations`."""

    conversations: Sequence[Sequence[Mapping[str, Any]]]
    tools: Sequence[Mapping[str, Any]] | None
    temperature: float
    max_tokens: int
    seed: int
    stop_tokens: Sequence[int] | None = None
    controls: SamplingControls = NO_CONTROLS
    prefixes: Sequence[Sequence[int] | None] | None = None

    def __post_init__(self) -> None:
        check_budget(self.max_tokens, self.temperature)
        if self.prefixes is not None and len(self.prefixes) != len(self.conversations):
            raise ValueError(f"{len(self.prefixes)} prefixes for {len(self.conversations)} conversations")


@dataclasses.dataclass
class ChatTurn:
    """One sampled assistant turn: the exact prompt ids it was conditioned on, the completion and the message."""

    prompt_tokens: list[int]
    completion: Completion
    message: Message


class TranscriptMismatch(ValueError):
    """A turn's prompt does not start with the transcript so far (prompt + earlier turns and insertions)."""


def parse_tool_calls(text: str, *, id_prefix: str = "call") -> tuple[str, list[Message]]:
    """(content, tool_calls) of an assistant text with `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
    blocks: the content is the text outside the blocks (stripped); each well-formed block becomes an OpenAI tool
    call with `arguments` as a JSON string and id `<id_prefix>_<k>`. A block that is not a JSON object with a
    string `name` stays in the content (the model did not make a call)."""
    calls: list[Message] = []
    kept: list[str] = []
    pos = 0
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(
            {
                "id": f"{id_prefix}_{len(calls)}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


def assistant_message(content: str, tool_calls: Sequence[Message]) -> Message:
    """An OpenAI assistant message (`tool_calls` only when there are some)."""
    msg: Message = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = [dict(c) for c in tool_calls]
    return msg


def _continuation_renders(messages: list[Message]) -> list[tuple[list[Message], bool]]:
    """What `continue_transcript` renders of a conversation, as (messages, generation prompt): the conversation up
    to its last assistant message, the whole conversation (generation prompt), the conversation before that
    message (generation prompt), and that with an empty assistant message. ValueError without an assistant
    message."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        raise ValueError("a transcript is continued after an assistant message; the conversation has none")
    empty: Message = {"role": "assistant", "content": ""}
    return [
        (messages[: last + 1], False),
        (messages, True),
        (messages[:last], True),
        ([*messages[:last], empty], False),
    ]


def _continued(
    prefix: Sequence[int], head: list[int], full: list[int], opened: list[int], empty: list[int]
) -> list[int]:
    """`continue_transcript`'s prompt from the four renderings of `_continuation_renders`."""
    if full[: len(head)] != head or empty[: len(opened)] != opened:
        raise TranscriptMismatch("the chat template does not render later messages after the earlier ones unchanged")
    close = empty[len(opened) :]  # how the template ends an assistant turn (e.g. its EOS)
    have = next(k for k in range(len(close), -1, -1) if k == 0 or list(prefix[-k:]) == close[:k])
    return [*(int(t) for t in prefix), *close[have:], *full[len(head) :]]


def chat_prompts(
    tok: Any,
    conversations: Sequence[list[Message]],
    tools: list[Message] | None,
    prefixes: Sequence[Sequence[int] | None],
) -> list[list[int]]:
    """The prompt of each conversation: `continue_transcript` on its prefix, or `render_chat` where the prefix is
    None. Each prompt is the ids those functions give the conversation alone, and a failure raises what they
    raise (of the first failing conversation when it is the only kind of failure), at the cost of one
    `pipeline.environments.tokenizer.render_chats` call (two batched template calls and one tokenizer call)
    instead of up to four template and tokenizer calls per conversation."""
    from pipeline.environments.tokenizer import render_chats  # refuses a tokenizer without a chat template

    wanted = [
        [(conv, True)] if prefix is None else _continuation_renders(conv)
        for conv, prefix in zip(conversations, prefixes, strict=True)
    ]
    rendered = iter(render_chats(tok, [chat for want in wanted for chat in want], tools))
    prompts = []
    for want, prefix in zip(wanted, prefixes, strict=True):
        got = [next(rendered) for _ in want]
        prompts.append(got[0] if prefix is None else _continued(prefix, *got))
    return prompts


def continue_transcript(
    tok: Any, messages: list[Message], tools: list[Message] | None, prefix: Sequence[int]
) -> list[int]:
    """The next turn's prompt of a conversation whose ids so far are `prefix` (ending with its last assistant turn
    as sampled): `prefix`, then the end-of-turn ids the chat template closes an assistant turn with that `prefix`
    does not already end with (a turn cut at `max_tokens` has none; one that stopped has the stop id), then the
    template's rendering of the messages after the last assistant message with the generation prompt. The
    sampled ids are kept as they are, so the prompt always extends the transcript. Raises ValueError when
    `messages` has no assistant message or the tokenizer no chat template, `TranscriptMismatch` when the template
    does not render later messages after the earlier ones unchanged (so no continuation exists). Many
    conversations at once: `chat_prompts`."""
    return chat_prompts(tok, [messages], tools, [prefix])[0]


def local_chat(ctx: Any, request: ChatRequest) -> list[ChatTurn]:
    """The next assistant turn of each conversation through `ctx.generate`, the prompts rendered by the tokenizer's
    chat template (a conversation with a prefix continued on it: `continue_transcript`; all at once:
    `chat_prompts`) and tool calls parsed from the sampled text (`parse_tool_calls`). ValueError when the
    tokenizer has no chat template; `ctx.generate`'s errors propagate."""
    tok = ctx.tokenizer
    tools = [dict(t) for t in request.tools] if request.tools else None
    if not request.conversations:
        return []
    prefixes = [p or None for p in request.prefixes or [None] * len(request.conversations)]  # empty: a first turn
    prompts = chat_prompts(tok, [[dict(m) for m in conv] for conv in request.conversations], tools, prefixes)
    outs = check_completions(
        ctx.generate(
            GenerationRequest(
                prompts,
                n=1,
                temperature=request.temperature,
                max_tokens=request.max_tokens,
                stop_tokens=request.stop_tokens,
                seed=request.seed,
                controls=request.controls,
            )
        ),
        len(prompts),
        1,
    )
    stop = effective_stop_tokens(tok, request.stop_tokens)
    turns = []
    for k, (prompt, [comp]) in enumerate(zip(prompts, outs, strict=True)):
        body = [t for t in comp.tokens if t not in stop]
        content, calls = parse_tool_calls(str(tok.decode(body)), id_prefix=f"call_{k}")
        turns.append(ChatTurn(prompt, comp, assistant_message(content, calls)))
    return turns


def chat_turns(ctx: Any, request: ChatRequest) -> list[ChatTurn]:
    """The next assistant turn of each conversation: `ctx.chat(request)` when the context has it, else
    `local_chat(ctx, request)`. Exactly one turn per conversation, in order (ValueError otherwise)."""
    chat = getattr(ctx, "chat", None)
    turns = chat(request) if callable(chat) else local_chat(ctx, request)
    if len(turns) != len(request.conversations):
        raise ValueError(f"chat returned {len(turns)} turns for {len(request.conversations)} conversations")
    return list(turns)


@dataclasses.dataclass
class ChatTranscript:
    """One conversation's rollout tokens, built turn by turn (see the module docstring)."""

    prompt_tokens: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    turns: int = 0

    def add(self, turn: ChatTurn) -> None:
        """Append one turn: the tokens its prompt adds to the transcript (mask 0, logprob 0.0), then its sampled
        tokens (mask 1). Raises TranscriptMismatch when the prompt does not extend the transcript, ValueError when
        the completion's tokens and logprobs disagree in length."""
        comp = turn.completion
        if len(comp.tokens) != len(comp.logprobs):
            raise ValueError(f"completion has {len(comp.tokens)} tokens but {len(comp.logprobs)} logprobs")
        prompt = [int(t) for t in turn.prompt_tokens]
        if self.turns == 0:
            self.prompt_tokens = prompt
        else:
            sofar = self.prompt_tokens + self.tokens
            if prompt[: len(sofar)] != sofar:
                at = next((i for i, (a, b) in enumerate(zip(prompt, sofar, strict=False)) if a != b), len(prompt))
                raise TranscriptMismatch(
                    f"turn {self.turns}: the prompt ({len(prompt)} tokens) does not extend the transcript "
                    f"({len(sofar)} tokens; first difference at token {at}): the chat template re-renders earlier "
                    "turns differently from how they were sampled"
                )
            inserted = prompt[len(sofar) :]
            self.tokens += inserted
            self.logprobs += [0.0] * len(inserted)
            self.mask += [0] * len(inserted)
        self.tokens += [int(t) for t in comp.tokens]
        self.logprobs += [float(x) for x in comp.logprobs]
        self.mask += [1] * len(comp.tokens)
        self.turns += 1
