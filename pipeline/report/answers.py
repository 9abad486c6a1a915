"""Right and wrong answers per lesson, for the report: what the policy answered, what was extracted from it and what
was expected (schema-v3 text columns of rollout and eval rows).

Read: for every lesson with a committed evaluation, its eval rows at the newest evaluated policy step
(`evals/step-S/<lesson>.parquet`); and the rows of the newest committed rollout files (newest policy step first, at most
`ROLLOUT_FILES` files) for the lessons they hold. A row is *right* when its episode reward is >= 1 (the success rule
of exact answers), else *wrong*; up to `PER_KIND` of each per lesson and source, in file order. Prompts are decoded
from the prompt tokens when a decoder is given (the run's tokenizer), else left empty. Unreadable files are skipped
with a note; nothing here raises for missing data.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.store import layout
from pipeline.store.storage import CorruptFileError, RunStore, SchemaMismatchError
from schemas import EVAL_ROW, ROLLOUT
from schemas.base import TableSpec

logger = logging.getLogger(__name__)

PER_KIND = 3
"""Right (and wrong) samples shown per lesson and source."""
ROLLOUT_FILES = 8
"""How many of the newest committed rollout files are read for training samples."""
TEXT_LIMIT = 600
"""Characters of a prompt or response shown (longer texts are cut with '…')."""
RIGHT_REWARD = 1.0
"""A sample is right when its episode reward is >= this."""


@dataclasses.dataclass(frozen=True)
class AnswerSample:
    """One scored sample as the report shows it."""

    lesson_id: str
    source: str
    """`eval step S` or `rollout step P`."""
    right: bool
    example_id: str
    prompt: str
    response: str
    extracted_answer: str | None
    ground_truth: str
    reward: float


def _cut(text: str) -> str:
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + "…"


def pick(rows: Sequence[dict[str, Any]], source: str, decode: Callable[[list[int]], str] | None) -> list[AnswerSample]:
    """Up to `PER_KIND` right and `PER_KIND` wrong samples per lesson of `rows` (dicts of schema rows), in order."""
    out: list[AnswerSample] = []
    taken: dict[tuple[str, bool], int] = {}
    for r in rows:
        right = float(r.get("episode_reward", 0.0)) >= RIGHT_REWARD
        key = (str(r.get("lesson_id")), right)
        if taken.get(key, 0) >= PER_KIND:
            continue
        taken[key] = taken.get(key, 0) + 1
        prompt = ""
        if decode is not None:
            try:
                prompt = decode(list(r.get("prompt_tokens") or []))
            except Exception:  # a prompt that does not decode is shown empty, the answer still is
                prompt = ""
        out.append(
            AnswerSample(
                lesson_id=key[0],
                source=source,
                right=right,
                example_id=str(r.get("example_id", "")),
                prompt=_cut(prompt),
                response=_cut(str(r.get("response_text") or "")),
                extracted_answer=r.get("extracted_answer"),
                ground_truth=str(r.get("ground_truth") or ""),
                reward=float(r.get("episode_reward", 0.0)),
            )
        )
    return out


def _read(store: RunStore, rel: str, spec: TableSpec[Any], notes: list[str]) -> list[dict[str, Any]]:
    try:
        return RunStore.parse_parquet(store.get(rel), spec, rel).to_pylist()
    except (CorruptFileError, SchemaMismatchError, OSError) as e:
        notes.append(f"skipped {rel} (answers): {e}")
        return []


def read_answers(
    store: RunStore,
    eval_summaries: Sequence[dict[str, Any]],
    decode: Callable[[list[int]], str] | None,
    notes: list[str],
    bad: set[str] | frozenset[str] = frozenset(),
) -> list[AnswerSample]:
    """The right and wrong samples of the module docstring: eval rows of each lesson's newest evaluated checkpoint
    (from `eval_summaries`, the rows `RunData.eval_summaries` holds), then rows of the newest rollout files."""
    newest: dict[str, int] = {}
    for s in eval_summaries:
        if s.get("external") or s.get("eval_type", "eval") != "eval":
            continue
        lesson, step = s.get("lesson_id"), s.get("policy_step")
        if isinstance(lesson, str) and isinstance(step, int):
            newest[lesson] = max(step, newest.get(lesson, step))
    out: list[AnswerSample] = []
    for lesson, step in sorted(newest.items()):
        rel = layout.eval_rollouts_file(step, lesson)
        if rel in bad or not store.exists(rel):
            continue
        out += pick(_read(store, rel, EVAL_ROW, notes), f"eval step {step}", decode)
    files: list[str] = []
    for folder in sorted(store.list(layout.ROLLOUTS), reverse=True):
        committed = sorted(store.list_committed(folder), key=lambda r: (r.rsplit("-", 1)[-1], r), reverse=True)
        files += [f for f in committed if f not in bad]
        if len(files) >= ROLLOUT_FILES:
            break
    seen: set[str] = set()
    for rel in files[:ROLLOUT_FILES]:
        rows = [r for r in _read(store, rel, ROLLOUT, notes) if r.get("lesson_id") not in seen]
        if not rows:
            continue
        step = rows[0].get("policy_step")
        out += pick(rows, f"rollout step {step}", decode)
        seen |= {str(r.get("lesson_id")) for r in rows}
    return out
