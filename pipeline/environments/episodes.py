"""One episode's captured endpoint calls as rollout rows (`rollouts_from_calls`).

An episode served through the generate endpoint (`pipeline.environments.endpoint`) is a list of `CapturedCall`s in
arrival order: each the exact prompt ids the sampler conditioned on, the ids it sampled and their logprobs. They
become rows the way `ChatTranscript` builds a multi-turn rollout, without ever re-tokenising text:

- the first call's prompt is the row's prompt; its sampled ids are the first response tokens (mask 1, the sampler's
  logprobs);
- a later call whose prompt starts with the transcript so far (the row's prompt + response) continues the row: the
  prompt's extra tokens (tool results, environment messages, a chat template's role headers) are appended with loss
  mask 0 and logprob 0.0, then its sampled ids with mask 1;
- a later call whose prompt does not extend the transcript (an agent that rewrote or truncated its history, a
  template that re-renders earlier turns differently from how they were sampled) starts a new segment: a new row
  with the same `episode_id` and `segment_index + 1`.

Every segment's row carries the episode's reward as `episode_reward` (each token of the episode is credited with its
outcome); the per-token reward sits on the last sampled token of the last segment (`token_rewards_for`) and the
other segments' token rewards are 0. A row's `policy_step` is the oldest policy step among its calls (None when no
call knew it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pipeline.environments.base import EnvRollout, checked_reward, token_rewards_for


class Call(Protocol):
    """What a captured call gives (`pipeline.environments.endpoint.CapturedCall` satisfies it)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_step: int


class _Segment:
    def __init__(self, call: Call) -> None:
        self.prompt = [int(t) for t in call.prompt_ids]
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.steps: list[int] = []
        self.finish = "stop"
        self.calls = 0

    def extends(self, prompt: Sequence[int]) -> bool:
        sofar = self.prompt + self.tokens
        return len(prompt) >= len(sofar) and list(prompt[: len(sofar)]) == sofar

    def add(self, call: Call) -> None:
        ids = [int(t) for t in call.completion_ids]
        if len(ids) != len(call.logprobs):
            raise ValueError(f"a captured call has {len(ids)} sampled ids but {len(call.logprobs)} logprobs")
        if self.calls:
            inserted = [int(t) for t in call.prompt_ids[len(self.prompt) + len(self.tokens) :]]
            self.tokens += inserted
            self.logprobs += [0.0] * len(inserted)
            self.mask += [0] * len(inserted)
        self.tokens += ids
        self.logprobs += [float(x) for x in call.logprobs]
        self.mask += [1] * len(ids)
        self.finish = call.finish_reason
        if call.policy_step is not None and call.policy_step >= 0:
            self.steps.append(int(call.policy_step))
        self.calls += 1


def segments_of(calls: Sequence[Call]) -> list[_Segment]:
    """The calls grouped into segments (see the module docstring)."""
    segments: list[_Segment] = []
    for call in calls:
        if not segments or not segments[-1].extends(call.prompt_ids):
            segments.append(_Segment(call))
        segments[-1].add(call)
    return segments


def rollouts_from_calls(
    calls: Sequence[Call],
    *,
    env_name: str,
    example_id: str,
    episode_reward: float,
    reward_components: Mapping[str, float] | None = None,
    episode_id: str,
    response_text: str = "",
    extracted_answer: str | None = None,
    ground_truth: str = "",
    info: Mapping[str, float] | None = None,
    tokenizer: Any = None,
) -> list[EnvRollout]:
    """The rows of one episode (see the module docstring), one per segment, in order.

    `response_text` is the last segment's text as the environment read it; with a `tokenizer` and no
    `response_text`, each row's text is its response ids decoded once (for inspection only). `info` goes on every
    row, plus `segments` (the episode's segment count). Raises ValueError when there are no calls, a call's ids and
    logprobs disagree in length, or the reward is not finite."""
    if not calls:
        raise ValueError(f"episode {episode_id!r} made no calls")
    episode_reward = checked_reward(episode_reward, "episode reward")
    components = {str(k): checked_reward(v, f"reward component {k!r}") for k, v in (reward_components or {}).items()}
    segments = segments_of(calls)
    rows = []
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        n = len(seg.tokens)
        rewards = token_rewards_for(n, episode_reward, seg.mask) if last else [0.0] * n
        text = response_text if last else ""
        if not text and tokenizer is not None:
            text = str(tokenizer.decode(seg.tokens))
        rows.append(
            EnvRollout(
                env_name=env_name,
                example_id=example_id,
                prompt_tokens=seg.prompt,
                response_tokens=seg.tokens,
                response_logprobs=seg.logprobs,
                token_rewards=rewards,
                response_loss_mask=seg.mask,
                episode_reward=float(episode_reward),
                truncated=seg.finish == "length",
                finish_reason=seg.finish if seg.finish in ("stop", "length") else "stop",
                info={**{k: float(v) for k, v in (info or {}).items()}, "segments": float(len(segments))},
                response_text=text,
                extracted_answer=extracted_answer if last else None,
                ground_truth=ground_truth,
                reward_components=dict(components),
                episode_id=episode_id,
                segment_index=i,
                policy_step=min(seg.steps) if seg.steps else None,
            )
        )
    return rows
