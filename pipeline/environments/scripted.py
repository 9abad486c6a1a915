"""`ScriptedContext`: an `InferenceContext` answering from scripted texts, for tests of environments.

It stands in for the external inference engine (which environments only see through `InferenceContext`),
cutting each scripted text at stop tokens and `max_tokens` the way a real engine does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pipeline.environments.base import Completion, effective_stop_tokens
from pipeline.environments.generation import GenerationRequest

Script = Callable[[str], str]
"""A function of the decoded prompt (prompt + earlier turns) returning the response text."""


class ScriptedContext:
    """An `InferenceContext` answering from scripted texts, for unit tests of environments' scoring.

    `script` is a list of response texts consumed in order (one per requested completion, cycling) or a
    function of the decoded prompt (prompt + earlier turns). Each text is encoded, EOS appended, then cut
    like a real engine: at the first stop token (kept; finish 'stop') or at `max_tokens` (finish 'length').
    Logprobs are `logprob` per token. `fail` (an exception) is raised by every `generate` call. Calls are
    recorded in `calls` as (prompts, kwargs).
    """

    def __init__(
        self,
        tokenizer: Any,
        script: Sequence[str] | Script,
        *,
        logprob: float = -1.0,
        fail: Exception | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.logprob = logprob
        self.fail = fail
        self.calls: list[tuple[list[list[int]], dict[str, Any]]] = []
        self._next = 0

    def _text(self, prompt_text: str) -> str:
        if callable(self.script):
            return self.script(prompt_text)
        texts = list(self.script)
        text = texts[self._next % len(texts)]
        self._next += 1
        return text

    def generate(self, request: GenerationRequest) -> list[list[Completion]]:
        prompts, n, stop_tokens, max_tokens = request.prompts, request.n, request.stop_tokens, request.max_tokens
        self.calls.append(
            (
                [list(p) for p in prompts],
                {
                    "n": n,
                    "temperature": request.temperature,
                    "max_tokens": request.max_tokens,
                    "stop_tokens": stop_tokens,
                    "seed": request.seed,
                },
            )
        )
        if self.fail is not None:
            raise self.fail
        stop = effective_stop_tokens(self.tokenizer, stop_tokens)
        eos = self.tokenizer.eos_token_id
        out: list[list[Completion]] = []
        for p in prompts:
            prompt_text = str(self.tokenizer.decode(list(p)))
            comps = []
            for _ in range(n):
                toks = [int(t) for t in self.tokenizer.encode(self._text(prompt_text))] + [int(eos)]
                finish = "length"
                for i, t in enumerate(toks):
                    if t in stop:
                        toks, finish = toks[: i + 1], "stop"
                        break
                if len(toks) > max_tokens:
                    toks, finish = toks[:max_tokens], "length"
                comps.append(Completion(toks, [self.logprob] * len(toks), finish))
            out.append(comps)
        return out
