"""The environments' `InferenceContext` over an inference backend, for one sampling call.

Environments call `ctx.generate(GenerationRequest(...))` (`pipeline.environments.InferenceContext`); this adapter
adds the lesson's sampling controls, forwards the request to the backend, counts the tokens sampled, and collects
the policy steps an external server reported during the call. Multi-turn chat environments call `ctx.chat(ChatRequest)`
(`pipeline.environments.chat`): answered by the backend's `/v1/chat/completions` client when it has one, else by
rendering the tokenizer's chat template locally.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipeline.environments.base import Completion
from pipeline.environments.chat import ChatRequest, ChatTurn, local_chat
from policy.inference.base import NO_CONTROLS, GenerationRequest, InferenceBackend, SamplingControls


class BackendContext:
    """The `InferenceContext` an environment sees: `tokenizer` plus `generate` through `backend`."""

    def __init__(self, tokenizer: Any, backend: InferenceBackend, controls: SamplingControls = NO_CONTROLS) -> None:
        """`controls` (top-p / top-k / min-p) apply to every `generate` call of this context."""
        self.tokenizer = tokenizer
        self.backend = backend
        self.controls = controls
        self.generated_tokens = 0
        self.calls = 0
        self.served_steps: set[int] = set()
        self.policy_step: int | None = None
        """The policy step the caller samples with (set by the rollout manager; read by the generate endpoint)."""
        self.max_seq_len: int | None = None
        """The backend's sequence limit (set by the rollout manager; the generate endpoint refuses longer prompts)."""

    def generate(self, request: GenerationRequest) -> list[list[Completion]]:
        """`request.n` completions per prompt (see `policy.inference.base`; a too-long prompt raises
        PromptTooLongError). The context's controls apply unless the request sets its own."""
        if request.controls.is_default and not self.controls.is_default:
            request = dataclasses.replace(request, controls=self.controls)
        out = self.backend.generate(request)
        self.calls += 1
        self.generated_tokens += sum(len(c.tokens) for comps in out for c in comps)
        if self.backend.last_served_steps:
            self.served_steps |= set(self.backend.last_served_steps)
        return out

    def chat(self, request: ChatRequest) -> list[ChatTurn]:
        """The next assistant turn of each conversation (`pipeline.environments.chat.chat_turns`): the backend's own
        chat client when it has one (`OpenAIBackend.chat`), else `local_chat` through `generate`. The context's
        controls apply unless the request sets its own."""
        if request.controls.is_default and not self.controls.is_default:
            request = dataclasses.replace(request, controls=self.controls)
        backend_chat = getattr(self.backend, "chat", None)
        if not callable(backend_chat):
            return local_chat(self, request)  # counts through self.generate
        turns: list[ChatTurn] = backend_chat(request)
        self.calls += 1
        self.generated_tokens += sum(len(t.completion.tokens) for t in turns)
        if self.backend.last_served_steps:
            self.served_steps |= set(self.backend.last_served_steps)
        return turns
