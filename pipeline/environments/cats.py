"""The "moar cats" task (after Marin's smoke test): reward for saying "cat".

Prompts are short fixed strings. The reward of a response is `min(count, cap) / cap` where `count` is
the number of case-insensitive occurrences of "cat" in the decoded response (so "cats", "Cat" count);
one "cat" already earns `1/cap`, which a random tiny model with the built-in tokenizer hits often
enough for RL to learn the task within tens of steps. A response succeeds when it says "cat" at all.
"""

from __future__ import annotations

import numpy as np

from pipeline.environments.base import Example, Score, SingleTurnEnvironment, check_mode

TRAIN_PROMPTS: tuple[str, ...] = (
    "i like cats, give me moar cats",
    "do you like cats?",
    "tell me about cats",
    "what is your favorite animal?",
    "give me moar cats",
    "cats?",
    "say cats",
    "what do you love?",
    "i want a cat",
    "write a poem about cats",
    "what is the best pet?",
    "hello",
    "name an animal",
    "more cats please",
    "what do cats say?",
    "tell me a story",
)
"""The training prompt list (fixed, in this order)."""

PROBE_PROMPTS: tuple[str, ...] = (
    "i like cats, give me moar cats",
    "do you like cats?",
    "what is your favorite animal?",
    "tell me a story",
    "hello",
    "what is the best pet?",
    "say something",
)
"""Seven fixed prompts for the demo's behavioural check (>= 3 of 7 answered with "cat"); the eval stream."""


def count_cats(text: str) -> int:
    """Number of case-insensitive, non-overlapping occurrences of "cat" in text."""
    return text.lower().count("cat")


def says_cat(text: str) -> bool:
    """True when text contains "cat" (any case): the behavioural check of the demo."""
    return count_cats(text) > 0


class CatsEnv(SingleTurnEnvironment):
    """Reward `min(count_cats(response), cap) / cap` in [0, 1]; success iff the response says "cat".

    Train mode draws prompts from `TRAIN_PROMPTS` with rng; eval mode walks `PROBE_PROMPTS` in order
    (cycling), so evaluations of different policies see the same prompts. Example ids are
    `train-<i>` / `probe-<i>` (index into the list).
    """

    name = "cats"

    def __init__(
        self,
        cap: int = 4,
        *,
        max_prompt_tokens: int | None = None,
        add_bos: bool = True,
    ) -> None:
        super().__init__(max_prompt_tokens=max_prompt_tokens, add_bos=add_bos)
        if cap < 1:
            raise ValueError(f"cap={cap!r}: must be >= 1")
        self.cap = cap

    def examples(self, n: int, rng: np.random.Generator, mode: str) -> list[Example]:
        check_mode(mode)
        if mode == "eval":
            idx = [i % len(PROBE_PROMPTS) for i in range(n)]
            return [Example(f"probe-{i}", PROBE_PROMPTS[i]) for i in idx]
        picks = rng.integers(0, len(TRAIN_PROMPTS), size=n)
        return [Example(f"train-{int(i)}", TRAIN_PROMPTS[int(i)]) for i in picks]

    def score(self, example: Example, text: str) -> Score:
        count = count_cats(text)
        return Score(
            reward=min(count, self.cap) / self.cap,
            success=count > 0,
            info={"cat_count": float(count)},
        )
