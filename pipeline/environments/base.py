"""The environment protocol: sample prompts, ask the policy through an inference context, score, group.

An `Environment` is named in config by a dotted class path plus keyword arguments (`EnvConfig`) and
built by `load_environment` (in `pipeline.environments.loading`). `Environment.sample` returns a
`SampleResult`: one `EnvGroup` per example that fully succeeded (all `n_generations` rollouts of one
prompt, for RLOO/GRPO), one `ExampleFailure` per example that did not (with a reason; the caller may
retry), and a flat metrics dict.

Per-token contract of `EnvRollout` (it maps 1:1 onto `schemas.RolloutRow`): `response_tokens`,
`response_logprobs`, `token_rewards` and `response_loss_mask` have one entry per response token;
the loss mask is 1 on tokens the policy sampled and 0 on tokens the environment inserted (tool
output), which carry logprob 0.0. Unless an environment gives per-token rewards, the episode reward
sits on the last policy token (`token_rewards_for`).

`SingleTurnEnvironment` implements `sample` for prompt -> one completion -> score tasks; subclasses
provide the example streams and the scoring function. `ScriptedContext` (`pipeline.environments.scripted`)
is an inference context answering from scripted texts, for tests. Nothing here imports JAX.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from pipeline.environments.generation import GenerationRequest

logger = logging.getLogger(__name__)

MODES = ("train", "eval")
FINISH_REASONS = ("stop", "length")
SKIP_DRAW_ROUNDS = 4
"""Draws of replacements for skipped prompts per sample call (`draw_skipping`) before skipped ones are used."""
SKIP_METRICS = ("n_skipped_prompts", "n_retested_prompts")
"""The metrics of `draw_skipping` a sample call reports (prefixed `env/` in rollout records; summed over retries)."""

_T = TypeVar("_T")


# ---------------------------------------------------------------------------------------
# data types
# ---------------------------------------------------------------------------------------


@dataclass
class Completion:
    """One sampled continuation: tokens (a stop token, when hit, is kept), their logprobs, why it ended."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    policy_steps: list[int] | None = None
    """The policy step that sampled each token (partial rollouts: a policy can change mid-sequence); None: every
    token was sampled by the policy of the call."""


class Tokenizer(Protocol):
    """What environments need of a tokenizer (a transformers fast tokenizer satisfies it)."""

    eos_token_id: Any
    pad_token_id: Any

    def encode(self, text: str, /) -> list[int]: ...

    def decode(self, token_ids: list[int], /) -> str: ...


@dataclass(frozen=True)
class PromptSkip:
    """Prompts (example ids) that training draws pass over (difficulty-aware sampling, `curriculum.skip_after`):
    each drawn prompt in `example_ids` is kept only with probability `retest_rate` (a re-test), else replaced by
    another draw (`draw_skipping`)."""

    example_ids: frozenset[str]
    retest_rate: float = 0.0


@dataclass(frozen=True)
class SampleSpec:
    """What one `Environment.sample` call asks for: `n_examples` examples, `n_generations` completions each, at
    `temperature`, at most `max_tokens` new tokens per completion (per turn in multi-turn environments), stopping at
    `stop_tokens` (None: the tokenizer's EOS), in `mode` "train" or "eval". `chat`: the lesson is chat-formatted,
    so prompts are rendered with the tokenizer's chat template (`encode_prompt(..., chat=True)`)."""

    n_examples: int
    n_generations: int
    temperature: float
    max_tokens: int
    stop_tokens: Sequence[int] | None
    mode: str
    chat: bool = False
    skip: PromptSkip | None = None
    """Prompts a training draw passes over (`draw_skipping`); None: none. Ignored in eval mode (the eval stream is
    fixed)."""


@runtime_checkable
class InferenceContext(Protocol):
    """The policy as environments see it: a tokenizer and batched sampling.

    `generate` returns, for each prompt of the request, exactly `request.n` completions (in order).
    `stop_tokens=None` means the tokenizer's EOS. `seed` makes sampling reproducible where the backend can.
    """

    tokenizer: Any

    def generate(self, request: GenerationRequest) -> list[list[Completion]]: ...


@dataclass
class EnvRollout:
    """One scored episode of one prompt (see the module docstring for the per-token contract)."""

    env_name: str
    example_id: str
    prompt_tokens: list[int]
    response_tokens: list[int]
    response_logprobs: list[float]
    token_rewards: list[float]
    response_loss_mask: list[int]
    episode_reward: float
    truncated: bool
    finish_reason: str
    info: dict[str, float] = field(default_factory=dict)
    """Environment-specific numbers about this episode (summed/averaged into metrics; not persisted)."""
    response_text: str = ""
    """The response as the environment read it (decoded from `response_tokens` once; persisted for inspection)."""
    extracted_answer: str | None = None
    """The answer the scorer extracted from the response (None: none found, or the environment extracts none)."""
    ground_truth: str = ""
    """The reference answer the response was scored against ("" when the task has none)."""
    reward_components: dict[str, float] = field(default_factory=dict)
    """Each reward function's own value when `episode_reward` combines several (a rubric, a judge)."""
    episode_id: str = ""
    """Set when one episode is written as several rows (segments); "" for a whole episode in one row."""
    segment_index: int = 0
    """This row's position among its episode's segments."""
    policy_step: int | None = None
    """The oldest policy step that sampled any of this episode's tokens when the environment knows it (an episode
    served through the generate endpoint across a policy change); None: the step the worker sampled with."""
    token_policy_steps: list[int] | None = None
    """The policy step of each response token (partial rollouts; one per response token); None: every token's step
    is the row's policy step."""


@dataclass
class EnvGroup:
    """All rollouts of one prompt; `key` is unique within a sample call and (64 random bits) across calls."""

    key: str
    rollouts: list[EnvRollout]


@dataclass
class ExampleFailure:
    """An example that produced no group, and why (prompt too long, generation error, bad data row, ...)."""

    example_id: str
    reason: str


@dataclass
class SampleResult:
    """What one `Environment.sample` call produced."""

    groups: list[EnvGroup]
    failures: list[ExampleFailure]
    metrics: dict[str, float]


class EnvironmentLoadError(ValueError):
    """An environment named in config could not be built; the message names the class path and the cause."""

    def __init__(self, class_path: str, why: str) -> None:
        super().__init__(f"cannot load environment {class_path!r}: {why}")
        self.class_path = class_path
        self.why = why


# ---------------------------------------------------------------------------------------
# the protocol
# ---------------------------------------------------------------------------------------


class Environment(ABC):
    """An RL environment. Subclasses set `name` and implement `sample`.

    Promises of `sample`: deterministic given the same `rng` state and a deterministic context;
    every example either yields one `EnvGroup` of exactly `n_generations` rollouts or one
    `ExampleFailure`; it does not raise for per-example problems (bad data, generation errors).
    `mode` is "train" or "eval" (eval may use a fixed held-out example stream).
    """

    name: str = "env"

    @classmethod
    def check_args(cls, env_args: Mapping[str, Any]) -> None:
        """Start-up check of this environment's `env_args`, run by the config validators (`validate_job`,
        `validate_rollout`, `validate_evaluate`) for every lesson before anything starts.

        Raise `pipeline.config.ConfigError(<arg name>, value, why)` for what would make construction fail the same
        way on every start (a missing data file, a file it cannot read); the validator reports it as one line
        naming `curriculum.lessons.<id>.env.env_args.<arg name>`. Bounded in time (no network waits of minutes).
        The default checks nothing."""
        del env_args

    @abstractmethod
    def sample(self, ctx: InferenceContext, spec: SampleSpec, rng: np.random.Generator) -> SampleResult:
        """Sample `spec.n_examples` examples, `spec.n_generations` completions each, score them, and group them."""

    def close(self) -> None:  # noqa: B027 - optional hook: most environments hold nothing
        """Release what the environment holds (processes, servers, connections); called once when its sampler
        shuts down. The default holds nothing."""


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def check_mode(mode: str) -> None:
    """Raise ValueError unless mode is 'train' or 'eval'."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: must be one of {MODES}")


def draw_skipping(
    draw: Callable[[int], list[_T]],
    n: int,
    rng: np.random.Generator,
    skip: PromptSkip | None,
    example_id: Callable[[_T], str],
) -> tuple[list[_T], dict[str, float]]:
    """`n` items from `draw(k)` (k fresh items of the example stream) that pass over the prompts of `skip`, and the
    `SKIP_METRICS` of the draw ({} without a skip set: then exactly `draw(n)`, the rng untouched by the skip).

    A drawn item whose `example_id` is in `skip.example_ids` is kept with probability `retest_rate` (counted in
    `n_retested_prompts`), else passed over (`n_skipped_prompts`) and replaced by a further draw, for up to
    `SKIP_DRAW_ROUNDS` rounds; if items are still missing then (nearly every prompt is skipped), the passed-over
    ones fill them (as re-tests), so a call never yields fewer than `n` items. Deterministic given `rng` and `draw`.
    """
    if skip is None or not skip.example_ids:
        return draw(n), {}
    kept: list[_T] = []
    passed: list[_T] = []
    retested = 0
    for _ in range(SKIP_DRAW_ROUNDS):
        need = n - len(kept)
        if need <= 0:
            break
        for item in draw(need):
            if example_id(item) not in skip.example_ids:
                kept.append(item)
            elif rng.random() < skip.retest_rate:
                kept.append(item)
                retested += 1
            else:
                passed.append(item)
    fill = passed[: max(0, n - len(kept))]
    kept += fill
    skipped, retests = len(passed) - len(fill), retested + len(fill)
    return kept, {"n_skipped_prompts": float(skipped), "n_retested_prompts": float(retests)}


def draw_seed(rng: np.random.Generator) -> int:
    """A generation seed in [0, 2**31) drawn from rng."""
    return int(rng.integers(0, 2**31 - 1))


def group_key(env_name: str, example_id: str, rng: np.random.Generator) -> str:
    """`env/example/<16 hex digits from rng>`: unique within a call, and across calls with overwhelming odds."""
    return f"{env_name}/{example_id}/{int(rng.integers(0, 2**63 - 1)):016x}"


def effective_stop_tokens(tokenizer: Any, stop_tokens: Sequence[int] | None) -> set[int]:
    """The set of token ids that end a response: `stop_tokens`, or the tokenizer's EOS when None."""
    if stop_tokens is not None:
        return {int(t) for t in stop_tokens}
    eos = getattr(tokenizer, "eos_token_id", None)
    return {int(eos)} if eos is not None else set()


def encode_prompt(tokenizer: Any, text: str, *, add_bos: bool = True, chat: bool = False) -> list[int]:
    """Prompt tokens: `tokenizer.encode(text)`, with BOS prepended when asked, the tokenizer has one and
    its encode did not already add it. `chat=True`: the ids of `[{"role": "user", "content": text}]` rendered by
    the tokenizer's chat template with the generation prompt, exactly as the template says (`add_bos` unused);
    ValueError when the tokenizer has no chat template."""
    if chat:
        from pipeline.environments.tokenizer import render_chat

        return render_chat(tokenizer, [{"role": "user", "content": text}])
    tokens = [int(t) for t in tokenizer.encode(text)]
    bos = getattr(tokenizer, "bos_token_id", None)
    if add_bos and bos is not None and (not tokens or tokens[0] != bos):
        tokens = [int(bos), *tokens]
    return tokens


def response_text(tokenizer: Any, tokens: Sequence[int], stop: set[int]) -> str:
    """The decoded response up to (not including) the first stop/EOS token."""
    cut = list(tokens)
    for i, t in enumerate(cut):
        if t in stop:
            cut = cut[:i]
            break
    return str(tokenizer.decode(cut))


def token_rewards_for(n_tokens: int, reward: float, loss_mask: Sequence[int] | None = None) -> list[float]:
    """Per-token rewards of an episode: `reward` on the last token with loss mask 1 (the last token if the
    mask is all 0 or absent), 0.0 elsewhere; empty when there are no tokens."""
    out = [0.0] * n_tokens
    if n_tokens == 0:
        return out
    idx = n_tokens - 1
    if loss_mask is not None:
        policy = [i for i, m in enumerate(loss_mask) if m]
        if policy:
            idx = policy[-1]
    out[idx] = float(reward)
    return out


def reward_problem(value: Any, what: str = "reward") -> str | None:
    """Why `value` cannot be a reward (missing, not a number, NaN or infinite), or None when it can: the one check
    every reward of every environment kind passes (`reward_checks.rollout_problem`, applied by the rollout manager
    to every group an environment returns; `rollout_from_completion`, `rollouts_from_calls` and `VerifiersEnv` use
    it too), so a broken reward fails its example with this reason instead of the worker or the evaluator."""
    if value is None:
        return f"{what} is missing (None)"
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        return f"{what} {value!r} is not a number"
    if not math.isfinite(float(value)):
        return f"{what} is {float(value)!r}, not a finite number"
    return None


def checked_reward(value: Any, what: str = "reward") -> float:
    """`float(value)`; ValueError with `reward_problem`'s reason when it is not a usable reward."""
    problem = reward_problem(value, what)
    if problem is not None:
        raise ValueError(problem)
    return float(value)


def rollout_from_completion(
    env_name: str,
    example_id: str,
    prompt_tokens: Sequence[int],
    completion: Completion,
    reward: float,
    *,
    token_rewards: Sequence[float] | None = None,
    info: dict[str, float] | None = None,
) -> EnvRollout:
    """An `EnvRollout` of a single-turn completion: loss mask all 1, `truncated` iff finish_reason 'length',
    per-token rewards from `token_rewards` when given (one per token) else `token_rewards_for`.

    Raises ValueError when tokens/logprobs/token_rewards lengths disagree or the reward is not finite.
    """
    n = len(completion.tokens)
    if len(completion.logprobs) != n:
        raise ValueError(f"completion has {n} tokens but {len(completion.logprobs)} logprobs")
    reward = checked_reward(reward, "episode reward")
    if token_rewards is not None and len(token_rewards) != n:
        raise ValueError(f"completion has {n} tokens but {len(token_rewards)} token rewards")
    if completion.policy_steps is not None and len(completion.policy_steps) != n:
        raise ValueError(f"completion has {n} tokens but {len(completion.policy_steps)} policy steps")
    return EnvRollout(
        env_name=env_name,
        example_id=example_id,
        prompt_tokens=[int(t) for t in prompt_tokens],
        response_tokens=[int(t) for t in completion.tokens],
        response_logprobs=[float(x) for x in completion.logprobs],
        token_rewards=[float(x) for x in token_rewards] if token_rewards is not None else token_rewards_for(n, reward),
        response_loss_mask=[1] * n,
        episode_reward=float(reward),
        truncated=completion.finish_reason == "length",
        finish_reason=completion.finish_reason,
        info=dict(info or {}),
        token_policy_steps=None if completion.policy_steps is None else [int(x) for x in completion.policy_steps],
    )


def summarize(
    groups: Sequence[EnvGroup],
    failures: Sequence[ExampleFailure],
    *,
    n_examples: int,
    success: Callable[[EnvRollout], bool],
) -> dict[str, float]:
    """Metrics of a sample call: mean_reward and success_rate (per episode: its segment rows count once),
    mean_response_tokens and truncation_rate (per row), n_examples, n_groups, n_rollouts, n_failures, and for each
    numeric `info` key (but "success") `<key>_mean` (per rollout) and `<key>_total`; 0.0 without rollouts."""
    rollouts = [r for g in groups for r in g.rollouts]
    episodes = [r for r in rollouts if r.segment_index == 0]
    n = len(rollouts)
    m: dict[str, float] = {
        "n_examples": float(n_examples),
        "n_groups": float(len(groups)),
        "n_rollouts": float(n),
        "n_failures": float(len(failures)),
        "mean_reward": float(np.mean([r.episode_reward for r in episodes])) if episodes else 0.0,
        "success_rate": float(np.mean([success(r) for r in episodes])) if episodes else 0.0,
        "mean_response_tokens": float(np.mean([len(r.response_tokens) for r in rollouts])) if n else 0.0,
        "truncation_rate": float(np.mean([r.truncated for r in rollouts])) if n else 0.0,
    }
    keys = sorted({k for r in rollouts for k in r.info} - {"success"})
    for k in keys:
        total = float(sum(r.info.get(k, 0.0) for r in rollouts))
        m[f"{k}_total"] = total
        m[f"{k}_mean"] = total / n
    return m


def check_completions(out: Any, n_prompts: int, n: int) -> list[list[Completion]]:
    """Validate the shape of `generate`'s output (n_prompts lists of n completions); raise ValueError if not."""
    if not isinstance(out, list) or len(out) != n_prompts:
        size = len(out) if isinstance(out, list) else "?"
        raise ValueError(f"generate returned {type(out).__name__} of length {size}, expected {n_prompts} lists")
    for i, comps in enumerate(out):
        if not isinstance(comps, list) or len(comps) != n:
            size = len(comps) if isinstance(comps, list) else "?"
            raise ValueError(f"generate returned {size} completions for prompt {i}, expected {n}")
    return out


# ---------------------------------------------------------------------------------------
# single-turn environments
# ---------------------------------------------------------------------------------------


@dataclass
class Example:
    """One problem: a stable id, the prompt text (None when the data row is bad) and what scoring needs."""

    example_id: str
    prompt: str | None
    target: Any = None
    error: str | None = None
    """Set when the example cannot be used (e.g. a data row lacks a field); becomes an ExampleFailure."""


@dataclass
class Score:
    """The score of one response: reward, whether it counts as a success, and numeric env-specific info."""

    reward: float
    success: bool
    info: dict[str, float] = field(default_factory=dict)
    extracted_answer: str | None = None
    """The answer the scorer read from the response (None: none found, or the scorer extracts none)."""
    ground_truth: str | None = None
    """The reference answer scored against; None: `str(example.target)` ("" when the target is None)."""


class SingleTurnEnvironment(Environment):
    """prompt -> `n_generations` completions -> `score(example, text)` each.

    Subclasses implement `examples(n, rng, mode)` and `score(example, response_text)`. Prompts longer than
    `max_prompt_tokens` (when set) and bad examples become `ExampleFailure`s; so does every example of a
    batch whose `generate` call raised or returned a malformed result.
    """

    def __init__(self, *, max_prompt_tokens: int | None = None, add_bos: bool = True) -> None:
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens={max_prompt_tokens!r}: must be >= 1 or None")
        self.max_prompt_tokens = max_prompt_tokens
        self.add_bos = add_bos

    @abstractmethod
    def examples(self, n: int, rng: np.random.Generator, mode: str) -> list[Example]:
        """`n` examples: drawn with rng in train mode; in eval mode the env's fixed eval stream."""

    @abstractmethod
    def score(self, example: Example, text: str) -> Score:
        """Score one decoded response (cut at the first stop/EOS token)."""

    def reference_response(self, example: Example) -> str | None:
        """The response that states `example`'s reference answer in the form the lesson requires (e.g.
        `<answer>42</answer>`), which `score` must give full reward; None (the default): this environment cannot
        render one, and the start-up check of reference answers (`pipeline.environments.start_checks`) skips it."""
        del example
        return None

    def sample(self, ctx: InferenceContext, spec: SampleSpec, rng: np.random.Generator) -> SampleResult:
        check_mode(spec.mode)
        n_examples, n_generations, mode = spec.n_examples, spec.n_generations, spec.mode
        tok = ctx.tokenizer
        stop = effective_stop_tokens(tok, spec.stop_tokens)
        failures: list[ExampleFailure] = []
        ready: list[tuple[Example, list[int]]] = []
        drawn, skip_metrics = draw_skipping(
            lambda k: self.examples(k, rng, mode),
            n_examples,
            rng,
            spec.skip if mode == "train" else None,
            lambda ex: ex.example_id,
        )
        for ex in drawn:
            if ex.error is not None or ex.prompt is None:
                failures.append(ExampleFailure(ex.example_id, ex.error or "example has no prompt"))
                continue
            prompt = encode_prompt(tok, ex.prompt, add_bos=self.add_bos, chat=spec.chat)
            if self.max_prompt_tokens is not None and len(prompt) > self.max_prompt_tokens:
                failures.append(
                    ExampleFailure(
                        ex.example_id,
                        f"prompt has {len(prompt)} tokens > max_prompt_tokens={self.max_prompt_tokens}",
                    )
                )
                continue
            ready.append((ex, prompt))
        groups: list[EnvGroup] = []
        if ready:
            seed = draw_seed(rng)
            try:
                outs = check_completions(
                    ctx.generate(
                        GenerationRequest(
                            [p for _, p in ready],
                            n=n_generations,
                            temperature=spec.temperature,
                            max_tokens=spec.max_tokens,
                            stop_tokens=spec.stop_tokens,
                            seed=seed,
                        )
                    ),
                    len(ready),
                    n_generations,
                )
            except Exception as e:  # every example of the batch fails with the reason
                logger.warning(
                    "%s: generation failed for %d examples: %r",
                    self.name,
                    len(ready),
                    e,
                )
                failures += [ExampleFailure(ex.example_id, f"generation error: {e!r}") for ex, _ in ready]
                outs = []
            for (ex, prompt), comps in zip(ready, outs, strict=False):
                try:
                    rollouts = []
                    for c in comps:
                        text = response_text(tok, c.tokens, stop)
                        s = self.score(ex, text)
                        info = dict(s.info)
                        info["success"] = float(s.success)
                        r = rollout_from_completion(self.name, ex.example_id, prompt, c, s.reward, info=info)
                        # kept on the row for inspection (schema v3): what was read, extracted and expected
                        r.response_text = text
                        r.extracted_answer = s.extracted_answer
                        truth = s.ground_truth
                        r.ground_truth = truth if truth is not None else "" if ex.target is None else str(ex.target)
                        rollouts.append(r)
                except Exception as e:  # a bad completion/score fails its example only
                    failures.append(ExampleFailure(ex.example_id, f"scoring error: {e!r}"))
                    continue
                groups.append(EnvGroup(group_key(self.name, ex.example_id, rng), rollouts))
        metrics = summarize(
            groups,
            failures,
            n_examples=n_examples,
            success=lambda r: r.info.get("success", 0.0) > 0,
        )
        metrics.update(skip_metrics)
        return SampleResult(groups, failures, metrics)
