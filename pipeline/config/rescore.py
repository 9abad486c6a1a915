"""The `python -m steps.rescore` step config: re-score committed rollout files with a new scorer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pipeline.config.base import ConfigError, at_least, require
from pipeline.config.steps import StoreConfig


@dataclass(frozen=True)
class RescoreStepConfig:
    """`python -m steps.rescore`: re-score the committed rollout files of a run root into `rescored/<name>/`."""

    store: StoreConfig = field(default_factory=StoreConfig)
    """The run root whose rollout files are re-scored (and where the new files go)."""
    name: str = "rescored"
    """The rescoring's name: its files go under `rescored/<name>/step-P/` (one path component)."""
    scorer: dict[str, Any] = field(default_factory=dict)
    """The scorer, as in a judged lesson's `scorers` list: `{type: judge | reward_model | function, name, weight,
    ...}` (see docs/guides/bring-your-environment.md)."""
    base_weight: float = 0.0
    """New episode reward = `base_weight` × the row's old reward + the scorer's `weight` × its score (0: the scorer
    replaces the old reward)."""
    steps: list[int] | None = None
    """Policy steps whose `rollouts/step-P/` files are re-scored; None: every step."""
    tokenizer: str | None = None
    """Tokenizer that decodes rows without `response_text` (schema versions 1 and 2); None: run.json's
    `model.tokenizer`."""
    max_files: int | None = None
    """Stop after re-scoring this many files (None: all); a rerun goes on with the rest."""

    def __post_init__(self) -> None:
        from pipeline.scoring import ScorerConfigError, check_scorer

        require(
            bool(self.name) and self.name.replace("_", "").replace("-", "").replace(".", "").isalnum(),
            "name",
            self.name,
            "must be one path component (letters, digits, _ - .)",
        )
        try:
            check_scorer(self.scorer)
        except ScorerConfigError as e:
            raise ConfigError(f"scorer.{e.field}" if e.field else "scorer", e.value, e.why) from None
        require(math.isfinite(self.base_weight), "base_weight", self.base_weight, "must be a finite number")
        at_least(self, 1, "max_files", or_null=True)
        require(all(s >= 0 for s in self.steps or []), "steps", self.steps, "must be policy steps >= 0")
