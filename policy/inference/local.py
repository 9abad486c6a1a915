"""What every in-process backend shares: request checks, one row per sample, the missing-sample check, stats.

An in-process backend implements `_generate_rows` (one completion, or None when it failed, per `SampleRow`);
`LocalBackend.generate` turns a `GenerationRequest` into rows (prompt i, sample j -> PRNG id `i * n + j`, token
budget cut at `max_seq_len`) and back into completions, raising `PromptTooLongError` before any work and
`GenerationError` naming every sample that did not come back.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from pipeline.environments.base import Completion
from policy.inference.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationError,
    GenerationRequest,
    InferenceBackend,
    PromptTooLongError,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SampleRow:
    """One sample to produce: prompt `prompt_index`, sample `sample_index`, its token budget and PRNG id."""

    prompt_index: int
    sample_index: int
    prompt: list[int]
    max_tokens: int
    sample_id: int


class LocalBackend(InferenceBackend):
    """An in-process backend sampling from a model held in this process."""

    def __init__(self, tokenizer: object, max_seq_len: int, vocab_size: int) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.max_seq_len = int(max_seq_len)
        self.vocab_size = int(vocab_size)

    def generate(self, request: GenerationRequest) -> list[list[Completion]]:
        """`n` completions per prompt, in order (each non-empty, with per-token logprobs of logits/T)."""
        stops = self._resolve_stops(request.stop_tokens)
        rows = self._rows(request)
        if not rows:
            return []
        t0 = time.perf_counter()
        results = self._generate_rows(rows, request, stops)
        elapsed = time.perf_counter() - t0
        out: list[list[Completion]] = [[] for _ in request.prompts]
        missing: list[tuple[int, int]] = []
        for row, comp in zip(rows, results, strict=True):
            if comp is None or not comp.tokens or len(comp.tokens) != len(comp.logprobs):
                missing.append((row.prompt_index, row.sample_index))
            else:
                out[row.prompt_index].append(comp)
        if missing:
            msg = f"{self.name}: {len(missing)} of {len(rows)} samples missing (prompt, sample): {missing[:10]}"
            raise GenerationError(msg, missing)
        n_tok = sum(len(c.tokens) for c in results if c is not None)
        self.stats.calls += 1
        self.stats.completions += len(rows)
        self.stats.prompt_tokens += sum(len(r.prompt) for r in rows)
        self.stats.generated_tokens += n_tok
        self.stats.seconds += elapsed
        logger.info(
            "%s: %d prompts x %d -> %d tokens in %.2fs (%.1f tok/s)",
            self.name,
            len(request.prompts),
            request.n,
            n_tok,
            elapsed,
            n_tok / max(elapsed, 1e-9),
        )
        return out

    def _rows(self, request: GenerationRequest) -> list[SampleRow]:
        """One row per sample; raises ValueError (empty prompt, id out of vocabulary) or PromptTooLongError."""
        n = request.n
        rows: list[SampleRow] = []
        for i, p in enumerate(request.prompts):
            prompt = [int(t) for t in p]
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size}): {bad[:5]}")
            if len(prompt) >= self.max_seq_len:
                raise PromptTooLongError(i, len(prompt), self.max_seq_len)
            budget = min(request.max_tokens, self.max_seq_len - len(prompt))
            rows.extend(SampleRow(i, j, prompt, budget, i * n + j) for j in range(n))
        return rows

    def _resolve_stops(self, stop_tokens: Sequence[int] | None) -> list[int]:
        if stop_tokens is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            return [] if eos is None else [int(eos)]
        return sorted({int(t) for t in stop_tokens})

    @staticmethod
    def _completion(tokens: Iterable[Any], logprobs: Iterable[Any], stops: Sequence[int]) -> Completion:
        """A completion of `tokens` (ints) and `logprobs` (floats); "stop" iff the last token is a stop token."""
        toks = [int(t) for t in tokens]
        reason = FINISH_STOP if toks and toks[-1] in set(stops) else FINISH_LENGTH
        return Completion(tokens=toks, logprobs=[float(x) for x in logprobs], finish_reason=reason)

    @abc.abstractmethod
    def _generate_rows(
        self, rows: list[SampleRow], request: GenerationRequest, stops: list[int]
    ) -> list[Completion | None]:
        """One completion per row (None: failed to produce it), sampled as `request` says (temperature, seed,
        controls; `stops` resolved)."""
