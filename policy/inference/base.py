"""The one inference backend protocol: a `GenerationRequest` in, token ids + per-token logprobs out.

Promises of every backend (`InferenceBackend.generate`):

- It returns, for each prompt of the request in order, exactly `request.n` `Completion`s, each with at least one
  token, token ids as sampled (never re-tokenised text) and one logprob per token; a sample the backend failed
  to produce raises `GenerationError` naming it (never an empty or missing completion).
- logprob of token t = `log softmax(logits_t / T)[token_t]` (float32); at `T = 0` sampling is greedy and the
  logprob is that of the untempered distribution (T treated as 1), matching `policy.model.teacher_forced_logprobs`.
- A stop token ends a completion and is included in it (`finish_reason="stop"`); otherwise the completion has
  `max_tokens` tokens (`finish_reason="length"`). When `len(prompt) + max_tokens` exceeds the backend's
  `max_seq_len` the budget of that prompt is cut to `max_seq_len - len(prompt)` ("length"). A prompt of length
  >= `max_seq_len` raises `PromptTooLongError` before anything is generated.
- `stop_tokens=None` means the tokenizer's EOS; `[]` means no stop token.
- In-process backends: sample j of prompt i uses the PRNG stream `fold_in(PRNGKey(seed), i * n + j)`.

Weights: an in-process backend samples from the model last given to `update_model`. A backend whose server owns
the weights says so (`external_weights = True`) and reports the policy step it serves (`served_policy_step()`
before a call, `last_served_steps` during the last call); the rollout manager tags rows with it.

The backends live in their own modules (`dense`, `levanter_engine`, `openai`), each registered for its config
class (`policy.inference.registry`).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

from pipeline.environments.base import Completion
from pipeline.environments.generation import NO_CONTROLS, GenerationRequest, SamplingControls

__all__ = [
    "NO_CONTROLS",
    "BackendBuild",
    "GenerationError",
    "GenerationRequest",
    "GenerationStats",
    "InferenceBackend",
    "PromptTooLongError",
    "SamplingControls",
]

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


class GenerationError(RuntimeError):
    """Some requested samples did not come back; `missing` lists (prompt index, sample index)."""

    def __init__(self, message: str, missing: Sequence[tuple[int, int]] = ()) -> None:
        super().__init__(message)
        self.missing = list(missing)


class PromptTooLongError(ValueError):
    """A prompt leaves no room for a generated token within max_seq_len."""

    def __init__(self, prompt_index: int, length: int, max_seq_len: int) -> None:
        super().__init__(
            f"prompt {prompt_index} has {length} tokens; max_seq_len={max_seq_len} leaves no room to generate"
        )
        self.prompt_index = prompt_index
        self.length = length
        self.max_seq_len = max_seq_len


@dataclasses.dataclass
class GenerationStats:
    """Running totals of a backend (for rollout metrics)."""

    calls: int = 0
    completions: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class BackendBuild:
    """What every backend is built from besides its config: the policy model (in-process backends), the
    tokenizer, the longest sequence, the compute dtype (None: float32 on CPU, bfloat16 on an accelerator) and
    `fast_compile` (dense: lowest XLA optimisation level, for tests)."""

    model: Any
    tokenizer: Any
    max_seq_len: int
    compute_dtype: str | None = None
    fast_compile: bool = False


class InferenceBackend(abc.ABC):
    """Token-level sampling from a policy (see the module docstring for the promises)."""

    name: str = "abstract"
    external_weights: bool = False
    """True when a server owns the weights: `update_model` is a no-op and the server reports its policy step."""
    manages_weights: bool = False
    """True when the worker tells the server which committed policy to load (`attach` + `load_policy`)."""

    def __init__(self) -> None:
        self.stats = GenerationStats()
        self.last_served_steps: set[int] = set()
        """Policy steps a server reported during the last `generate` (empty for in-process backends)."""

    @classmethod
    def from_config(cls, config: Any, build: BackendBuild) -> InferenceBackend:
        """The backend `config` (its registered config class) describes; what `make_backend` calls."""
        raise NotImplementedError(f"{cls.__name__} cannot be built from a config")

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> list[list[Completion]]:
        """`request.n` completions per prompt, in prompt order (each non-empty, with per-token logprobs)."""

    @abc.abstractmethod
    def update_model(self, model: Any) -> None:
        """Sample from `model` from the next `generate` on (same structure: no recompilation)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release device buffers / connections; the backend is unusable afterwards."""

    def served_policy_step(self) -> int | None:
        """The policy step an external server says it serves now (None: in-process, or the server does not say)."""
        return None


def truncate_at_stop(
    tokens: list[int], logprobs: list[float], stop_tokens: Sequence[int] | None
) -> tuple[list[int], list[float], bool]:
    """Cut `tokens`/`logprobs` after the first stop token (kept). Returns (tokens, logprobs, stopped)."""
    if stop_tokens:
        stops = set(stop_tokens)
        for i, t in enumerate(tokens):
            if t in stops:
                return tokens[: i + 1], logprobs[: i + 1], True
    return tokens, logprobs, False
