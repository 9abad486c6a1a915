"""Scorers: LLM judges, reward models and rule functions that score (prompt, response) texts in batches.

`build_scorer(mapping)` builds one from config; its `type` picks the class:

- `judge` (`pipeline.scoring.judge.JudgeScorer`): an LLM over an OpenAI-compatible endpoint.
- `reward_model` (`pipeline.scoring.reward_model.RewardModelScorer`): a HF sequence-classification model.
- `function` (`FunctionScorer`): a Python function `fn(response, ground_truth) -> float | bool` named by dotted
  path (the exact-answer environment's verifier signature), e.g. for rescoring with a new rule.

Every mapping may also carry `name` (the reward component it fills; default: its type) and `weight` (its factor
when the judged environment or the rescore step combines components; default 1.0). See
docs/guides/bring-your-environment.md.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipeline.scoring.base import (
    ScoreOutcome,
    Scorer,
    ScorerConfigError,
    ScoreRequest,
    ScorerStats,
    failed,
    require_keys,
    scorer_metrics,
)

SCORER_TYPES = ("judge", "reward_model", "function")


class FunctionScorer(Scorer):
    """`fn(response, ground_truth) -> float | bool` per request; an exception fails that request."""

    kind = "function"

    def __init__(self, fn: Callable[[str, str], Any], name: str = "function") -> None:
        self.fn = fn
        self.name = name

    def score_batch(self, requests: Sequence[ScoreRequest]) -> list[ScoreOutcome]:
        """One outcome per request: the function's value, or its exception as the reason."""
        out = []
        for r in requests:
            t0 = time.monotonic()
            try:
                v = float(self.fn(r.response, r.ground_truth))
            except Exception as e:
                out.append(failed(f"{type(e).__name__}: {e}", time.monotonic() - t0))
                continue
            out.append(ScoreOutcome(v, latency_s=time.monotonic() - t0) if math.isfinite(v) else failed(f"score {v}"))
        return out


def scorer_name(spec: Mapping[str, Any]) -> str:
    """The reward component name of a scorer mapping: `name`, else its `type`."""
    return str(spec.get("name") or spec.get("type"))


def scorer_weight(spec: Mapping[str, Any]) -> float:
    """The weight of a scorer mapping (default 1.0); raises ScorerConfigError when it is not a finite number."""
    w = spec.get("weight", 1.0)
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
        raise ScorerConfigError("weight", w, "must be a finite number")
    return float(w)


def check_scorer(spec: Any) -> None:
    """Check a scorer mapping without building it (no network, no model load); raises ScorerConfigError naming
    the field."""
    if not isinstance(spec, Mapping):
        raise ScorerConfigError("", spec, f"a scorer must be a mapping with a `type` ({', '.join(SCORER_TYPES)})")
    kind = spec.get("type")
    if kind not in SCORER_TYPES:
        raise ScorerConfigError("type", kind, f"must be one of {SCORER_TYPES}")
    name = scorer_name(spec)
    if not name or "/" in name:
        raise ScorerConfigError("name", name, "must be a non-empty name without '/'")
    scorer_weight(spec)
    if kind == "judge":
        from pipeline.scoring.judge import judge_spec

        judge_spec(spec)
    elif kind == "reward_model":
        from pipeline.scoring.reward_model import reward_model_spec

        reward_model_spec(spec)
    else:
        require_keys(spec, ("type", "name", "weight", "function"), "function scorer")
        _import_function(spec.get("function"))


def _import_function(path: Any) -> Callable[[str, str], Any]:
    if not isinstance(path, str) or "." not in path:
        raise ScorerConfigError("function", path, "must be a dotted path 'package.module.function'")
    module_name, _, attr = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ScorerConfigError("function", path, f"cannot be imported: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ScorerConfigError("function", path, "is not callable")
    return fn  # type: ignore[no-any-return]


def build_scorer(spec: Mapping[str, Any]) -> Scorer:
    """The scorer a mapping describes (checked by `check_scorer` first); raises ScorerConfigError naming the field."""
    check_scorer(spec)
    name = scorer_name(spec)
    kind = spec["type"]
    if kind == "judge":
        from pipeline.scoring.judge import JudgeScorer, judge_spec

        return JudgeScorer(judge_spec(spec), name=name)
    if kind == "reward_model":
        from pipeline.scoring.reward_model import RewardModelScorer, reward_model_spec

        return RewardModelScorer(reward_model_spec(spec), name=name)
    return FunctionScorer(_import_function(spec["function"]), name=name)


__all__ = [
    "SCORER_TYPES",
    "FunctionScorer",
    "ScoreOutcome",
    "ScoreRequest",
    "Scorer",
    "ScorerConfigError",
    "ScorerStats",
    "build_scorer",
    "check_scorer",
    "failed",
    "scorer_metrics",
    "scorer_name",
    "scorer_weight",
]
