"""Sample completions as text: the small metrics record a rollout worker logs once per policy step, and the
reader of the newest committed rollout file that the report shows. JAX-free.

The record (`metrics/rollout/*.jsonl`, forwarded to trackers like every metrics record):

    {"event": "samples", "policy_step": P, "lesson_id": ..., "file": "rollouts/step-P/....parquet",
     "samples": [{"rollout_id": ..., "prompt": text, "completion": text, "reward": float}, ...]}

Texts are decoded with the run's tokenizer (special tokens left out) and cut to `MAX_CHARS` characters.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from pipeline.store import layout
from pipeline.store.storage import CorruptFileError, RunStore, SchemaMismatchError
from schemas.rollout import ROLLOUT

logger = logging.getLogger(__name__)

SAMPLES_EVENT = "samples"
"""`event` of the samples record in rollout metrics."""
SAMPLES_PER_RECORD = 3
MAX_CHARS = 400
"""Longest prompt or completion text kept in a record (longer texts end with an ellipsis)."""

Decode = Callable[[Sequence[int]], str]
"""Token ids -> text, special tokens left out."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """One completion as text."""

    rollout_id: str
    lesson_id: str
    policy_step: int
    prompt: str
    completion: str
    reward: float


def _cut(text: str) -> str:
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 1] + "…"


def to_samples(rows: Iterable[Any], decode: Decode, k: int = SAMPLES_PER_RECORD) -> list[Sample]:
    """The first `k` rows (rollout rows or dicts with the rollout schema's fields) as decoded samples."""
    out: list[Sample] = []
    for row in rows:
        if len(out) >= k:
            break

        def get(name: str, row: Any = row) -> Any:
            return row[name] if isinstance(row, dict) else getattr(row, name)

        out.append(
            Sample(
                rollout_id=str(get("rollout_id")),
                lesson_id=str(get("lesson_id")),
                policy_step=int(get("policy_step")),
                prompt=_cut(decode(list(get("prompt_tokens")))),
                completion=_cut(decode(list(get("response_tokens")))),
                reward=float(get("episode_reward")),
            )
        )
    return out


def samples_record(samples: Sequence[Sample], file: str) -> dict[str, Any]:
    """The metrics record of `samples` (all of one policy step and lesson) taken from rollout file `file`."""
    first = samples[0] if samples else None
    return {
        "event": SAMPLES_EVENT,
        "policy_step": first.policy_step if first else None,
        "lesson_id": first.lesson_id if first else None,
        "file": file,
        "samples": [
            {"rollout_id": s.rollout_id, "prompt": s.prompt, "completion": s.completion, "reward": s.reward}
            for s in samples
        ],
    }


def tokenizer_decoder(spec: str) -> Decode:
    """A decoder for tokenizer `spec` (a built-in one or a local folder with tokenizer.json), without JAX or
    transformers: only the `tokenizers` library. Raises ValueError naming the spec when it cannot be loaded."""
    from tokenizers import Tokenizer

    from pipeline.environments.tokenizer import BUILTIN_SPECS, build_builtin_tokenizer_object

    if spec in BUILTIN_SPECS:
        tok = build_builtin_tokenizer_object(spec)
    else:
        path = Path(spec) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"tokenizer {spec!r}: no {path} to decode rollouts with")
        tok = Tokenizer.from_file(str(path))
    return lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=True)


def newest_rollout_file(store: RunStore) -> str | None:
    """The committed rollout file of the highest policy step (the newest by sequence number within it), or None."""
    for folder in sorted(store.list(layout.ROLLOUTS), reverse=True):
        files = sorted(store.list_committed(folder), key=lambda r: (r.rsplit("-", 1)[-1], r))
        if files:
            return files[-1]
    return None


def newest_samples(store: RunStore, decode: Decode, k: int = 8) -> tuple[str | None, list[Sample]]:
    """(file, up to `k` decoded samples) of `newest_rollout_file(store)`; (None, []) when there is none.

    Reads only (an unreadable file is logged and gives no samples; nothing is quarantined)."""
    rel = newest_rollout_file(store)
    if rel is None:
        return None, []
    try:
        table = RunStore.parse_parquet(store.get(rel), ROLLOUT, rel)
    except (CorruptFileError, SchemaMismatchError, OSError) as e:
        logger.warning("samples: cannot read %s: %s", rel, e)
        return rel, []
    return rel, to_samples(table.to_pylist(), decode, k)
