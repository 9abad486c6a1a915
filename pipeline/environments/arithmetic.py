"""Addition lessons of growing difficulty (for curricula).

easy: both operands in 0..9; medium: 10..99; hard: 100..999. The prompt is `"{a}+{b}="`.

Scoring rule: the answer is the first line of the response (text up to EOS/stop token or newline),
stripped of surrounding whitespace; it is parsed only when it is a plain integer (`[+-]?[0-9]+`).
- exact sum: reward 1.0 (a success);
- otherwise, for a parsed integer: 0.25 if it has the same number of digits as the sum, plus 0.25
  if its last digit equals the sum's last digit (partial credit, at most 0.5);
- unparseable answer: 0.0.
"""

from __future__ import annotations

import re

import numpy as np

from pipeline.environments.base import Example, Score, SingleTurnEnvironment, check_mode

DIFFICULTIES: dict[str, tuple[int, int]] = {
    "easy": (0, 9),
    "medium": (10, 99),
    "hard": (100, 999),
}
"""Inclusive operand range per difficulty."""

_INT = re.compile(r"[+-]?[0-9]+")


def parse_answer(text: str) -> int | None:
    """The integer on the first line of text (whitespace-stripped), or None when it is not a plain integer."""
    line = text.split("\n", 1)[0].strip()
    return int(line) if _INT.fullmatch(line) else None


def arithmetic_reward(answer: int | None, target: int) -> float:
    """1.0 if answer == target; else 0.25·[same digit count] + 0.25·[same last digit]; 0.0 if answer is None."""
    if answer is None:
        return 0.0
    if answer == target:
        return 1.0
    a, t = str(abs(answer)), str(abs(target))
    return 0.25 * (len(a) == len(t)) + 0.25 * (a[-1] == t[-1])


class ArithmeticEnv(SingleTurnEnvironment):
    """`a+b=` problems; reward per `arithmetic_reward` (module docstring); success iff exact.

    Train mode draws operands with the sample call's rng. Eval mode uses a fixed held-out stream: the
    first `n` problems of a list of `n_eval` problems drawn from `np.random.default_rng([seed, 1])`
    (same distribution, not disjoint from training, identical across calls so policies are comparable).
    Example ids are `"{a}+{b}"`.
    """

    def __init__(
        self,
        difficulty: str = "easy",
        seed: int = 0,
        *,
        n_eval: int = 256,
        max_prompt_tokens: int | None = None,
        add_bos: bool = True,
    ) -> None:
        super().__init__(max_prompt_tokens=max_prompt_tokens, add_bos=add_bos)
        if difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty={difficulty!r}: must be one of {sorted(DIFFICULTIES)}")
        if n_eval < 1:
            raise ValueError(f"n_eval={n_eval!r}: must be >= 1")
        self.difficulty = difficulty
        self.seed = seed
        self.name = f"arithmetic-{difficulty}"
        lo, hi = DIFFICULTIES[difficulty]
        ops = np.random.default_rng([seed, 1]).integers(lo, hi + 1, size=(n_eval, 2))
        self.eval_problems: list[tuple[int, int]] = [(int(a), int(b)) for a, b in ops]

    @staticmethod
    def _example(a: int, b: int) -> Example:
        return Example(f"{a}+{b}", f"{a}+{b}=", target=a + b)

    def examples(self, n: int, rng: np.random.Generator, mode: str) -> list[Example]:
        check_mode(mode)
        if mode == "eval":
            return [self._example(*self.eval_problems[i % len(self.eval_problems)]) for i in range(n)]
        lo, hi = DIFFICULTIES[self.difficulty]
        ops = rng.integers(lo, hi + 1, size=(n, 2))
        return [self._example(int(a), int(b)) for a, b in ops]

    def score(self, example: Example, text: str) -> Score:
        answer = parse_answer(text)
        reward = arithmetic_reward(answer, int(example.target))
        return Score(
            reward=reward,
            success=reward == 1.0,
            info={"parse_failure": float(answer is None)},
        )
