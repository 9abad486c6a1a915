"""The shared reward check of every environment kind's results: a group whose episode reward, per-token reward or
reward component is missing or not a finite number fails its example with the reason (applied by the rollout
manager to every group an environment returns), instead of failing the worker or the evaluator."""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.environments.base import EnvGroup, EnvRollout, ExampleFailure, reward_problem


def rollout_problem(rollout: EnvRollout) -> str | None:
    """Why a scored episode cannot be trained on or reported (its episode reward, a per-token reward or a reward
    component missing or not finite), or None: the shared check of every environment kind's results."""
    problem = reward_problem(rollout.episode_reward, "episode reward")
    if problem is not None:
        return problem
    for name, value in (rollout.reward_components or {}).items():
        problem = reward_problem(value, f"reward component {name!r}")
        if problem is not None:
            return problem
    for i, value in enumerate(rollout.token_rewards):
        problem = reward_problem(value, f"token reward {i}")
        if problem is not None:
            return problem
    return None


def split_bad_rewards(groups: Sequence[EnvGroup]) -> tuple[list[EnvGroup], list[ExampleFailure]]:
    """(the groups every rollout of which passes `rollout_problem`, one `ExampleFailure` per other group naming the
    first broken reward): a group with a broken reward fails its example, whatever environment made it."""
    good: list[EnvGroup] = []
    bad: list[ExampleFailure] = []
    for g in groups:
        problem = next((p for p in map(rollout_problem, g.rollouts) if p is not None), None)
        if problem is None:
            good.append(g)
        else:
            example_id = g.rollouts[0].example_id if g.rollouts else g.key
            bad.append(ExampleFailure(str(example_id), f"reward error: {problem}"))
    return good, bad
