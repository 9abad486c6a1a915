"""A judged lesson: any rlpipe environment whose rollouts are (re)scored by LLM judges, reward models or rule
functions (`pipeline.scoring`), the way OpenRLHF's `remote_rm_url`, verl's reward managers and verifiers' judge
rubrics score with a model instead of (or on top of) a rule.

    env:
      env_class: pipeline.environments.judged.JudgedEnv
      env_args:
        base: {env_class: pipeline.environments.exact_answer.ExactAnswerEnv, env_args: {path: data/qa.jsonl}}
        base_weight: 0.0            # 0: the judge replaces the rule; 1 (default): the scores are added to it
        scorers:
          - {type: judge, name: judge, base_url: http://127.0.0.1:8000/v1, model: judge, prompt: "...", weight: 1.0}

The base environment samples and scores as usual; then every rollout's (prompt text, response text, reference
answer) goes to each scorer in one batch per `sample` call. The episode reward becomes
`base_weight * base reward + sum(weight_i * score_i)`; `reward_components` holds the base reward (under the base
environment's name, or `base_name`) and each scorer's score (under the scorer's `name`), and the per-token reward
sits on the last policy token again (`token_rewards_for`). An example any of whose rollouts a scorer failed to
score becomes an `ExampleFailure` whose reason names the scorer and its cause (a judge timeout, refused
connection, unparsable reply): never a silent 0. `success_threshold` (when set) makes success
`reward >= success_threshold`; else the base environment's success flag is kept.

Prompt text: for a `SingleTurnEnvironment` base, the example's own prompt text and target (recorded as the base
draws its examples); for any other base, the prompt tokens decoded. Response text: the rollout's `response_text`,
else its response tokens decoded up to the first stop token. Metrics: the base's, plus per scorer
`n_scored/<name>`, `n_scorer_failures/<name>`, `scorer_latency_s/<name>`, `scorer_latency_max_s/<name>` and
`reward_component/<name>` (`pipeline.scoring.scorer_metrics`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pipeline.config.base import ConfigError
from pipeline.environments.base import (
    SKIP_METRICS,
    EnvGroup,
    Environment,
    EnvRollout,
    Example,
    ExampleFailure,
    InferenceContext,
    SampleResult,
    SampleSpec,
    SingleTurnEnvironment,
    effective_stop_tokens,
    response_text,
    summarize,
    token_rewards_for,
)
from pipeline.scoring import (
    Scorer,
    ScorerConfigError,
    ScoreRequest,
    ScorerStats,
    build_scorer,
    check_scorer,
    scorer_metrics,
    scorer_name,
    scorer_weight,
)

logger = logging.getLogger(__name__)


def _base_parts(base: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(base, Mapping) or not isinstance(base.get("env_class"), str):
        raise ConfigError("base", base, "must be a mapping {env_class: package.module.Class, env_args: {...}}")
    extra = set(base) - {"env_class", "env_args"}
    if extra:
        raise ConfigError(f"base.{sorted(extra)[0]}", base[sorted(extra)[0]], "unknown field (env_class, env_args)")
    args = base.get("env_args") or {}
    if not isinstance(args, Mapping):
        raise ConfigError("base.env_args", args, "must be a mapping of keyword arguments")
    from pipeline.config import EnvConfig

    try:  # EnvConfig resolves the short names of the built-in environments (`cats`, `exact_answer`, ...)
        env_class = EnvConfig(env_class=str(base["env_class"]), env_args=dict(args)).env_class
    except ConfigError as e:
        why = str(e).removeprefix(f"{e.field}={e.value!r}: ")
        raise ConfigError("base.env_class", base["env_class"], why) from None
    return env_class, dict(args)


class JudgedEnv(Environment):
    """A base environment rescored by scorers (see the module docstring)."""

    name = "judged"

    @classmethod
    def check_args(cls, env_args: Mapping[str, Any]) -> None:
        """Refuse (ConfigError naming the argument) a base that cannot be imported or whose own `check_args`
        refuses its arguments, and a scorer list that is empty, malformed or names a field badly."""
        from pipeline.environments.loading import import_object

        env_class, args = _base_parts(env_args.get("base"))
        try:
            base_cls = import_object(env_class)
        except (ImportError, AttributeError) as e:
            raise ConfigError("base.env_class", env_class, f"cannot be imported: {e}") from None
        if not (inspect.isclass(base_cls) and issubclass(base_cls, Environment)):
            raise ConfigError("base.env_class", env_class, "is not a pipeline.environments.Environment subclass")
        try:
            base_cls.check_args(args)
        except ConfigError as e:
            why = str(e).removeprefix(f"{e.field}={e.value!r}: ")
            raise ConfigError(f"base.env_args.{e.field}", e.value, why) from None
        scorers = env_args.get("scorers")
        if not isinstance(scorers, Sequence) or isinstance(scorers, str) or not scorers:
            raise ConfigError("scorers", scorers, "must be a non-empty list of scorer mappings ({type: judge, ...})")
        names: set[str] = set()
        for i, spec in enumerate(scorers):
            try:
                check_scorer(spec)
            except ScorerConfigError as e:
                where = f"scorers[{i}]" + (f".{e.field}" if e.field else "")
                raise ConfigError(where, e.value, e.why) from None
            name = scorer_name(spec)
            if name in names:
                raise ConfigError(f"scorers[{i}].name", name, "is used by an earlier scorer (names must differ)")
            names.add(name)
        for key in ("base_weight", "success_threshold"):
            v = env_args.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise ConfigError(key, v, "must be a finite number")

    def __init__(
        self,
        base: Mapping[str, Any],
        scorers: Sequence[Mapping[str, Any]],
        *,
        base_weight: float = 1.0,
        base_name: str | None = None,
        success_threshold: float | None = None,
        name: str | None = None,
    ) -> None:
        from pipeline.config import EnvConfig
        from pipeline.environments.loading import load_environment

        type(self).check_args({"base": base, "scorers": scorers, "base_weight": base_weight})
        env_class, args = _base_parts(base)
        self.base = load_environment(EnvConfig(env_class=env_class, env_args=args))
        self.name = name or f"judged_{self.base.name}"
        self.base_name = base_name or self.base.name
        self.base_weight = float(base_weight)
        self.success_threshold = success_threshold
        self.weights = {scorer_name(s): scorer_weight(s) for s in scorers}
        if self.base_name in self.weights:
            raise ValueError(f"scorer name {self.base_name!r} is the base environment's component name")
        self.scorers: list[Scorer] = []
        try:
            for s in scorers:
                self.scorers.append(build_scorer(s))
        except Exception:
            self.close()
            raise
        self._examples: dict[str, Example] = {}
        if isinstance(self.base, SingleTurnEnvironment):
            draw = self.base.examples

            def recording(n: int, rng: np.random.Generator, mode: str) -> list[Example]:
                out = draw(n, rng, mode)
                self._examples.update({ex.example_id: ex for ex in out})
                return out

            self.base.examples = recording  # type: ignore[method-assign]

    def close(self) -> None:
        """Release the scorers' connections and models, then close the wrapped environment."""
        for s in self.scorers:
            s.close()
        self.base.close()

    def _request(self, r: EnvRollout, tok: Any, stop: set[int]) -> ScoreRequest:
        ex = self._examples.get(r.example_id)
        if ex is not None and ex.prompt is not None:
            prompt = ex.prompt
        else:
            prompt = str(tok.decode([int(t) for t in r.prompt_tokens], skip_special_tokens=True))
        text = r.response_text or response_text(tok, r.response_tokens, stop)
        truth = r.ground_truth or ("" if ex is None or ex.target is None else str(ex.target))
        return ScoreRequest(prompt=prompt, response=text, example_id=r.example_id, ground_truth=truth)

    def sample(self, ctx: InferenceContext, spec: SampleSpec, rng: np.random.Generator) -> SampleResult:
        self._examples.clear()
        result = self.base.sample(ctx, spec, rng)
        tok = ctx.tokenizer
        stop = effective_stop_tokens(tok, spec.stop_tokens)
        rollouts = [r for g in result.groups for r in g.rollouts]
        requests = [self._request(r, tok, stop) for r in rollouts]
        outcomes = {s.name: s.score_batch(requests) for s in self.scorers}
        failures = list(result.failures)
        groups: list[EnvGroup] = []
        i = 0
        for g in result.groups:
            span = range(i, i + len(g.rollouts))
            i += len(g.rollouts)
            bad = [(n, outcomes[n][j].reason) for n in outcomes for j in span if not outcomes[n][j].ok]
            if bad:
                n, why = bad[0]
                more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                failures.append(ExampleFailure(g.rollouts[0].example_id, f"scorer {n!r}: {why}{more}"))
                continue
            new = [
                self._rescored(r, requests[j], {n: outcomes[n][j].value for n in outcomes})
                for j, r in zip(span, g.rollouts, strict=True)
            ]
            groups.append(EnvGroup(g.key, new))
        metrics = summarize(
            groups, failures, n_examples=spec.n_examples, success=lambda r: r.info.get("success", 0) > 0
        )
        for s in self.scorers:
            stats = ScorerStats()
            stats.add(outcomes[s.name])
            metrics.update(scorer_metrics(s.name, stats))
        metrics.update({k: v for k, v in result.metrics.items() if k in SKIP_METRICS})  # the base's prompt draw
        return SampleResult(groups, failures, metrics)

    def _rescored(self, r: EnvRollout, req: ScoreRequest, scores: Mapping[str, float | None]) -> EnvRollout:
        base = float(r.episode_reward)
        components = {**r.reward_components, self.base_name: base}
        reward = self.base_weight * base
        for n, v in scores.items():
            assert v is not None
            components[n] = float(v)
            reward += self.weights[n] * float(v)
        info = dict(r.info)
        if self.success_threshold is not None:
            info["success"] = float(reward >= self.success_threshold)
        return dataclasses.replace(
            r,
            episode_reward=reward,
            token_rewards=token_rewards_for(len(r.response_tokens), reward, r.response_loss_mask),
            info=info,
            response_text=req.response,
            ground_truth=req.ground_truth,
            reward_components=components,
        )
