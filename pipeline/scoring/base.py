"""The scorer interface: (prompt text, response text, example) in batches -> a reward, or a failure with a reason.

A `Scorer` scores a batch of `ScoreRequest`s and returns one `ScoreOutcome` per request, in order. An outcome is
either a value (`value` set, `reason` None) or a failure (`value` None, `reason` a one-line cause: the judge timed
out, refused the connection, answered something the score rule cannot parse, ...). A scorer never turns a failure
into a default score: the caller decides what a failure means (the judged environment fails the example with the
reason; the rescore step fails the row). `score_batch` itself does not raise for per-request problems.

Scorers are built from plain mappings (lesson `env_args`, the rescore step's `scorer:` field) by
`pipeline.scoring.build_scorer`, whose `type` picks the class (`judge`, `reward_model`). Nothing here imports JAX.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ScoreRequest:
    """One response to score: the prompt and response as text, the example's id and reference answer."""

    prompt: str
    response: str
    example_id: str = ""
    ground_truth: str = ""


@dataclass
class ScoreOutcome:
    """The score of one request: `value` (None on failure) with the extracted answer, or `reason` on failure.

    `latency_s`: wall seconds spent on this request (every attempt of a judge request; a reward model's batch time
    shared among its requests). `raw`: the scorer's raw output (a judge's reply text) when it has one."""

    value: float | None
    reason: str | None = None
    latency_s: float = 0.0
    extracted: str | None = None
    raw: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the request was scored (a finite value, no failure reason)."""
        return self.reason is None and self.value is not None and math.isfinite(self.value)


def failed(reason: str, latency_s: float = 0.0, raw: str | None = None) -> ScoreOutcome:
    """A failure outcome with its reason."""
    return ScoreOutcome(None, reason=reason, latency_s=latency_s, raw=raw)


class ScorerConfigError(ValueError):
    """A scorer spec is unusable: `field` names the offending key (relative to the scorer mapping)."""

    def __init__(self, field: str, value: Any, why: str) -> None:
        super().__init__(f"{field}={value!r}: {why}")
        self.field = field
        self.value = value
        self.why = why


class Scorer(ABC):
    """Scores batches of responses. Subclasses set `name` (the reward component it fills) and `kind`."""

    name: str = "scorer"
    kind: str = "scorer"

    @abstractmethod
    def score_batch(self, requests: Sequence[ScoreRequest]) -> list[ScoreOutcome]:
        """One outcome per request, in order; per-request problems are failures with a reason, never raised."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections or models (the default holds none)."""


@dataclass
class ScorerStats:
    """What a scorer did over some calls: counts, latency and the values, for the metrics of `scorer_metrics`."""

    requests: int = 0
    failures: int = 0
    latency_s: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, outcomes: Sequence[ScoreOutcome]) -> None:
        """Count `outcomes`."""
        for o in outcomes:
            self.requests += 1
            self.latency_s.append(o.latency_s)
            if o.ok:
                assert o.value is not None
                self.values.append(float(o.value))
            else:
                self.failures += 1


def scorer_metrics(name: str, stats: ScorerStats) -> dict[str, float]:
    """Metrics of one scorer (keys documented in docs/reference/metrics.md; `n_` keys are summed by the rollout
    manager over retries): `n_scored/<name>`, `n_scorer_failures/<name>`, `scorer_latency_s/<name>` (mean seconds
    per request), `scorer_latency_max_s/<name>`, `reward_component/<name>` (mean value over scored responses)."""
    m = {
        f"n_scored/{name}": float(stats.requests - stats.failures),
        f"n_scorer_failures/{name}": float(stats.failures),
    }
    if stats.latency_s:
        m[f"scorer_latency_s/{name}"] = float(sum(stats.latency_s) / len(stats.latency_s))
        m[f"scorer_latency_max_s/{name}"] = float(max(stats.latency_s))
    if stats.values:
        m[f"reward_component/{name}"] = float(sum(stats.values) / len(stats.values))
    return m


def require_keys(spec: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    """Raise ScorerConfigError naming the first key of `spec` not in `allowed`."""
    for key in spec:
        if key not in allowed:
            raise ScorerConfigError(str(key), spec[key], f"unknown {where} field (known: {', '.join(allowed)})")
