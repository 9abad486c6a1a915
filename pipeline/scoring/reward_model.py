"""A reward model: a Hugging Face sequence-classification model (through transformers, on torch) scoring
(prompt, response) pairs in batches.

`path` names a local folder holding the model and its tokenizer (`AutoModelForSequenceClassification`,
`AutoTokenizer`; nothing is downloaded). Each pair is rendered as `template` over `{prompt}` and `{response}`
(default: `{prompt}{response}`) or, with `template: null`, passed to the tokenizer as a text pair; pairs are
tokenised in batches of `batch_size`, truncated to `max_length` tokens (from the left, so the end of the response
stays), padded, and the logit `label_index` of the classification head is the score (`sigmoid: true` maps it to
(0, 1)). A batch that fails (an error inside the model) fails its requests with the reason. torch and
transformers are imported when the scorer is built, so lessons without a reward model never load them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.scoring.base import ScoreOutcome, Scorer, ScorerConfigError, ScoreRequest, failed, require_keys

_FIELDS = ("type", "name", "weight", "path", "template", "batch_size", "max_length", "label_index", "sigmoid")


@dataclass(frozen=True)
class RewardModelSpec:
    """A reward model's settings (the module docstring says what each does)."""

    path: str
    template: str | None = "{prompt}{response}"
    batch_size: int = 8
    max_length: int = 1024
    label_index: int = 0
    sigmoid: bool = False


def reward_model_spec(spec: Mapping[str, Any]) -> RewardModelSpec:
    """The `RewardModelSpec` of a scorer mapping; raises ScorerConfigError naming the field and the cause."""
    require_keys(spec, _FIELDS, "reward_model")
    path = spec.get("path")
    if not isinstance(path, str) or not path:
        raise ScorerConfigError("path", path, "must name a local Hugging Face model folder")
    if not (Path(path) / "config.json").is_file():
        raise ScorerConfigError("path", path, "has no config.json (a folder written by save_pretrained)")
    template = spec.get("template", "{prompt}{response}")
    if template is not None:
        try:
            str(template).format_map({"prompt": "", "response": ""})
        except (KeyError, IndexError, ValueError) as e:
            raise ScorerConfigError("template", template, f"template error ({type(e).__name__}: {e})") from None
    out: dict[str, int] = {}
    for key, default, low in (("batch_size", 8, 1), ("max_length", 1024, 2), ("label_index", 0, 0)):
        v = spec.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ScorerConfigError(key, v, f"must be a whole number >= {low}")
        out[key] = v
    return RewardModelSpec(
        path=path,
        template=None if template is None else str(template),
        batch_size=out["batch_size"],
        max_length=out["max_length"],
        label_index=out["label_index"],
        sigmoid=bool(spec.get("sigmoid", False)),
    )


class RewardModelScorer(Scorer):
    """Scores (prompt, response) pairs with a sequence-classification model on CPU (see the module docstring)."""

    kind = "reward_model"

    def __init__(self, spec: RewardModelSpec, name: str = "reward_model") -> None:
        import torch
        import transformers

        self.spec = spec
        self.name = name
        self._torch = torch
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(spec.path, local_files_only=True)
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = transformers.AutoModelForSequenceClassification.from_pretrained(spec.path, local_files_only=True)
        self.model.eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        n_labels = int(self.model.config.num_labels)
        if spec.label_index >= n_labels:
            raise ScorerConfigError("label_index", spec.label_index, f"the model has {n_labels} label(s)")

    def _encode(self, batch: Sequence[ScoreRequest]) -> Any:
        kw: dict[str, Any] = {
            "padding": True,
            "truncation": True,
            "max_length": self.spec.max_length,
            "return_tensors": "pt",
            "add_special_tokens": True,
        }
        if self.spec.template is None:
            return self.tokenizer([r.prompt for r in batch], [r.response for r in batch], **kw)
        texts = [self.spec.template.format_map({"prompt": r.prompt, "response": r.response}) for r in batch]
        return self.tokenizer(texts, **kw)

    def score_batch(self, requests: Sequence[ScoreRequest]) -> list[ScoreOutcome]:
        """Score `requests` in batches of `batch_size`; a failing batch fails its requests with the reason."""
        out: list[ScoreOutcome] = []
        for i in range(0, len(requests), self.spec.batch_size):
            batch = requests[i : i + self.spec.batch_size]
            t0 = time.monotonic()
            try:
                with self._torch.no_grad():
                    logits = self.model(**self._encode(batch)).logits[:, self.spec.label_index].float()
                    if self.spec.sigmoid:
                        logits = self._torch.sigmoid(logits)
                values = [float(v) for v in logits.tolist()]
            except Exception as e:  # one bad batch fails its requests, not the caller
                share = (time.monotonic() - t0) / len(batch)
                out += [failed(f"reward model error: {type(e).__name__}: {e}", share) for _ in batch]
                continue
            share = (time.monotonic() - t0) / len(batch)
            for v in values:
                out.append(ScoreOutcome(v, latency_s=share) if math.isfinite(v) else failed(f"score {v}", share))
        return out
