"""The one sampling request: what an environment asks of the policy, and what every inference backend serves.

JAX-free, so environments (here, in `pipeline`) and backends (`policy.inference`) share the type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pipeline.config.curriculum import sampling_controls_problem


@dataclasses.dataclass(frozen=True)
class SamplingControls:
    """Which tokens may be sampled, applied to the tempered distribution `p = softmax(logits / T)`:

    - `top_k > 0`: only the `top_k` most probable tokens (ties at the k-th probability kept);
    - `top_p < 1`: only the smallest set of most probable tokens whose mass reaches `top_p`;
    - `min_p > 0`: only tokens with `p >= min_p * max(p)`.
    A token must pass every active rule; the most probable token always passes. The recorded logprob stays that
    of the untruncated tempered distribution (what the learner's teacher-forced pass computes). Greedy (T = 0)
    ignores them. Raises ValueError for `top_p` outside (0, 1], `top_k < 0` or `min_p` outside [0, 1].
    """

    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if problem := sampling_controls_problem(self.top_p, self.top_k, self.min_p):
            name, value, why = problem
            raise ValueError(f"{name}={value}: {why}")

    @property
    def is_default(self) -> bool:
        """True when no rule is active (every token may be sampled)."""
        return self.top_p >= 1.0 and self.top_k == 0 and self.min_p <= 0.0


NO_CONTROLS = SamplingControls()


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One batched sampling call: `n` completions of each prompt (token ids) under one set of sampling params.

    `stop_tokens=None`: the tokenizer's EOS; `[]`: none. `seed` makes sampling reproducible where the backend can.
    Raises ValueError for `n < 1`, `max_tokens < 1` or `temperature < 0`.
    """

    prompts: Sequence[Sequence[int]]
    n: int
    temperature: float
    max_tokens: int
    stop_tokens: Sequence[int] | None
    seed: int
    controls: SamplingControls = NO_CONTROLS
    """top-p / top-k / min-p (`SamplingControls`); every backend applies them or refuses the request."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n={self.n}: must be >= 1")
        check_budget(self.max_tokens, self.temperature)


def check_budget(max_tokens: int, temperature: float) -> None:
    """ValueError (naming the value) unless `max_tokens >= 1` and `temperature >= 0`: what every sampling request
    (completions or chat) must hold."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0")
