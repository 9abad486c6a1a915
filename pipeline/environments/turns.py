"""The turn loop of multi-turn environments: one batched generation per turn, per-example failures."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from pipeline.environments.base import ExampleFailure

logger = logging.getLogger(__name__)


class Episode(Protocol):
    """What the loop reads of an episode: its example's index and whether it has ended."""

    example: int
    done: bool


E = TypeVar("E", bound=Episode)


def play_turns(
    name: str,
    episodes: Sequence[E],
    example_ids: Sequence[str],
    max_turns: int,
    generate: Callable[[int, list[E]], Sequence[Any]],
    advance: Callable[[E, Any, bool], None],
    failures: list[ExampleFailure],
) -> set[int]:
    """Play `episodes` turn by turn, at most `max_turns`; returns the indices of the examples that failed.

    Each turn, `generate(turn, active)` answers every active episode (not done, its example not failed) in one
    batch and `advance(episode, answer, last_turn)` applies one answer. A `generate` error fails every example of
    that batch and ends play; an `advance` error fails that episode's example only. Each failed example gets one
    `ExampleFailure` (its id from `example_ids`, the first reason) appended to `failures`."""
    failed: set[int] = set()

    def fail(example: int, why: str) -> None:
        if example not in failed:
            failed.add(example)
            failures.append(ExampleFailure(example_ids[example], why))

    for turn in range(max_turns):
        active = [e for e in episodes if not e.done and e.example not in failed]
        if not active:
            break
        try:
            answers = generate(turn, active)
        except Exception as exc:  # every example of this batch fails with the reason
            logger.warning("%s: generation failed in turn %d: %r", name, turn, exc)
            for ex in sorted({e.example for e in active}):
                fail(ex, f"generation error in turn {turn}: {exc!r}")
            break
        for ep, answer in zip(active, answers, strict=True):
            try:
                advance(ep, answer, turn == max_turns - 1)
            except Exception as exc:  # an answer that does not fit the episode fails its example only
                fail(ep.example, f"bad turn {turn}: {exc!r}")
    return failed
